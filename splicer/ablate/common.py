"""What every ablate stage shares: the run's settings, atomic JSON writes, progress bars, digests."""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..progress import SILENT, Stages

RESULTS = "results.json"


@dataclass
class AblateSettings:
    backend: str = "torch"
    device: str = "auto"
    time_decode: bool = True
    corpus_overrides: dict[str, str] = field(default_factory=dict)
    batch_size: int | None = None  # sequences per forward / per engine call; None: the backend's default
    engine_args: dict = field(default_factory=dict)
    engine_env: dict = field(default_factory=dict)  # vllm: environment variables for every engine process (--engine-env)
    bandwidth_gbs: float | None = None  # memory bandwidth for the decode floor column (H200: 4800)
    threads: int | None = None  # torch: CPU threads (--threads); None: SPLICER_THREADS, OMP_NUM_THREADS or the free cores
    bootstrap: int = 1000
    progress: bool = True
    process_per_variant: bool = False  # vllm: a fresh worker process per variant instead of one for the run
    overlap_starts: int = 0  # vllm: engines started ahead (in spare workers) while the current one scores
    rewake_before_timing: bool = False  # vllm with overlap: one more sleep and wake right before each decode timing
    precompile: int = 0  # vllm: processes that compile every variant's engine while the base pass runs (rows stay serial)
    gpus: tuple = ()  # vllm: CUDA ids to spread the rows over (two or more); () = one GPU
    allow_quantized_base: bool = False  # a stand-in reference that keeps some classes quantized (see validate_base)
    engine_cache_dir: Path | None = None  # vllm: compile/Triton/Inductor caches; None: their per-user defaults
    add_checkpoints: tuple = ()  # `--add NAME=DIR`: other checkpoints of the model, scored as plan rows of their own
    extend_only: bool = False  # `budget --verify`: rows added to DIR's job, refused unless the job measures as DIR's
    own_inputs: tuple = ()  # input folders this run wrote inside DIR itself (the demo's pair), which DIR may hold
    stages: Stages = field(default=SILENT, repr=False)  # stage lines (stderr off a terminal, and DIR/ablate.log)


def atomic_json(path: Path, data) -> None:
    atomic_text(path, json.dumps(data, indent=2, default=_jsonable) + "\n")


def atomic_text(path: Path, text: str) -> None:
    """Write path whole or not at all (outputs.write_file: beside it, then renamed; UTF-8 whatever the locale); a full
    disk or a read-only folder is one line (outputs.write_error, which names DIR, the -o to change), with no partial
    file left."""
    from ..outputs import write_error, write_file

    write_file(
        path,
        lambda tmp: tmp.write_text(text, encoding="utf-8"),
        tmp=path.with_suffix(path.suffix + ".tmp"),
        error=lambda e, p: write_error(e, p.parent),
    )


def _jsonable(o):
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, float) and (o != o):
        return None
    raise TypeError(type(o))


@contextmanager
def closing_backends(*backends):
    """End the backends' worker processes however the run ends (finished, failed, interrupted)."""
    try:
        yield backends
    finally:
        for backend in backends:
            backend.close()


def progress_bar(iterable=None, **kw):
    from tqdm.auto import tqdm

    return tqdm(iterable, **kw)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))


def parts_digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def pick_batch_size(settings: AblateSettings, backend) -> int:
    return settings.batch_size or backend.default_batch
