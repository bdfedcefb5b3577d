"""The stand-in's EngineArgs: only which fields the release it follows has (FAKE_VLLM_API, read at import, as a worker
process imports it after its environment is set), for the probes that ask vLLM rather than read its version."""

from __future__ import annotations

import dataclasses

from .. import _LATER_ENGINE_ARGS, _api

EngineArgs = dataclasses.make_dataclass(
    "EngineArgs",
    [("model", str, dataclasses.field(default=""))]
    + [(name, object, dataclasses.field(default=None)) for name, since in _LATER_ENGINE_ARGS.items() if _api() >= since],
)
