"""Splice against re-quantize: a build re-made by its quantizer with some classes left in BF16 (`--add-requantized
CLASSES=DIR`, or a plan's checkpoint row with requantized_without) is scored beside the splice of the same classes,
and the table, the report, CSV/JSON and results.json carry their paired difference, equal to `splicer compare`'s.

The tiny fixture's experts-g32 build (only the routed experts quantized) stands in for the build re-made without
everything but the experts; the demo plan's experts-only row is its splice. CPU, torch backend, no timing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splicer.cli import main

WITHOUT = "attention,gdn,lm_head,shared_expert"
PLAN = """name = "requant"
description = "the experts-only and gdn rows on small corpora"
top_k = 20
[[corpus]]
name = "wiki-en"
kind = "builtin"
text = "wiki-en"
chunk_tokens = 16
max_chunks = 6
[[corpus]]
name = "chat"
kind = "chat"
conversations = 6
history_turns = 2
answer_tokens = 6
[[row]]
name = "build"
restore = []
[[row]]
name = "experts-only"
restore = ["gdn", "attention", "shared_expert", "lm_head"]
[[row]]
name = "gdn"
restore = ["gdn"]
"""
ROW = "requantized-attention+gdn+lm_head+shared_expert"


@pytest.fixture(scope="module")
def run(pairs, tmp_path_factory):
    build, base = (Path(pairs["fused"][k]).resolve() for k in ("lowlatency", "base"))
    other = Path(pairs["fused"]["experts-g32"]).resolve()
    root = tmp_path_factory.mktemp("requant")
    (root / "plan.toml").write_text(PLAN)
    out = root / "run"
    args = ["ablate", "all", str(build), str(base), "-o", str(out), "--plan", str(root / "plan.toml"), "--device", "cpu"]
    assert main([*args, "--no-time", "-q", "--add-requantized", f"{WITHOUT}={other}"]) == 0
    return {"dir": out, "build": build, "base": base, "other": other, "plan": str(root / "plan.toml")}


def _results(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


def test_the_re_made_build_is_paired_with_the_splice_of_the_same_classes(run, capsys):
    rows = {v["name"]: v for v in _results(run["dir"])["variants"]}
    assert rows[ROW]["checkpoint"]["requantized_without"] == sorted(WITHOUT.split(","))
    vs = rows[ROW]["vs_splice"]
    assert vs["splice"] == "experts-only" and vs["classes"] == sorted(WITHOUT.split(","))
    assert "vs_splice" not in rows["gdn"]  # only re-made builds carry one
    capsys.readouterr()
    assert main(["compare", str(run["dir"]), "experts-only", ROW]) == 0
    pooled = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| pooled"))
    diff = vs["kl"]["pooled"]["diff"]
    lo, hi = vs["kl"]["pooled"]["diff_ci"]
    assert f"{diff:+.5f} [{lo:+.5f}, {hi:+.5f}]" in pooled  # the same paired difference, engine noise folded alike


def test_table_report_and_csv_carry_the_pair(run, capsys):
    table = (run["dir"] / "table.md").read_text()
    assert "Splice against re-quantize:" in table and "| experts-only " in table and ROW in table
    report = (run["dir"] / "report.md").read_text()
    line = next(x for x in report.splitlines() if x.startswith("- Splice against re-quantize"))
    assert f"row experts-only (the splice) minus row {ROW}" in line and "% of the re-made build's KL" in line
    # experts-g32 also quantizes the MTP head, which the build keeps in BF16: said, not hidden
    assert "note: it quantizes experts, mtp, where the build without" in line
    assert main(["table", str(run["dir"]), "--format", "json"]) == 0
    recs = {r["variant"]: r for r in json.loads(capsys.readouterr().out)}
    assert recs[ROW]["splice_row"] == "experts-only" and recs[ROW]["requantized_without"] == ",".join(sorted(WITHOUT.split(",")))
    assert recs["gdn"]["splice_minus_requantized_kl"] is None
    rows = {v["name"]: v for v in _results(run["dir"])["variants"]}
    assert recs[ROW]["splice_minus_requantized_kl"] == rows[ROW]["vs_splice"]["kl"]["pooled"]["diff"]


def test_without_the_splice_row_the_report_says_which_row_is_missing(run, tmp_path):
    args = ["ablate", "gdn", str(run["build"]), str(run["base"]), "-o", str(tmp_path / "alone"), "--plan", run["plan"]]
    assert main([*args, "--device", "cpu", "--no-time", "-q", "--add-requantized", f"shared_expert={run['other']}"]) == 0
    rows = {v["name"]: v for v in _results(tmp_path / "alone")["variants"]}
    vs = rows["requantized-shared_expert"]["vs_splice"]
    assert vs["splice"] is None and "no finished row restores exactly shared_expert" in vs["why"]
    assert (
        "not compared with a splice (no finished row restores exactly shared_expert: run one"
        in (tmp_path / "alone" / "report.md").read_text()
    )


@pytest.fixture(scope="module")
def spliced(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("spliced") / "splice-gdn"
    assert main(["splice", "--restore", "gdn", str(run["build"]), str(run["base"]), "-o", str(out), "-q"]) == 0
    return out


def test_a_splice_folder_of_this_build_pairs_as_the_splice(run, spliced, tmp_path, capsys):
    out = tmp_path / "score"
    args = ["score", str(run["base"]), str(run["build"]), str(spliced), "-o", str(out), "--device", "cpu", "--plan", run["plan"]]
    assert main([*args, "--no-time", "-q", "--add-requantized", f"gdn={run['other']}"]) == 0
    rows = {v["name"]: v for v in _results(out)["variants"]}
    assert rows["splice-gdn"]["checkpoint"]["splice_of_build"] == ["gdn"]
    assert rows["requantized-gdn"]["vs_splice"]["splice"] == "splice-gdn"


@pytest.mark.parametrize(
    "which, says",
    [
        ("build", "is the build itself"),
        ("base", "has no quantization_config"),
        ("spliced", "is splicer's own splice of this build"),
    ],
)
def test_what_cannot_be_a_re_made_build_is_refused_before_anything_is_written(run, spliced, tmp_path, capsys, which, says):
    folder = spliced if which == "spliced" else run[which]
    args = [
        "ablate",
        "gdn",
        str(run["build"]),
        str(run["base"]),
        "-o",
        str(tmp_path / "o"),
        "--plan",
        run["plan"],
        "--device",
        "cpu",
    ]
    assert main([*args, "--no-time", "--add-requantized", f"gdn={folder}"]) != 0
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "row, says",
    [
        ('requantized_without = ["gdn"]\nrestore = ["gdn"]', "requantized_without describes a checkpoint"),
        ('checkpoint = "x"\nrequantized_without = []', "names no class"),
        ('checkpoint = "x"\nrequantized_without = ["gdn@0-2"]', "takes whole classes"),
        ('checkpoint = "x"\nrequantized_without = ["nope"]', "unknown class 'nope'"),
        ('checkpoint = "x"\nrequantized_without = "gdn"', "requantized_without"),
    ],
)
def test_a_bad_requantized_row_is_one_line(tmp_path, capsys, row, says):
    from splicer.arch import all_classes
    from splicer.errors import SplicerError
    from splicer.plans.plan import load_plan

    plan = tmp_path / "p.toml"
    plan.write_text(
        'name = "p"\ndescription = "d"\n[[corpus]]\nname = "wiki-en"\nkind = "builtin"\ntext = "wiki-en"\n'
        f'[[row]]\nname = "build"\nrestore = []\n[[row]]\nname = "r"\n{row}\n'
    )
    with pytest.raises(SplicerError, match=says):
        load_plan(str(plan), all_classes())


@pytest.mark.parametrize(
    "specs, says",
    [
        (["gdn"], "should be CLASSES=DIR"),
        (["nope=x"], "CLASSES names unknown class 'nope'"),
        (["gdn@1=x"], "whole classes"),
        (["gdn,=x"], "names no class, or an empty one"),
        (["gdn=OTHER", "gdn=OTHER"], "classes gdn given twice"),
        (["shared_expert, gdn=OTHER", "gdn,shared_expert=OTHER"], "classes gdn, shared_expert given twice"),
        (["mtp=OTHER"], "the build does not quantize mtp"),
    ],
)
def test_a_bad_add_requantized_is_one_line(run, tmp_path, capsys, specs, says):
    args = [
        "ablate",
        "gdn",
        str(run["build"]),
        str(run["base"]),
        "-o",
        str(tmp_path / "o"),
        "--plan",
        run["plan"],
        "--device",
        "cpu",
    ]
    for spec in specs:
        args += ["--add-requantized", spec.replace("OTHER", str(run["other"]))]
    assert main(args) != 0
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
