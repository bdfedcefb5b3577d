"""torch's CPU thread count: what the user asked for, else the cores this process may use less those others keep busy."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import SplicerError


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
