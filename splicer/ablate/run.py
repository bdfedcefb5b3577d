"""`splicer ablate` in one straight line: validate the inputs and DIR, resolve the plan's rows for the build's family,
then under DIR's lock the job, the base pass and the rows (rows.py); the rows read the base pass from its cache."""

from __future__ import annotations

import time
from pathlib import Path

from ..checkpoint import open_checkpoint
from ..corpora.core import check_hub_corpora
from ..errors import SplicerError
from ..io.outputs import ABLATE, check_output, exclusive, local_folder
from ..io.progress import Stages
from ..plans import spread
from ..plans.plan import add_checkpoints, load_plan, resolve_rows
from .base_pass import base_cache
from .common import AblateRun, AblateSettings, closing_backends
from .job import make_job, override_corpora, prepare_corpora, select_rows, write_job
from .rows import RowSchedule, run_rows


def run_ablate(rows_spec: str, build_src: str, base_src: str, out: Path, plan_name: str, settings: AblateSettings) -> dict:
    """`splicer ablate`: the run made and checked (prepare_run), then under DIR's lock: the job record, the base pass
    (cached in DIR/cache), each row (run_row: its folder from RowSchedule, scores in DIR/scores/ROW, timing),
    results.json, table.md and report.md rewritten after every row. A rerun of the same job keeps the finished rows."""
    run = prepare_run(rows_spec, build_src, base_src, out=out, plan_name=plan_name, settings=settings)
    out, stages = run.out, run.stages
    base_digest = run.base.header_digest()
    tok, corpora = prepare_corpora(run.base.root, run.plan, settings)
    out.mkdir(parents=True, exist_ok=True)
    busy = f"another splicer ablate is writing to {out}; wait for it to finish or use another -o"
    with exclusive(out / ".lock", busy), closing_backends(*run.backends):
        check_output(out, run.inputs, ABLATE, own=settings.own_inputs)  # again under the lock: DIR may have changed
        stages.line(f"ablate {rows_spec} of plan {run.plan.name}: {build_src} against {base_src} into {out}")
        if note := getattr(run.backend, "threads_note", None):  # a backend that runs torch on the CPU says its thread count
            stages.line(note)
        if run.smoothing_warning:
            stages.line(run.smoothing_warning)
        job = make_job(
            run.plan,
            settings,
            corpora=corpora,
            build_src=build_src,
            build=run.build,
            base_src=base_src,
            base_digest=base_digest,
            out=out,
        )
        done, earlier_runs = write_job(out, job, stages, settings.extend_only)
        t_start = time.perf_counter()
        # When this invocation began (before its splices and base pass), as its elapsed_s counts from then.
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        # Rows this invocation runs, in order (RowSchedule says how their splices and engines are scheduled).
        run_list = [it for it in run.todo if it.row.name not in done and it.row.name in run.selected]
        cache = base_cache(run.plan, settings, backend=run.backend, out=out, base_digest=base_digest, corpora=corpora)
        schedule = RowSchedule(run, run_list)
        try:
            return run_rows(
                run,
                schedule=schedule,
                job=job,
                done=done,
                earlier_runs=earlier_runs,
                cache=cache,
                tok=tok,
                corpora=corpora,
                started=started,
                t_start=t_start,
            )
        except BaseException:
            schedule.cancel()  # nothing is spliced or compiled into DIR once its lock is released
            raise


def smoothing_warning(build, base, modules: dict) -> str | None:
    """A build whose unquantized tensors changed beyond rounding (smoothing folded in): its spliced rows do not mean
    what the table says, so the log says so before any row runs."""
    from ..splice.unquantized import SMOOTHING_NOTE, changed_text, compare_unquantized

    diffs = compare_unquantized(build, base, modules).differences
    if all(d.rounding_only for d in diffs):
        return None
    return (
        f"warning: the build's unquantized tensors were {SMOOTHING_NOTE} ({changed_text(diffs)}); "
        "`splicer inspect BUILD --base BASE` lists them"
    )


def prepare_run(
    rows_spec: str, build_src: str, base_src: str, *, out: Path, plan_name: str, settings: AblateSettings
) -> AblateRun:
    """The run, checked before DIR changes: the plan, the inputs (validated, DIR not inside them), the rows resolved
    for the build's family and the rows asked for, the backends."""
    from ..arch import all_classes

    plan = load_plan(plan_name, all_classes())  # a plan may name any family's classes; rows this one lacks are skipped
    # Before a checkpoint is opened (or downloaded): a Hub corpus this process cannot read would fail after the base pass starts.
    check_hub_corpora(
        override_corpora(plan, settings.corpus_overrides),
        f"plan {plan.name}",
        "pass --corpus NAME=FILE (a local .txt or .jsonl) for each, or a plan of local corpora (e.g. --plan demo)",
    )
    build = open_checkpoint(build_src, "build")
    from ..splice.modules import list_modules
    from ..splice.validate import validate_build

    added = add_checkpoints(plan, settings.add_checkpoints, settings.add_requantized, all_classes())
    # A build only scored (`splicer score`, or only checkpoint rows asked for) need not be one splicer can splice.
    asked = {w.strip() for w in rows_spec.split(",")}
    splicing = any(r.restore or r.keep is not None for r in plan.rows if rows_spec == "all" or r.name in asked)
    if splicing or build.quantization_config is None:
        validate_build(build)
    modules = list_modules(build)
    options = settings.backend_options
    options.check_loadable(build, modules)  # the build row is loaded as stored: refused now, not as a failed row
    # Before the base is read (or downloaded).
    out = check_output(
        out,
        [build.root, *local_folder(base_src), *(p for r in plan.rows if r.checkpoint for p in local_folder(r.checkpoint))],
        ABLATE,
        own=settings.own_inputs,
    )
    quantized = [c for c in build.arch.classes if any(m.quantized and m.cls == c for m in modules.values())]
    selected = select_rows(plan, rows_spec, quantized) | set(added)
    # One backend per GPU with --gpus (spread.py); the first runs the base pass.
    backends = tuple(options.make_backends(settings.device, out / "logs"))
    base = open_checkpoint(base_src, "base")
    from ..splice.validate import quantized_layers, validate_base

    frozen = validate_base(base, build, settings.allow_quantized_base)
    checkpoints = open_checkpoint_rows(plan, selected, base, settings)
    check_requantized(plan, checkpoints, build, quantized)
    family = build.config.get("model_type") or build.arch.name
    class_layers = quantized_layers(modules, build.arch)
    todo, skipped = resolve_rows(
        plan, family, build.arch.classes, quantized, frozen, class_layers, build.text_config.get("num_hidden_layers")
    )
    spread_rows = None
    lanes = spread.lane_labels(options.gpus, backends)
    if lanes:  # each lane's own engines of the build replace the plan's extra ones (spread.py); refused before DIR changes
        firsts, lasts, rows, replaced = spread.gpu_build_rows(todo, lanes, timed=bool(settings.time_decode and plan.timing))
        todo = [firsts[0], *rows, *(it for it in (*firsts[1:], *lasts) if it is not None)]
        why = spread.SPREAD_REPEAT_REASON if options.gpus else spread.RAY_REPEAT_REASON
        skipped += [{"name": it.row.name, "reason": why} for it in replaced]
        selected |= {it.row.name for it in (*firsts, *lasts) if it is not None}
        spread_rows = (firsts, lasts, rows, lanes)
    run = AblateRun(
        rows_spec=rows_spec,
        build_src=build_src,
        base_src=base_src,
        out=out,
        settings=settings,
        plan=plan,
        build=build,
        base=base,
        checkpoints=checkpoints,
        quantized=quantized,
        frozen=frozen,
        class_layers=class_layers or {},
        todo=todo,
        selected=frozenset(selected),
        skipped=[s for s in skipped if s["name"] in selected],  # a row not asked for is not reported as skipped
        spread=spread_rows,
        backends=backends,
        # Per run: stage lines go into this DIR's log (from the lock on: nothing is said before it).
        stages=Stages(quiet=not settings.progress, log_path=out / "ablate.log"),
        smoothing_warning=smoothing_warning(build, base, modules) if splicing else None,
    )
    check_output(out, run.inputs, ABLATE, own=settings.own_inputs)
    return run


def check_requantized(plan, checkpoints: dict, build, quantized: list[str]) -> None:
    """A row declared the build re-made without some classes (requantized_without) must be a quantized checkpoint other
    than the build and its own splices, and those classes must be ones the build quantizes; else one line, before DIR
    changes."""
    from .rows import spliced_classes

    for row in plan.rows:
        if not row.requantized_without or row.name not in checkpoints:
            continue
        ckpt, without = checkpoints[row.name], ", ".join(row.requantized_without)
        where = f"row {row.name} ({row.checkpoint})"
        if ckpt.header_digest() == build.header_digest():
            raise SplicerError(
                f"{where} is the build itself; pass the build re-made by its quantizer with {without} left in BF16"
            )
        if not ckpt.quantization_config:
            raise SplicerError(f"{where} has no quantization_config (a BF16 checkpoint); pass the re-quantized build")
        if spliced_classes(ckpt.root, build.header_digest()):
            raise SplicerError(
                f"{where} is splicer's own splice of this build (its splice.json), not the build re-made by its quantizer; "
                "score it with --add NAME=DIR, where it pairs as the splice"
            )
        unquantized = [c for c in row.requantized_without if c not in quantized]
        if unquantized:
            raise SplicerError(
                f"{where}: the build does not quantize {', '.join(unquantized)}, so no re-quantize can leave it in BF16; "
                f"name only classes the build quantizes ({', '.join(quantized)})"
            )


def open_checkpoint_rows(plan, selected: set[str], base, settings: AblateSettings) -> dict:
    """Open (for a Hub id, download) every selected `checkpoint` row and check it is the base's model, before DIR
    changes: row name -> Checkpoint. The torch backend must also be able to dequantize its format."""
    from ..splice.validate import validate_base

    out = {}
    for row in plan.rows:
        if not (row.checkpoint and row.name in selected):
            continue
        ckpt = open_checkpoint(row.checkpoint, f"checkpoint of row {row.name}")
        try:
            validate_base(base, ckpt, allow_quantized=True)
        except SplicerError as e:
            raise SplicerError(f"row {row.name}: {e}") from None
        try:
            settings.backend_options.check_loadable(ckpt)
        except SplicerError as e:
            raise SplicerError(f"row {row.name}: {e}") from None
        out[row.name] = ckpt
    return out
