"""`splicer plot DIR` with DIR/speculative.json: MTP acceptance per variant, a panel per k, flagged drafters left out,
and a folder without measured MTP acceptance plotted exactly as before. The records are built as tests/test_mtp.py
builds them (per-prompt draft counts); the figures are read from the calls the plot makes to matplotlib."""

from __future__ import annotations

import json

import pytest

from splicer.analysis import speculative
from splicer.analysis.plot import LINK_LINE, MTP_LINK_LINE, MTP_STEM, PLOT_STEM, write_plot

from .test_mtp import _prompt
from .test_plot import _variant

N = 10  # prompts: enough for every interval (five per corpus)


def _spec(rows: dict[str, dict[int, list[int]]], n: int = N) -> dict:
    """A speculative.json: per row, per k, the accepted tokens of each prompt (20 drafts each); every row also timed
    without a drafter (k 0)."""
    engines = []
    for row, ks in rows.items():
        engines.append({"row": row, "k": 0, "status": "ok", "tokens": [[1]] * n})
        for k, accepted in ks.items():
            engines.append({"row": row, "k": k, "status": "ok", "per_prompt": [_prompt(a, 20, k) for a in accepted]})
    return {
        "build_row": "build",
        "settings": {"method": "mtp", "new_tokens": 64},
        "prompts": [{"corpus": "a" if i % 2 else "b", "index": i} for i in range(n)],
        "engines": engines,
    }


def _folder(tmp_path, spec: dict | None, names=("build", "gdn", "attention", "lm_head")):
    tmp_path.mkdir(parents=True, exist_ok=True)
    variants = [_variant(name, 0.8 * 0.8**i, 9e9 + 1e8 * i, 10.0 + i) for i, name in enumerate(names)]
    variants.append(_variant("build-again", 0.8, 9e9, 10.1, repeat_of="build"))
    (tmp_path / "results.json").write_text(
        json.dumps({"corpora": {"wiki-en": {}, "chat": {}}, "inputs": {"build": {"source": "/x/build"}}, "variants": variants})
    )
    (tmp_path / "table.md").write_text("| table |\n")
    if spec is not None:
        (tmp_path / speculative.FILE).write_text(json.dumps(spec))
    return tmp_path


def _record_mtp_figure(monkeypatch) -> dict:
    """At each savefig of a figure with panels titled 'k = ...': per panel (by k) the rows drawn, in order, with the
    x value and the style each errorbar call passed; the figure's title, the panels' texts, and the grid's shape."""
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    calls = []
    real_errorbar, real_savefig = Axes.errorbar, Figure.savefig

    def recording_errorbar(self, x, y, *args, **kwargs):
        calls.append((self, x[0], y[0], args, kwargs))
        return real_errorbar(self, x, y, *args, **kwargs)

    seen: dict = {}

    def recording_savefig(self, *args, **kwargs):
        panels = [ax for ax in self.axes if ax.get_title().startswith("k = ")]
        if panels and not seen:
            ticks = {round(t): label.get_text() for t, label in zip(panels[0].get_yticks(), panels[0].get_yticklabels())}
            for ax in panels:
                k = int(ax.get_title().split()[2])
                seen.setdefault("panels", {})[k] = [
                    {"row": ticks[round(y)], "x": x, "fmt": args[0] if args else kwargs.get("fmt"), **kwargs}
                    for a, x, y, args, kwargs in calls
                    if a is ax
                ]
                seen.setdefault("texts", {})[k] = [(ticks[round(t.get_position()[1])], t.get_text()) for t in ax.texts]
            seen["title"] = self._suptitle.get_text()
            seen["visible"] = sum(ax.get_visible() for ax in self.axes)
            seen["grid"] = self.axes[0].get_subplotspec().get_gridspec().get_geometry()
            seen["legend"] = [t.get_text() for legend in self.legends for t in legend.get_texts()]
        return real_savefig(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "errorbar", recording_errorbar)
    monkeypatch.setattr(Figure, "savefig", recording_savefig)
    return seen


BUILD_K1, BUILD_K2 = [14, 15, 13, 14, 14, 15, 13, 14, 14, 14], [24, 25, 23, 24, 24, 25, 23, 24, 24, 24]


def test_mtp_acceptance_is_a_panel_per_k_with_flagged_drafters_left_out(tmp_path, monkeypatch):
    spec = _spec(
        {
            "build": {1: BUILD_K1, 2: BUILD_K2},
            "gdn": {1: [10, 11, 9, 10, 10, 11, 9, 10, 10, 10], 2: [16, 17, 15, 16, 16, 17, 15, 16, 16, 16]},  # lower
            "attention": {1: [14, 14, 14, 14, 15, 14, 13, 14, 14, 14], 2: [24, 24, 25, 23, 24, 24, 24, 25, 23, 24]},
            "lm_head": {1: [15, 14, 13, 14, 14, 15, 14, 14, 13, 14], 2: [0] * N},  # k = 2: no drafting from trained weights
        }
    )
    folder = _folder(tmp_path, spec)
    seen = _record_mtp_figure(monkeypatch)
    written, _ = write_plot(folder)
    assert [p.name for p in written] == [f"{PLOT_STEM}.png", f"{PLOT_STEM}.svg", f"{MTP_STEM}.png", f"{MTP_STEM}.svg", "table.md"]
    assert all((folder / f"{MTP_STEM}.{ext}").stat().st_size > 1000 for ext in ("png", "svg"))
    summary = speculative.load(folder)["summary"]
    assert "flagged" in summary["lm_head"]["2"]  # the record does hold a broken drafter, which the plot must leave out
    panels = seen["panels"]
    assert sorted(panels) == [1, 2] and seen["grid"] == (1, 2)
    assert [p["row"] for p in panels[1]] == ["build (reference)", "gdn", "attention", "lm_head"]
    assert [p["row"] for p in panels[2]] == ["build (reference)", "gdn", "attention"]
    for k, drawn in panels.items():  # the summary's own acceptance, in %
        for p in drawn:
            assert p["x"] == pytest.approx(100 * summary[p["row"].split(" (")[0]][str(k)]["acceptance"]["value"])
            assert p["xerr"] is not None  # its 95 % interval
    assert ("lm_head", "left out: drafter flagged") in seen["texts"][2] and not seen["texts"][1]
    assert "lm_head at k = 2 (acceptance 0.0 % over 400 draft tokens)" in seen["title"].replace("\n", " ")
    # the build marked as the reference; a significant difference from it filled, none hollow
    assert summary["gdn"]["2"]["vs_build"]["significant"] and summary["attention"]["2"]["vs_build"]["significant"] is False
    style = {p["row"]: (p["fmt"], p["mfc"]) for p in panels[2]}
    assert style["build (reference)"][0] == "D" and style["gdn"] == ("o", "C3") and style["attention"] == ("o", "none")
    assert any(text.startswith("build, the reference") for text in seen["legend"])
    table = (folder / "table.md").read_text()
    assert table.count(LINK_LINE) == 1 and table.count(MTP_LINK_LINE) == 1 and "drawn before" not in table


def test_more_panels_than_three_wrap_and_rows_without_intervals_say_why(tmp_path, monkeypatch):
    long = "gdn.0-2_4-6+attention+shared_expert"  # as budget --verify names a row: drawn as P1, spelled out in the key
    spec = _spec({"build": {k: [10, 12, 11] for k in (1, 2, 3, 4)}, long: {k: [9, 9, 10] for k in (1, 2, 3, 4)}}, n=3)
    folder = _folder(tmp_path, spec, names=("build", long))
    results = json.loads((folder / "results.json").read_text())
    results["variants"][1]["restored"] = ["gdn@0-2,4-6", "attention", "shared_expert"]
    (folder / "results.json").write_text(json.dumps(results))
    seen = _record_mtp_figure(monkeypatch)
    write_plot(folder)
    assert sorted(seen["panels"]) == [1, 2, 3, 4] and seen["grid"] == (2, 3) and seen["visible"] == 4
    assert [p["row"] for p in seen["panels"][4]] == ["build (reference)", "P1"]
    assert all(p["xerr"] is None for ps in seen["panels"].values() for p in ps)  # three prompts: no interval
    assert "no bar: fewer than 5 prompts" in seen["title"] and "see the key below" in seen["title"]
    assert {p["mfc"] for ps in seen["panels"].values() for p in ps if p["row"] == "P1"} == {"none"}  # no paired interval
    assert any(text.startswith("no interval for its paired difference") for text in seen["legend"])


@pytest.mark.parametrize(
    "spec",
    [
        _spec({"build": {2: [0] * N}, "gdn": {2: [0] * N}}),  # every drafter flagged
        dict(_spec({}), engines=[{"row": "build", "k": 2, "status": "failed", "error": "engine died"}]),
        {"build_row": "build", "prompts": [], "engines": []},
        [],  # not a speculative record
    ],
    ids=["all-flagged", "all-failed", "empty", "not-a-record"],
)
def test_without_measured_mtp_acceptance_the_plot_is_as_before(tmp_path, spec):
    plain = _folder(tmp_path / "plain", None)
    written, _ = write_plot(plain)
    assert [p.name for p in written] == [f"{PLOT_STEM}.png", f"{PLOT_STEM}.svg", "table.md"]
    folder = _folder(tmp_path / "mtp", spec)
    (folder / f"{MTP_STEM}.png").write_bytes(b"an earlier plot's figure")  # of acceptance the folder no longer holds
    written, _ = write_plot(folder)
    assert [p.name for p in written] == [f"{PLOT_STEM}.png", f"{PLOT_STEM}.svg", "table.md"]
    assert not list(folder.glob(f"{MTP_STEM}.*"))
    assert (folder / "table.md").read_text() == (plain / "table.md").read_text()
    assert (folder / f"{PLOT_STEM}.png").read_bytes() == (plain / f"{PLOT_STEM}.png").read_bytes()


def test_an_mtp_plot_older_than_speculative_json_is_linked_as_stale(tmp_path):
    import os

    from splicer.analysis.plot import link

    folder = _folder(tmp_path, _spec({"build": {1: BUILD_K1}, "gdn": {1: BUILD_K1}}))
    write_plot(folder)
    later = (folder / f"{MTP_STEM}.png").stat().st_mtime_ns + 10**9
    os.utime(folder / speculative.FILE, ns=(later, later))  # splicer mtp measured again after the plot
    link(folder)
    text = (folder / "table.md").read_text()
    assert text.count(MTP_LINK_LINE) == 1 and "drawn before the last MTP engines finished" in text
    assert "drawn before the last rows finished" not in text


@pytest.mark.parametrize(
    "ks",
    [(1,), (1, 2)],
    ids=["one-panel", "two-panels"],
)
def test_the_legend_fits_the_figure(tmp_path, monkeypatch, ks):
    """Every marking the panels use in the legend (the reference, significant, not significant, no interval), one
    panel wide (5.2 in) or two: the legend wraps into rows rather than run past the figure's edges, where the PNG
    cut it off ("◆ build" ... "no significant difference from the bu")."""
    from matplotlib.figure import Figure

    spec = _spec(
        {
            "build": {k: BUILD_K1 for k in ks},
            "gdn": {k: [10, 11, 9, 10, 10, 11, 9, 10, 10, 10] for k in ks},  # lower: significant
            "attention": {k: [14, 14, 14, 14, 15, 14, 13, 14, 14, 14] for k in ks},  # n.s.
        }
    )
    folder = _folder(tmp_path, spec, names=("build", "gdn", "attention"))
    boxes = []
    real_savefig = Figure.savefig

    def recording_savefig(self, *args, **kwargs):
        if self.legends:
            self.canvas.draw()
            renderer = self.canvas.get_renderer()
            lowest = min(ax.get_tightbbox(renderer).y0 for ax in self.axes if ax.get_visible())  # the x labels' bottom
            boxes.append((self.legends[0].get_window_extent(renderer), self.bbox, self.legends[0], lowest))
        return real_savefig(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", recording_savefig)
    write_plot(folder)
    (legend_box, figure_box, legend, lowest), *_ = boxes
    assert len(legend.get_texts()) == 3
    assert figure_box.x0 <= legend_box.x0 and legend_box.x1 <= figure_box.x1  # nothing cut at either side
    assert figure_box.y0 <= legend_box.y0 and legend_box.y1 <= lowest  # inside the figure, under the panels
