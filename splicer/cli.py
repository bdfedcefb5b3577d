"""The `splicer` command line: argument parsing only; each command calls one stage."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from . import __version__
from .errors import SplicerError


def _cmd_inspect(args) -> int:
    from .checkpoint import open_checkpoint
    from .splice.inspect import format_report, inspect_checkpoint

    build = open_checkpoint(args.build, "checkpoint")
    info = inspect_checkpoint(build)
    text = None if args.json else format_report(info)
    if args.base:
        from .splice.unquantized import compare_unquantized, format_summary, summary
        from .splice.validate import validate_base

        base = open_checkpoint(args.base, "base")
        validate_base(base, build, False)  # the base of this model, unquantized, as splice requires it
        info["unquantized_vs_base"] = summary(compare_unquantized(build, base))
        if text is not None:
            text += "\n" + format_summary(info["unquantized_vs_base"], args.build, args.base)
    print(json.dumps(info, indent=2) if args.json else text)
    return 0


ALLOW_QUANTIZED_BASE_HELP = (
    "accept a base that keeps some classes quantized exactly as the build stores them "
    "(a stand-in reference, e.g. INT4 experts); those classes cannot be restored"
)


def _cmd_splice(args) -> int:
    from .io.progress import Stages
    from .splice.core import splice

    record = splice(
        args.build,
        args.base,
        args.out,
        args.restore,
        layers=args.layers,
        modules_regex=args.modules,
        force=args.force,
        progress=not args.quiet,
        tokenizer_from_base=args.tokenizer_from_base,
        drop_dead_ignore=args.drop_dead_ignore,
        allow_quantized_base=args.allow_quantized_base,
        unquantized_from_base=args.unquantized_from_base,
        stages=Stages(quiet=args.quiet),
    )
    s = record["shards"]
    from_base = (
        f"; {len(record['unquantized_from_base'])} unquantized tensors that differed took the base's values"
        + (
            f" ({len(record['unquantized_not_compared'])} not compared: the base lacks them or stores them otherwise)"
            if record["unquantized_not_compared"]
            else ""
        )
        if args.unquantized_from_base
        else ""
    )
    print(
        f"wrote {args.out}: restored {record['restored_modules']} modules ({', '.join(record['restored_classes'])}); "
        f"shards rewritten {s['rewritten']}, hard-linked {s['linked']}, copied {s['copied']}{from_base}"
    )
    return 0


BUILDS_DEFAULT = "lowlatency,experts-g32"


def _cmd_fixture(args) -> int:
    from .fixtures.core import FixtureSpec, write_fixture_folder, write_pair

    if args.family != "qwen3_5_moe":
        from .fixtures.families import FAMILY_FIXTURES, write_family_pair

        if args.family not in FAMILY_FIXTURES:
            raise SplicerError(
                f"--family {args.family!r}: no fixture for it; choose from qwen3_5_moe, {', '.join(sorted(FAMILY_FIXTURES))}"
            )
        if args.full_dims or args.preset != "tiny" or args.experts_layout != "fused" or args.builds != BUILDS_DEFAULT:
            raise SplicerError(
                f"--family {args.family} writes its base and its own builds "
                f"({', '.join(FAMILY_FIXTURES[args.family].builds)}); drop --preset, --builds, --experts-layout and --full-dims"
            )
        paths = write_fixture_folder(
            args.out,
            lambda d: write_family_pair(d, args.family, seed=args.seed),
            args.force,
            {"family": args.family, "seed": args.seed},
        )
        for k, p in paths.items():
            print(f"{k}: {p}")
        return 0
    if args.full_dims:
        from .backends.torch_ref import pick_device
        from .fixtures.standin import RESIDUAL_SCALE, write_standin

        device = "cuda" if args.device == "auto" else args.device
        if device.startswith("cuda") and not __import__("torch").cuda.is_available():
            raise SplicerError(
                "--full-dims draws ~35B parameters and wants a GPU (--device cuda); torch sees none. "
                "Use --device cpu only if you can wait (tens of minutes) and have ~30 GB of disk"
            )
        device = str(pick_device(device))  # cpu, cuda or cuda:N, or one line saying which devices there are
        spec = FixtureSpec(preset="full", seed=args.seed, residual_scale=RESIDUAL_SCALE)
        r = write_fixture_folder(
            args.out, lambda d: write_standin(d, spec, device=device), args.force, {"full_dims": True, "seed": args.seed}
        )
        print(
            f"build: {r['build']}\nreference: {r['reference']}\ngenerated in {r['generate_s']:.1f} s, "
            f"reference spliced in {r['splice_reference_s']:.1f} s"
        )
        return 0

    kinds = [k for k in args.builds.split(",") if k.strip()]
    from .fixtures.core import BUILD_KINDS

    bad = [k for k in kinds if k not in BUILD_KINDS]
    if bad or not kinds:
        raise SplicerError(
            f"--builds {args.builds!r}: unknown build kind {bad[0] if bad else '(none)'!r}; choose from {', '.join(BUILD_KINDS)}"
        )
    spec = FixtureSpec(preset=args.preset, experts_layout=args.experts_layout, seed=args.seed)
    paths = write_fixture_folder(
        args.out, lambda d: write_pair(d, spec, kinds), args.force, {"preset": args.preset, "builds": kinds, "seed": args.seed}
    )
    for k, p in paths.items():
        print(f"{k}: {p}")
    return 0


def _backend_options(args) -> dict:
    """The backend options the user set, by the option names the backends take (backends.backend_options checks them,
    each backend its own)."""
    from .backends.vllm_engine_args import parse_engine_args, parse_engine_env

    engine_args = parse_engine_args(args.engine_arg)
    for flag in ("tensor_parallel_size", "max_model_len", "gpu_memory_utilization", "moe_backend"):
        if getattr(args, flag) is not None:
            engine_args[flag] = getattr(args, flag)
    if args.language_model_only:
        engine_args["language_model_only"] = True
    given = {
        "threads": args.threads,
        "engine_args": engine_args,
        "engine_env": parse_engine_env(args.engine_env),
        "engine_cache_dir": args.engine_cache_dir,
        "expert_cache": getattr(args, "expert_cache", None),
        "process_per_variant": args.process_per_variant,
        "overlap_starts": args.overlap_starts,
        "rewake_before_timing": args.rewake_before_timing,
        "precompile": args.precompile,
        "gpus": tuple(g.strip() for g in args.gpus.split(",") if g.strip()) if args.gpus else None,
        "ray": getattr(args, "ray", None),
        "ray_lanes": getattr(args, "ray_lanes", None),
    }
    return {k: v for k, v in given.items() if v or (k == "gpus" and v is not None)}


def _cmd_ablate(args) -> int:
    from .ablate import AblateSettings, run_ablate
    from .backends import backend_options

    overrides = {}
    for item in args.corpus or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SplicerError(f"--corpus {item!r} should be NAME=FILE (a .txt or .jsonl file)")
        overrides[name] = path
    options = backend_options(args.backend, _backend_options(args), args.device)  # before --demo writes its pair into DIR
    task_names = [t.strip() for t in (args.tasks or "").split(",") if t.strip()]
    if task_names:  # an unknown task or a missing lm-eval is refused before anything runs
        from .backends import backend_type
        from .tasks.run import check_tasks, settings_refusal, task_settings

        check_tasks(task_names, args.include_path)
        refusal = settings_refusal(
            Path(args.out),
            task_settings(task_names, args.include_path, args.task_limit, args.backend),
            force_hint="run `splicer tasks DIR ... --force` to replace them",
            limit_flag="--task-limit",
            earlier_models=backend_type(args.backend).task_models_before,
        )
        if refusal:
            raise SplicerError(refusal)
    elif args.include_path:
        raise SplicerError("--include-path names a folder of task YAMLs for --tasks; add --tasks NAMES")
    from .io.outputs import ABLATE, FIXTURE, check_output, removed_on_refusal

    device, own_inputs = args.device, ()
    if args.demo:
        if args.build or args.base:
            raise SplicerError("--demo builds its own tiny pair; drop BUILD and BASE, or drop --demo")
        from .fixtures.core import FixtureSpec, write_fixture_folder, write_pair
        from .plans.plan import load_plan

        plan = args.plan or "demo"
        from .arch import all_classes

        load_plan(plan, all_classes())  # a bad --plan is refused before the pair is written
        pair_dir = Path(args.out).absolute() / "demo-pair"
        own_inputs = (pair_dir,)
        out = check_output(args.out, [], ABLATE, own=own_inputs)
        if device == "auto":
            device = "cpu"
    else:
        if not (args.build and args.base):
            raise SplicerError("ablate needs BUILD and BASE (or --demo)")
        out, plan = args.out, args.plan or "where-error-comes-from"
    settings = AblateSettings(
        backend=args.backend,
        device=device,
        time_decode=not args.no_time,
        corpus_overrides=overrides,
        batch_size=args.batch_size,
        progress=not args.quiet,
        allow_quantized_base=args.allow_quantized_base,
        bandwidth_gbs=args.bandwidth_gbs,
        add_checkpoints=tuple(args.add),
        add_requantized=tuple(args.add_requantized or ()),
        own_inputs=own_inputs,
        backend_options=options,
    )
    with removed_on_refusal(Path(out).absolute()):
        if args.demo:
            if not (pair_dir / FIXTURE.record).exists():
                from .backends.cpu_threads import set_torch_threads

                set_torch_threads(args.threads)  # the pair is drawn with torch too: as many threads as the backend will have
                pair_dir.parent.mkdir(parents=True, exist_ok=True)
                write_fixture_folder(
                    pair_dir, lambda d: write_pair(d, FixtureSpec(), kinds=("lowlatency",)), force=True, what={"demo": True}
                )
            build, base = pair_dir / "lowlatency", pair_dir / "base"
        else:
            build, base = args.build, args.base
        results = run_ablate(args.rows, str(build), str(base), args.out, plan, settings)
    from .analysis.table import render_markdown

    print(render_markdown(results, args.out))
    print(
        f"\nwrote {args.out / 'results.json'}, {args.out / 'table.md'} and {args.out / 'report.md'} in {results.get('elapsed_s', 0):.0f} s"
    )
    failed = [v["name"] for v in results["variants"] if v.get("status") != "ok"]
    task_failed = []
    if task_names:  # lm-eval on every finished row, once the rows are scored: DIR/tasks.json (splicer tasks DIR)
        from .tasks.run import run_tasks

        record = run_tasks(
            args.out,
            task_names,
            include_path=args.include_path,
            limit=args.task_limit,
            device=device,
            progress=not args.quiet,
            backend=args.backend,
        )
        task_failed = [r for r, e in record["rows"].items() if e.get("status") != "ok"]
        print(f"wrote {args.out / 'tasks.json'}: {', '.join(task_names)} on {len(record['rows'])} rows")
    if failed or task_failed:  # the finished rows are written; the run is not a success, and says so last
        sys.stdout.flush()
        if failed:
            print(
                f"splicer: error: {len(failed)} of {len(results['variants'])} rows failed: {', '.join(failed)}; see each "
                f"row's error in {args.out / 'table.md'} (and results.json); rerun the same command to retry them",
                file=sys.stderr,
            )
        if task_failed:
            print(f"splicer: error: tasks failed on {', '.join(task_failed)}; see {args.out / 'tasks.json'}", file=sys.stderr)
        return 1
    return 0


def _row_name_for(source: str, taken: set[str]) -> str:
    """A results row name from a checkpoint folder or repo id: its last part, made a plain name, unique."""
    stem = re.sub(r"[^A-Za-z0-9_.+-]", "-", Path(source.rstrip("/")).name or "checkpoint").lstrip(".-")[:90] or "checkpoint"
    name, k = stem, 2
    while name in taken:
        name, k = f"{stem}-{k}", k + 1
    taken.add(name)
    return name


def _cmd_score(args) -> int:
    """`splicer score BASE BUILD...`: `ablate` with the first BUILD as the build row and the others as checkpoint rows."""
    taken = {"build", "base"}
    args.add = [f"{_row_name_for(b, taken)}={b}" for b in args.builds[1:]]
    requantized = [
        "requantized-" + "+".join(sorted({c.strip() for c in spec.partition("=")[0].split(",")})) for spec in args.add_requantized
    ]
    args.rows = ",".join([a.partition("=")[0] for a in args.add] + requantized) or "build"
    args.build, args.demo = args.builds[0], False
    return _cmd_ablate(args)


def _cmd_plan_sweep(args) -> int:
    from .plans.sweep import write_sweep

    out = write_sweep(args.build, args.cls, args.groups, args.out, args.template)
    print(f"wrote {out}: run it with splicer ablate all BUILD BASE -o DIR --plan {out}")
    return 0


def _cmd_plot(args) -> int:
    from .analysis.plot import write_plot

    written, left_out = write_plot(args.dir)
    plots = [str(p) for p in written if p.suffix != ".md"]
    linked = any(p.suffix == ".md" for p in written)
    print(
        f"wrote {', '.join(plots)}"
        + (f"; linked from {Path(args.dir) / 'table.md'}" if linked else " (no table.md to link from)")
        + (f"; left out, a measurement not a number: {', '.join(left_out)}" if left_out else "")
    )
    return 0


def _cmd_budget(args) -> int:
    from .budget.search import budget_report

    text, finished = budget_report(
        args.dir, args.max_decode_ms, args.max_gb, args.max_kl, args.corpus, args.verify, not args.quiet
    )
    print(text)
    if not finished:
        return 1
    return 0


def _cmd_table(args) -> int:
    from .analysis.table import render

    print(render(args.dir, args.format))
    return 0


def _cmd_report(args) -> int:
    from .analysis.report import report

    print(report(args.dir), end="")
    return 0


def _cmd_readme_blocks(args) -> int:
    from .readme_blocks import run

    text, rc = run(args.files, args.update, main)
    print(text)
    return rc


def _cmd_cluster_scores(args) -> int:
    from .analysis.cluster_scores import write

    path, source = write(args.dir)
    made, kept = (sorted(r for r, s in source.items() if s == how) for how in ("scores", "kept"))
    print(
        f"wrote {path} ({path.stat().st_size:,} bytes): {len(made)} finished rows from scores/"
        + (f", {len(kept)} kept as the file held them ({', '.join(kept)})" if kept else "")
    )
    return 0


MTP_ENGINE_DEFAULTS = {"tokens": "1,2", "prompts": 8, "prompt_tokens": 128, "new_tokens": 64}


def _cmd_mtp(args) -> int:
    from .ablate.speculative import run_mtp
    from .analysis import speculative

    engine_only = [k for k in (*MTP_ENGINE_DEFAULTS, "no_time") if getattr(args, k) not in (None, False)]
    forced_only = [k for k in ("sequences_per_corpus", "device", "force") if getattr(args, k) not in (None, False)]
    if args.teacher_forced and engine_only:
        flag = "--" + engine_only[0].replace("_", "-")
        raise SplicerError(f"{flag} sets vLLM's engines, and --teacher-forced starts none: drop one of them")
    if not args.teacher_forced and forced_only:
        flag = "--" + forced_only[0].replace("_", "-")
        why = {
            "--device": " (vLLM's engines run where DIR's job ran)",
            "--force": " (a rerun of the engines with other settings starts DIR/speculative.json afresh)",
        }.get(flag, "")
        raise SplicerError(f"{flag} goes with --teacher-forced{why}: add it or drop {flag}")
    rows = [r.strip() for r in args.rows.split(",") if r.strip()] if args.rows else None
    if args.teacher_forced:
        return _mtp_teacher_forced(args, rows)
    for k, v in MTP_ENGINE_DEFAULTS.items():
        setattr(args, k, v if getattr(args, k) is None else getattr(args, k))
    tokens = _int_list(args.tokens, "--tokens")
    record = run_mtp(
        args.dir,
        rows=rows,
        tokens=tuple(tokens),
        prompts_per_corpus=args.prompts,
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        time_decode=not args.no_time,
        progress=not args.quiet,
    )
    from tabulate import tabulate

    from .io import results_record

    spec = speculative.load(args.dir)
    order = [v["name"] for v in results_record.load(args.dir).get("variants", [])]
    print(tabulate(speculative.table_rows(spec, order), headers=speculative.HEADERS, tablefmt="github", disable_numparse=True))
    print(f"\nwrote {args.dir / speculative.FILE}; table.md and report.md of {args.dir} now hold MTP acceptance")
    sys.stdout.flush()
    failed = [f"{e['row']} k={e['k']}: {e.get('error', '')}" for e in record["engines"] if e.get("status") != "ok"]
    flagged = [k for k, fig in spec["summary"].get(record["build_row"], {}).items() if fig.get("flagged")]
    what = f"the build's drafter is flagged at k={', '.join(flagged)}" if flagged else None
    return _mtp_outcome(args.dir, record, rows, failed, "engines", args.dir / "mtp-logs", what)


def _mtp_outcome(out: Path, record: dict, rows, failed: list[str], unit: str, log: Path, flagged: str | None) -> int:
    """The end of `splicer mtp` on stderr, engine path and teacher-forced alike: each skipped row in one line, then an
    error line each for what failed, for --rows that could not be measured and for a flagged build; 1 when any."""
    for x in record.get("skipped") or []:
        print(f"splicer: {x['row']} not measured: {x['reason']}", file=sys.stderr)
    asked = [x["row"] for x in record.get("skipped") or [] if rows and x["row"] in rows]
    if failed:
        print(
            f"splicer: error: {len(failed)} {unit} failed ({'; '.join(failed)}); see {log}, then run the same command again",
            file=sys.stderr,
        )
    if asked:
        print(f"splicer: error: --rows {', '.join(asked)} could not be measured (the reasons above)", file=sys.stderr)
    if flagged:
        print(
            f"splicer: error: {flagged} ({out / 'table.md'}): its acceptance is no result, and no row is compared with it",
            file=sys.stderr,
        )
    return 1 if failed or asked or flagged else 0


def _mtp_teacher_forced(args, rows: list[str] | None) -> int:
    from tabulate import tabulate

    from .ablate.speculative import run_teacher_forced
    from .analysis import teacher_forced
    from .io import results_record

    record = run_teacher_forced(
        args.dir,
        rows=rows,
        sequences_per_corpus=args.sequences_per_corpus,
        device=args.device or "auto",
        progress=not args.quiet,
        force=args.force,
    )
    spec = teacher_forced.load(args.dir)
    order = [v["name"] for v in results_record.load(args.dir).get("variants", [])]
    print(
        tabulate(teacher_forced.table_rows(spec, order), headers=teacher_forced.HEADERS, tablefmt="github", disable_numparse=True)
    )
    print(f"\nwrote {args.dir / teacher_forced.FILE}; table.md and report.md of {args.dir} now hold the teacher-forced estimate")
    sys.stdout.flush()
    failed = [f"{r}: {e.get('error', '')}" for r, e in record["rows"].items() if e.get("status") != "ok"]
    flagged = (spec["summary"].get(record["build_row"]) or {}).get("flagged")
    what = "the build's teacher-forced estimate is flagged" if flagged else None
    return _mtp_outcome(args.dir, record, rows, failed, "rows", args.dir / "speculative.log", what)


def _cmd_tasks(args) -> int:
    from tabulate import tabulate

    from .analysis import task_scores
    from .io import results_record
    from .tasks.run import run_tasks

    record = run_tasks(
        args.dir,
        args.tasks.split(","),
        include_path=args.include_path,
        rows=[r.strip() for r in args.rows.split(",") if r.strip()] if args.rows else None,
        limit=args.limit,
        device=args.device,
        batch_size=args.batch_size,
        progress=not args.quiet,
        force=args.force,
        backend=args.backend,
    )
    spec = task_scores.load(args.dir)
    order = [v["name"] for v in results_record.load(args.dir).get("variants", [])]
    print(tabulate(task_scores.table_rows(spec, order), headers=task_scores.HEADERS, tablefmt="github", disable_numparse=True))
    print(f"\nwrote {args.dir / task_scores.FILE}; table.md and report.md of {args.dir} now hold task accuracy")
    failed = [r for r, e in record["rows"].items() if e.get("status") != "ok"]
    if failed:
        print(
            f"splicer: error: {len(failed)} rows failed: {', '.join(failed)}; see {args.dir / 'tasks.json'}, then run again",
            file=sys.stderr,
        )
        return 1
    return 0


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values:
        raise SplicerError(f"{flag} {text!r}: give whole numbers separated by commas, e.g. 1,2")
    return values


def _cmd_compare(args) -> int:
    from .analysis.table import compare

    print(compare(args.dir, args.a, args.b))
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with the project's one-line errors (argparse prints its usage block first and exits with 2)."""

    def error(self, message):
        raise SplicerError(f"{self.prog}: {message}; see {self.prog} --help")


def _count(minimum: int, maximum: int = 2**31 - 1):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"{value} is outside {minimum}..{maximum}")
        return value

    return parse


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def _share(text: str) -> float:
    value = _positive(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text} is not a share of the GPU's memory between 0 and 1")
    return value


def _run_options(s) -> None:
    """Options `ablate` and `score` share: plan, backend, engine and timing settings."""
    s.add_argument(
        "--tasks",
        help="after the rows, lm-evaluation-harness tasks on every finished row (splicer tasks DIR: accuracy, s.e., "
        "paired vs build), e.g. mmlu,gsm8k with network, or your own with --include-path",
    )
    s.add_argument("--include-path", type=Path, help="--tasks: a folder of task YAMLs (python -m splicer.tasks.cloze)")
    s.add_argument("--task-limit", type=_count(1), help="--tasks: only the first N items of each task")
    s.add_argument("--plan", help="plan name from ablations/ or a .toml path (default where-error-comes-from; demo with --demo)")
    s.add_argument(
        "--add-requantized",
        action="append",
        default=[],
        metavar="CLASSES=DIR",
        help="also score the build re-made by its quantizer with CLASSES (e.g. gdn) left in BF16, as row "
        "requantized-CLASSES, beside the splice of the same classes: the table's splice-against-re-quantize section "
        "(repeatable)",
    )
    from .backends import BACKENDS, DEFAULT_BACKEND

    s.add_argument("--backend", default=DEFAULT_BACKEND, choices=BACKENDS)
    s.add_argument("--device", default="auto", help="torch backend: cpu, cuda, cuda:N or auto")
    s.add_argument("--corpus", action="append", metavar="NAME=FILE", help="replace a plan corpus with a local .txt/.jsonl file")
    s.add_argument(
        "--threads",
        type=_count(1),
        help="torch backend: CPU threads (default: SPLICER_THREADS, else "
        "OMP_NUM_THREADS, else the cores other processes leave free)",
    )
    s.add_argument("--batch-size", type=_count(1), default=None, help="sequences per forward/engine call (torch 4, vllm 256)")
    s.add_argument("--tensor-parallel-size", type=_count(1), help="vllm: GPUs per engine")
    s.add_argument("--max-model-len", type=_count(2), help="vllm: context length")
    s.add_argument("--gpu-memory-utilization", type=_share, help="vllm: share of GPU memory the engine may take")
    s.add_argument("--moe-backend", help="vllm: MoE kernel backend, e.g. marlin")
    s.add_argument("--language-model-only", action="store_true", help="vllm: skip the vision tower")
    s.add_argument(
        "--process-per-variant",
        action="store_true",
        help="vllm: a fresh process (and engine-core process) per variant instead of one worker for the run",
    )
    s.add_argument(
        "--overlap-starts",
        type=_count(0),
        nargs="?",
        const=1,
        default=0,
        metavar="N",
        help="vllm: start the next N variants' engines (default 1) in spare workers while the current one "
        "scores; decode is still timed with no engine starting; each engine then gets a fixed 12 GiB KV "
        "cache unless --engine-arg kv_cache_memory_bytes=...; in overlapped runs on an H200 engines of one variant "
        "timed at two levels ~6 %% apart: time serially for decode verdicts",
    )
    s.add_argument(
        "--precompile",
        type=_count(0),
        nargs="?",
        const=2,
        default=0,
        metavar="N",
        help="vllm: while the base pass runs, compile every variant's engine once (dummy weights) in N "
        "processes (default 2), which end before any row starts; each row's engine then starts alone "
        "on the GPU, reads its compiled graphs from vLLM's cache, and is scored and timed serially; "
        "one more process takes the base pass's engine's place once it ends, if variants still wait",
    )
    s.add_argument(
        "--gpus",
        metavar="LIST",
        help="vllm: spread the rows over these GPUs (CUDA ids, e.g. 0,1): the base pass on the first while "
        "--precompile's processes compile on the others, then every GPU runs rows one engine at a time, "
        "timing the build at its start and end; each row's decode is compared with the build on its own GPU",
    )
    s.add_argument(
        "--ray",
        nargs="?",
        const="default",
        metavar="ADDRESS",
        help="run the rows on a Ray cluster (pip install 'splicer[ray]'): one lane per engine's worth of GPUs "
        "(tensor x pipeline parallel size; the torch backend on the CPU: per core), each timing the build at its "
        "start and end; ADDRESS as ray.init takes it (HOST:6379, auto), default RAY_ADDRESS or a local cluster; "
        "every worker must see the checkpoints and DIR at the same paths",
    )
    s.add_argument("--ray-lanes", type=_count(1), metavar="N", help="--ray: use at most N lanes")
    s.add_argument(
        "--rewake-before-timing",
        action="store_true",
        help="vllm with --overlap-starts: sleep and wake each engine once more right before its decode timing",
    )
    s.add_argument(
        "--engine-cache-dir",
        type=Path,
        metavar="PATH",
        help="vllm: keep vLLM's compile cache and Triton's and Inductor's caches (autotuning included) in PATH "
        "instead of their per-user defaults, which later runs on the machine reuse",
    )
    s.add_argument(
        "--expert-cache",
        type=Path,
        metavar="DIR",
        help="vllm: the first engine saves its routed experts in vLLM's layout under DIR (as large as the experts); "
        "every later engine whose experts are the same bytes copies them instead of loading them one tensor at a time",
    )
    s.add_argument(
        "--engine-arg", action="append", metavar="KEY=VALUE", help="vllm: any vllm.LLM keyword (VALUE as JSON), repeatable"
    )
    s.add_argument(
        "--engine-env",
        action="append",
        metavar="NAME=VALUE",
        help="vllm: an environment variable for every engine process, repeatable; part of the base pass's "
        "cache key and of the job (e.g. VLLM_TRITON_FORCE_FIRST_CONFIG=1 skips Triton autotuning: faster cold "
        "starts, but prefill kernels, hence TTFT, are not vLLM's tuned ones)",
    )
    s.add_argument("--no-time", action="store_true", help="skip decode timing")
    s.add_argument(
        "--allow-quantized-base", action="store_true", help=ALLOW_QUANTIZED_BASE_HELP + "; rows that restore them are skipped"
    )
    s.add_argument(
        "--bandwidth-gbs",
        type=_positive,
        help="memory bandwidth in GB/s: adds the decode floor (bytes read per step / bandwidth) to the table",
    )
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="splicer",
        description="Where does the error of an INT4 checkpoint come from, and what would it cost to restore each part?",
    )
    p.add_argument("--version", action="version", version=f"splicer {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("inspect", help="classes, bits, bytes and config lint of a checkpoint")
    s.add_argument("build", metavar="BUILD", help="checkpoint folder or Hub repo id")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s.add_argument(
        "--base",
        metavar="BASE",
        help="also compare every tensor the checkpoint stores unquantized with this base's (reads those tensors of both)",
    )
    s.set_defaults(func=_cmd_inspect)

    s = sub.add_parser("splice", help="restore module classes of BUILD to BF16 from BASE")
    s.add_argument("build", metavar="BUILD", help="compressed-tensors INT4 build: folder or Hub repo id")
    s.add_argument("base", metavar="BASE", help="its BF16 base: folder or Hub repo id (only needed shards are read)")
    s.add_argument("-o", "--out", required=True, metavar="OUT", help="output folder (must not exist unless --force)")
    s.add_argument(
        "--restore",
        required=True,
        metavar="CLASSES",
        help="comma list of the family's module classes (splicer inspect lists them), each whole or in some "
        "decoder layers (gdn@0-9,attention@3,7), or all",
    )
    s.add_argument(
        "--layers",
        metavar="LIST",
        help="only these decoder layers for every class, e.g. 0,4-7 (the MTP head, class "
        "mtp, is restored whole; not with CLASS@LAYERS entries)",
    )
    s.add_argument("--modules", metavar="REGEX", help="only modules whose HF name matches REGEX (fused groups must stay whole)")
    s.add_argument(
        "--tokenizer-from-base",
        action="store_true",
        help="copy the base's tokenizer, chat template and generation config verbatim",
    )
    s.add_argument(
        "--drop-dead-ignore", action="store_true", help="remove ignore entries that match no module under either naming"
    )
    s.add_argument("--force", action="store_true", help="replace OUT if it exists and an earlier splice wrote it")
    s.add_argument("--allow-quantized-base", action="store_true", help=ALLOW_QUANTIZED_BASE_HELP)
    s.add_argument(
        "--unquantized-from-base",
        action="store_true",
        help="also give every tensor the build stores unquantized the base's values where they differ (a quantizer "
        "that rounded norms, say; `splicer inspect BUILD --base BASE` lists them)",
    )
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=_cmd_splice)

    s = sub.add_parser("ablate", help="splice, score and time every row of a plan; write DIR/results.json and DIR/table.md")
    s.add_argument("rows", metavar="ROWS", help="all, or a comma list of row names from the plan (the build row always runs)")
    s.add_argument("build", metavar="BUILD", nargs="?", help="INT4 build (folder or Hub id)")
    s.add_argument("base", metavar="BASE", nargs="?", help="its BF16 base (folder or Hub id)")
    s.add_argument("-o", "--out", required=True, type=Path, metavar="DIR", help="results folder (resumable)")
    s.add_argument(
        "--add",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="also score (and time) another checkpoint of the model as row NAME, in any format the backend "
        "loads, against the same base pass (repeatable)",
    )
    s.add_argument("--demo", action="store_true", help="build the tiny synthetic pair and run on CPU, no network")
    _run_options(s)
    s.set_defaults(func=_cmd_ablate)

    s = sub.add_parser(
        "score",
        help="builds of one model in any format vLLM (or the torch backend) loads, each against "
        "the same BF16 base on the same tokens: the first BUILD is the table's reference row",
    )
    s.add_argument("base", metavar="BASE", help="the BF16 base (folder or Hub id)")
    s.add_argument("builds", metavar="BUILD", nargs="+", help="quantized checkpoints of it (folders or Hub ids)")
    s.add_argument("-o", "--out", required=True, type=Path, metavar="DIR", help="results folder (resumable)")
    _run_options(s)
    s.set_defaults(func=_cmd_score)

    s = sub.add_parser("plan", help="write a plan file")
    plans = s.add_subparsers(dest="plan_command", required=True)
    t = plans.add_parser(
        "sweep",
        help="rows restoring one class in groups of its layers, each group left out, and whole: which layers carry the error",
    )
    t.add_argument("build", metavar="BUILD", help="the quantized build the plan is for (folder or Hub repo id): its layers")
    t.add_argument("--class", dest="cls", required=True, help="the class to sweep, e.g. gdn")
    t.add_argument("--groups", type=int, required=True, help="how many groups of its layers (2 or more)")
    t.add_argument("-o", "--out", required=True, help="the plan file to write (.toml, new)")
    t.add_argument(
        "--from",
        dest="template",
        default="where-error-comes-from",
        help="plan whose corpora, timing and top_k the sweep uses (a name from ablations/ or a .toml path)",
    )
    t.set_defaults(func=_cmd_plan_sweep)

    s = sub.add_parser(
        "plot",
        help="KL per corpus against decode ms and size on disk, every variant a point, the Pareto "
        "front drawn: DIR/plot-kl.png and .svg, linked from DIR/table.md; MTP acceptance per row and k where "
        "DIR/speculative.json has it: DIR/plot-mtp.png and .svg",
    )
    s.add_argument("dir", metavar="DIR", help="a results folder (splicer ablate or splicer score)")
    s.set_defaults(func=_cmd_plot)

    s = sub.add_parser(
        "budget",
        help="which restores fit a size, decode or KL budget: every combination of the measured "
        "single-entry rows predicted (additive, with the measured additivity), the Pareto front",
    )
    s.add_argument("dir", metavar="DIR", help="a results folder of splicer ablate with single-class (or per-layer) rows")
    s.add_argument("--max-decode-ms", type=float, help="decode ms/token at most (needs a timed run)")
    s.add_argument("--max-gb", type=float, help="size on disk at most, GB")
    s.add_argument("--max-kl", type=float, help="predicted KL at most")
    s.add_argument("--corpus", help="KL on this corpus (default: pooled over the corpora)")
    s.add_argument(
        "--verify",
        type=int,
        default=0,
        metavar="N",
        help="splice and measure N points of the front no row measured (rows added to DIR's job, run with its "
        "inputs and settings), then print predicted against measured",
    )
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bars while --verify runs")
    s.set_defaults(func=_cmd_budget)

    s = sub.add_parser("table", help="print the table of an ablate results folder")
    s.add_argument("dir", metavar="DIR", type=Path)
    s.add_argument("--format", default="markdown", choices=["markdown", "csv", "json"])
    s.set_defaults(func=_cmd_table)

    s = sub.add_parser("report", help="the findings of an ablate results folder as sentences (every figure from results.json)")
    s.add_argument("dir", metavar="DIR", type=Path)
    s.set_defaults(func=_cmd_report)

    s = sub.add_parser("compare", help="paired differences between two variants of a results folder, on the same positions")
    s.add_argument("dir", metavar="DIR", type=Path)
    s.add_argument("a", metavar="VARIANT_A")
    s.add_argument("b", metavar="VARIANT_B")
    s.set_defaults(func=_cmd_compare)

    s = sub.add_parser(
        "mtp",
        help="MTP acceptance per variant of a vLLM results folder: each row with its MTP head as vLLM's speculative decoder",
        description="Start every finished row of DIR (or --rows) in vLLM again with its own MTP head as the speculative "
        "decoder (one engine per --tokens k) and once without, generate greedily from the first tokens of DIR's "
        "sequences, and count acceptance from vLLM's spec-decode counters (rate, per position, mean accepted length, "
        "paired against the build) and batch-1 decode with and without the drafter; DIR/speculative.json, and a "
        "section in DIR/table.md and DIR/report.md. Resumable: a rerun keeps the finished engines. --teacher-forced "
        "starts no engine: it estimates the first draft position's acceptance on DIR's scored sequences with the "
        "torch reference's model and MTP head of each row, on any folder, beside vLLM's k=1 figure where there is one.",
    )
    s.add_argument(
        "dir",
        metavar="DIR",
        type=Path,
        help="a results folder splicer ablate or score wrote (with --backend vllm, but for --teacher-forced)",
    )
    s.add_argument("--tokens", help="draft tokens per step, one engine each (default 1,2)")
    s.add_argument("--rows", help="comma list of DIR's rows (default: every finished row but repeats and the base)")
    s.add_argument("--prompts", type=_count(1, 10000), help="prompts per corpus (default 8)")
    s.add_argument("--prompt-tokens", type=_count(1, 1 << 20), help="tokens of each prompt (default 128)")
    s.add_argument("--new-tokens", type=_count(2, 1 << 16), help="tokens generated per prompt (default 64)")
    s.add_argument("--no-time", action="store_true", help="count acceptance only; no decode timing")
    s.add_argument(
        "--teacher-forced",
        action="store_true",
        help="no engines: estimate first-position acceptance on DIR's scored sequences with the torch reference's model "
        "of each row and its MTP head (any folder; CPU or GPU), beside vLLM's k=1 figure where DIR has one; "
        "DIR/mtp-teacher-forced.json",
    )
    s.add_argument(
        "--sequences-per-corpus",
        type=_count(1),
        help="with --teacher-forced: the first N sequences of each corpus (default: all)",
    )
    s.add_argument("--device", help="with --teacher-forced: cpu, cuda or cuda:N (default: cuda when there is one)")
    s.add_argument(
        "--force",
        action="store_true",
        help="with --teacher-forced: replace DIR/mtp-teacher-forced.json made with other settings or sequences",
    )
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(func=_cmd_mtp)

    s = sub.add_parser(
        "tasks",
        help="task accuracy per variant of a results folder through lm-evaluation-harness (accuracy, s.e., paired vs build)",
        description="Run lm-evaluation-harness tasks on every finished row of DIR (or --rows): accuracy with its standard "
        "error per task and the paired difference from the build on the same items; DIR/tasks.json, and a section of "
        "DIR/table.md and DIR/report.md. The model is the one DIR was scored with (or --backend's), with DIR's options: "
        "through vLLM, lm-eval's VLLM model with DIR's engine arguments, one engine per row; through the torch backend, "
        "lm-eval's HF model over transformers' model of the family with the row's weights, on --device. Offline, a task "
        "of your own: python -m splicer.tasks.cloze TEXT... -o FOLDER, then --tasks cloze --include-path FOLDER; with "
        "network, lm-eval's own tasks (--tasks mmlu,gsm8k).",
    )
    s.add_argument("dir", metavar="DIR", type=Path, help="a results folder splicer ablate or score wrote")
    s.add_argument("--tasks", required=True, help="comma list of lm-eval task names")
    s.add_argument("--include-path", type=Path, help="a folder of task YAMLs of your own (lm-eval's --include_path)")
    s.add_argument("--rows", help="comma list of DIR's rows (default: every finished row but repeats)")
    s.add_argument("--limit", type=_count(1), help="only the first N items of each task")
    s.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: cuda when there is one)")
    from .backends import BACKENDS

    s.add_argument(
        "--backend",
        choices=BACKENDS,
        help="the model lm-eval drives (default: the backend DIR was scored with); its options are DIR's",
    )
    s.add_argument(
        "--batch-size",
        type=_count(1, 4096),
        help="lm-eval's batch size (default: 8 on the torch backend; on vLLM, requests per engine call, 1024)",
    )
    s.add_argument(
        "--force", action="store_true", help="replace DIR/tasks.json made with other tasks, task files, --limit or model"
    )
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(func=_cmd_tasks)

    s = sub.add_parser(
        "cluster-scores",
        help="DIR/cluster-scores.safetensors: the per-position scores summed per sequence (or group), all the intervals need",
        description="Rewrite DIR/cluster-scores.safetensors (ablate updates it after every row): each finished row's "
        "per-position scores (DIR/scores/ROW/) summed per sequence, or chat group; a finished row whose per-position "
        "files are gone keeps the records the file held. compare, budget and the verdicts read it where DIR/scores/ "
        "is absent, with the same intervals.",
    )
    s.add_argument("dir", metavar="DIR", type=Path, help="a results folder splicer ablate or score wrote")
    s.set_defaults(func=_cmd_cluster_scores)

    s = sub.add_parser(
        "readme-blocks",
        help="check (or --update) the <!-- splicer:begin COMMAND DIR --> blocks of Markdown "
        "files against what the command prints now",
    )
    s.add_argument("files", metavar="FILE", nargs="+")
    s.add_argument("--update", action="store_true", help="rewrite stale blocks (each file written beside and renamed)")
    s.set_defaults(func=_cmd_readme_blocks)

    s = sub.add_parser(
        "fixture", help="write a tiny synthetic base and quantized builds (qwen3_5_moe, or --family; tests, demo, GPU checks)"
    )
    s.add_argument("out", metavar="DIR")
    s.add_argument("--preset", default="tiny", choices=["tiny", "gpu", "bench"])
    s.add_argument("--experts-layout", default="fused", choices=["fused", "per_expert"])
    s.add_argument(
        "--builds",
        default=BUILDS_DEFAULT,
        help="comma list of build kinds (see BUILD_KINDS in splicer/fixtures/core.py): lowlatency, lowlatency-nomtp, experts-g32, "
        "gptq-experts-g32, w4a16, w8a16, w8a8, fp8-dynamic, fp8-block, nvfp4a16, mixed, fp8-native, awq, fbgemm-fp8",
    )
    s.add_argument(
        "--family",
        default="qwen3_5_moe",
        help="qwen3_5_moe (default), or another family's model_type (an unknown one is answered with the list): a tiny "
        "pair of that family made from transformers' own model class (an int4 build; the MoE families also experts-g32)",
    )
    s.add_argument("--seed", type=_count(0), default=0)
    s.add_argument(
        "--full-dims",
        action="store_true",
        help="Qwen3.6-35B-A3B's real text dims with random weights: DIR/build (seed-000-like INT4) and DIR/reference "
        "(BF16 except the INT4 routed experts; ablate it with --allow-quantized-base)",
    )
    s.add_argument("--device", default="auto", help="--full-dims: where to draw and quantize (default cuda)")
    s.add_argument("--force", action="store_true", help="replace DIR if it exists and an earlier splicer fixture wrote it")
    s.set_defaults(func=_cmd_fixture)
    return p


def main(argv=None) -> int:
    from .io.console import printable_everywhere

    printable_everywhere()
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except BrokenPipeError:
        # Output piped into a reader that stopped (`splicer table DIR | head -3`): nothing left to say, and Python
        # would otherwise report the broken pipe again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except SplicerError as e:
        print(f"splicer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("splicer: interrupted; rerun the same command to resume (finished work is kept)", file=sys.stderr)
        return 130
    except MemoryError:
        print("splicer: error: out of memory; close other programs or use a machine with more RAM", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
