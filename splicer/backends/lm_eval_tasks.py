"""lm-evaluation-harness as every backend runs it: the task registry (lm-eval's own tasks and a folder of YAMLs), and one
evaluation of a model lm-eval drives (its HF model over the torch reference, its VLLM model in the vLLM backend's
worker), reduced to what splicer keeps. Imported where lm-eval runs, never at splicer's import: lm-eval is an extra."""

from __future__ import annotations

import functools
from pathlib import Path

from ..errors import SplicerError


def task_manager(names: list[str], include_path: Path | None):
    """lm-eval's task registry, with the caller's own folder of YAMLs; an unknown name is one line listing what is
    close. Raises SplicerError when lm-eval is missing or a task is unknown. Built once per process for the same
    tasks and folder: the check before a run and every row's evaluation (in this process, or in the vLLM worker that
    serves one row after another) share it, since indexing lm-eval's own registry takes seconds; a YAML of the folder
    added or changed since makes another."""
    include = None if include_path is None else str(include_path)
    return _task_manager(tuple(names), include, _yaml_state(include))


def _yaml_state(include_path: str | None) -> tuple:
    """What lm-eval reads of a folder of task YAMLs, as names, sizes and times: the cache key's part for the folder."""
    if include_path is None or not Path(include_path).is_dir():
        return ()
    return tuple(
        sorted(
            (str(p), p.stat().st_size, p.stat().st_mtime_ns)
            for p in Path(include_path).rglob("*")
            if p.suffix in (".yaml", ".yml")
        )
    )


def _task_manager(names: tuple[str, ...], include_path: str | None, state: tuple):
    try:
        from lm_eval.tasks import TaskManager  # noqa: F401  (the registries below need it)
    except ImportError:
        raise SplicerError("task accuracy needs lm-evaluation-harness: pip install 'splicer[tasks]'") from None
    if include_path is not None and not Path(include_path).is_dir():
        raise SplicerError(f"--include-path {include_path}: not a folder; give the folder that holds the task YAMLs")
    if include_path is not None:
        # lm-eval's own registry is thousands of YAMLs, indexed in seconds: leave it out when the folder has every task
        own = _registry(include_path, state, False)
        if all(n in set(own.all_tasks) for n in names):
            return own
    manager = _registry(include_path, state, True)
    known = set(manager.all_tasks)
    for n in names:
        if n not in known:
            import difflib

            close = difflib.get_close_matches(n, sorted(known), n=3)
            hint = f"; close: {', '.join(close)}" if close else ""
            where = (
                f"in lm-eval or in {include_path}" if include_path else "in lm-eval (a task of your own: --include-path FOLDER)"
            )
            raise SplicerError(f"--tasks {n}: no such task {where}{hint}")
    return manager


@functools.lru_cache(maxsize=8)
def _registry(include_path: str | None, _state: tuple, defaults: bool):
    """lm-eval's TaskManager of the folder, with lm-eval's own tasks or without; kept whatever names are asked of it, so
    that a name refused once is refused again without indexing lm-eval's registry again."""
    from lm_eval.tasks import TaskManager

    if include_path is None:
        return TaskManager()
    return TaskManager(include_path=include_path, include_defaults=defaults)


def evaluate(lm, request: dict) -> dict:
    """lm-eval's simple_evaluate of `lm` on request["tasks"] (request: tasks, include_path, limit, metrics), reduced to
    plain data that crosses a process boundary: lm-eval's `results` and `group_subtasks`, and per task each sample's
    doc_id, filter and the scores named in request["metrics"] (a sample also holds its document, arguments and
    responses, and a task's config may hold functions, neither of which splicer keeps)."""
    import lm_eval

    include = request.get("include_path")
    manager = task_manager(list(request["tasks"]), Path(include) if include else None)
    res = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(request["tasks"]),
        task_manager=manager,
        log_samples=True,
        limit=request.get("limit"),
        verbosity="ERROR",
    )
    keep = tuple(request.get("metrics") or ())
    samples = {
        task: [
            {"doc_id": s.get("doc_id"), "filter": s.get("filter", "none"), **{m: _plain(s[m]) for m in keep if m in s}}
            for s in rows
        ]
        for task, rows in (res.get("samples") or {}).items()
    }
    return {
        "results": _plain(res.get("results") or {}),
        "group_subtasks": _plain(res.get("group_subtasks") or {}),
        "samples": samples,
    }


def _plain(value):
    """JSON's types for lm-eval's numbers (numpy scalars among them) and containers; anything else as its text."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item"):  # numpy and torch scalars
        try:
            return value.item()
        except (TypeError, ValueError):
            pass
    return str(value)
