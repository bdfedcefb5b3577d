"""`splicer plot DIR`: KL per corpus against decode time and against size on disk, every variant of a results
folder a labelled point, the Pareto front drawn, written as PNG and SVG beside table.md and linked from it.

Read from DIR/results.json only. Vertical bars: the variant's KL 95 % interval on that corpus (bootstrap over
sequences, as the table's). Horizontal bars on the decode panels: the interquartile range of the variant's timing runs
(their spread, not an interval of the median). A variant timed on several engines (its rows with `repeat = true`,
results.json `repeat_of`, e.g. build and build-again) is one point: at the mean of its engines' decode figures, a tick
at each engine's figure, its bar from the lowest to the highest end of their IQRs; KL and size are its own row's.
Checkpoint rows are drawn like the rest; a row with no timing (a --no-time run) is left out of the decode panels,
which are then not drawn at all. Predicted points are hollow, measured ones filled: the Pareto front `splicer budget
DIR` last predicted (DIR/budget.json), with its KL and decode intervals, drawn dashed; a point it verified is joined by
a thin line to its measured row.

Labels: a row's name, or for a name generated from what the row restores (`gdn.0-2_4-6+attention`, as `budget
--verify` names rows) that restore spelled out (`gdn layers 0-2,4-6 + attention`); one longer than SHORT_LABEL_CHARS is drawn as
P1, P2... and spelled out, with its row name, in a key under the panels. Labels are placed by `_place_labels`, a
deterministic search in display space (no label on another label, a marker or a legend; a thin line to its point
when moved away): adjustText 1.4 was tried and left 7 pairs of 17 crowded labels overlapping.

MTP acceptance, where `splicer mtp DIR` measured any (DIR/speculative.json, read through speculative.load, the
table's own summary): DIR/plot-mtp.png and .svg, a panel per number of draft tokens k, each row a point with its
acceptance's 95 % interval over prompts, the build a diamond on a dashed line, a row whose paired difference from the
build excludes 0 filled, one whose does not hollow. A flagged drafter is no result: its line in that panel says so and
the title names it. Without a measured row no MTP figure is drawn and the KL figure and table.md are as they were.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import SplicerError
from ..io import results_record
from ..io.outputs import cannot_write, write_file
from ..io.results_record import UNUSABLE
from .budget import finite_number, pareto

PLOT_STEM = "plot-kl"
MTP_STEM = "plot-mtp"  # MTP acceptance, where DIR/speculative.json has any
MTP_ROW_IN = 0.3  # inches of height per variant in the MTP panels: its 8 pt label and bar with room between
SHORT_LABEL_CHARS = 28  # longer labels are drawn as P1, P2... and spelled out in a key under the panels
PANELS_PER_ROW = 3  # corpora side by side; more wrap to further rows
LINK_LINE = "Plot: KL per corpus against decode ms/token and against size on disk"
MTP_LINK_LINE = "Plot: MTP acceptance per variant and number of draft tokens"
DPI = 120  # the PNG's; labels are placed at it, so that the saved figure is the one checked
MEASURED_MS, PREDICTED_MS, TICK_MS = 6, 6, 7  # marker sizes, points: labels keep off them


def readable_name(name: str, restored) -> tuple[str, bool]:
    """A row's label: for a name generated from its restore (`gdn.0-2_4-6+attention`, as `budget --verify` names its
    rows) that restore spelled out, `gdn layers 0-2,4-6 + attention`; any other name as it is. Second: whether the
    name holds more than that spelling (a -2 that --verify adds against a clash, a long name cut and hashed), so that
    the key must give the name too."""
    entries = restored if isinstance(restored, list) and all(isinstance(e, str) for e in restored) else []
    if not any("@" in e for e in entries):
        return name, False  # the build, a whole class, a sweep's gdn-1: already readable
    generated = "+".join(e.replace("@", ".").replace(",", "_") for e in entries)
    stem = re.escape(generated) if len(generated) <= 100 else re.escape(generated[:90]) + "-[0-9a-f]{8}"  # budget.row_name
    if not re.fullmatch(stem + r"(-\d+)?", name):
        return name, False  # named by hand: the name is what the reader knows it by

    def spell(entry: str) -> str:
        cls, at, layers = entry.partition("@")
        return f"{cls} layer{'s' if ',' in layers or '-' in layers else ''} {layers}" if at else cls

    return " + ".join(spell(e) for e in entries), name != generated


def _add_labels(rows: list[dict], labels: dict, keyed: list) -> None:
    """Each row's label (rows: name and restored) into labels: readable_name's, or for one too long to draw P1, P2...
    with (P1, spelled out, row name) appended to keyed; rows already labelled keep theirs, so that a row has one label
    in every figure of the folder."""
    for p in rows:
        if p["name"] in labels:
            continue
        text, name_too = readable_name(p["name"], p["restored"])
        if len(text) <= SHORT_LABEL_CHARS and not name_too:
            labels[p["name"]] = text
        else:
            keyed.append((f"P{len(keyed) + 1}", text, p["name"]))
            labels[p["name"]] = keyed[-1][0]


def _points(results: dict) -> list[dict]:
    """One point per variant: its own row's KL and size; its decode over every engine it was timed on (the row and
    its repeats)."""
    rows: dict[str, list[dict]] = {}
    for v in results.get("variants", []):
        if not isinstance(v, dict) or v.get("status") != "ok" or not isinstance(v.get("metrics"), dict):
            continue
        if v.get(UNUSABLE):  # a NaN measurement: no point to draw (write_plot names it)
            continue
        rows.setdefault(v["repeat_of"] if isinstance(v.get("repeat_of"), str) else v["name"], []).append(v)
    out = []
    for name, group in rows.items():
        own = next((v for v in group if v["name"] == name), group[0])  # a repeat stands in for a failed row
        metrics = {c: m for c, m in own["metrics"].items() if isinstance(m, dict) and isinstance(m.get("kl"), (int, float))}
        if not metrics:
            continue
        timed = [v for v in [own] + [v for v in group if v is not own] if isinstance(v.get("decode_ms_per_token"), (int, float))]
        engines = [v["decode_ms_per_token"] for v in timed]
        iqrs = [(v.get("timing") or {}).get("decode_iqr") for v in timed]
        if len(timed) > 1:  # the mean of the engines, the bar over all their runs' IQRs
            ends = [e for d, q in zip(engines, iqrs) for e in (q if _pair(q) else [d, d])]
            decode, iqr = sum(engines) / len(engines), [min(ends), max(ends)]
        else:
            decode, iqr = (engines[0], iqrs[0]) if timed else (None, None)
        out.append(
            {
                "name": own["name"],
                "restored": own.get("restored"),
                "size_gb": (own.get("size_bytes") or 0) / 1e9,
                "decode": decode,
                "decode_iqr": iqr,
                "engines": engines,
                "metrics": metrics,
            }
        )
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
    return (
        [e for e in _list(record.get("front")) if _drawable(e)],
        [e for e in _list(record.get("verified")) if _drawable(e)],
        record.get("cost") if record.get("cost") in ("decode", "size_gb") else None,
    )


def _list(x) -> list:
    return x if isinstance(x, list) else []


def _pair(x) -> bool:
    return isinstance(x, list) and len(x) == 2 and all(finite_number(v) for v in x)


def _drawable(e) -> bool:
    """A budget.json point the plot can draw (budget writes them so; a hand edit or an older splicer may not): KL per
    corpus as numbers 0 or more, intervals as number pairs, costs as numbers 0 or more or absent."""
    if (
        not isinstance(e, dict)
        or not isinstance(e.get("kl_by_corpus"), dict)
        or not all(finite_number(v) for v in e["kl_by_corpus"].values())
    ):
        return False
    cis = e.get("kl_ci_by_corpus") or {}
    return (
        isinstance(cis, dict)
        and all(_pair(v) for v in cis.values() if v is not None)
        and all(e.get(k) is None or (finite_number(e[k]) and e[k] >= 0) for k in ("decode", "size_gb"))
        and all(v >= 0 for v in e["kl_by_corpus"].values())
        and (e.get("decode_ci") is None or _pair(e["decode_ci"]))
    )


def write_plot(folder: str | Path) -> tuple[list[Path], list[str]]:
    """Write DIR/plot-kl.png and .svg and link them from DIR/table.md; returns the files written, and the rows left
    out because a measurement is not a number (`row (why)`)."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    results = results_record.load(folder)
    points = _points(results)
    corpora = [c for c in (results.get("corpora") or {}) if any(c in p["metrics"] for p in points)] or sorted(
        {c for p in points for c in p["metrics"]}
    )
    if not points or not corpora:
        raise SplicerError(f"{folder}/results.json has no scored variant yet; run the rows first")
    timed = [p for p in points if p["decode"] is not None]
    cut = []  # bars whose lower end was below 0 and is drawn at 0
    predicted, verified, cost = _predicted(folder)
    by_row = {p["name"]: p for p in points}
    axes_x = ([("decode", "decode ms/token (batch 1)")] if timed else []) + [("size_gb", "size on disk, GB")]
    labels, keyed = {}, []  # keyed: (P1, spelled out, row name) for labels too long to draw
    on_zero: dict = {}  # labels of the rows drawn at a log axis's floor (KL 0), in order
    _add_labels(points, labels, keyed)
    # One panel per corpus and cost, at most PANELS_PER_ROW side by side: a row of five panels is too wide to read
    # where a README shows it.
    cols = min(len(corpora), PANELS_PER_ROW)
    rows_per_cost = -(-len(corpora) // cols)
    width = 5.2 * cols
    key_lines = _key_lines(keyed, width)
    key_height = 0.14 * (len(key_lines) + 1) if key_lines else 0.0  # inches: 7 pt monospace lines and a margin
    fig, axes = plt.subplots(
        len(axes_x) * rows_per_cost, cols, figsize=(width, 4.4 * len(axes_x) * rows_per_cost + key_height), squeeze=False, dpi=DPI
    )
    for r, c in ((r, c) for r in range(len(axes_x) * rows_per_cost) for c in range(cols)):
        if (r % rows_per_cost) * cols + c >= len(corpora):
            axes[r][c].set_visible(False)
    panels = []  # (axes, [(x, y, label)], [(x, y, marker size)]) for the labels, placed once the layout is final
    for r, (key, label) in enumerate(axes_x):
        for i, corpus in enumerate(corpora):
            ax = axes[r * rows_per_cost + i // cols][i % cols]
            pts = [p for p in (timed if key == "decode" else points) if corpus in p["metrics"]]
            kls = [p["metrics"][corpus]["kl"] for p in pts if p["metrics"][corpus]["kl"] > 0]
            log = bool(kls) and max(kls) / min(kls) > 10  # a restore that removes most of the error: both ends readable
            # A log axis has no 0: a row at KL 0 (the base, a restore of every class the build quantizes) would be
            # neither drawn nor named, and the measured front would run off the panel's bottom to it. Such a point is
            # drawn on a dotted floor below every positive KL, as a down triangle labelled "KL 0".
            zero = log and (any(p["metrics"][corpus]["kl"] <= 0 for p in pts) or _predicted_zero(predicted, key, corpus))
            floor = min(kls + _predicted_kls(predicted, key, corpus)) / 4 if zero else None

            def at(y, floor=floor):
                return floor if floor is not None and y <= 0 else y

            anchors, marks = [], []
            for p in pts:
                m = p["metrics"][corpus]
                x, y = p[key], at(m["kl"])
                on_floor = y != m["kl"]
                xerr = _bar(x, p["decode_iqr"], cut) if key == "decode" else None
                ax.errorbar(
                    [x],
                    [y],
                    yerr=_bar(y, m.get("kl_ci"), cut, floor or 0.0),
                    xerr=xerr,
                    fmt="v" if on_floor else "o",
                    ms=MEASURED_MS,
                    capsize=2,
                    lw=0.8,
                    color="C0",
                )
                marks.append((x, y, MEASURED_MS))
                engines = len(p["engines"]) if key == "decode" else 1
                if engines > 1:  # each engine's own figure
                    ax.plot(p["engines"], [y] * engines, "|", ms=TICK_MS, mew=0.8, color="C0")
                    marks += [(e, y, TICK_MS) for e in p["engines"]]
                text = labels[p["name"]] + (f" ({engines} engines)" if engines > 1 else "") + (" (KL 0)" if on_floor else "")
                anchors.append((x, y, text))
                if on_floor:
                    on_zero.setdefault(labels[p["name"]], None)
            marks += _draw_predicted(ax, key, corpus, predicted, verified, by_row, key == cost, cut, floor)
            front = pareto([(p[key], p["metrics"][corpus]["kl"], p["name"]) for p in pts])
            if len(front) > 1:
                ax.step(
                    [f[0] for f in front],
                    [at(f[1]) for f in front],
                    where="post",
                    color="C3",
                    lw=1,
                    label="Pareto front (measured)",
                )
            if floor is not None:
                ax.axhline(floor, color="0.5", ls=":", lw=0.8, label="KL 0 (floor of the log axis)")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7, loc="best")
            ax.set_xlabel(label)
            ax.set_ylabel(f"KL(base ‖ variant), {corpus}")
            if log:
                ax.set_yscale("log")
            if floor is not None:  # the floor's points and the front's last step inside the panel
                ax.set_ylim(bottom=floor / 1.6)
            ax.grid(alpha=0.3)
            panels.append((ax, anchors, marks))
    build = ((results.get("inputs") or {}).get("build") or {}).get("source", "")
    repeated = any(len(p["engines"]) > 1 for p in timed)
    notes = ["bars: KL 95 % interval" + ("; decode: IQR of timing runs" if timed else "; decode not timed in this run")]
    if repeated:
        notes.append("a variant timed on several engines: at their mean, a tick at each, its bar over all their runs")
    if cut:
        notes.append("bars cut at 0: a timing run's estimate or an interval reached below 0, as on a loaded machine")
    if on_zero:
        notes.append(
            f"KL 0 on a log axis: {', '.join(on_zero)} drawn as a down triangle on the dotted floor, where bars reaching "
            "below it end"
        )
    if keyed:
        notes.append(f"{', '.join(k[0] for k in keyed[:2])}{', ...' if len(keyed) > 2 else ''}: see the key below the plots")
    chars = max(40, int(width * 72 / (0.6 * 9)))  # 9 pt: at most 0.6 em a character, so that a line fits the figure
    fig.suptitle(
        "\n".join(
            textwrap.fill(line, chars)
            for line in [f"{Path(str(build)).name or folder.name}: every variant against the base"] + [f"({n})" for n in notes]
        ),
        fontsize=9,
    )
    if key_lines:
        fig.text(0.01, 0.07 / fig.get_figheight(), "\n".join(key_lines), fontsize=7, va="bottom", family="monospace")
    fig.tight_layout(rect=(0, key_height / fig.get_figheight(), 1, 1))
    try:
        _place_labels(fig, panels)
        written = [
            write_file(folder / f"{PLOT_STEM}.{ext}", lambda tmp, ext=ext: fig.savefig(tmp, dpi=DPI, format=ext))
            for ext in ("png", "svg")
        ]
    finally:
        plt.close(fig)
    variants = [v for v in results["variants"] if isinstance(v, dict)]
    written += _write_mtp(folder, variants, Path(str(build)).name or folder.name, labels, keyed)
    if link(folder):
        written.append(folder / "table.md")
    left_out = [f"{v['name']} ({v[UNUSABLE]})" for v in results["variants"] if v.get("status") == "ok" and v.get(UNUSABLE)]
    return written, left_out


def _key_lines(keyed: list[tuple[str, str, str]], width_in: float) -> list[str]:
    """The key under the panels: each short label, what the row restores and (when that is not all of it) the row's
    name as results.json and the table spell it, wrapped after a +, comma or _ to the figure's width."""
    chars = max(40, int(width_in * 72 / (0.6 * 7)) - 2)  # monospace 7 pt: 0.6 em a character
    lines = []
    for short, text, name in keyed:
        for head, body in ((f"{short:<4}", text), ("    row ", name)) if text != name else ((f"{short:<4}", name),):
            line = head
            for piece in re.split(r"(?<=[+,_ ])", body):
                if len(line) + len(piece) > chars and line.strip():
                    lines.append(line.rstrip())
                    line = " " * 8
                line += piece
            lines.append(line.rstrip())
    return lines


def _place_labels(fig, panels: list) -> None:
    """Put each point's label next to it where it covers no other label (of any panel), no marker and no legend,
    inside its panel: the nearest free place on rings around the point (right and up first), a thin line to the
    point when that is not right beside it; among near places, one that no drawn line (bars, fronts, other labels'
    lines) crosses and whose own line crosses no label. Deterministic: the same figure gets the same places. Works in
    display pixels of the final layout (call it after tight_layout, save at the figure's dpi)."""
    import numpy as np
    from matplotlib.text import Text

    fig.canvas.draw()  # the layout, the axis limits and each legend's "best" corner are settled by a draw
    renderer = fig.canvas.get_renderer()
    pt = fig.dpi / 72  # pixels a point
    pad = 2.0  # pixels kept clear around a label (its light background reaches 1.2 of them)
    placed = []  # label boxes so far, every panel: x0, y0, x1, y1 in pixels
    # Directions from the point, in order of preference; a label's near edge or corner faces the point.
    sides = [(1, 1), (1, -1), (-1, 1), (-1, -1), (1, 0), (-1, 0), (0, 1), (0, -1)]
    sides += [(u, v) for t in (0.5, -0.5) for u, v in ((t, 1), (t, -1), (1, t), (-1, t))]
    for ax, anchors, marks in panels:
        ax.set_xlim(ax.get_xlim())  # the labels added below must not move the limits the layout was drawn with
        ax.set_ylim(ax.get_ylim())
        blocked = [
            (cx - r, cy - r, cx + r, cy + r)
            for (cx, cy), (_, _, ms) in zip(ax.transData.transform([(x, y) for x, y, _ in marks]).reshape(-1, 2), marks)
            for r in [ms * pt / 2 + pad]
        ]
        legend = ax.get_legend()
        if legend is not None:  # pinned where "best" put it, so that a redraw does not move it onto a label
            box = legend.get_window_extent(renderer)
            corner = ax.transAxes.inverted().transform((box.x0, box.y0))
            ax.legend(*ax.get_legend_handles_labels(), fontsize=7, loc=tuple(corner))
            blocked.append(tuple(box.extents))
        frame = ax.get_window_extent(renderer).extents + np.array([pad, pad, -pad, -pad])
        ink = _LineInk(fig, ax)
        centres = ax.transData.transform([(x, y) for x, y, _ in anchors]).reshape(-1, 2)
        # Points with fewer neighbours first: they keep the place beside them, the crowd then fills around.
        crowd = [int((np.hypot(*(centres - c).T) < 40 * pt).sum()) for c in centres]
        for i in sorted(range(len(anchors)), key=lambda i: (crowd[i], i)):
            x, y, text = anchors[i]
            cx, cy = centres[i]
            probe = ax.annotate(text, (x, y), textcoords="offset points", xytext=(0, 0), ha="center", va="center", fontsize=7)
            probe.update_positions(renderer)  # else its text is not yet placed at the point
            ext = Text.get_window_extent(probe, renderer).extents - np.array([cx, cy, cx, cy]) + np.array([-pad, -pad, pad, pad])
            probe.remove()
            taken = np.array(blocked + placed).reshape(-1, 4)
            around = (taken[:, 0] <= cx) & (cx <= taken[:, 2]) & (taken[:, 1] <= cy) & (cy <= taken[:, 3])
            spot, ring = _free_spot(
                (cx, cy), ext, sides, taken, frame, MEASURED_MS * pt / 2 + 2 * pt, ink, taken[~around]
            )  # its leader line may start under its own marker, no other
            arrow = dict(arrowstyle="-", lw=0.5, color="0.45", shrinkA=1, shrinkB=MEASURED_MS / 2) if ring else None
            ax.annotate(
                text,
                (x, y),
                textcoords="offset points",
                xytext=((spot[0] - cx) / pt, (spot[1] - cy) / pt),
                ha="center",
                va="center",
                fontsize=7,
                arrowprops=arrow,
                annotation_clip=False,
                bbox=dict(boxstyle="square,pad=0.12", fc="white", ec="none", alpha=0.75),
            )
            placed.append(tuple(ext + np.array([spot[0], spot[1], spot[0], spot[1]])))
            if ring:
                ink.add_segment((cx, cy), spot)


class _LineInk:
    """Where lines are drawn in a panel (its Line2D and the bars' line collections, then the labels' leader lines),
    as pixels of the figure, with a summed table: how much line a box covers is four look-ups."""

    def __init__(self, fig, ax):
        import numpy as np

        self.shape = (int(fig.bbox.height) + 2, int(fig.bbox.width) + 2)
        self.grid = np.zeros(self.shape, dtype=np.int32)
        paths = [line.get_transform().transform(line.get_xydata()) for line in ax.lines if line.get_linestyle() != "None"]
        for coll in ax.collections:  # error bars
            paths += [coll.get_transform().transform(p.vertices) for p in coll.get_paths()]
        for path in paths:
            for a, b in zip(path[:-1], path[1:]):
                self._mark(a, b)
        self._sum()

    def _mark(self, a, b) -> None:
        import numpy as np

        a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            return
        n = int(min(np.hypot(*(b - a)), 4000)) + 2
        xy = np.rint(a + np.linspace(0, 1, n)[:, None] * (b - a)).astype(int)
        ok = (xy[:, 0] >= 0) & (xy[:, 0] < self.shape[1]) & (xy[:, 1] >= 0) & (xy[:, 1] < self.shape[0])
        self.grid[xy[ok, 1], xy[ok, 0]] = 1

    def _sum(self) -> None:
        import numpy as np

        self.table = np.zeros((self.shape[0] + 1, self.shape[1] + 1), dtype=np.int64)
        self.table[1:, 1:] = self.grid.cumsum(0).cumsum(1)

    def add_segment(self, a, b) -> None:
        self._mark(a, b)
        self._sum()

    def covered(self, boxes):
        """Line pixels inside each box (x0, y0, x1, y1)."""
        import numpy as np

        x0, y0 = (np.clip(np.floor(boxes[:, i]).astype(int), 0, self.shape[1 - i]) for i in (0, 1))
        x1, y1 = (np.clip(np.ceil(boxes[:, i]).astype(int) + 1, 0, self.shape[1 - (i - 2)]) for i in (2, 3))
        t = self.table
        return t[y1, x1] - t[y0, x1] - t[y1, x0] + t[y0, x0]


def _overlapping(boxes, others):
    """Per box (rows of x0, y0, x1, y1): whether it overlaps any of `others`."""
    return (
        (boxes[:, None, 0] < others[None, :, 2])
        & (others[None, :, 0] < boxes[:, None, 2])
        & (boxes[:, None, 1] < others[None, :, 3])
        & (others[None, :, 1] < boxes[:, None, 3])
    ).any(axis=1)


def _free_spot(point, ext, sides: list, blocked, frame, gap: float, ink: _LineInk, crossed):
    """A centre for a label box of extents `ext` (relative to its centre) near `point`: ring by ring outwards and by
    `sides` within a ring, the first where the box overlaps nothing in `blocked` and lies inside `frame` (outside it
    only when the frame is full); within three rings of that, the first clean one besides (no line under the box, its
    leader line through none of `crossed`: other labels, markers, legend). Returns the centre and its ring (0: right beside the point)."""
    import numpy as np

    half = np.array([(ext[2] - ext[0]) / 2, (ext[3] - ext[1]) / 2])
    step = half[1] * 1.2
    rings = int(max(frame[2] - frame[0], frame[3] - frame[1]) / step) + 2
    dirs = np.array(sides, dtype=float)
    first = None
    for inside in (True, False):
        for ring in range(rings * (1 if inside else 4)):
            if first is not None and ring > first[1] + 3:
                return first
            centres = np.asarray(point) + dirs * (half + gap + ring * step)
            boxes = np.hstack([centres + ext[:2], centres + ext[2:]])
            free = ~_overlapping(boxes, blocked)
            if inside:
                free &= (
                    (boxes[:, 0] >= frame[0]) & (boxes[:, 1] >= frame[1]) & (boxes[:, 2] <= frame[2]) & (boxes[:, 3] <= frame[3])
                )
            if not free.any():
                continue
            if first is None:
                first = (centres[int(np.argmax(free))], ring)
            clean = free & (ink.covered(boxes) == 0)
            if ring and len(crossed):  # the leader line, sampled from the point to the box, through nothing else
                t = np.linspace(0, 1, 16)[None, :, None]
                samples = np.asarray(point)[None, None, :] + t * (centres[:, None, :] - np.asarray(point))
                sx, sy = samples[..., 0][..., None], samples[..., 1][..., None]
                hit = ((sx > crossed[:, 0]) & (sx < crossed[:, 2]) & (sy > crossed[:, 1]) & (sy < crossed[:, 3])).any(axis=(1, 2))
                clean &= ~hit
            if clean.any():
                return centres[int(np.argmax(clean))], ring
        if first is not None:
            return first
    raise AssertionError("no free place for a label within four panels' reach")  # unreachable: the figure is finite


def _bar(x: float, span, cut: list, floor: float = 0.0) -> list | None:
    """Matplotlib's error bar of a point x from an interval or IQR `span` (None: no bar): drawn from the point, never
    below 0 (neither KL nor a time is negative: a bar reaching below 0 is cut there and noted in `cut`) nor below a
    log axis's floor (where KL 0 is drawn), and an interval that misses its point draws no negative length."""
    if not _pair(span):
        return None
    if span[0] < 0:
        cut.append(span)
    lo, hi = min(max(span[0], floor), x), max(span[1], x)
    return [[x - lo], [hi - x]]


def _predicted_kls(front: list[dict], key: str, corpus: str) -> list[float]:
    """The positive predicted KLs a panel draws (budget.json's front on that corpus and cost)."""
    return [e["kl_by_corpus"][corpus] for e in front if e.get(key) is not None and e["kl_by_corpus"].get(corpus, 0) > 0]


def _predicted_zero(front: list[dict], key: str, corpus: str) -> bool:
    """Whether a panel draws a predicted KL of 0 (a prediction floored at 0)."""
    return any(e.get(key) is not None and e["kl_by_corpus"].get(corpus) == 0 for e in front)


def _draw_predicted(
    ax,
    key: str,
    corpus: str,
    front: list[dict],
    verified: list[dict],
    by_row: dict,
    front_line: bool,
    cut: list,
    floor: float | None = None,
) -> list[tuple]:
    """The budget's predicted front (hollow squares with their KL and decode intervals, joined by a dashed line on the
    panels of the cost it was searched against) and a line from each verified prediction to its measured row; returns
    the markers drawn, (x, y, size), for the labels to keep off. A KL of 0 is drawn at a log axis's floor."""

    def at(y):
        return floor if floor is not None and y <= 0 else y

    pts = [(e[key], at(e["kl_by_corpus"][corpus]), e) for e in front if e.get(key) is not None and corpus in e["kl_by_corpus"]]
    marks = [(x, y, PREDICTED_MS) for x, y, _ in pts]
    if pts:
        pts.sort(key=lambda t: t[0])
        ax.plot(
            [t[0] for t in pts],
            [t[1] for t in pts],
            ls="--" if front_line else "none",
            lw=0.8,
            color="C1",
            marker="s",
            ms=PREDICTED_MS - 1,
            mfc="none",
            label="predicted front (budget)" if front_line else "predicted front points (budget)",
        )
        for x, y, e in pts:
            xerr = _bar(x, e.get("decode_ci"), cut) if key == "decode" else None
            yerr = _bar(y, (e.get("kl_ci_by_corpus") or {}).get(corpus), cut, floor or 0.0)
            ax.errorbar([x], [y], xerr=xerr, yerr=yerr, fmt="s", ms=PREDICTED_MS - 1, mfc="none", color="C1", capsize=2, lw=0.6)
    for e in verified:
        row = by_row.get(e.get("row"))
        if (
            row is None
            or e.get(key) is None
            or corpus not in e["kl_by_corpus"]
            or row.get(key) is None
            or corpus not in row["metrics"]
        ):
            continue
        x, y = e[key], at(e["kl_by_corpus"][corpus])
        ax.plot([x, row[key]], [y, at(row["metrics"][corpus]["kl"])], color="C1", lw=0.8)
        ax.plot([x], [y], "s", ms=PREDICTED_MS, mfc="none", color="C1")
        marks.append((x, y, PREDICTED_MS))
    return marks


def mtp_panels(spec: dict, order: list[str]) -> tuple[list[dict], list[str], list[tuple[str, int, str]]]:
    """What the MTP figure draws, read from speculative.load's summary as the table reads it: one panel per k with a
    measured row, {k, rows: [{row, value, ci, why, reference, significant}]} (value and ci: the acceptance and its
    95 % interval, fractions; why: why it has no interval; reference: the build row; significant: the paired
    difference from the build excludes 0, None where it has none); every row that is drawn or flagged, in the results
    table's order; and the flagged (row, k, reason), which are no result and are left out of the panels."""
    summary, build = spec["summary"], spec["record"].get("build_row", "build")
    names = [n for n in order if n in summary] + [n for n in summary if n not in order]
    panels: dict[int, list[dict]] = {}
    flagged = []
    for name in names:
        for key, fig in summary[name].items():
            if key == "0":  # the row's plain decode only
                continue
            if fig.get("flagged"):
                flagged.append((name, int(key), fig["flagged"]))
                continue
            acc = fig.get("acceptance") or {}
            if acc.get("value") is None:
                continue
            vs = fig.get("vs_build") or {}
            panels.setdefault(int(key), []).append(
                {
                    "row": name,
                    "value": acc["value"],
                    "ci": acc.get("ci"),
                    "why": acc.get("why"),
                    "reference": name == build,
                    "significant": vs.get("significant"),
                }
            )
    shown = {e["row"] for rows in panels.values() for e in rows} | {f[0] for f in flagged}
    rows = [n for n in names if n in shown]
    return [{"k": k, "rows": panels[k]} for k in sorted(panels)], rows, sorted(flagged, key=lambda f: (f[1], rows.index(f[0])))


# How the MTP panels mark a row against the build: (legend text, marker, colour, face colour).
MTP_STYLES = {
    "reference": ("build, the reference (dashed line: its acceptance)", "D", "0.15", "0.15"),
    True: ("differs from the build (paired 95 % interval excludes 0)", "o", "C3", "C3"),
    False: ("no significant difference from the build", "o", "C0", "none"),
    None: ("no interval for its paired difference from the build", "o", "0.5", "none"),
}


def _write_mtp(folder: Path, variants: list[dict], title: str, labels: dict, keyed: list) -> list[Path]:
    """DIR/plot-mtp.png and .svg: MTP acceptance per row, a panel per k, where DIR/speculative.json measured one;
    otherwise nothing (returns the files written)."""
    import textwrap

    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.transforms import blended_transform_factory

    from .speculative import load

    spec = load(folder)
    panels, rows, flagged = mtp_panels(spec, [v.get("name") for v in variants]) if spec else ([], [], [])
    if not panels:
        for path in (folder / f"{MTP_STEM}.{ext}" for ext in ("png", "svg")):
            try:  # an earlier plot's figure of acceptance that DIR no longer holds (an MTP run redone)
                path.unlink(missing_ok=True)
            except OSError as e:
                raise cannot_write(e, path) from None
        return []
    restored = {v.get("name"): v.get("restored") for v in variants}
    _add_labels([{"name": r, "restored": restored.get(r)} for r in rows], labels, keyed)
    ticks = [labels[r] + (" (reference)" if r == spec["record"].get("build_row", "build") else "") for r in rows]
    cols = min(len(panels), PANELS_PER_ROW)
    grid_rows = -(-len(panels) // cols)
    width = 5.2 * cols
    used = {labels[r] for r in rows}
    key_lines = _key_lines([k for k in keyed if k[0] in used], width)
    styles = [s for s in MTP_STYLES if any(_mtp_style(e) == s for p in panels for e in p["rows"])]
    legend_cols = 2 if cols == 1 else 4
    legend_lines = -(-len(styles) // legend_cols)
    bottom = (0.14 * (len(key_lines) + 1) if key_lines else 0.0) + 0.18 * legend_lines + 0.12  # inches: key, legend
    fig, axes = plt.subplots(
        grid_rows, cols, figsize=(width, (1.3 + MTP_ROW_IN * len(rows)) * grid_rows + bottom), squeeze=False, sharey=True, dpi=DPI
    )
    for i, ax in enumerate(axes.flat):
        ax.set_visible(i < len(panels))
    at = {r: y for y, r in enumerate(rows)}
    flagged_at = {(row, k) for row, k, _ in flagged}
    for ax, panel in zip(axes.flat, panels):
        k, ends = panel["k"], []
        ref = next((e for e in panel["rows"] if e["reference"]), None)
        if ref is not None:  # a line, not the build's interval shaded: overlapping intervals say nothing of a paired test
            ax.axvline(100 * ref["value"], color="0.3", ls="--", lw=0.8, zorder=1)
        for e in panel["rows"]:
            _, marker, colour, face = MTP_STYLES[_mtp_style(e)]
            x, span = 100 * e["value"], [100 * c for c in e["ci"]] if e["ci"] else None
            ax.errorbar(
                [x],
                [at[e["row"]]],
                xerr=_bar(x, span, []),
                fmt=marker,
                ms=MEASURED_MS,
                mfc=face,
                mec=colour,
                color=colour,
                capsize=2,
                lw=0.8,
                zorder=3,
            )
            ends += span or [x]
        drawn = {e["row"] for e in panel["rows"]}
        to_axes = blended_transform_factory(ax.transAxes, ax.transData)
        for row in rows:  # an empty line says why: a flagged drafter is no result, and no point is drawn for it
            if row not in drawn:
                why = "left out: drafter flagged" if (row, k) in flagged_at else f"not measured at k = {k}"
                ax.text(
                    0.02,
                    at[row],
                    why,
                    transform=to_axes,
                    fontsize=7,
                    color="0.35",
                    style="italic",
                    va="center",
                    bbox=dict(boxstyle="square,pad=0.12", fc="white", ec="none", alpha=0.75),
                )  # the light background keeps it readable over the build's dashed line
        lo, hi = min(ends), max(ends)
        pad = max(2.0, 0.15 * (hi - lo))  # points of acceptance: room for the caps and the 'left out' notes
        ax.set_xlim(max(0.0, lo - pad), min(100.0, hi + pad))
        ax.set_title(f"k = {k} draft token{'s' if k > 1 else ''}", fontsize=9)
        ax.set_xlabel("acceptance, % of draft tokens")
        ax.grid(axis="x", alpha=0.3)
    axes[0][0].set_yticks(range(len(rows)), ticks)
    for ax in axes.flat:  # each wrapped row of panels labels its rows again, at one size
        ax.tick_params(axis="y", labelsize=8)
    axes[0][0].set_ylim(len(rows) - 0.5, -0.5)  # the first row on top, as in the table
    notes = ["bars: 95 % interval over prompts"]
    for why in dict.fromkeys(e["why"] for p in panels for e in p["rows"] if not e["ci"] and e["why"]):
        notes.append(f"no bar: {why}")
    if flagged:
        notes.append(
            "left out, a drafter flagged as no result: "
            + "; ".join(f"{labels.get(row, row)} at k = {k} ({reason.split(':')[0]})" for row, k, reason in flagged)
        )
    if any(k[0] in used for k in keyed):
        notes.append("P1, ...: see the key below the plots")
    chars = max(40, int(width * 72 / (0.6 * 9)))  # 9 pt: at most 0.6 em a character, so that a line fits one panel
    heading = f"{title}: MTP acceptance per variant (vLLM, each variant's own MTP head drafting k tokens)"
    fig.suptitle("\n".join(textwrap.fill(line, chars) for line in [heading] + [f"({n})" for n in notes]), fontsize=9)
    handles = [
        Line2D([], [], marker=m, color=c, mfc=f, ms=MEASURED_MS, ls="--" if s == "reference" else "none", lw=0.8)
        for s in styles
        for _, m, c, f in [MTP_STYLES[s]]
    ]
    key_height = 0.14 * (len(key_lines) + 1) if key_lines else 0.0
    # As many entries a row as fit the figure's width, measured as drawn: the legend's texts are long, and one panel
    # (5.2 in) does not hold two of them side by side, nor two panels four (the PNG cut them off at both sides).
    ncol = min(len(styles), legend_cols)
    while True:
        legend = fig.legend(
            handles,
            [MTP_STYLES[s][0] for s in styles],
            loc="lower center",
            bbox_to_anchor=(0.5, key_height / fig.get_figheight()),
            ncol=ncol,
            fontsize=7,
            frameon=False,
        )
        if ncol == 1 or legend.get_window_extent(fig.canvas.get_renderer()).width <= fig.bbox.width:
            break
        legend.remove()
        ncol -= 1
    extra = 0.18 * (-(-len(styles) // ncol) - legend_lines)  # inches: the rows the legend has beyond those planned
    if extra > 0:
        fig.set_size_inches(width, fig.get_figheight() + extra)
        bottom += extra
        legend.set_bbox_to_anchor((0.5, key_height / fig.get_figheight()))
    if key_lines:
        fig.text(0.01, 0.07 / fig.get_figheight(), "\n".join(key_lines), fontsize=7, va="bottom", family="monospace")
    fig.tight_layout(rect=(0, bottom / fig.get_figheight(), 1, 1))
    try:
        return [
            write_file(folder / f"{MTP_STEM}.{ext}", lambda tmp, ext=ext: fig.savefig(tmp, dpi=DPI, format=ext))
            for ext in ("png", "svg")
        ]
    finally:
        plt.close(fig)


def _mtp_style(e: dict):
    return "reference" if e["reference"] else e["significant"]


def link(folder: Path) -> bool:
    """Add the plots' link lines to DIR/table.md (once each; MTP acceptance's where DIR holds its figure), saying so
    when a plot is older than what it draws (results.json: rows finished after it was drawn; speculative.json: MTP
    engines); returns whether there was a table to link from."""
    from .speculative import FILE as SPECULATIVE

    table = folder / "table.md"
    if not table.exists():
        return False
    lines = table.read_text().splitlines()
    text = "\n".join(line for line in lines if not line.startswith((LINK_LINE, MTP_LINK_LINE))).rstrip("\n")
    for stem, title, source, what in (
        (PLOT_STEM, LINK_LINE, results_record.path_of(folder), "rows"),
        (MTP_STEM, MTP_LINK_LINE, folder / SPECULATIVE, "MTP engines"),
    ):
        png = folder / f"{stem}.png"
        if stem == MTP_STEM and not (png.exists() and source.exists()):
            continue
        stale = png.exists() and source.exists() and png.stat().st_mtime_ns < source.stat().st_mtime_ns
        note = f" It was drawn before the last {what} finished: run `splicer plot DIR` again." if stale else ""
        text += f"\n\n{title}: [{stem}.png]({stem}.png) ([SVG]({stem}.svg)).{note}"
    write_file(table, lambda tmp: tmp.write_text(text + "\n", encoding="utf-8"))
    return True
