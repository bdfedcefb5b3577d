"""The engine interface that scoring, generation and timing run on, and what every backend shares.

Two implementations: `torch_ref` (transformers' causal LM of the checkpoint's family, CPU or CUDA,
kernel-free, full vocabulary visible) and `vllm` (the serving engine; added on the GPU
machine). The interface is shaped after `vllm.LLM` with
`SamplingParams(max_tokens=1, prompt_logprobs=20)`: per position, the top-k ids with
log-probabilities and the log-probability of the actual next token.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # annotations only: the registry, and so the command line's parser, imports this without torch
    import torch


@dataclass
class SequenceScores:
    """Next-token predictions at positions 0..T-2 of one sequence (position t predicts token t+1)."""

    topk_ids: torch.Tensor  # int32 [T-1, k]
    topk_logprobs: torch.Tensor  # float32 [T-1, k]
    target_logprobs: torch.Tensor  # float32 [T-1]: log p(actual next token)
    gathered: torch.Tensor | None = None  # float32 [T-1, g]: exact log p at gather_ids, where exact_gather says so
    full: torch.Tensor | None = None  # float32 [T-1, V]: full log-softmax, where the backend sees it


def decode_spread(per_token_ms: list[float]) -> dict:
    """Median, interquartile range and min-max of per-run decode ms/token, under the keys results.json uses."""
    import statistics

    q = statistics.quantiles(per_token_ms, n=4) if len(per_token_ms) > 1 else [per_token_ms[0]] * 3
    return {
        "decode_ms_per_token": statistics.median(per_token_ms),
        "decode_iqr": [q[0], q[2]],
        "decode_min_max": [min(per_token_ms), max(per_token_ms)],
    }


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
    # score() returns the loaded engine's exact log-probs at gather_ids (SequenceScores.gathered); read after load().
    # torch: always. vLLM: where its engine serves prompt_logprob_token_ids (0.31 and later, V2 model runner), unless
    # hold_exact_gather() held the run to bounded scores. Without it the KL is bounded from the variant's own top-k.
    exact_gather: bool
    default_batch: int  # sequences per score() call when the plan or command line does not say
    overlap_starts: int  # engines it can start ahead while another serves (0: one at a time)
    precompile_slots: int  # processes that compile variants' engines ahead, before any is timed (0: none)
    results_wording: ResultsWording  # how a results table words its figures (backends.results_wording)

    def load(self, folder: Path) -> None: ...

    def load_info(self) -> dict: ...  # what the last load() recorded (engine start-up, kernels); {} when nothing

    def prefetch(self, folder: Path) -> bool: ...  # start folder's engine ahead; False when it cannot

    def precompile(self, folder: Path) -> bool: ...  # queue folder's engine to be compiled ahead; False when it cannot

    def finish_precompile(self) -> list[dict]: ...  # wait for the queued compiles, end their processes; one record each

    def close(self) -> None: ...  # end worker processes, free the model

    def abort(self) -> None: ...  # end worker processes now, from another thread (an interrupt); close() still follows

    def score(
        self,
        sequences: list[list[int]],
        top_k: int = 20,
        gather_ids: list[torch.Tensor] | None = None,
        want_full: bool = False,
        batch_size: int = 4,
    ) -> Iterator[SequenceScores]: ...

    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> list[list[int]]: ...

    def time_decode(self, prompt: list[int], new_tokens: int, warmup: int, runs: int) -> dict | None: ...

    def unload(self) -> None: ...

    # Every later engine scores as the run's base pass did (exact: gathered log-probs at the base's top-k ids; else
    # bounded), so that one run never mixes the two KLs; a one-line SplicerError when this backend cannot.
    def hold_exact_gather(self, exact: bool) -> None: ...

    def describe(self) -> dict: ...


class OneEngineAtATime:
    """What Backend asks of one that starts nothing ahead and compiles nothing ahead (the torch reference, a Ray lane)."""

    overlap_starts = 0
    precompile_slots = 0

    def prefetch(self, folder: Path) -> bool:
        return False

    def precompile(self, folder: Path) -> bool:
        return False

    def finish_precompile(self) -> list[dict]:
        return []


class BackendOptions(Protocol):
    """A backend's own options (its options_type): built once from what the user gave, checked where they are made,
    never changed during a run. Everything `ablate` asks of them, so that no stage outside splicer/backends/ needs a
    backend's name."""

    backend: str  # the backend's name (backends.BACKENDS)
    gpus: tuple  # the GPUs the rows are spread over (plans/spread.py); () for one device
    ray: str | None  # --ray's cluster address (backends/ray_lanes.py); None: no Ray

    @classmethod
    def option_names(cls) -> set[str]: ...  # the options it takes, as backend_options is given them

    @classmethod
    def refused_elsewhere(cls, given: dict) -> str: ...  # the line for these of its options given to another backend

    @classmethod
    def from_job(cls, settings: dict): ...  # the options a job.json's settings record (budget --verify reruns them)

    @classmethod
    def backend_type(cls) -> type: ...  # the backend class these options make

    def check_device(self, device: str) -> None: ...  # a --device these options cannot go with is refused

    def job_settings(self) -> dict: ...  # its fields of job.json's settings

    def cache_key(self) -> list: ...  # its part of the base pass's cache key

    def context_length(self) -> int | None: ...  # the engine's context length, when the options set one

    # On a Ray lane (--ray): the device the lane's backend is given for --device DEVICE, and the GPUs one engine holds.
    def ray_engine(self, device: str, cluster_has_gpus: bool) -> tuple[str, int]: ...

    def check_loadable(self, ckpt, modules: dict | None = None) -> None: ...  # refuse, in one line, what it cannot load

    def make_backends(self, device: str, log_dir: Path) -> list[Backend]: ...  # the run's backends; the first does the base pass

    # With the model's MTP head as a speculative decoder (`splicer mtp`): None when this backend cannot run one, else
    # the options for engines started one at a time, each alone on its device (nothing started or compiled ahead).
    def speculative(self): ...


# What the KL columns' variant log-probs at the base's top-k ids were (results.json `kl_support`, for the run and per
# row): the engine's exact log-probs there, or the variant's own top-k with a missing id given its k-th log-prob
# (metrics.fill_missing). A file written before it was recorded has none: its backend's wording says which.
KL_EXACT = "exact"
KL_OWN_TOP_K = "own_top_k"
KL_SUPPORT_WORDS = {KL_EXACT: "exact log-probs at the base's top-k ids", KL_OWN_TOP_K: "log-probs from the variant's own top-k"}


def kl_support(exact_gather: bool) -> str:
    """results.json's `kl_support` of scores made with (True) or without exact gathered log-probs."""
    return KL_EXACT if exact_gather else KL_OWN_TOP_K


@dataclass(frozen=True)
class ResultsWording:
    """How a results table words what a backend measured. results.json names the backend, so a file of any age is
    worded by its backend's entry (backends.results_wording); a name no backend has (a test's stub) gets these
    defaults, the wording of exact figures."""

    # the KL columns, given {top} (the base's top-k, in words), {k} and {kth} (the k-th log-prob, in words)
    kl_bound: str = (
        "KL = KL(base ‖ variant) over the base's {top} with the rest lumped, the variant's exact log-probs at those ids: "
        "a lower bound on the full KL (data-processing inequality)"
    )
    # the KL columns of a run that recorded exact log-probs at the base's top-k ids (kl_support KL_EXACT), for a backend
    # whose kl_bound words its other runs (None: kl_bound words every run)
    kl_exact: str | None = None
    engine_in_caption: bool = False  # the caption names the engine's version beside the backend
    # the heading of the speed table, for a backend whose engine logs each variant's start-up, weight memory and compile
    # time (None: no such table)
    start_up_heading: str | None = None
