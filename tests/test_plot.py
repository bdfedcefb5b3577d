"""`splicer plot DIR`: the figure's files, its link from table.md, and the Pareto front it draws."""

from __future__ import annotations

import json

from splicer.analysis.budget import pareto
from splicer.analysis.plot import LINK_LINE
from splicer.cli import main


def test_pareto_keeps_the_points_nothing_beats_on_both_axes():
    pts = [(1.0, 0.9, "a"), (2.0, 0.5, "b"), (2.5, 0.6, "c"), (3.0, 0.1, "d"), (3.0, 0.05, "e"), (4.0, 0.05, "f")]
    assert [p[2] for p in pareto(pts)] == ["a", "b", "e"]


def _variant(name, kl, size, decode=None, repeat_of=None):
    metrics = {c: {"kl": kl, "kl_ci": [kl * 0.9, kl * 1.1], "top1": 0.5} for c in ("wiki-en", "chat")}
    return {
        "name": name,
        "status": "ok",
        "restored": [],
        "size_bytes": size,
        "decode_ms_per_token": decode,
        "timing": {"decode_iqr": [decode * 0.95, decode * 1.05]} if decode else None,
        "metrics": metrics,
        "repeat_of": repeat_of,
    }


def test_plot_writes_png_and_svg_and_links_them_once(tmp_path, capsys):
    results = {
        "corpora": {"wiki-en": {}, "chat": {}},
        "inputs": {"build": {"source": "/x/build"}},
        "variants": [
            _variant("build", 0.8, 9e9, 10.0),
            _variant("gdn", 0.5, 9.5e9, 10.5),
            _variant("all", 0.0, 16e9, 14.0),
            _variant("build-again", 0.8, 9e9, 10.1, repeat_of="build"),
        ],
    }
    (tmp_path / "results.json").write_text(json.dumps(results))
    (tmp_path / "table.md").write_text("| table |\n")
    assert main(["plot", str(tmp_path)]) == 0
    for ext in ("png", "svg"):
        assert (tmp_path / f"plot-kl.{ext}").stat().st_size > 1000
    svg = (tmp_path / "plot-kl.svg").read_text()
    assert "gdn" in svg and "build-again" not in svg and "Pareto front" in svg
    assert main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "table.md").read_text().count(LINK_LINE) == 1
    assert not list(tmp_path.glob(".*partial*"))


def test_plot_of_a_folder_without_results_is_refused(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "results.json does not exist" in err and len(err.strip().splitlines()) == 1


def test_a_plot_older_than_the_results_is_linked_as_stale(tmp_path):
    import os

    from splicer.analysis.plot import link, write_plot

    results = {"corpora": {"wiki-en": {}}, "variants": [_variant("build", 0.8, 9e9), _variant("gdn", 0.5, 9.5e9)]}
    (tmp_path / "results.json").write_text(json.dumps(results))
    (tmp_path / "table.md").write_text("| table |\n")
    write_plot(tmp_path)
    assert "drawn before" not in (tmp_path / "table.md").read_text()
    later = (tmp_path / "plot-kl.png").stat().st_mtime_ns + 10**9
    os.utime(tmp_path / "results.json", ns=(later, later))  # a row finished after the plot
    (tmp_path / "table.md").write_text("| table, rewritten |\n")
    link(tmp_path)
    text = (tmp_path / "table.md").read_text()
    assert text.count(LINK_LINE) == 1 and "drawn before the last rows finished" in text


def test_a_damaged_results_file_is_one_line(tmp_path, capsys):
    for content, message in (("{", "is not valid JSON"), ("[]", "not a splicer results file")):
        (tmp_path / "results.json").write_text(content)
        assert main(["plot", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


def _drawn_labels(monkeypatch):
    """Record, at each savefig, every point label of the figure with its box as drawn (display pixels), and the
    figure's texts outside the panels (title, key)."""
    from matplotlib.figure import Figure
    from matplotlib.text import Text

    seen = []
    real_savefig = Figure.savefig

    def recording_savefig(self, *args, **kwargs):
        renderer = self.canvas.get_renderer()
        self.canvas.draw()
        seen.append(
            {
                "labels": [(ax, t.get_text(), Text.get_window_extent(t, renderer)) for ax in self.axes for t in ax.texts],
                "texts": " ".join(t.get_text() for t in self.texts) + self._suptitle.get_text(),
                "dpi": self.dpi,
            }
        )
        return real_savefig(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", recording_savefig)
    return seen


def test_crowded_labels_do_not_overlap_each_other_or_a_marker(tmp_path, capsys, monkeypatch):
    """15 variants within 3 % of each other on both axes, some with long generated names (budget --verify's rows):
    every label box is clear of every other label and of every point's marker."""
    import itertools

    from splicer.analysis.plot import write_plot

    names = (
        ["build"]
        + [f"gdn-{i}" for i in range(1, 6)]
        + [f"shared_expert-and-more-{i}" for i in range(4)]
        + [f"gdn.{i}-{i + 2}_{i + 4}-{i + 6}_{i + 8}-{i + 10}+attention+shared_expert" for i in range(5)]
    )
    variants = []
    for i, name in enumerate(names):
        v = _variant(name, 0.18 * (1 + 0.002 * (i % 7)), 19.3e9 * (1 + 0.002 * (i % 5)), 4.38 * (1 + 0.002 * (i % 4)))
        if "." in name:
            v["restored"] = [name.split("+")[0].replace(".", "@").replace("_", ","), "attention", "shared_expert"]
        variants.append(v)
    (tmp_path / "results.json").write_text(json.dumps({"corpora": {"wiki-en": {}, "chat": {}}, "variants": variants}))
    seen = _drawn_labels(monkeypatch)
    write_plot(tmp_path)
    drawn = seen[0]
    assert len(drawn["labels"]) == 4 * len(names)  # every point labelled on each of the 4 panels
    boxes = [box for _, _, box in drawn["labels"]]
    for a, b in itertools.combinations(boxes, 2):
        assert not a.overlaps(b), "two labels overlap"
    radius = 6 / 2 * drawn["dpi"] / 72  # a measured point's marker: 6 points across
    for ax, _, box in drawn["labels"]:
        r = 0 if ax.get_xlabel().startswith("decode") else 1
        for v in variants:
            x = v["decode_ms_per_token"] if r == 0 else v["size_bytes"] / 1e9
            for corpus in ("wiki-en", "chat"):
                if ax.get_ylabel().endswith(corpus):
                    cx, cy = ax.transData.transform((x, v["metrics"][corpus]["kl"]))
                    assert not (
                        box.x0 < cx + radius and cx - radius < box.x1 and box.y0 < cy + radius and cy - radius < box.y1
                    ), "a label covers a marker"
    # Long names are P1... on the plot and spelled out, with the row name, in the key
    assert "gdn layers 0-2,4-6,8-10 + attention + shared_expert" in drawn["texts"]
    assert all(name in drawn["texts"] for name in names if "." in name)
    assert {t for _, t, _ in drawn["labels"]} >= {"P1", "P5", "gdn-1", "shared_expert-and-more-0"}


def test_a_variant_timed_on_two_engines_is_one_point_with_their_spread(tmp_path, capsys, monkeypatch):
    from matplotlib.axes import Axes

    from splicer.analysis.plot import write_plot

    variants = [
        _variant("build", 0.8, 9e9, 10.0),
        _variant("gdn", 0.5, 9.5e9, 10.5),
        _variant("build-again", 0.81, 9e9, 10.4, repeat_of="build"),
    ]
    (tmp_path / "results.json").write_text(json.dumps({"corpora": {"wiki-en": {}}, "variants": variants}))
    bars = []
    real_errorbar = Axes.errorbar

    def recording_errorbar(self, x, y, *args, **kwargs):
        bars.append((self.get_xlabel() or "?", x[0], y[0], kwargs.get("xerr")))
        return real_errorbar(self, x, y, *args, **kwargs)

    monkeypatch.setattr(Axes, "errorbar", recording_errorbar)
    seen = _drawn_labels(monkeypatch)
    write_plot(tmp_path)
    labels = sorted(t for _, t, _ in seen[0]["labels"])
    assert labels == ["build", "build (2 engines)", "gdn", "gdn"]  # decode panel: one build point; size panel too
    decode_build = [b for b in bars if b[2] == 0.8 and b[3] is not None]
    assert len(decode_build) == 1
    _, x, _, xerr = decode_build[0]
    assert x == 10.2  # the mean of the two engines, KL the build row's own
    assert (x - xerr[0][0], x + xerr[1][0]) == (10.0 * 0.95, 10.4 * 1.05)  # from the lowest to the highest IQR end


def test_generated_row_names_are_spelled_out_and_others_kept():
    from splicer.analysis.plot import readable_name

    assert readable_name("gdn.0-2_4-6+attention", ["gdn@0-2,4-6", "attention"]) == ("gdn layers 0-2,4-6 + attention", False)
    assert readable_name("gdn.10+shared_expert", ["gdn@10", "shared_expert"]) == ("gdn layer 10 + shared_expert", False)
    # -2: budget --verify's name against a clash; the key must give the name too
    assert readable_name("gdn.0+attention-2", ["gdn@0", "attention"]) == ("gdn layer 0 + attention", True)
    assert readable_name("gdn-1", ["gdn@0-2,4-6"]) == ("gdn-1", False)  # a sweep's own name
    assert readable_name("build", []) == ("build", False)


def test_rows_at_kl_0_on_a_log_axis_are_drawn_at_its_floor_and_named(tmp_path, capsys, monkeypatch):
    """KLs spanning more than 10x get a log axis, which has no 0: rows at KL 0 (the base, a restore of every class the
    build quantizes) were neither drawn nor named, and the measured front's last step ran off the panel's bottom.
    They are drawn on a dotted floor below every positive KL, labelled KL 0 and named in the title, and every line
    stays inside the panel."""
    from matplotlib.axes import Axes

    from splicer.analysis.plot import write_plot

    variants = [
        _variant("build", 0.006, 9e9, 10.0),
        _variant("gdn", 0.003, 9.5e9, 10.5),
        _variant("experts-only", 0.0004, 12e9, 12.0),
        _variant("all", 0.0, 16e9, 14.0),
        _variant("base", 0.0, 17e9, 15.0),
    ]
    for v in variants[3:]:
        for m in v["metrics"].values():
            m["kl_ci"] = [0.0, 0.0]
    (tmp_path / "results.json").write_text(json.dumps({"corpora": {"wiki-en": {}}, "variants": variants}))
    points = []
    real_errorbar = Axes.errorbar

    def recording_errorbar(self, x, y, *args, **kwargs):
        points.append((self, x[0], y[0], kwargs.get("fmt")))
        return real_errorbar(self, x, y, *args, **kwargs)

    monkeypatch.setattr(Axes, "errorbar", recording_errorbar)
    seen = _drawn_labels(monkeypatch)
    write_plot(tmp_path)
    drawn = seen[0]
    axes = {ax for ax, *_ in points}
    assert len(axes) == 2 and all(ax.get_yscale() == "log" for ax in axes)
    for ax in axes:
        bottom, top = ax.get_ylim()
        at_floor = [(y, fmt) for a, _, y, fmt in points if a is ax and y < 0.0004]
        assert len(at_floor) == 2 and all(bottom < y < 0.0004 and fmt == "v" for y, fmt in at_floor)
        for line in ax.lines:  # the measured front, its last steps down to the KL-0 rows included
            ys = [y for y in line.get_ydata() if not isinstance(y, str)]
            assert all(bottom <= y <= top for y in ys if line.get_transform() == ax.transData)
        front = next(line for line in ax.lines if line.get_label() == "Pareto front (measured)")
        assert min(front.get_ydata()) > bottom
    labels = sorted(t for _, t, _ in drawn["labels"])
    assert labels.count("all (KL 0)") == 2 and labels.count("base (KL 0)") == 2  # one per panel: decode and size
    assert "KL 0 on a log axis: all, base" in drawn["texts"].replace("\n", " ")
