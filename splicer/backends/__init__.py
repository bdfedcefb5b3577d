"""The engine interface that scoring, generation and timing run on.

Two implementations: `torch_ref` (transformers' causal LM of the checkpoint's family, CPU or CUDA,
kernel-free, full vocabulary visible) and `vllm` (the serving engine; added on the GPU
machine). The interface is shaped after `vllm.LLM` with
`SamplingParams(max_tokens=1, prompt_logprobs=20)`: per position, the top-k ids with
log-probabilities and the log-probability of the actual next token.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ..errors import SplicerError


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

    def describe(self) -> dict: ...


class BackendOptions(Protocol):
    """A backend's own options (its options_type): built once from what the user gave, checked where they are made,
    never changed during a run. Everything `ablate` asks of them, so that no stage outside splicer/backends/ needs a
    backend's name."""

    backend: str  # the backend's name (make_backend's)
    gpus: tuple  # the GPUs the rows are spread over (spread.py); () for one device

    @classmethod
    def option_names(cls) -> set[str]: ...  # the options it takes, as backend_options is given them

    @classmethod
    def refused_elsewhere(cls, given: dict) -> str: ...  # the line for these of its options given to another backend

    @classmethod
    def from_job(cls, settings: dict): ...  # the options a job.json's settings record (budget --verify reruns them)

    def check_device(self, device: str) -> None: ...  # a --device these options cannot go with is refused

    def job_settings(self) -> dict: ...  # its fields of job.json's settings

    def cache_key(self) -> list: ...  # its part of the base pass's cache key

    def context_length(self) -> int | None: ...  # the engine's context length, when the options set one

    def check_loadable(self, ckpt, modules: dict | None = None) -> None: ...  # refuse, in one line, what it cannot load

    def make_backends(self, device: str, log_dir: Path) -> list[Backend]: ...  # the run's backends; the first does the base pass


def usable_cores(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota (a container's `--cpus`)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):  # no cgroup v2 quota file: no quota
        pass
    return cores


def load_of_others(cores: int) -> float:
    """How many of this process's cores other processes keep busy: the 1-minute load average less this process's own
    share of it (its CPU seconds over that minute), or the runnable tasks now that are not this process's threads
    (/proc/loadavg's fourth field), whichever is larger: the average lags a minute behind processes that just started.
    Load spread over more cores than this process may use counts in proportion."""
    try:
        load1 = os.getloadavg()[0]
        t = os.times()
        own = min(cores, (t.user + t.system) / 60)
        others = max(0.0, load1 - own)
        running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
        mine = sum(1 for task in Path("/proc/self/task").iterdir() if _task_state(task) == "R")
        others = max(others, float(running - mine))
    except (AttributeError, OSError, ValueError, IndexError):  # no load figures (not Linux): assume none
        return 0.0
    return others * cores / max(cores, os.cpu_count() or cores)


def _task_state(task: Path) -> str:
    try:
        return task.joinpath("stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):  # the thread ended while we looked
        return ""


THREADS_VARIABLE = "SPLICER_THREADS"
MAX_THREADS = 1024  # torch takes a C int, and OpenMP allocates every thread's stack at once: a count far above any core count aborts the process


def choose_threads(
    requested: int | None = None, env=None, cores: int | None = None, others: float | None = None
) -> tuple[int, str]:
    """torch's CPU thread count and why, as `torch threads: N (why)`.

    A count the user gave wins (requested, then SPLICER_THREADS, then OMP_NUM_THREADS). Otherwise the cores this
    process may use less the cores other processes keep busy, at least one: torch's threads wait for each other by
    spinning, so with more threads than free cores each step waits for the slowest thread's next time slice: beside two
    busy processes on 2 cores, 2 threads made the demo three times slower than 1."""
    env = os.environ if env is None else env
    if requested:
        if requested > MAX_THREADS:
            raise SplicerError(f"--threads {requested} is more than {MAX_THREADS} threads; give a thread count")
        return requested, f"torch threads: {requested} (asked for)"
    if env.get(THREADS_VARIABLE, "").strip():
        text = env[THREADS_VARIABLE].strip()
        if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_THREADS:
            raise SplicerError(
                f"{THREADS_VARIABLE}={text[:20]!r} is not a whole number from 1 to {MAX_THREADS}; set it to "
                "a thread count or unset it"
            )
        return int(text), f"torch threads: {int(text)} (from {THREADS_VARIABLE})"
    omp = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if (
        omp.isascii() and omp.isdigit() and int(omp) >= 1
    ):  # OpenMP's own setting (a nested list's first level); anything else OpenMP ignores too
        if int(omp) > MAX_THREADS:
            raise SplicerError(
                f"OMP_NUM_THREADS={omp[:20]!r} is more than {MAX_THREADS} threads; set it to a thread count, "
                f"or set {THREADS_VARIABLE} for splicer alone"
            )
        return int(omp), f"torch threads: {int(omp)} (from OMP_NUM_THREADS)"
    cores = usable_cores() if cores is None else cores
    others = load_of_others(cores) if others is None else others
    n = max(1, cores - round(others))
    return n, f"torch threads: {n} ({cores} cores, load {others:.1f}; set {THREADS_VARIABLE} to choose)"


_threads_note: str | None = None  # set_torch_threads' last choice: torch's thread count is the process's, not a backend's


def set_torch_threads(requested: int | None = None) -> str:
    """Apply choose_threads to this process's torch; returns its line for the log (torch_threads_note gives it later)."""
    global _threads_note
    n, _threads_note = choose_threads(requested)
    torch.set_num_threads(n)
    return _threads_note


def torch_threads_note() -> str | None:
    """The line of set_torch_threads' last choice in this process; None when nothing chose yet."""
    return _threads_note


BACKENDS = ("torch", "vllm")  # make_backend's names


def options_type(name: str) -> type:
    """The options class of backend NAME: what that backend takes beyond a device (fields), checks (on construction) and
    records (job.json, the base pass's cache key); every other stage reads a backend's options through it."""
    if name == "torch":
        from .torch_ref import TorchOptions

        return TorchOptions
    if name == "vllm":
        from .vllm_backend import VllmOptions

        return VllmOptions
    raise SplicerError(f"unknown backend {name!r}; choose {' or '.join(BACKENDS)}")


def backend_options(name: str, given: dict, device: str = "auto"):
    """The options of backend NAME from those the user gave (option -> value, only those set). An option of another
    backend is checked as that backend checks it (so a bad value says what it should be), then refused with that
    backend's line; the chosen backend's options check their combinations, and the device, where they are made."""
    chosen = options_type(name)
    for other in map(options_type, BACKENDS):
        owned = {k: v for k, v in given.items() if k in other.option_names()}
        if other is not chosen and owned:
            other(**owned)
            raise SplicerError(other.refused_elsewhere(owned))
    options = chosen(**given)
    options.check_device(device)
    return options


def make_backend(name: str, device: str = "auto", **options) -> Backend:
    if name == "torch":
        from .torch_ref import TorchBackend

        return TorchBackend(device=device, **options)
    if name == "vllm":
        from .vllm_backend import VllmBackend

        return VllmBackend(device=device, **options)
    raise SplicerError(f"unknown backend {name!r}; choose {' or '.join(BACKENDS)}")
