"""`splicer ablate` in one straight line: validate the inputs and DIR, resolve the plan's rows for the build's family,
then under DIR's lock the job, the base pass and the rows (rows.py); the rows read the base pass from its cache."""

from __future__ import annotations

import time
from pathlib import Path

from .. import spread
from ..checkpoint import open_checkpoint
from ..corpora import check_hub_corpora
from ..errors import SplicerError
from ..outputs import ABLATE, check_output, exclusive, local_folder
from ..plan import add_checkpoints, load_plan, resolve_rows
from ..progress import Stages
from .base_pass import base_cache
from .common import AblateSettings, closing_backends
from .job import make_job, override_corpora, prepare_corpora, select_rows, write_job
from .rows import RowSchedule, run_rows


def run_ablate(rows_spec: str, build_src: str, base_src: str, out: Path, plan_name: str, settings: AblateSettings) -> dict:
    """`splicer ablate`: validate the inputs and DIR, resolve the plan's rows for this family, then under DIR's lock:
    the job record, the base pass (cached in DIR/cache), each row (run_row: its folder from RowSchedule, scores in
    DIR/scores/ROW, timing), results.json, table.md and report.md rewritten after every row. A rerun of the same job
    keeps the finished rows."""
    from ..arch import all_classes
    from ..backends import make_backend

    plan = load_plan(plan_name, all_classes())  # a plan may name any family's classes; rows this one lacks are skipped
    # Before a checkpoint is opened (or downloaded): a Hub corpus this process cannot read would fail after the base pass starts.
    check_hub_corpora(
        override_corpora(plan, settings.corpus_overrides),
        f"plan {plan.name}",
        "pass --corpus NAME=FILE (a local .txt or .jsonl) for each, or a plan of local corpora (e.g. --plan demo)",
    )
    build = open_checkpoint(build_src, "build")
    from ..modules import list_modules
    from ..validate import validate_build

    added = add_checkpoints(plan, settings.add_checkpoints)
    # A build only scored (`splicer score`, or only checkpoint rows asked for) need not be one splicer can splice.
    asked = {w.strip() for w in rows_spec.split(",")}
    splicing = any(r.restore or r.keep is not None for r in plan.rows if rows_spec == "all" or r.name in asked)
    if splicing or build.quantization_config is None:
        validate_build(build)
    modules = list_modules(build)
    if settings.backend == "torch" and build.quantization_config:
        from ..backends.torch_ref import TorchBackend

        TorchBackend.check_readable(build, modules)  # the build row is loaded as stored: refused now, not as a failed row
    # Before the base is read (or downloaded).
    out = check_output(
        out,
        [build.root, *local_folder(base_src), *(p for r in plan.rows if r.checkpoint for p in local_folder(r.checkpoint))],
        ABLATE,
        own=settings.own_inputs,
    )
    quantized = [c for c in build.arch.classes if any(m.quantized and m.cls == c for m in modules.values())]
    selected = select_rows(plan, rows_spec, quantized) | set(added)
    options = (
        {
            "engine_args": settings.engine_args,
            "log_dir": out / "logs",
            "cache_dir": settings.engine_cache_dir,
            "one_process": not settings.process_per_variant,
            "overlap_starts": settings.overlap_starts,
            "rewake_before_timing": settings.rewake_before_timing,
            "precompile": settings.precompile,
            "engine_env": settings.engine_env,
        }
        if settings.backend == "vllm"
        else {"threads": settings.threads}
    )
    if settings.gpus and settings.backend != "vllm":
        raise SplicerError("--gpus spreads rows over GPUs with the vLLM backend; add --backend vllm or drop --gpus")
    if settings.gpus:
        spread.check_gpus(settings.gpus, settings.overlap_starts)
    # One backend per GPU with --gpus (spread.py); the first runs the base pass.
    backends = (
        spread.make_backends(settings, options, out / "logs")
        if settings.gpus
        else [make_backend(settings.backend, settings.device, **options)]
    )
    backend = backends[0]
    base = open_checkpoint(base_src, "base")
    from ..validate import validate_base

    frozen = validate_base(base, build, settings.allow_quantized_base)
    checkpoints = open_checkpoint_rows(plan, selected, base, settings)
    family = build.config.get("model_type") or build.arch.name
    from ..validate import quantized_layers

    class_layers = quantized_layers(modules, build.arch)
    todo, skipped = resolve_rows(
        plan, family, build.arch.classes, quantized, frozen, class_layers, build.text_config.get("num_hidden_layers")
    )
    if settings.gpus:  # each GPU's own engines of the build replace the plan's extra ones (spread.py); refused before DIR changes
        firsts, lasts, spread_rows, replaced = spread.gpu_build_rows(
            todo, settings.gpus, timed=bool(settings.time_decode and plan.timing)
        )
        todo = [firsts[0], *spread_rows, *(it for it in (*firsts[1:], *lasts) if it is not None)]
        skipped += [{"name": it.row.name, "reason": spread.SPREAD_REPEAT_REASON} for it in replaced]
        selected |= {it.row.name for it in (*firsts, *lasts) if it is not None}
    skipped = [s for s in skipped if s["name"] in selected]  # a row not asked for is not reported as skipped
    inputs = [build.root, base.root, *(c.root for c in checkpoints.values())]
    check_output(out, inputs, ABLATE, own=settings.own_inputs)
    base_digest = base.header_digest()
    base_root = base.root
    tok, corpora = prepare_corpora(base_root, plan, settings)
    out.mkdir(parents=True, exist_ok=True)
    busy = f"another splicer ablate is writing to {out}; wait for it to finish or use another -o"
    with exclusive(out / ".lock", busy), closing_backends(*backends):
        check_output(out, inputs, ABLATE, own=settings.own_inputs)  # again under the lock: DIR may have changed
        # Set per run: a settings object reused for another DIR must not keep logging into the first one's log.
        settings.stages = Stages(quiet=not settings.progress, log_path=out / "ablate.log")
        settings.stages.line(f"ablate {rows_spec} of plan {plan.name}: {build_src} against {base_src} into {out}")
        if note := getattr(backend, "threads_note", None):  # a backend that runs torch on the CPU says its thread count
            settings.stages.line(note)
        job = make_job(plan, corpora, build_src, build, base_src, base_digest, settings, out)
        done, earlier_runs = write_job(out, job, settings.stages, settings.extend_only)
        t_start = time.perf_counter()
        # When this invocation began (before its splices and base pass), as its elapsed_s counts from then.
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        # Rows this invocation runs, in order (RowSchedule says how their splices and engines are scheduled).
        run_list = [it for it in todo if it.row.name not in done and it.row.name in selected]
        cache = base_cache(backend, plan, settings, out, base_digest, corpora)
        schedule = RowSchedule(run_list, backend, build, build_src, base_root, base_src, out, settings, compilers=backends)
        schedule.checkpoints = checkpoints
        try:
            return run_rows(
                schedule,
                backends,
                todo,
                run_list,
                done,
                cache,
                corpora,
                tok,
                plan,
                settings,
                out,
                base,
                job,
                quantized,
                frozen,
                skipped,
                earlier_runs,
                started,
                t_start,
                (firsts, lasts, spread_rows) if settings.gpus else None,
                class_layers,
            )
        except BaseException:
            schedule.cancel()  # nothing is spliced or compiled into DIR once its lock is released
            raise


def open_checkpoint_rows(plan, selected: set[str], base, settings: AblateSettings) -> dict:
    """Open (for a Hub id, download) every selected `checkpoint` row and check it is the base's model, before DIR
    changes: row name -> Checkpoint. The torch backend must also be able to dequantize its format."""
    from ..validate import validate_base

    out = {}
    for row in plan.rows:
        if not (row.checkpoint and row.name in selected):
            continue
        ckpt = open_checkpoint(row.checkpoint, f"checkpoint of row {row.name}")
        try:
            validate_base(base, ckpt, allow_quantized=True)
        except SplicerError as e:
            raise SplicerError(f"row {row.name}: {e}") from None
        if settings.backend == "torch" and ckpt.quantization_config:
            from ..backends.torch_ref import TorchBackend

            try:
                TorchBackend.check_readable(ckpt)
            except SplicerError as e:
                raise SplicerError(f"row {row.name}: {e}") from None
        out[row.name] = ckpt
    return out
