"""`splicer plot DIR`: the figure's files, its link from table.md, and the Pareto front it draws."""

from __future__ import annotations

import json

from splicer.cli import main
from splicer.plot import LINK_LINE, pareto


def test_pareto_keeps_the_points_nothing_beats_on_both_axes():
    pts = [(1.0, 0.9, "a"), (2.0, 0.5, "b"), (2.5, 0.6, "c"), (3.0, 0.1, "d"), (3.0, 0.05, "e"), (4.0, 0.05, "f")]
    assert [p[2] for p in pareto(pts)] == ["a", "b", "e"]


def _variant(name, kl, size, decode=None, repeat_of=None):
    metrics = {c: {"kl": kl, "kl_ci": [kl * 0.9, kl * 1.1], "top1": 0.5} for c in ("wiki-en", "chat")}
    return {"name": name, "status": "ok", "restored": [], "size_bytes": size, "decode_ms_per_token": decode,
            "timing": {"decode_iqr": [decode * 0.95, decode * 1.05]} if decode else None, "metrics": metrics,
            "repeat_of": repeat_of}


def test_plot_writes_png_and_svg_and_links_them_once(tmp_path, capsys):
    results = {"corpora": {"wiki-en": {}, "chat": {}}, "inputs": {"build": {"source": "/x/build"}},
               "variants": [_variant("build", 0.8, 9e9, 10.0), _variant("gdn", 0.5, 9.5e9, 10.5),
                            _variant("all", 0.0, 16e9, 14.0), _variant("build-again", 0.8, 9e9, 10.1, repeat_of="build")]}
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

    from splicer.plot import link, write_plot

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
