"""DIR/results.json, the record `splicer ablate` and `splicer score` write and every other command reads: its shape
(the TypedDicts below, for the fields readers rely on), `load` (parsed, schema version and rows checked once, or a
one-line error naming the problem and the fix) and `write` (whole or not at all). Every reader and the writer go
through here, so the file's format is known in one place. The JSON is kept as the plain dict it parses to: readers
index it as before, and a rewrite is byte for byte what the writer produced."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, TypedDict

from ..errors import SplicerError

FILE = "results.json"
SCHEMA = 1  # the version this splicer writes and reads; a file without "schema" (hand-made) is read as this one


class CorpusMetrics(TypedDict, total=False):
    """One variant's scores on one corpus (analysis.metrics.summarize, with the verdicts' intervals)."""

    kl: float | None
    top1: float | None
    dnll: float | None
    kl_ci: list[float] | None
    top1_ci: list[float] | None
    dnll_ci: list[float] | None


class Variant(TypedDict, total=False):
    """One row of the plan as ablate finished (or failed) it."""

    name: str
    status: str  # "ok" once scored on every corpus
    metrics: dict[str, CorpusMetrics]
    kl_support: str | None  # how its KL was measured (as the run's kl_support)
    size_bytes: int | None
    decode_ms_per_token: float | None
    timing: dict[str, Any] | None
    decode_vs_build: dict[str, Any] | None
    repeat_of: str | None
    gpu: int | None
    # A re-quantized build's row (checkpoint.requantized_without): the splice of the same classes against it, paired
    # (verdicts.splice_vs_requantized): classes, splice (its row, or None with why), kl/top1/dnll comparisons.
    vs_splice: dict[str, Any] | None


class Results(TypedDict, total=False):
    """The top level (ablate.results.new_results makes it; finish_results adds the backend, verdicts and timing)."""

    schema: int
    base_pass: dict[str, Any]
    job: dict[str, Any]
    plan: dict[str, Any]
    top_k: int | None
    kl_support: str | None  # backends.base.KL_EXACT or KL_OWN_TOP_K; absent in files written before it was recorded
    backend: str | None
    engine_version: str | None
    device: str | None
    inputs: dict[str, dict[str, Any]]
    corpora: dict[str, dict[str, Any]]
    quantized_classes: list[str]
    base_quantized_classes: list[str]
    noise_floor: dict[str, Any]
    timing_settings: dict[str, Any] | None
    bandwidth_bytes_per_s: float | None
    class_layers: dict[str, Any]
    variants: list[Variant]
    skipped: list[dict[str, Any]]
    runs: list[dict[str, Any]]
    verdicts: dict[str, Any]
    time_breakdown: dict[str, Any]
    backend_info: dict[str, Any]
    elapsed_s: float


def path_of(folder: Path) -> Path:
    return Path(folder) / FILE


def read(folder: Path) -> Results:
    """DIR/results.json parsed, its top level and schema version checked, rows as written (ablate's own rerun reads
    it so: its finished rows are kept exactly), or a one-line error saying what is wrong and how to get a good one."""
    path = path_of(folder)
    if path.is_dir():
        raise SplicerError(
            f"{path} is a folder, not the results file; pass the folder splicer ablate or score wrote "
            "(the one holding results.json)"
        )
    if not path.exists():
        raise SplicerError(f"{path} does not exist; run splicer ablate with -o {folder} first")
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise SplicerError(f"{path} cannot be read ({e.strerror}); ask its owner for read access, or copy it") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise SplicerError(f"{path} is not valid JSON; rerun splicer ablate to rewrite it") from None
    if not isinstance(results, dict) or not isinstance(results.get("variants"), list):
        raise SplicerError(
            f"{path} is not a splicer results file (no variants list); pass a folder splicer ablate or score wrote"
        )
    schema = results.get("schema", SCHEMA)
    if not isinstance(schema, int) or isinstance(schema, bool) or schema < 1:
        raise SplicerError(f"{path} has schema {str(schema)[:20]!r}, not a version number; rerun splicer ablate to rewrite it")
    if schema > SCHEMA:
        raise SplicerError(f"{path} has schema {schema}, newer than this splicer reads ({SCHEMA}); upgrade splicer to read it")
    return results


def load(folder: Path) -> Results:
    """DIR/results.json for the readers (table, compare, report, budget, plot, seeds): read, then checked once for
    what every reader relies on (check_results); a row whose figures are not finite is marked UNUSABLE in memory."""
    results = read(folder)
    check_results(results, path_of(folder))
    return results


def write(folder: Path, results: Results) -> None:
    """DIR/results.json whole or not at all (outputs.write_file: beside it, then renamed), as ablate has always
    written it: two-space indent, paths as strings, a final newline; a NaN score stays NaN
    (what a broken variant measured: load marks that row UNUSABLE)."""
    from .outputs import write_error, write_file

    path = path_of(folder)
    text = json.dumps(results, indent=2, default=json_default) + "\n"
    write_file(
        path,
        lambda tmp: tmp.write_text(text, encoding="utf-8"),
        tmp=path.with_suffix(path.suffix + ".tmp"),
        error=lambda e, p: write_error(e, p.parent),
    )


def json_default(o):
    """What json cannot write by itself in a splicer record: paths as strings."""
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, float) and (o != o):
        return None
    raise TypeError(type(o))


KL_TOLERANCE = 1e-6  # a mean of per-position KLs that are each >= 0 up to float rounding: below -this it is no KL
UNUSABLE = "unusable"  # set (in memory, never written) on a row whose measurements are not finite numbers: why


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_results(results: dict, path: Path) -> None:
    """What the readers of results.json rely on, checked once. A hand edit or a foreign file gets one line naming the
    row and the field: a row that is not an object or has no name, a metric, size or timing that is not a number (a
    string, true/false), a negative KL or a decode time at or below 0 (no measurement gives either). A NaN or infinite
    measurement is what a broken variant scores (its logits were NaN): that row is kept for the table but marked
    UNUSABLE with the reason, and budget and plot leave it out and say so."""
    fix = "restore results.json from the run, or rerun splicer ablate on it"
    seen = set()
    for i, v in enumerate(results["variants"]):
        if not isinstance(v, dict):
            raise SplicerError(f"{path}: variants[{i}] is {type(v).__name__}, not a row (an object); {fix}")
        name = v.get("name")
        if not isinstance(name, str) or not name:
            raise SplicerError(f"{path}: variants[{i}] has no name; {fix}")
        if name in seen:  # ablate writes one entry per row: readers would take either of the two
            raise SplicerError(f"{path}: variants[{i}] is a second row named {name[:60]!r}; {fix}")
        seen.add(name)
        where = f"{path}: row {name[:60]!r}"
        bad = []

        def number(value, field: str, low: float | None = None, strict: bool = False) -> None:
            if value is None:
                return
            if not _number(value):
                raise SplicerError(f"{where}: {field} is {str(value)[:20]!r}, not a number; {fix}")
            if not math.isfinite(value):
                bad.append(f"{field} is {value}")
            elif low is not None and (value <= low if strict else value < low):
                raise SplicerError(
                    f"{where}: {field} is {value:g}, "
                    + ("at or below 0 (a time is positive)" if strict else "below 0 (KL is never negative)")
                    + f"; {fix}"
                )

        metrics = v.get("metrics")
        finished = v.get("status") == "ok"  # a finished row was scored on every corpus: its KL is never missing
        if (metrics is not None or finished) and not isinstance(metrics, dict):
            raise SplicerError(f"{where}: metrics is {'missing' if metrics is None else 'not an object'}; {fix}")
        for corpus, m in (metrics or {}).items():
            if not isinstance(m, dict):
                raise SplicerError(f"{where}: metrics of corpus {str(corpus)[:40]!r} is not an object; {fix}")
            if finished and m.get("kl") is None:
                raise SplicerError(f"{where}: KL on {corpus} is missing; {fix}")
            number(m.get("kl"), f"KL on {corpus}", -KL_TOLERANCE)
            for key in ("top1", "dnll"):
                number(m.get(key), f"{key} on {corpus}")
            for key in ("kl_ci", "top1_ci", "dnll_ci"):
                ci = m.get(key)
                if ci is not None and not (isinstance(ci, list) and len(ci) == 2):
                    raise SplicerError(f"{where}: {key} on {corpus} is not a pair of numbers; {fix}")
                for x in ci or []:
                    number(x, f"{key} on {corpus}")
        number(v.get("size_bytes"), "size_bytes", 0)
        number(v.get("decode_ms_per_token"), "decode_ms_per_token", 0, strict=True)
        timing = v.get("timing")
        if timing is not None and not isinstance(timing, dict):
            raise SplicerError(f"{where}: timing is not an object; {fix}")
        blocks = (timing or {}).get("per_run_ms")
        if blocks is not None and not isinstance(blocks, list):
            raise SplicerError(f"{where}: timing.per_run_ms is not a list; {fix}")
        for x in blocks or []:
            if v.get("decode_ms_per_token") is not None:
                number(x, "a timing block (per_run_ms)")
            elif x is not None and not _number(x):  # unresolved (a block's estimate at or below 0): numbers all the same
                raise SplicerError(f"{where}: a timing block (per_run_ms) is {str(x)[:20]!r}, not a number; {fix}")
        d = v.get("decode_vs_build")
        if isinstance(d, dict):
            number(d.get("engine_sd_ms"), "decode_vs_build.engine_sd_ms", 0)
        ck = v.get("checkpoint")
        if isinstance(ck, dict) and ck.get("requantized_without") is not None:
            _check_requantized_without(ck["requantized_without"], results, where, fix)
        if bad:
            v[UNUSABLE] = "; ".join(bad)


def _check_requantized_without(without, results: dict, where: str, fix: str) -> None:
    """A re-made build's classes left in BF16 (checkpoint.requantized_without, `--add-requantized`), as ablate writes
    them: a list of distinct classes the build quantizes (results.json's quantized_classes; every family's classes
    where a hand-made file has none). Checked here, so that budget, table and report refuse the same hand edit alike."""
    if not isinstance(without, list) or not without or not all(isinstance(c, str) and c for c in without):
        raise SplicerError(f"{where}: checkpoint.requantized_without is {str(without)[:40]!r}, not a list of class names; {fix}")
    twice = sorted({c for c in without if without.count(c) > 1})
    if twice:
        raise SplicerError(f"{where}: checkpoint.requantized_without names {', '.join(twice)[:60]} twice; {fix}")
    from ..arch import all_classes

    classes = all_classes()
    quantized = results.get("quantized_classes")
    if not (isinstance(quantized, list) and all(isinstance(c, str) for c in quantized)):
        quantized = None  # a hand-made file: any family's class
    for c in without:
        if c not in classes:
            known = f"the build quantizes {', '.join(quantized)}" if quantized else f"classes: {', '.join(classes)}"
            raise SplicerError(f"{where}: checkpoint.requantized_without names unknown class {c[:40]!r} ({known}); {fix}")
        if quantized is not None and c not in quantized:
            raise SplicerError(
                f"{where}: checkpoint.requantized_without names {c}, which the build does not quantize (it quantizes "
                f"{', '.join(quantized) or 'nothing'}); {fix}"
            )


def read_stage_record(path: Path) -> dict | None:
    """A later stage's JSON record in a results folder (speculative.json, tasks.json, mtp-teacher-forced.json, ...) as
    a dict; None when it is missing, unreadable or not an object: each reader then behaves as if the stage never ran."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def finished_entries(path: Path, digest: str, key: str):
    """The finished entries (status "ok") under `key` of a stage's record at path, when it was made with the same
    settings (its settings_digest); none otherwise, since a record of other prompts, tasks or settings compares with
    nothing a new run measures. A list under `key` comes back as a list, a mapping (row -> entry) as a mapping."""
    old = read_stage_record(path) or {}
    entries = old.get(key) if old.get("settings_digest") == digest else None
    if isinstance(entries, dict):
        return {k: e for k, e in entries.items() if isinstance(e, dict) and e.get("status") == "ok"}
    if isinstance(entries, list):
        return [e for e in entries if isinstance(e, dict) and e.get("status") == "ok"]
    return [] if key == "engines" else {}
