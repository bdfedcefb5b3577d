"""Issue 30: `budget`, `budget --verify`, `plot` and `plan sweep` on results folders a user did not make or cannot
write: results.json checked once (a bad value is one line naming the row and field, a NaN row is left out and said),
budget.json always strict JSON, predictions that are not physical (a negative KL, a negative decode time) refused or
floored and said, the decode interval of a combination counting the build's mean k-1 times, writes that fail (a
read-only folder, a full disk) one line naming the file with nothing left behind, and --verify on the demo's folder.
Every case runs the command line; inputs are hashed before and after."""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path

import pytest

from splicer.cli import main

from .conftest import tree_digest


def _v(name, restored, kl, size, decode=None, **extra):
    return {
        "name": name,
        "status": "ok",
        "restored": restored,
        "size_bytes": size,
        "decode_ms_per_token": decode,
        "metrics": {"wiki-en": {"kl": kl, "positions": 100}},
        **extra,
    }


def _folder(tmp_path: Path, *variants, **top) -> Path:
    folder = tmp_path / "run"
    folder.mkdir(exist_ok=True)
    (folder / "results.json").write_text(
        json.dumps(
            {"variants": list(variants), "corpora": {"wiki-en": {}}, "class_layers": {"gdn": [0, 1, 2], "attention": [3]}, **top}
        )
    )
    return folder


def _strict(path: Path):
    """JSON as any other reader takes it: NaN and infinities are not JSON."""

    def refuse(token):
        raise ValueError(f"{path} holds {token}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("splicer: error: ") and len(err.strip().splitlines()) == 1, err
    return err


ROWS = [_v("build", [], 1.0, 10e9), _v("g0", ["gdn@0"], 0.8, 11e9), _v("a", ["attention"], 0.7, 12e9)]


def test_a_nan_kl_row_is_left_out_said_by_budget_and_plot_and_budget_json_stays_json(tmp_path, capsys):
    folder = _folder(tmp_path, *ROWS, _v("g1", ["gdn@1"], float("nan"), 11e9))
    digest = tree_digest(folder)
    assert main(["budget", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "Left out (a measurement is not a number): row g1 (KL on wiki-en is nan)" in out
    record = _strict(folder / "budget.json")
    assert [a["entry"] for a in record["model"]["atoms"]] == ["gdn@0", "attention"]
    assert main(["plot", str(folder)]) == 0
    assert "left out, a measurement not a number: g1 (KL on wiki-en is nan)" in capsys.readouterr().out
    assert tree_digest(folder)["results.json"] == digest["results.json"]


def _results_dir_is_a_folder(tmp_path):
    folder = tmp_path / "run"
    (folder / "results.json").mkdir(parents=True)
    return folder


@pytest.mark.parametrize("command", ["budget", "plot"])
@pytest.mark.parametrize(
    "make, message",
    [
        (lambda t: _folder(t, *ROWS, _v("g1", ["gdn@1"], "0.5", 11e9)), "row 'g1': KL on wiki-en is '0.5', not a number"),
        (
            lambda t: _folder(t, *ROWS, _v("g1", ["gdn@1"], -0.2, 11e9)),
            "row 'g1': KL on wiki-en is -0.2, below 0 (KL is never negative)",
        ),
        (lambda t: _folder(t, *ROWS, ["g1", 0.5]), "variants[3] is list, not a row (an object)"),
        (
            lambda t: _folder(t, *ROWS, _v("g1", ["gdn@1"], 0.5, 11e9, decode=-3.0)),
            "row 'g1': decode_ms_per_token is -3, at or below 0",
        ),
        (_results_dir_is_a_folder, "results.json is a folder, not the results file"),
        (lambda t: _folder(t, *ROWS, _v("g1", ["gdn@1"], None, 11e9)), "row 'g1': KL on wiki-en is missing"),
        (lambda t: _folder(t, *ROWS, {**_v("g1", ["gdn@1"], 0.5, 11e9), "metrics": None}), "row 'g1': metrics is missing"),
        (lambda t: _folder(t, *ROWS, _v("g0", ["gdn@1"], 0.5, 11e9)), "variants[3] is a second row named 'g0'"),
    ],
)
def test_a_bad_results_json_is_one_line_naming_row_and_field(tmp_path, capsys, command, make, message):
    folder = make(tmp_path)
    digest = tree_digest(folder)
    assert main([command, str(folder)]) == 2
    assert message in _one_line(capsys)
    assert tree_digest(folder) == digest and not (folder / "budget.json").exists()


def test_decode_predicted_at_or_below_zero_is_refused_and_said(tmp_path, capsys):
    """A loaded machine: each single-entry row timed 6 ms/token faster than a 10 ms build, so restoring both is
    'predicted' at -2 ms/token. No engine decodes in negative time: budget predicts no decode, says why, and refuses
    --max-decode-ms; budget.json holds no decode prediction."""
    folder = _folder(
        tmp_path, _v("build", [], 1.0, 10e9, 10.0), _v("g0", ["gdn@0"], 0.8, 11e9, 4.0), _v("a", ["attention"], 0.7, 12e9, 4.0)
    )
    assert main(["budget", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "Decode not predicted" in out and "gdn@0,attention is predicted at -2.0 ms/token from a build at 10.0" in out
    assert "against size on disk" in out and "-2.000" not in out
    record = _strict(folder / "budget.json")
    assert record["cost"] == "size_gb" and all(e["decode"] is None for e in record["front"])
    (folder / "budget.json").unlink()
    assert main(["budget", str(folder), "--max-decode-ms", "5"]) == 2
    assert "--max-decode-ms: decode is not predicted" in _one_line(capsys)
    assert not (folder / "budget.json").exists()


def test_a_predicted_kl_below_zero_is_shown_as_zero_and_said(tmp_path, capsys):
    folder = _folder(tmp_path, _v("build", [], 1.0, 10e9), _v("g0", ["gdn@0"], 0.4, 11e9), _v("a", ["attention"], 0.4, 12e9))
    assert main(["budget", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "Predicted KL below 0, shown as 0" in out and "gdn@0,attention" in out
    [both] = [e for e in _strict(folder / "budget.json")["front"] if len(e["atoms"]) == 2]
    assert both["kl"] == 0.0 and both["kl_by_corpus"]["wiki-en"] == 0.0


def _timed(name, restored, kl, size, blocks, **extra):
    v = _v(name, restored, kl, size, sum(blocks) / len(blocks), **extra)
    v["timing"] = {"decode_ms_per_token": v["decode_ms_per_token"], "per_run_ms": blocks}
    return v


def test_a_combinations_decode_interval_counts_the_builds_mean_k_minus_1_times(tmp_path, capsys):
    """S7: restoring k atoms predicts build + sum(atom - build) = sum(atom) - (k-1) build, so with engine means of spread
    sd, 1 engine per atom and 2 of the build, its standard deviation is sd * sqrt(k + (k-1)^2 / 2). Checked against a
    direct simulation of the engine means, not the formula the code uses."""
    import torch

    sd, df = 0.5, 3
    spread = {"engine_sd_ms": sd, "df": df}
    folder = _folder(
        tmp_path,
        _timed("build", [], 1.0, 10e9, [10.0, 10.2], decode_vs_build=spread),
        _timed("build-again", [], 1.0, 10e9, [10.1, 10.3], repeat_of="build"),
        _timed("g0", ["gdn@0"], 0.8, 11e9, [11.0, 11.2]),
        _timed("a", ["attention"], 0.7, 12e9, [12.0, 12.4]),
        _timed("s", ["shared_expert"], 0.6, 13e9, [13.0, 13.2]),
    )
    assert main(["budget", str(folder)]) == 0
    capsys.readouterr()
    [three] = [e for e in _strict(folder / "budget.json")["front"] if len(e["atoms"]) == 3]
    half = (three["decode_ci"][1] - three["decode_ci"][0]) / 2
    g = torch.Generator().manual_seed(0)
    n = 400_000
    atoms = sd * torch.randn(3, n, generator=g, dtype=torch.float64)
    build = sd * torch.randn(2, n, generator=g, dtype=torch.float64).mean(0)
    prediction = atoms.sum(0) - 2 * build  # the build's mean enters k - 1 = 2 times
    t975_df3 = 3.182446305284263
    assert half == pytest.approx(t975_df3 * float(prediction.std()), rel=0.01)


def test_kl_intervals_of_predictions_stop_at_zero(tmp_path, capsys):
    """Item 11: a prediction near 0 whose per-position values straddle 0 (two atoms' reductions add to about the
    build's KL) gets a bootstrap interval reaching below 0; KL is never negative, so the interval stops at 0, said."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    seq = torch.arange(20).repeat_interleave(4)
    build = torch.ones(80, dtype=torch.float64)
    e1 = 0.4 * (2 * torch.rand(80, generator=g, dtype=torch.float64) - 1)
    e2 = 0.4 * (2 * torch.rand(80, generator=g, dtype=torch.float64) - 1)
    e2 += 0.01 - (e1 + e2).mean()  # the prediction g0 + a - build averages 0.01
    rows = {"build": build, "g0": 0.5 + e1, "a": 0.5 + e2}
    folder = _folder(
        tmp_path,
        _v("build", [], float(build.mean()), 10e9),
        _v("g0", ["gdn@0"], float(rows["g0"].mean()), 11e9),
        _v("a", ["attention"], float(rows["a"].mean()), 12e9),
    )
    for name, kl in rows.items():
        (folder / "scores" / name).mkdir(parents=True)
        save_file({"kl_top": kl.float(), "seq_index": seq}, str(folder / "scores" / name / "wiki-en.safetensors"))
    assert main(["budget", str(folder)]) == 0
    out = capsys.readouterr().out
    [both] = [e for e in _strict(folder / "budget.json")["front"] if len(e["atoms"]) == 2]
    assert both["kl"] == pytest.approx(0.01, abs=1e-6)
    assert both["kl_ci"][0] == 0.0 < both["kl"] < both["kl_ci"][1]
    assert both["kl_ci_by_corpus"]["wiki-en"][0] == 0.0
    assert "raised to 0: KL and decode time are never negative" in out


def _failing_writes(monkeypatch, folder: Path, code: int):
    """Writes into `folder` fail as on a read-only file system or a full disk. Simulated: the tests may run as root,
    which ignores permission bits; every writer renames its file into place, so failing the rename fails the write
    after its temporary file was made, the harder case (the temporary must be removed)."""
    real_replace = os.replace

    def failing_replace(src, dst):
        if Path(dst).parent == folder:
            raise OSError(code, os.strerror(code))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)


def test_plain_budget_answers_on_a_folder_it_cannot_write(tmp_path, capsys, monkeypatch):
    folder = _folder(tmp_path, *ROWS)
    digest = tree_digest(folder)
    _failing_writes(monkeypatch, folder, errno.EROFS)
    assert main(["budget", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "Pareto front of predicted KL" in out and "| gdn@0" in out
    assert f"Not written: cannot write {folder / 'budget.json'} (Read-only file system)" in out
    assert tree_digest(folder) == digest and sorted(p.name for p in folder.iterdir()) == ["results.json"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder regardless of its permission bits")
def test_plain_budget_answers_on_a_chmod_read_only_folder(tmp_path, capsys):
    folder = _folder(tmp_path, *ROWS)
    digest = tree_digest(folder)
    folder.chmod(0o555)
    try:
        assert main(["budget", str(folder)]) == 0
        assert f"Not written: cannot write {folder / 'budget.json'}" in capsys.readouterr().out
        assert tree_digest(folder) == digest
    finally:
        folder.chmod(0o755)


@pytest.mark.parametrize("code, fix", [(errno.ENOSPC, "no space left"), (errno.EROFS, "copy the folder somewhere writable")])
def test_plot_on_a_full_disk_or_read_only_folder_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch, code, fix):
    folder = _folder(tmp_path, *ROWS)
    (folder / "table.md").write_text("| variant |\n")
    digest = tree_digest(folder)
    _failing_writes(monkeypatch, folder, code)
    assert main(["plot", str(folder)]) == 2
    err = _one_line(capsys)
    assert f"cannot write {folder / 'plot-kl.png'}" in err and fix in err
    assert tree_digest(folder) == digest and sorted(p.name for p in folder.iterdir()) == ["results.json", "table.md"]


def test_plan_sweep_into_a_full_disk_is_one_line_and_leaves_nothing(pairs, tmp_path, capsys, monkeypatch):
    build = pairs["fused"]["lowlatency"]
    before = tree_digest(build)
    out_dir = tmp_path / "plans"
    out_dir.mkdir()
    _failing_writes(monkeypatch, out_dir, errno.ENOSPC)
    assert (
        main(
            ["plan", "sweep", str(build), "--class", "gdn", "--groups", "2", "-o", str(out_dir / "sweep.toml"), "--from", "demo"]
        )
        == 2
    )
    assert f"cannot write {out_dir / 'sweep.toml'}: no space left" in _one_line(capsys)
    assert list(out_dir.iterdir()) == [] and tree_digest(build) == before


DEMO_PLAN = """name = "demo-small"
description = "the demo's layout with few rows, for budget --verify on the demo's own folder"
top_k = 20
[[corpus]]
name = "wiki-en"
kind = "builtin"
text = "wiki-en"
chunk_tokens = 32
max_chunks = 2
[timing]
prompt_tokens = 8
new_tokens = 3
warmup = 0
runs = 2
[[row]]
name = "build"
restore = []
[[row]]
name = "gdn-1"
restore = ["gdn@0"]
[[row]]
name = "attention"
restore = ["attention"]
[[row]]
name = "build-again"
restore = []
repeat = true
"""


def test_verify_runs_on_the_demo_folder_whose_inputs_live_inside_it(tmp_path, capsys):
    """Item 2: `ablate all --demo -o DIR` writes its pair into DIR/demo-pair; `budget DIR --verify 1` runs ablate into DIR
    with that pair again, as the demo did (here with a smaller plan than the demo's, for time). The folder is moved
    first: its job names the pair relative to itself, so a rerun keeps every row and --verify finds the pair."""
    plan = tmp_path / "demo-small.toml"
    plan.write_text(DEMO_PLAN)
    first = tmp_path / "demo-out"
    assert main(["ablate", "all", "--demo", "--plan", str(plan), "-o", str(first), "-q"]) == 0
    folder = tmp_path / "moved" / "demo-out"
    folder.parent.mkdir()
    first.rename(folder)
    assert main(["ablate", "all", "--demo", "--plan", str(plan), "-o", str(folder), "-q"]) == 0
    assert json.loads((folder / "results.json").read_text())["runs"][-1]["rows_run"] == []
    pair = tree_digest(folder / "demo-pair")
    capsys.readouterr()
    assert main(["budget", str(folder), "--verify", "1", "-q"]) == 0
    out = capsys.readouterr().out
    [entry] = json.loads((folder / "budget.json").read_text())["verified"]
    assert entry["atoms"] == ["gdn@0", "attention"] and entry["row"] == "gdn.0+attention"
    row = {v["name"]: v for v in json.loads((folder / "results.json").read_text())["variants"]}[entry["row"]]
    assert row["status"] == "ok" and math.isclose(entry["measured"]["kl"], row["metrics"]["wiki-en"]["kl"])
    assert "Verified" in out and tree_digest(folder / "demo-pair") == pair


def test_plot_cuts_bars_below_zero_ms_and_says_so(tmp_path, capsys, monkeypatch):
    """Item 6: on a loaded machine a row's timing runs (their IQR) reach -30,000 ms/token; the decode axis no longer
    runs there without a word: the bar stops at 0 and the title says why."""
    from matplotlib.figure import Figure

    timed = _v("g0", ["gdn@0"], 0.8, 11e9, 12.0)
    timed["timing"] = {"decode_ms_per_token": 12.0, "decode_iqr": [-30000.0, 20.0], "per_run_ms": [12.0, 12.0]}
    folder = _folder(tmp_path, _v("build", [], 1.0, 10e9, 10.0), timed)
    seen = []
    real_savefig = Figure.savefig

    def recording_savefig(self, *args, **kwargs):
        seen.append(([ax.get_xlim() for ax in self.axes], self._suptitle.get_text()))
        return real_savefig(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", recording_savefig)
    assert main(["plot", str(folder)]) == 0
    limits, title = seen[0]
    assert limits[0][0] > -5 and "bars cut at 0" in title  # the first panel is decode against KL


def test_verified_rows_are_matched_by_what_they_restore_not_by_spelling(tmp_path, capsys):
    """The definition check of item 1 on a real folder (results/budget-h200, written before budget.json stored each
    point's entries): a prediction's atoms (three GDN groups) and its row's restore (their union, one entry) are one
    restore, so the three verified rows still count as their measurements."""
    import shutil

    folder = tmp_path / "budget-h200"
    shutil.copytree(
        Path(__file__).parent.parent / "results" / "budget-h200",
        folder,
        ignore=shutil.ignore_patterns("logs.tgz", "*.png", "*.svg", "reanalysis", "before-verify"),
    )
    results = json.loads((folder / "results.json").read_text())
    assert not any("entries" in e for e in json.loads((folder / "budget.json").read_text())["verified"])
    assert main(["budget", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "restores something else" not in out and "Verified (spliced and measured" in out
    verified = json.loads((folder / "budget.json").read_text())["verified"]
    kl = {v["name"]: v["metrics"] for v in results["variants"]}
    assert len(verified) == 3 and all("measured" in e for e in verified)
    assert all(
        e["measured"]["kl"]
        == pytest.approx(
            sum(m["kl"] * m["positions"] for m in kl[e["row"]].values()) / sum(m["positions"] for m in kl[e["row"]].values()),
            rel=1e-9,
        )
        for e in verified
    )


def test_kl_intervals_missing_for_too_few_sequences_say_so_not_that_scores_are_missing(tmp_path, capsys):
    """Score files of 4 sequences are at hand: the budget gives no KL interval (metrics.MIN_SEQUENCES, as the verdicts)
    and says why, instead of claiming the per-position scores are missing."""
    import torch
    from safetensors.torch import save_file

    from splicer.analysis.metrics import TOO_FEW

    seq = torch.arange(4).repeat_interleave(5)
    g = torch.Generator().manual_seed(2)
    rows = {"build": torch.ones(20), "g0": 0.8 + 0.1 * torch.rand(20, generator=g), "a": 0.7 + 0.1 * torch.rand(20, generator=g)}
    folder = _folder(
        tmp_path,
        _v("build", [], 1.0, 10e9),
        _v("g0", ["gdn@0"], float(rows["g0"].mean()), 11e9),
        _v("a", ["attention"], float(rows["a"].mean()), 12e9),
    )
    for name, kl in rows.items():
        (folder / "scores" / name).mkdir(parents=True)
        save_file({"kl_top": kl, "seq_index": seq}, str(folder / "scores" / name / "wiki-en.safetensors"))
    assert main(["budget", str(folder)]) == 0
    out = capsys.readouterr().out
    assert f"KL intervals: none ({TOO_FEW})" in out and "lacks the rows' per-position scores" not in out
    assert all(e["kl_ci"] is None for e in _strict(folder / "budget.json")["front"] if e["atoms"])
