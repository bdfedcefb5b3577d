"""Task accuracy (`splicer tasks DIR --tasks NAMES`, DIR/tasks.json): every finished row of a results folder run
through lm-evaluation-harness's own task code, accuracy with its standard error per task, and the paired difference
from the build on the same items. Reads DIR/results.json (the rows and the folders they ran on, as the MTP stage
does); writes DIR/tasks.json after every row (a rerun with the same tasks keeps finished rows) and rewrites table.md
and report.md with a task section.

The model lm-eval scores is the backend's that scored DIR (or --backend's), with DIR's recorded options: through vLLM,
lm-eval's own VLLM model with DIR's engine arguments, one engine per row; through the torch backend, lm-eval's HF model
over transformers' model of the family filled with the row's weights (quantized modules dequantized as
compressed-tensors reads them), on --device.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from ..ablate.common import atomic_json, check_rows_finished, row_folder
from ..analysis.task_scores import FILE, summarize
from ..backends import DEFAULT_BACKEND, backend_type, task_backend
from ..backends.lm_eval_tasks import task_manager as check_tasks
from ..errors import SplicerError
from ..io import results_record
from ..io.outputs import exclusive
from ..io.progress import Stages

SCHEMA = 1
METRICS = ("acc", "acc_norm", "exact_match")  # lm-eval's names of the accuracy metrics kept per task


def _task_files_digest(include_path: Path | None) -> str:
    """The task definitions a run read: a changed YAML or data file is another run."""
    h = hashlib.sha256()
    if include_path is not None:
        for p in sorted(Path(include_path).rglob("*")):
            if p.is_file() and p.suffix in (".yaml", ".yml", ".jsonl", ".json", ".txt", ".csv"):
                h.update(p.name.encode())
                h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _leaves(result: dict, task: str) -> list[str]:
    """The tasks whose samples a task's figure rests on: itself, or a group's subtasks (lm-eval's group_subtasks)."""
    subtasks = (result.get("group_subtasks") or {}).get(task)
    if not subtasks:
        return [task]
    return [leaf for sub in subtasks for leaf in _leaves(result, sub)]


def _metric_key(res: dict) -> tuple[str, str] | None:
    """(metric, filter) of the first accuracy metric a task reports, under its first filter (lm-eval names a result
    'METRIC,FILTER': 'acc,none', 'exact_match,strict-match')."""
    for m in METRICS:
        for key in res:
            if key.startswith(f"{m},") and not key.startswith(f"{m}_stderr"):
                return m, key.split(",", 1)[1]
    return None


def _per_task(result: dict, names: list[str]) -> dict:
    """lm-eval's results and samples -> {task: {metric, filter, value, stderr, n, items: {doc: 0/1}}}; a group's items
    are its subtasks' (named SUBTASK/DOC_ID), a filtered task's those of the filter its figure is taken from."""
    out = {}
    for task in names:
        res = (result.get("results") or {}).get(task) or {}
        key = _metric_key(res)
        rec: dict = {"metric": None, "items": {}, "n": 0}
        if key is None:
            out[task] = rec
            continue
        metric, filt = key
        se = res.get(f"{metric}_stderr,{filt}")
        rec.update(metric=metric, filter=filt, value=res[f"{metric},{filt}"], stderr=se if isinstance(se, (int, float)) else None)
        leaves = _leaves(result, task)
        for leaf in leaves:
            for sample in (result.get("samples") or {}).get(leaf, []):
                if sample.get("filter", "none") != filt or metric not in sample:
                    continue
                name = str(sample["doc_id"]) if len(leaves) == 1 else f"{leaf}/{sample['doc_id']}"
                rec["items"][name] = float(sample[metric])
        rec["n"] = len(rec["items"])
        out[task] = rec
    return out


def settings_refusal(
    out: Path,
    settings: dict,
    force_hint: str = "pass --force to replace them",
    limit_flag: str = "--limit",
    earlier_models: tuple[str, ...] = (),
) -> str | None:
    """The one-line refusal when DIR/tasks.json holds results of other settings than these (None: the same, or no
    file): which recorded setting differs (old -> new), then force_hint, then the option that gives the old setting
    back (limit_flag: --limit, or ablate's --task-limit). A model among earlier_models (what the same backend recorded
    before its arithmetic changed, its task_models_before) is not refused, since no option gives it back: its rows are
    run again (earlier_model_notice says so), as their settings digest is another."""
    old = results_record.read_stage_record(Path(out) / FILE)
    if old is None:
        return None
    before = old.get("settings") or {}
    if before.get("model") in earlier_models:
        before = dict(before, model=settings.get("model"))
    same = {
        "tasks": "the same --tasks",
        "limit": f"the same {limit_flag}",
        "task_files": "the --include-path files they were made with",
        "lm_eval": f"lm-eval {before.get('lm_eval')}",
        # the model lm-eval drives is the backend's: the folder's own, or --backend's
        "model": "the same --backend (the model follows from it)",
    }
    for field, fix in same.items():
        if before.get(field) != settings.get(field):
            return (
                f"{Path(out) / FILE} holds task results of other settings ({field}: {before.get(field)!r} -> "
                f"{settings.get(field)!r}); {force_hint}, or run with {fix}"
            )
    return None


def earlier_model_notice(out: Path, settings: dict, earlier_models: tuple[str, ...], rows: list[str] | None = None) -> str | None:
    """The line a run says when DIR/tasks.json holds finished rows of a model the same backend recorded before its
    arithmetic changed (earlier_models): none is kept beside rows of the new arithmetic; those among rows (this run's;
    None: all) are run again, the others are dropped and named so (None: no such rows)."""
    old = results_record.read_stage_record(Path(out) / FILE) or {}
    model = (old.get("settings") or {}).get("model")
    recorded = old.get("rows") if isinstance(old.get("rows"), dict) else {}
    done = [r for r, e in recorded.items() if isinstance(e, dict) and e.get("status") == "ok"]
    if model not in earlier_models or not done:
        return None
    again = [r for r in done if rows is None or r in rows]
    dropped = [r for r in done if r not in again]
    said = []
    if again:
        said.append(f"its finished rows {', '.join(again)} are run again")
    if dropped:
        said.append(f"{', '.join(dropped)} not kept (ask for them with --rows to run them again)")
    return (
        f"{Path(out) / FILE} holds task results of an earlier arithmetic of the same backend (model: {model!r} -> "
        f"{settings.get('model')!r}): " + "; ".join(said)
    )


def task_settings(tasks: list[str], include_path: Path | None, limit: int | None, backend: str) -> dict:
    """What a task run's figures depend on: the tasks and their files, the item limit, lm-eval's version and the model
    lm-eval drives (the backend's own words for it)."""
    import lm_eval

    return {
        "tasks": tasks,
        "limit": limit,
        "task_files": _task_files_digest(include_path),
        "lm_eval": getattr(lm_eval, "__version__", None),
        "model": backend_type(backend).task_model,
    }


def run_tasks(
    out: Path,
    tasks: list[str],
    *,
    include_path: Path | None = None,
    rows: list[str] | None = None,
    limit: int | None = None,
    device: str = "auto",
    batch_size: int | None = None,
    progress: bool = True,
    force: bool = False,
    backend: str | None = None,
) -> dict:
    """Run lm-eval's tasks on rows of DIR (default: every finished row but repeats) and write DIR/tasks.json; backend:
    the one whose model lm-eval drives (default: DIR's own), batch_size: lm-eval's (default: the HF model's 8; on vLLM,
    requests per engine call, vllm_child.TASK_CHUNK)."""
    out = Path(out)
    results = results_record.load(out)
    tasks = list(dict.fromkeys(t.strip() for t in tasks if t.strip()))
    if not tasks:
        raise SplicerError("--tasks: name one task or more, e.g. --tasks cloze --include-path FOLDER, or mmlu,gsm8k")
    if limit is not None and limit < 1:
        raise SplicerError(f"--limit {limit}: give the number of items per task to run (1 or more)")
    check_tasks(tasks, include_path)
    backend = backend or results.get("backend") or DEFAULT_BACKEND
    ok = {v["name"]: v for v in results.get("variants", []) if v.get("status") == "ok"}
    if rows is None:
        rows = [n for n, v in ok.items() if not v.get("repeat_of")]
    check_rows_finished(out, results, rows)
    import os

    if not progress:  # lm-eval draws its own progress bars (tqdm) for every request batch
        os.environ.setdefault("TQDM_DISABLE", "1")
    settings = task_settings(tasks, include_path, limit, backend)
    earlier = backend_type(backend).task_models_before
    refusal = settings_refusal(out, settings, earlier_models=earlier)
    if refusal and not force:
        raise SplicerError(refusal)
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    path = out / FILE
    stages = Stages(quiet=not progress, log_path=out / "tasks.log")
    with exclusive(out / ".lock", f"another splicer command is writing to {out}; wait for it to finish", in_place=True):
        notice = earlier_model_notice(out, settings, earlier, rows)
        if notice:  # as ablate says a job that differs is run again
            stages.notice(notice)
        record = {"rows": results_record.finished_entries(path, digest, "rows")}
        record.update(schema=SCHEMA, settings=settings, settings_digest=digest)
        job_settings = (results.get("job") or {}).get("settings") or {}
        engine = task_backend(backend, job_settings, device, out / "task-logs")
        base = Path(results["inputs"]["base"]["source"])
        build = next((n for n, v in ok.items() if v.get("restored") == [] and not v.get("repeat_of")), None)
        record["build_row"] = build
        try:
            for n, row in enumerate(rows, 1):
                if row in record["rows"] and record["rows"][row].get("status") == "ok":
                    continue
                entry = {"status": "running"}
                t0 = time.perf_counter()
                try:
                    with stages.stage(f"tasks {n} of {len(rows)}: {row}"):
                        request = {
                            "tasks": tasks,
                            "include_path": str(include_path) if include_path else None,
                            "limit": limit,
                            "batch_size": batch_size,
                            "metrics": METRICS,
                        }
                        res = engine.evaluate_tasks(row_folder(out, results, ok[row]), base, request, log_name=row)
                        entry.update(status="ok", tasks=_per_task(res, tasks))
                        if dtype := (res.get("engine") or {}).get("dtype"):  # what the row's engine computed in
                            entry["engine_dtype"] = dtype
                except SplicerError as e:
                    entry.update(status="error", error=str(e))
                except Exception as e:  # one row's failure must not end the run; its first line is the reason
                    entry.update(
                        status="error", error=f"{e.__class__.__name__}: {(str(e).strip().splitlines() or [''])[0][:1000]}"
                    )
                entry["elapsed_s"] = round(time.perf_counter() - t0, 2)
                record["rows"][row] = entry
                record["summary"] = summarize(record)
                _write(path, record)
        finally:
            engine.close()
        record["summary"] = summarize(record)
        _write(path, record)
        from ..ablate.results import render_outputs

        render_outputs(out, results)
    return record


def _write(path: Path, record: dict) -> None:
    atomic_json(path, record)
