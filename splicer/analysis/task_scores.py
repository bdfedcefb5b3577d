"""Task accuracy figures from DIR/tasks.json (written by `splicer tasks`, splicer/tasks/run.py): per row and task,
lm-eval's accuracy and standard error, and the paired difference from the build on the items both answered; the
table's task section and the report's sentences."""

from __future__ import annotations

from pathlib import Path

from ..io import results_record
from .formatting import fmt_other_dtypes, fmt_paired_clause, fmt_paired_pp
from .metrics import MIN_SEQUENCES, identical_pairs, paired_comparison, wilson

FILE = "tasks.json"


def summarize(record: dict, reps: int = 2000) -> dict:
    """Per row and task: the metric lm-eval reports with its standard error, a 95 % Wilson interval over the items
    (0/1 scores; lm-eval's standard error is 0 at 0 or n correct of n), and the paired difference from the build on the
    items both answered (metrics.paired_comparison over items, each item its own unit; where no item's score differs
    from the build's, metrics.identical_pairs: 0 with no interval)."""
    import torch

    build = (record.get("rows") or {}).get(record.get("build_row") or "", {})
    out = {}
    for row, entry in (record.get("rows") or {}).items():
        if entry.get("status") != "ok":
            continue
        for task, rec in entry["tasks"].items():
            items = rec.get("items") or {}
            fig = {"metric": rec.get("metric"), "value": rec.get("value"), "stderr": rec.get("stderr"), "n": len(items)}
            if items and all(v in (0.0, 1.0) for v in items.values()):
                fig["ci"] = list(wilson(int(sum(items.values())), len(items)))
            ref = ((build.get("tasks") or {}).get(task) or {}).get("items") or {}
            common = sorted(set(items) & set(ref))
            if row != record.get("build_row") and fig["metric"] and common and all(items[i] == ref[i] for i in common):
                fig["vs_build"] = dict(identical_pairs("item"), items=len(common))
            elif row != record.get("build_row") and fig["metric"] and common:
                a = torch.tensor([items[i] for i in common])
                b = torch.tensor([ref[i] for i in common])
                cmp = paired_comparison({task: {"a": a, "b": b, "cluster": torch.arange(len(common)), "unit": "items"}}, reps)
                p = cmp["pooled"]
                fig["vs_build"] = {
                    "diff": p["diff"],
                    "ci": p["diff_ci"],
                    "significant": p["significant"],
                    "items": len(common),
                    **({"why": f"fewer than {MIN_SEQUENCES} items"} if p["diff_ci"] is None else {}),
                }
            out.setdefault(row, {})[task] = fig
    return out


def load(out) -> dict | None:
    """DIR/tasks.json with its summary (None when DIR has none or it cannot be read)."""
    record = results_record.read_stage_record(Path(out) / FILE)
    if record is None:
        return None
    return {"record": record, "summary": summarize(record)}  # recomputed, as speculative.load does


def _acc(fig: dict) -> str:
    if fig.get("value") is None:
        return ""
    ci, se = fig.get("ci"), fig.get("stderr")
    text = f"{100 * fig['value']:.1f} %"
    if ci:
        return text + f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"
    return text + (f" ± {100 * se:.1f} s.e." if se is not None else "")


HEADERS = ["variant", "task", "metric", "items", "score [95 %]", "Δ vs build, pp [95 %]"]


def table_rows(spec: dict, order: list[str]) -> list[list[str]]:
    summary, rows = spec["summary"], []
    for name in [n for n in order if n in summary] + [n for n in summary if n not in order]:
        for task, fig in summary[name].items():
            rows.append(
                [
                    name,
                    task,
                    fig.get("metric") or "no accuracy metric",
                    str(fig.get("n") or ""),
                    _acc(fig),
                    fmt_paired_pp(fig.get("vs_build")),
                ]
            )
    failed = {r: e for r, e in (spec["record"].get("rows") or {}).items() if e.get("status") != "ok"}
    for r, e in failed.items():
        rows.append([r, "", "", "", f"failed: {str(e.get('error', ''))[:200]}", ""])
    return rows


def other_dtypes(record: dict) -> str | None:
    """The sentence for rows whose engine computed in another dtype than the build row's (vLLM's dtype="auto" follows
    each checkpoint's config, and GPTQ exports often say float16), or None: a difference from the build then holds the
    dtypes' difference beside the quantization's. Rows run before engines recorded their dtype are not compared."""
    dtypes = {r: e.get("engine_dtype") for r, e in (record.get("rows") or {}).items() if e.get("status") == "ok"}
    build = dtypes.get(record.get("build_row") or "")
    return fmt_other_dtypes(
        "the build's engine",
        build,
        dtypes,
        "differences from the build",
        f"`splicer ablate --engine-arg dtype={build}` puts every engine of the folder, task runs included, in one dtype",
    )


def note(spec: dict) -> str:
    s = spec["record"].get("settings") or {}
    dtypes = other_dtypes(spec["record"])
    return (
        f"Task accuracy from `splicer tasks`: lm-evaluation-harness {s.get('lm_eval') or ''} on {s.get('model')}, tasks "
        f"{', '.join(s.get('tasks') or [])}"
        + (f", at most the first {s['limit']} items of each" if s.get("limit") else "")
        + "; the score of 0/1 items with its 95 % Wilson interval (else lm-eval's standard error), a group's over its "
        "subtasks' items, a filtered task's under its first filter; Δ vs build is paired on the items both answered, its "
        "95 % interval from a bootstrap over items (t x standard error, as the other intervals; with few discordant items "
        "it is approximate, and with none there is no interval: a row whose every item scores as the build's has a "
        "difference of 0 and no verdict)." + (f" {dtypes}" if dtypes else "")
    )


def sentences(spec: dict) -> list[str]:
    out = []
    build = spec["record"].get("build_row")
    for name, tasks in spec["summary"].items():
        for task, fig in tasks.items():
            if fig.get("value") is None:
                continue
            text = f"Task {task}, {name}: {fig['metric']} {_acc(fig)} over {fig.get('n')} items"
            vs = fig.get("vs_build")
            if name != build and vs and vs.get("diff") is not None:
                text += f"; {fmt_paired_clause(vs)}"
            out.append(text + ".")
    if dtypes := other_dtypes(spec["record"]):
        out.append(dtypes)
    for row, e in (spec["record"].get("rows") or {}).items():
        if e.get("status") != "ok":
            out.append(f"Tasks on {row}: failed ({str(e.get('error', ''))[:200]}).")
    return out
