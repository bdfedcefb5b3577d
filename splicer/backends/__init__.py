"""The engine interface that scoring, generation and timing run on.

Two implementations: `torch_ref` (transformers' causal LM of the checkpoint's family, CPU or CUDA,
kernel-free, full vocabulary visible) and `vllm` (the serving engine; added on the GPU
machine). The interface is shaped after `vllm.LLM` with
`SamplingParams(max_tokens=1, prompt_logprobs=20)`: per position, the top-k ids with
log-probabilities and the log-probability of the actual next token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

import torch


@dataclass
class SequenceScores:
    """Next-token predictions at positions 0..T-2 of one sequence (position t predicts token t+1)."""

    topk_ids: torch.Tensor  # int32 [T-1, k]
    topk_logprobs: torch.Tensor  # float32 [T-1, k]
    target_logprobs: torch.Tensor  # float32 [T-1]: log p(actual next token)
    gathered: torch.Tensor | None = None  # float32 [T-1, g]: log p at requested ids (exact or bounded)
    full: torch.Tensor | None = None  # float32 [T-1, V]: full log-softmax, where the backend sees it


def decode_spread(per_token_ms: list[float]) -> dict:
    """Median, interquartile range and min-max of per-run decode ms/token, under the keys results.json uses."""
    import statistics

    q = statistics.quantiles(per_token_ms, n=4) if len(per_token_ms) > 1 else [per_token_ms[0]] * 3
    return {"decode_ms_per_token": statistics.median(per_token_ms), "decode_iqr": [q[0], q[2]],
            "decode_min_max": [min(per_token_ms), max(per_token_ms)]}


def decode_summary(per_run_ms: list[float]) -> dict:
    """decode_spread of per-run ms/token, with the per-run values kept (the blocks verdicts.py pairs engines by); None in
    place of the spread when the median is not positive. A decode step takes time, so a median <= 0 says the estimate
    drowned in the clock's noise (e.g. two prefills' jitter in a wall-clock difference), not that decode was free: it
    must not enter a table as a time."""
    import statistics

    if per_run_ms and statistics.median(per_run_ms) > 0:
        return {**decode_spread(per_run_ms), "per_run_ms": list(per_run_ms)}
    return {"decode_ms_per_token": None, "decode_iqr": None, "decode_min_max": None, "per_run_ms": list(per_run_ms)}


class Backend(Protocol):
    """Everything `ablate` uses of a backend; both implementations provide all of it (no feature probes)."""

    name: str
    exact_gather: bool  # gathered log-probs are exact (full vocabulary visible)
    default_batch: int  # sequences per score() call when the plan or command line does not say
    overlap_starts: int  # engines it can start ahead while another serves (0: one at a time)
    precompile_slots: int  # processes that compile variants' engines ahead, before any is timed (0: none)

    def load(self, folder: Path) -> None: ...

    def load_info(self) -> dict: ...  # what the last load() recorded (engine start-up, kernels); {} when nothing

    def prefetch(self, folder: Path) -> bool: ...  # start folder's engine ahead; False when it cannot

    def precompile(self, folder: Path) -> bool: ...  # queue folder's engine to be compiled ahead; False when it cannot

    def finish_precompile(self) -> list[dict]: ...  # wait for the queued compiles, end their processes; one record each

    def close(self) -> None: ...  # end worker processes, free the model

    def abort(self) -> None: ...  # end worker processes now, from another thread (an interrupt); close() still follows

    def score(self, sequences: list[list[int]], top_k: int = 20, gather_ids: list[torch.Tensor] | None = None,
              want_full: bool = False, batch_size: int = 4) -> Iterator[SequenceScores]: ...

    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> list[list[int]]: ...

    def time_decode(self, prompt: list[int], new_tokens: int, warmup: int, runs: int) -> dict | None: ...

    def unload(self) -> None: ...

    def describe(self) -> dict: ...


def make_backend(name: str, device: str = "auto", **options) -> Backend:
    from ..errors import SplicerError

    if name == "torch":
        from .torch_ref import TorchBackend

        return TorchBackend(device=device, **options)
    if name == "vllm":
        from .vllm_backend import VllmBackend

        return VllmBackend(device=device, **options)
    raise SplicerError(f"unknown backend {name!r}; choose torch or vllm")
