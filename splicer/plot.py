"""`splicer plot DIR`: KL per corpus against decode time and against size on disk, every variant of a results folder a
labelled point (a repeat row is not a variant of its own), the Pareto front drawn, written as PNG and SVG beside table.md and linked from it.

Read from DIR/results.json only. Vertical bars: the variant's KL 95 % interval on that corpus (bootstrap over
sequences, as the table's). Horizontal bars on the decode panels: the interquartile range of the variant's timing runs
(their spread, not an interval of the median). Checkpoint rows and repeats are drawn like the rest; a row with no
timing (a --no-time run) is left out of the decode panels, which are then not drawn at all. Predicted points are
hollow, measured ones filled: the Pareto front `splicer budget DIR` last predicted (DIR/budget.json), with its KL and
decode intervals, drawn dashed; a point it verified is joined by a thin line to its measured row.
"""

from __future__ import annotations

from pathlib import Path

from .budget import finite_number
from .errors import SplicerError
from .outputs import write_file
from .table import UNUSABLE, load_results

PLOT_STEM = "plot-kl"
LABEL_CHARS = 24  # longer names are numbered on the plot and spelled out in a key
LINK_LINE = "Plot: KL per corpus against decode ms/token and against size on disk"


def _points(results: dict) -> list[dict]:
    out = []
    for v in results.get("variants", []):
        if not isinstance(v, dict) or v.get("status") != "ok" or not isinstance(v.get("metrics"), dict) or v.get("repeat_of"):
            continue
        if v.get(UNUSABLE):  # a NaN measurement: no point to draw (write_plot names it)
            continue  # a repeat is the same variant measured again: its spread is in the table, not a point of its own
        metrics = {c: m for c, m in v["metrics"].items() if isinstance(m, dict) and isinstance(m.get("kl"), (int, float))}
        if not metrics:
            continue
        out.append({"name": v["name"], "size_gb": (v.get("size_bytes") or 0) / 1e9, "decode": v.get("decode_ms_per_token"),
                    "decode_iqr": (v.get("timing") or {}).get("decode_iqr"), "metrics": metrics})
    return out


def _predicted(folder: Path) -> tuple[list[dict], list[dict], str | None]:
    """The budget search's predicted front and its verified points (DIR/budget.json), or nothing."""
    import json

    try:
        record = json.loads((folder / "budget.json").read_text())
    except (OSError, ValueError):
        return [], [], None
    if not isinstance(record, dict):
        return [], [], None
    return ([e for e in _list(record.get("front")) if _drawable(e)], [e for e in _list(record.get("verified")) if _drawable(e)],
            record.get("cost") if record.get("cost") in ("decode", "size_gb") else None)


def _list(x) -> list:
    return x if isinstance(x, list) else []


def _pair(x) -> bool:
    return isinstance(x, list) and len(x) == 2 and all(finite_number(v) for v in x)


def _drawable(e) -> bool:
    """A budget.json point the plot can draw (budget writes them so; a hand edit or an older splicer may not): KL per
    corpus as numbers 0 or more, intervals as number pairs, costs as numbers 0 or more or absent."""
    if not isinstance(e, dict) or not isinstance(e.get("kl_by_corpus"), dict) or not all(finite_number(v) for v in e["kl_by_corpus"].values()):
        return False
    cis = e.get("kl_ci_by_corpus") or {}
    return (isinstance(cis, dict) and all(_pair(v) for v in cis.values() if v is not None)
            and all(e.get(k) is None or (finite_number(e[k]) and e[k] >= 0) for k in ("decode", "size_gb"))
            and all(v >= 0 for v in e["kl_by_corpus"].values())
            and (e.get("decode_ci") is None or _pair(e["decode_ci"])))


def pareto(items: list, x=lambda p: p[0], y=lambda p: p[1]) -> list:
    """The items no other item beats on both x and y (lower is better on both), by increasing x; a y lower by less
    than 1e-12 (float noise of a sum) is no improvement. Used for the measured points here and the predicted
    combinations of `splicer budget`."""
    front, best = [], float("inf")
    for item in sorted(items, key=lambda p: (x(p), y(p))):
        if y(item) < best - 1e-12:
            front.append(item)
            best = y(item)
    return front


def write_plot(folder: str | Path) -> tuple[list[Path], list[str]]:
    """Write DIR/plot-kl.png and .svg and link them from DIR/table.md; returns the files written, and the rows left
    out because a measurement is not a number (`row (why)`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    results = load_results(folder)
    points = _points(results)
    corpora = [c for c in (results.get("corpora") or {}) if any(c in p["metrics"] for p in points)] or \
        sorted({c for p in points for c in p["metrics"]})
    if not points or not corpora:
        raise SplicerError(f"{folder}/results.json has no scored variant yet; run the rows first")
    timed = [p for p in points if p["decode"] is not None]
    cut = []  # bars whose lower end was below 0 and is drawn at 0
    predicted, verified, cost = _predicted(folder)
    by_row = {p["name"]: p for p in points}
    axes_x = ([("decode", "decode ms/token (batch 1)")] if timed else []) + [("size_gb", "size on disk, GB")]
    # Long row names (a budget's verified points: gdn.0-2_4-6_8-10+attention+...) are drawn as [n], with a key below.
    labels, numbered = {}, []
    for p in points:
        if len(p["name"]) <= LABEL_CHARS:
            labels[p["name"]] = p["name"]
        else:
            numbered.append(p["name"])
            labels[p["name"]] = f"[{len(numbered)}]"
    fig, axes = plt.subplots(len(axes_x), len(corpora), figsize=(5.2 * len(corpora), 4.4 * len(axes_x) + 0.18 * len(numbered)),
                             squeeze=False)
    for r, (key, label) in enumerate(axes_x):
        for c, corpus in enumerate(corpora):
            ax = axes[r][c]
            pts = [p for p in (timed if key == "decode" else points) if corpus in p["metrics"]]
            for p in pts:
                m = p["metrics"][corpus]
                x, y = p[key], m["kl"]
                xerr = _bar(x, p["decode_iqr"], cut) if key == "decode" else None
                ax.errorbar([x], [y], yerr=_bar(y, m.get("kl_ci"), cut), xerr=xerr, fmt="o", ms=6, capsize=2, lw=0.8,
                            color="C0")
                ax.annotate(labels[p["name"]], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
            _draw_predicted(ax, key, corpus, predicted, verified, by_row, key == cost, cut)
            front = pareto([(p[key], p["metrics"][corpus]["kl"], p["name"]) for p in pts])
            if len(front) > 1:
                ax.step([f[0] for f in front], [f[1] for f in front], where="post", color="C3", lw=1, label="Pareto front (measured)")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7, loc="best")
            ax.set_xlabel(label)
            ax.set_ylabel(f"KL(base ‖ variant), {corpus}")
            kls = [p["metrics"][corpus]["kl"] for p in pts if p["metrics"][corpus]["kl"] > 0]
            if kls and max(kls) / min(kls) > 10:  # a restore that removes most of the error: both ends readable
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
    build = ((results.get("inputs") or {}).get("build") or {}).get("source", "")
    fig.suptitle(f"{Path(str(build)).name or folder.name}: every variant against the base\n(bars: KL 95 % interval"
                 + ("; decode: IQR of timing runs" if timed else "; decode not timed in this run")
                 + ("; bars cut at 0: a timing run's estimate or an interval reached below 0, as on a loaded machine)"
                    if cut else ")"), fontsize=9)
    if numbered:
        fig.text(0.01, 0.005, "\n".join(f"[{i}] {name}" for i, name in enumerate(numbered, 1)), fontsize=7, va="bottom",
                 family="monospace")
    bottom = 0.18 * (len(numbered) + 1) / (4.4 * len(axes_x) + 0.18 * len(numbered)) if numbered else 0
    fig.tight_layout(rect=(0, bottom, 1, 1))
    try:
        written = [write_file(folder / f"{PLOT_STEM}.{ext}", lambda tmp, ext=ext: fig.savefig(tmp, dpi=120, format=ext))
                   for ext in ("png", "svg")]
    finally:
        plt.close(fig)
    if link(folder):
        written.append(folder / "table.md")
    left_out = [f"{v['name']} ({v[UNUSABLE]})" for v in results["variants"] if v.get("status") == "ok" and v.get(UNUSABLE)]
    return written, left_out


def _bar(x: float, span, cut: list) -> list | None:
    """Matplotlib's error bar of a point x from an interval or IQR `span` (None: no bar): drawn from the point, never
    below 0 (neither KL nor a time is negative: a bar reaching below 0 is cut there and noted in `cut`), and an
    interval that misses its point draws no negative length."""
    if not _pair(span):
        return None
    if span[0] < 0:
        cut.append(span)
    lo, hi = min(max(span[0], 0.0), x), max(span[1], x)
    return [[x - lo], [hi - x]]


def _draw_predicted(ax, key: str, corpus: str, front: list[dict], verified: list[dict], by_row: dict,
                    front_line: bool, cut: list) -> None:
    """The budget's predicted front (hollow squares with their KL and decode intervals, joined by a dashed line on the
    panels of the cost it was searched against) and a line from each verified prediction to its measured row."""
    pts = [(e[key], e["kl_by_corpus"][corpus], e) for e in front if e.get(key) is not None and corpus in e["kl_by_corpus"]]
    if pts:
        pts.sort(key=lambda t: t[0])
        ax.plot([t[0] for t in pts], [t[1] for t in pts], ls="--" if front_line else "none", lw=0.8, color="C1",
                marker="s", ms=5, mfc="none",
                label="predicted front (budget)" if front_line else "predicted front points (budget)")
        for x, y, e in pts:
            xerr = _bar(x, e.get("decode_ci"), cut) if key == "decode" else None
            yerr = _bar(y, (e.get("kl_ci_by_corpus") or {}).get(corpus), cut)
            ax.errorbar([x], [y], xerr=xerr, yerr=yerr, fmt="s", ms=5, mfc="none", color="C1", capsize=2, lw=0.6)
    for e in verified:
        row = by_row.get(e.get("row"))
        if row is None or e.get(key) is None or corpus not in e["kl_by_corpus"] or row.get(key) is None or corpus not in row["metrics"]:
            continue
        x, y = e[key], e["kl_by_corpus"][corpus]
        ax.plot([x, row[key]], [y, row["metrics"][corpus]["kl"]], color="C1", lw=0.8)
        ax.plot([x], [y], "s", ms=6, mfc="none", color="C1")


def link(folder: Path) -> bool:
    """Add the plot's link line to DIR/table.md (once), saying so when the plot is older than results.json (rows
    finished after it was drawn); returns whether there was a table to link from."""
    table = folder / "table.md"
    if not table.exists():
        return False
    text = "\n".join(line for line in table.read_text().splitlines() if not line.startswith(LINK_LINE)).rstrip("\n")
    png, results = folder / f"{PLOT_STEM}.png", folder / "results.json"
    stale = png.exists() and results.exists() and png.stat().st_mtime_ns < results.stat().st_mtime_ns
    note = " It was drawn before the last rows finished: run `splicer plot DIR` again." if stale else ""
    line = f"{text}\n\n{LINK_LINE}: [{PLOT_STEM}.png]({PLOT_STEM}.png) ([SVG]({PLOT_STEM}.svg)).{note}\n"
    write_file(table, lambda tmp: tmp.write_text(line, encoding="utf-8"))
    return True
