"""Engine arguments and environment: what every engine gets on the GPU machine, the fixed settings for overlapped
starts, and `--engine-arg KEY=VALUE` parsing."""

from __future__ import annotations

import importlib.util
import json
import re

from ..errors import SplicerError


def _parse_engine_value(v: str):
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def default_engine_args() -> tuple[dict, dict]:
    """(engine kwargs, environment) that the GPU machine needs; see scripts/gpu/README.md."""
    # Stats on (as under `vllm serve`): each request then carries the engine's own first- and last-token times,
    # from which decode is timed without the prefill's jitter (see time_decode).
    args = {"enable_prefix_caching": False, "max_logprobs": 20, "disable_log_stats": False}
    env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # lets LLM.apply_model ship the kernel probe to the worker
    if importlib.util.find_spec("flashinfer") is None:
        # Without flashinfer, vLLM 0.26's FlashInfer sampler and its SM90 GDN prefill cannot start.
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
        args["gdn_prefill_backend"] = "triton"
    return args, env


# With overlapped starts each engine gets a fixed KV cache instead of a profiled share of the GPU: vLLM's memory
# profiling assumes no other process changes its GPU memory meanwhile (gpu_worker.determine_available_memory skips
# it when kv_cache_memory_bytes is set). 12 GiB holds ~200 sequences of GDN state at Qwen3.6-35B-A3B's size, and three
# such engines (one serving, two starting) fit an H200 with their ~20 GiB of weights each. The utilization only gates
# vLLM's start-up check (free memory >= utilization x total) while other engines hold memory.
OVERLAP_DEFAULTS = {"kv_cache_memory_bytes": 12 << 30, "gpu_memory_utilization": 0.25}


# Set by splicer itself from other options; --engine-env may not override them.
_ENV_OWNED = {
    "CUDA_VISIBLE_DEVICES": "--gpus or --device cuda:N",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "--process-per-variant",
    "SPLICER_CPUS": "--gpus",
}


def parse_engine_env(items: list[str] | None) -> dict:
    """--engine-env KEY=VALUE: environment variables for every engine process (set before vLLM is imported there)."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise SplicerError(f"--engine-env {item!r} should be NAME=VALUE with NAME an environment variable's name")
        if key in _ENV_OWNED:
            raise SplicerError(f"--engine-env {key}: splicer sets {key} itself; use {_ENV_OWNED[key]}")
        out[key] = value
    return out


def parse_engine_args(items: list[str] | None) -> dict:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SplicerError(f"--engine-arg {item!r} should be KEY=VALUE (VALUE as JSON where it is not a plain string)")
        out[key.replace("-", "_")] = _parse_engine_value(value)
    return out
