"""`splicer budget DIR` (issue 17, first part): the additive model fitted from measured rows, its stated error, and
the Pareto front under a limit. Synthetic results.json files, so that every number is known."""

from __future__ import annotations

import json

import pytest

from splicer.analysis.budget import fit, front, predictions
from splicer.cli import main
from splicer.errors import SplicerError


def _v(name, restored, kl, size, decode=None):
    return {
        "name": name,
        "status": "ok",
        "restored": restored,
        "size_bytes": size,
        "decode_ms_per_token": decode,
        "metrics": {"wiki-en": {"kl": kl, "positions": 100}},
    }


def _results(*variants, class_layers=None):
    return {"variants": list(variants), "class_layers": class_layers or {"gdn": [0, 1, 2], "attention": [3]}}


def test_atoms_ratio_and_leave_one_out_error():
    """Reductions 0.2 (gdn@0), 0.1 (gdn@1), 0.3 (attention); rows restoring several reduce 0.9x their atoms' sum: the
    additivity is 0.9 within gdn (gdn@0-1) and 0.9 across classes (gdn@0 with attention). Each row is the only one of
    its kind, so predicted from the others it falls back to additive (1.00)."""
    r = _results(
        _v("build", [], 1.0, 10e9, 10.0),
        _v("g0", ["gdn@0"], 0.8, 11e9, 11.0),
        _v("g1", ["gdn@1"], 0.9, 11e9, 11.0),
        _v("a", ["attention"], 0.7, 12e9, 12.0),
        _v("g01", ["gdn@0-1"], 1.0 - 0.9 * 0.3, 12e9, 12.0),
        _v("g0a", ["gdn@0", "attention"], 1.0 - 0.9 * 0.5, 13e9, 13.0),
    )
    m = fit(r)
    assert sorted(a.entry for a in m.atoms) == ["attention", "gdn@0", "gdn@1"]
    assert m.additivity.within == {"gdn": pytest.approx(0.9)} and m.additivity.across == pytest.approx(0.9)
    assert [(c["row"], round(c["predicted_kl"], 6), round(c["measured_kl"], 6)) for c in m.checks] == [
        ("g01", 0.7, 0.73),
        ("g0a", 0.5, 0.55),
    ]
    preds = {p.label: p for p in predictions(m)}
    assert preds["gdn@0-1,attention"].kl == pytest.approx(1.0 - 0.9 * (0.9 * 0.3 + 0.3))
    assert preds["gdn@0-1,attention"].size_gb == pytest.approx(14.0)  # sizes add exactly
    assert preds["gdn@0-1"].measured["row"] == "g01"
    best = front([p for p in predictions(m) if p.size_gb <= 12.0], "size_gb")
    assert [p.label for p in best] == ["none (the build)", "gdn@0", "attention"]


def test_a_whole_class_row_is_a_union_of_its_layer_groups():
    """A sweep: gdn@0, gdn@1, gdn@2 are atoms; gdn@1-2 (leave one out) and gdn (whole, from class_layers) measure
    additivity instead of being atoms."""
    r = _results(
        _v("build", [], 1.0, 10e9),
        _v("g0", ["gdn@0"], 0.9, 11e9),
        _v("g1", ["gdn@1"], 0.9, 11e9),
        _v("g2", ["gdn@2"], 0.9, 11e9),
        _v("no0", ["gdn@1-2"], 0.8, 12e9),
        _v("gdn", ["gdn"], 0.7, 13e9),
    )
    m = fit(r)
    assert sorted(a.entry for a in m.atoms) == ["gdn@0", "gdn@1", "gdn@2"]
    assert [c["row"] for c in m.checks] == ["no0", "gdn"] and m.additivity.within == {"gdn": pytest.approx(1.0)}


def test_no_multi_row_means_additivity_is_assumed_and_said(tmp_path, capsys):
    r = _results(_v("build", [], 1.0, 10e9), _v("g0", ["gdn@0"], 0.8, 11e9), _v("a", ["attention"], 0.7, 12e9))
    (tmp_path / "results.json").write_text(json.dumps(r))
    assert main(["budget", str(tmp_path), "--max-gb", "11.5"]) == 0
    out = capsys.readouterr().out
    assert "additivity is assumed (1.00), not measured" in out and "gdn@0" in out and "| attention" not in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-decode-ms", "5"], "--max-decode-ms needs timed rows"),
        (["--corpus", "chat"], "no scored build row on corpus 'chat'"),
    ],
)
def test_budget_refuses_what_the_results_cannot_answer(tmp_path, capsys, args, message):
    r = _results(_v("build", [], 1.0, 10e9), _v("g0", ["gdn@0"], 0.8, 11e9))
    (tmp_path / "results.json").write_text(json.dumps(r))
    assert main(["budget", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_no_single_rows_is_refused():
    with pytest.raises(SplicerError, match="no row that restores one class"):
        fit(_results(_v("build", [], 1.0, 10e9), _v("all", ["gdn", "attention"], 0.5, 12e9)))


def test_a_slope_is_not_fitted_from_atoms_whose_kl_changes_are_noise():
    """The whole-gdn row measures within-gdn additivity only when one of its groups changed KL significantly: from
    noise the slope would be a ratio of two noises (the decode slope of results/budget-h200 was -1.34 so)."""

    def noisy(v, significant):
        return dict(v, vs_build={"kl": {"pooled": {"significant": significant}}})

    rows = [
        _v("build", [], 1.0, 10e9),
        _v("g0", ["gdn@0"], 0.999, 11e9),
        _v("g1", ["gdn@1"], 1.001, 11e9),
        _v("g2", ["gdn@2"], 0.9995, 11e9),
        _v("gdn", ["gdn"], 1.002, 13e9),
    ]
    m = fit(_results(*(noisy(v, False) if v["name"].startswith("g") else v for v in rows)))
    assert m.additivity.within == {} and m.additivity.unmeasurable == ("gdn",)
    assert fit(_results(*rows)).additivity.within["gdn"] == pytest.approx((1.0 - 1.002) / (0.001 - 0.001 + 0.0005))


def test_an_unreadable_budget_json_is_refused_not_overwritten(tmp_path, capsys):
    r = _results(_v("build", [], 1.0, 10e9), _v("g0", ["gdn@0"], 0.8, 11e9))
    (tmp_path / "results.json").write_text(json.dumps(r))
    (tmp_path / "budget.json").write_text("{not json")
    assert main(["budget", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "budget.json cannot be read" in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "budget.json").read_text() == "{not json"
    for args, message in (
        (["--max-gb", "nan"], "--max-gb nan: give a finite number"),
        (["--corpus", "nope"], "--corpus 'nope': this folder scored wiki-en"),
    ):
        (tmp_path / "budget.json").unlink(missing_ok=True)
        r["corpora"] = {"wiki-en": {}}
        (tmp_path / "results.json").write_text(json.dumps(r))
        assert main(["budget", str(tmp_path), *args]) == 2
        assert message in capsys.readouterr().err


def test_small_kls_and_sizes_print_so_that_their_differences_show(tmp_path, capsys):
    """KLs near 0.002 at four decimals print neighbouring points alike (0.0021 and 0.0021), and tabulate reprinted a
    size of 0.010 GB as 0.01 beside 0.009 and 0.011. Every KL of the answer is printed at one scale with three
    significant digits of the smallest, and sizes keep their three decimals."""
    r = _results(
        _v("build", [], 0.00622, 9e6),
        _v("g0", ["gdn@0"], 0.00361, 10e6),
        _v("a", ["attention"], 0.00595, 10e6),
        _v("g0a", ["gdn@0", "attention"], 0.00334, 11e6),
    )
    (tmp_path / "results.json").write_text(json.dumps(r))
    assert main(["budget", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "build 0.00622, 0.009 GB" in out
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in out.splitlines()
        if line.startswith("| ")
    }
    assert rows["none (the build)"][:2] == ["0.00622", "0.009"] and rows["none (the build)"][3] == "build: KL 0.00622"
    assert rows["gdn@0"][:2] == ["0.00361", "0.010"] and rows["gdn@0,attention"][:2] == ["0.00334", "0.011"]
    assert "g0a 0.00334 predicted, 0.00334 measured" in out  # the model's own error, on the same scale


def test_a_row_restoring_a_class_no_single_row_measures_is_named_with_the_row_to_add(tmp_path, capsys):
    """Rows build, gdn, attention, shared_expert and all, which restores experts too: no row restores several atoms and
    nothing else, but an all row exists, so "add an all row" would be wrong advice. The output says why all does not
    count and names the row that would: every class but experts (an experts-only row)."""
    r = _results(
        _v("build", [], 1.0, 10e9),
        _v("gdn", ["gdn"], 0.7, 11e9),
        _v("attention", ["attention"], 0.9, 11e9),
        _v("shared_expert", ["shared_expert"], 0.8, 11e9),
        _v("all", ["gdn", "attention", "shared_expert", "experts"], 0.0, 20e9),
        class_layers={"gdn": [0, 1, 2], "attention": [3], "shared_expert": [0, 1, 2, 3], "experts": [0, 1, 2, 3]},
    )
    (tmp_path / "results.json").write_text(json.dumps(r))
    assert main(["budget", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "add an all row" not in out
    assert (
        "No row restores several of these and nothing else: additivity is assumed (1.00), not measured, and the "
        "prediction error cannot be stated: row all also restores experts, which no single-entry row measures, so it "
        "is not predicted from them; add a row restoring the rest of row all's classes, restore = ['gdn', 'attention', "
        "'shared_expert'] (an experts-only row: every class but experts), or leave-one-out rows."
    ) in out.splitlines()
    # with a row that does measure the additivity, the all row is still named as outside the fit
    r["variants"].append(_v("experts-only", ["gdn", "attention", "shared_expert"], 0.45, 13e9))
    (tmp_path / "results.json").write_text(json.dumps(r))
    assert main(["budget", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Not in the fit: row all also restores experts, which no single-entry row measures." in out.splitlines()
    assert "No row restores" not in out
