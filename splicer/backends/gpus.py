"""One engine per GPU for `splicer ablate --gpus 0,1` (plans/spread.py runs the rows over them): the --gpus ids as
CUDA ids, each GPU's share of the cores and of --precompile's processes, and what --gpus accepts."""

from __future__ import annotations

import os

from ..errors import SplicerError


def cuda_ids(gpus: tuple[str, ...]) -> list[str]:
    """--gpus ids as the CUDA ids a child process is given: the parent's CUDA_VISIBLE_DEVICES (when set) maps them."""
    import torch

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        bad = [g for g in gpus if int(g) >= n]
        if bad:
            raise SplicerError(
                f"--gpus {','.join(gpus)}: this machine shows {n} GPU(s) (CUDA ids 0-{n - 1}); drop {','.join(bad)}"
            )
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible:
        if any(int(g) >= len(visible) for g in gpus):
            raise SplicerError(
                f"--gpus {','.join(gpus)}: CUDA_VISIBLE_DEVICES shows {len(visible)} GPU(s); give ids below {len(visible)}"
            )
        return [visible[int(g)] for g in gpus]
    return list(gpus)


def core_shares(n: int) -> list[list[int]]:
    """This process's cores split into n equal, disjoint shares (one per GPU)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cores) < n:
        return [cores] * n
    return [cores[k * len(cores) // n : (k + 1) * len(cores) // n] for k in range(n)]


def one_per_gpu(gpus: tuple[str, ...], precompile: int, make) -> list:
    """One backend per GPU, the first runs the base pass: make(device, gpu, precompile, cpus) with the GPU's CUDA
    device, its --gpus id, its share of --precompile's N processes (the first GPU, which holds the base pass's engine
    too, gets the fewest) and its share of the cores."""
    ids, shares = cuda_ids(gpus), core_shares(len(gpus))
    n = len(ids)
    lanes = [precompile // n + (1 if k >= n - precompile % n else 0) for k in range(n)]
    return [make(f"cuda:{cuda}", gpu, lanes[k], shares[k]) for k, (gpu, cuda) in enumerate(zip(gpus, ids))]


def check_gpus(gpus: tuple[str, ...], overlap_starts: int) -> None:
    """What --gpus accepts, and what it cannot go with (checked where the vLLM backend's options are made)."""
    if len(gpus) < 2 or len(set(gpus)) != len(gpus) or not all(str(g).isdigit() for g in gpus):
        raise SplicerError(
            f"--gpus {','.join(map(str, gpus))}: give two or more distinct CUDA device ids, e.g. --gpus 0,1 "
            "(one GPU: leave --gpus out)"
        )
    if overlap_starts:
        raise SplicerError(
            "--gpus and --overlap-starts: a run spread over GPUs starts each GPU's engines one at a time; drop --overlap-starts"
        )
