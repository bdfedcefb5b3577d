"""Shared fixtures: tiny qwen3_5_moe pairs written once per session (a few seconds on 2 cores)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network


def _set_threads() -> str:
    """torch's threads for the test process from the cores free now (or OMP_NUM_THREADS / SPLICER_THREADS), and one
    thread for the subprocesses tests start (unless OMP_NUM_THREADS is set): several of them (fake GPU workers, engines
    started ahead) run at once beside the test process, and with more threads than free cores torch's spinning
    threads stall each other (a two-worker test took 25 to 111 s with two threads each, on 2 cores)."""
    import torch

    from splicer.backends.cpu_threads import choose_threads

    n, why = choose_threads()
    torch.set_num_threads(n)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return why


THREADS = _set_threads()

from tests import worker_start  # noqa: E402  (after the threads are set: the forkserver inherits them)

worker_start.install()


def pytest_report_header(config):
    return THREADS


@pytest.fixture(scope="session")
def pairs(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """{'fused': {...}, 'per_expert': {...}}: base + lowlatency build (+ experts-g32 for fused)."""
    from splicer.fixtures.core import FixtureSpec, write_pair

    root = tmp_path_factory.mktemp("pairs")
    return {
        "fused": write_pair(root / "fused", FixtureSpec(experts_layout="fused"), kinds=("lowlatency", "experts-g32")),
        "per_expert": write_pair(root / "per_expert", FixtureSpec(experts_layout="per_expert", seed=1), kinds=("lowlatency",)),
    }


def tree_digest(folder: Path) -> dict[str, str]:
    """Every file's sha256 and mode under a folder: inputs must be byte-identical after any command."""
    out = {}
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file():
            out[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest() + oct(p.stat().st_mode)
    return out
