"""Fault injection for the reliability tests: `SPLICER_FAULT=point[#n]` kills the process (SIGKILL, no clean-up)
the n-th time (default first) execution passes `point`. Unset, it costs one dictionary lookup."""

from __future__ import annotations

import os
import signal

_seen: dict[str, int] = {}


def point(name: str) -> None:
    spec = os.environ.get("SPLICER_FAULT")
    if not spec:
        return
    target, _, nth = spec.partition("#")
    if target != name:
        return
    _seen[name] = _seen.get(name, 0) + 1
    if _seen[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
