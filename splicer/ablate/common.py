"""What every ablate stage shares: the run's settings, atomic JSON writes, progress bars, digests."""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..backends import DEFAULT_BACKEND, options_type
from ..errors import SplicerError
from ..io.progress import Stages
from ..io.results_record import FILE, json_default
from ..plans.plan import Plan

RESULTS = FILE  # DIR/results.json: read and written only through io.results_record


@dataclass(frozen=True)
class AblateSettings:
    """How `ablate` measures, as the command line (or `budget --verify`, from a job) gave it; never changed during a
    run. What only one backend takes is that backend's own options (backend_options: backends.BackendOptions)."""

    backend: str = DEFAULT_BACKEND
    device: str = "auto"
    time_decode: bool = True
    corpus_overrides: dict[str, str] = field(default_factory=dict)
    batch_size: int | None = None  # sequences per forward / per engine call; None: the backend's default
    bandwidth_gbs: float | None = None  # memory bandwidth for the decode floor column (H200: 4800)
    bootstrap: int = 1000
    progress: bool = True
    allow_quantized_base: bool = False  # a stand-in reference that keeps some classes quantized (see validate_base)
    add_checkpoints: tuple = ()  # `--add NAME=DIR`: other checkpoints of the model, scored as plan rows of their own
    add_requantized: tuple = ()  # `--add-requantized CLASSES=DIR`: the build re-made with CLASSES left in BF16
    extend_only: bool = False  # `budget --verify`: rows added to DIR's job, refused unless the job measures as DIR's
    own_inputs: tuple = ()  # input folders this run wrote inside DIR itself (the demo's pair), which DIR may hold
    backend_options: Any = None  # the backend's options (backends.backend_options); None: its defaults

    def __post_init__(self):
        kind = options_type(self.backend)  # an unknown backend is refused here
        if self.backend_options is None:
            object.__setattr__(self, "backend_options", kind())
        elif self.backend_options.backend != self.backend:
            raise SplicerError(
                f"options of the {self.backend_options.backend} backend given for --backend {self.backend}; "
                f"make them with backends.backend_options({self.backend!r}, ...)"
            )


@dataclass(frozen=True)
class AblateRun:
    """One `ablate` invocation, made once (run.prepare_run) from the command's arguments, the settings and the plan,
    before DIR's lock: the inputs, opened and checked, the rows this run knows (resolved for the build's family, in
    plan order) and which of them were asked for, the backends and where stage lines go. No stage changes it; what a
    stage makes (the job, the base pass, each row's results) it returns."""

    rows_spec: str  # ROWS as given: "all" or a comma list
    build_src: str  # the inputs as given (the table's caption shows them so)
    base_src: str
    out: Path  # DIR, as check_output gives it
    settings: AblateSettings
    plan: Plan
    build: Any  # the Checkpoints
    base: Any
    checkpoints: dict  # row name -> the opened Checkpoint of a selected `checkpoint` row
    quantized: list  # the build's quantized classes
    frozen: list  # the base's quantized classes (a stand-in reference)
    class_layers: dict  # class -> the decoder layers holding it quantized (for `splicer budget`)
    todo: list  # every row of the plan the build's family has, in order (PlannedRow)
    selected: frozenset  # the rows asked for (with the build, its repeats and, spread over GPUs, each GPU's build rows)
    skipped: list  # {"name", "reason"} of the rows asked for that cannot run
    spread: (
        tuple | None
    )  # with --gpus or Ray lanes: (each lane's first build row, each lane's last, the other rows, the lanes) (spread.py)
    backends: tuple  # one, or one per GPU; the first runs the base pass
    stages: Stages  # stage lines (stderr off a terminal, and DIR/ablate.log)
    smoothing_warning: str | None = None  # the build's unquantized tensors changed beyond rounding (run.smoothing_warning)

    @property
    def backend(self):
        return self.backends[0]

    @property
    def options(self):
        return self.settings.backend_options

    @property
    def inputs(self) -> list:
        """The folders the run reads, which DIR must not be inside."""
        return [self.build.root, self.base.root, *(c.root for c in self.checkpoints.values())]


def atomic_json(path: Path, data) -> None:
    atomic_text(path, json.dumps(data, indent=2, default=json_default) + "\n")


def atomic_text(path: Path, text: str) -> None:
    """Write path whole or not at all (outputs.write_file: beside it, then renamed; UTF-8 whatever the locale); a full
    disk or a read-only folder is one line (outputs.write_error, which names DIR, the -o to change), with no partial
    file left."""
    from ..io.outputs import write_error, write_file

    write_file(
        path,
        lambda tmp: tmp.write_text(text, encoding="utf-8"),
        tmp=path.with_suffix(path.suffix + ".tmp"),
        error=lambda e, p: write_error(e, p.parent),
    )


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


def row_folder(out: Path, results: dict, v: dict) -> Path:
    """The folder a finished row ran on: the base, the build, a checkpoint, or its splice under DIR/variants/."""
    inputs = results.get("inputs") or {}
    restored = v.get("restored")
    if restored == "base":
        return Path(inputs["base"]["source"])
    if restored == "checkpoint":
        return Path(v["checkpoint"]["source"])
    if restored == []:
        return Path(inputs["build"]["source"])
    return Path(out) / "variants" / (v.get("repeat_of") or v["name"])


def check_rows_finished(out: Path, results: dict, rows: list[str]) -> None:
    """Refuse, in one line, the first of rows (a --rows list of a later stage: tasks, mtp) that DIR has not finished:
    a row whose ablate run failed says so with its error (rerunning ablate finishes it), a name DIR never ran lists
    the finished rows."""
    variants = {v["name"]: v for v in results.get("variants", [])}
    for r in rows:
        v = variants.get(r)
        if v is not None and v.get("status") == "ok":
            continue
        if v is not None:
            error = (str(v.get("error") or v.get("status") or "").strip().splitlines() or ["no error recorded"])[0][:300]
            raise SplicerError(f"{r} failed in {out} (its error: {error}); rerun ablate to finish it")
        finished = [n for n, x in variants.items() if x.get("status") == "ok"]
        raise SplicerError(f"--rows {r}: {out} has no finished row of that name; finished: {', '.join(finished)}")
