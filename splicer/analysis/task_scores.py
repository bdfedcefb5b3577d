"""Task accuracy figures from DIR/tasks.json (written by `splicer tasks`, splicer/tasks/run.py): per row and task,
lm-eval's accuracy and standard error, and the paired difference from the build on the items both answered; the
table's task section and the report's sentences."""

from __future__ import annotations

import json
from pathlib import Path

from .metrics import paired_comparison

FILE = "tasks.json"
METRICS = ("acc", "acc_norm", "exact_match")  # the first a task reports is the one tabulated


def summarize(record: dict, reps: int = 2000) -> dict:
    """Per row and task: accuracy ± lm-eval's standard error, and the paired difference from the build on the items
    both answered (metrics.paired_comparison over items, each item its own unit)."""
    import torch

    build = (record.get("rows") or {}).get(record.get("build_row") or "", {})
    out = {}
    for row, entry in (record.get("rows") or {}).items():
        if entry.get("status") != "ok":
            continue
        for task, rec in entry["tasks"].items():
            metric = next((m for m in METRICS if m in rec), None)
            fig = {"metric": metric, "value": rec.get(metric), "stderr": rec.get(f"{metric}_stderr"), "n": rec.get("n")}
            ref = ((build.get("tasks") or {}).get(task) or {}).get("items") or {}
            common = sorted(set(rec["items"]) & set(ref), key=lambda x: (len(x), x))
            if row != record.get("build_row") and metric and common:
                a = torch.tensor([rec["items"][i].get(metric, 0.0) for i in common])
                b = torch.tensor([ref[i].get(metric, 0.0) for i in common])
                cmp = paired_comparison({task: {"a": a, "b": b, "cluster": torch.arange(len(common)), "unit": "items"}}, reps)
                p = cmp["pooled"]
                fig["vs_build"] = {"diff": p["diff"], "ci": p["diff_ci"], "significant": p["significant"], "items": len(common)}
            out.setdefault(row, {})[task] = fig
    return out


def load(out) -> dict | None:
    """DIR/tasks.json with its summary (None when DIR has none or it cannot be read)."""
    try:
        record = json.loads((Path(out) / FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    return {"record": record, "summary": summarize(record)}  # recomputed, as speculative.load does


def _acc(fig: dict) -> str:
    if fig.get("value") is None:
        return ""
    se = fig.get("stderr")
    return f"{100 * fig['value']:.1f} %" + (f" ± {100 * se:.1f}" if se is not None else "")


def _diff(fig: dict) -> str:
    vs = fig.get("vs_build")
    if not vs or vs.get("diff") is None:
        return ""
    ci = vs.get("ci")
    text = f"{100 * vs['diff']:+.1f}"
    if ci:
        text += f" [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]" + ("" if vs.get("significant") else " n.s.")
    return text


HEADERS = ["variant", "task", "metric", "items", "accuracy ± s.e.", "Δ vs build, pp [95 %]"]


def table_rows(spec: dict, order: list[str]) -> list[list[str]]:
    summary, rows = spec["summary"], []
    for name in [n for n in order if n in summary] + [n for n in summary if n not in order]:
        for task, fig in summary[name].items():
            rows.append([name, task, fig.get("metric") or "", str(fig.get("n") or ""), _acc(fig), _diff(fig)])
    failed = {r: e for r, e in (spec["record"].get("rows") or {}).items() if e.get("status") != "ok"}
    for r, e in failed.items():
        rows.append([r, "", "", "", f"failed: {str(e.get('error', ''))[:200]}", ""])
    return rows


def note(spec: dict) -> str:
    s = spec["record"].get("settings") or {}
    return (
        f"Task accuracy from `splicer tasks`: lm-evaluation-harness {s.get('lm_eval') or ''} on {s.get('model')}, tasks "
        f"{', '.join(s.get('tasks') or [])}"
        + (f", the first {s['limit']} items of each" if s.get("limit") else "")
        + "; accuracy ± lm-eval's standard error; Δ vs build is paired on the items both answered, its 95 % interval "
        "from a bootstrap over items (t x standard error, as the other intervals)."
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
            if name != build and vs and vs.get("diff") is not None and vs.get("ci"):
                verdict = "" if vs.get("significant") else ", not significant"
                text += f"; {_diff(fig).replace(' n.s.', '')} pp against the build{verdict}"
            out.append(text + ".")
    return out
