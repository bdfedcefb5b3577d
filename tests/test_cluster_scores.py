"""DIR/cluster-scores.safetensors: the per-position scores summed per sequence (or group) give every interval the
per-position files give (compare, the engine noise folded into the verdicts, budget's predictions), so a folder
shared without DIR/scores/ stays checkable; ablate writes it; rows scored on other positions are still refused.

A tiny plan with a text corpus and a chat corpus (groups of conversations, answer positions for dNLL) is ablated once
per module on the CPU; tests work on copies."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from splicer.analysis import cluster_scores, verdicts
from splicer.cli import main

PLAN = """name = "cluster-scores"
description = "two corpora, single-class rows and a build repeat"
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
conversations = 8
history_turns = 2
answer_tokens = 6
[[row]]
name = "build"
restore = []
[[row]]
name = "gdn-1"
restore = ["gdn@0"]
[[row]]
name = "gdn"
restore = ["gdn"]
[[row]]
name = "attention"
restore = ["attention"]
[[row]]
name = "build-again"
restore = []
repeat = true
"""


@pytest.fixture(scope="module")
def ablated(pairs, tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster-scores")
    (root / "plan.toml").write_text(PLAN)
    build, base = Path(pairs["fused"]["lowlatency"]).resolve(), Path(pairs["fused"]["base"]).resolve()
    out = root / "run"
    args = ["ablate", "all", str(build), str(base), "-o", str(out), "--plan", str(root / "plan.toml")]
    assert main([*args, "--device", "cpu", "--no-time", "-q"]) == 0
    return out


def _without_scores(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("scores", "cache"))
    assert not (dst / "scores").exists() and (dst / cluster_scores.FILE_NAME).exists()
    return dst


def _recomputed(results: dict, folder: Path) -> dict:
    """results.json's verdicts and every row's paired comparison with the build, computed again from folder's scores
    (attach keeps a row's comparison once made, so it is dropped first)."""
    again = copy.deepcopy(results)
    for v in again["variants"]:
        v.pop("vs_build", None)
    verdicts.attach(again, folder, results["verdicts"]["bootstrap"])
    return again


def _close(x, y, path=""):
    """Every number of two nested results equal to float rounding; everything else equal."""
    if isinstance(x, dict):
        assert set(x) == set(y), path
        for k in x:
            _close(x[k], y[k], f"{path}/{k}")
    elif isinstance(x, list):
        assert len(x) == len(y), path
        for i, (a, b) in enumerate(zip(x, y)):
            _close(a, b, f"{path}[{i}]")
    elif isinstance(x, float):
        assert y == pytest.approx(x, rel=1e-9, abs=1e-15), path
    else:
        assert x == y, path


def test_ablate_writes_the_cluster_scores_and_they_are_small(ablated):
    f = ablated / cluster_scores.FILE_NAME
    per_position = sum(p.stat().st_size for p in (ablated / "scores").rglob("*.safetensors"))
    assert f.exists() and f.stat().st_size < per_position / 4
    rec = cluster_scores.ClusterScores.get(ablated, "gdn", "chat")
    assert rec is not None and "group" in rec and bool(rec["answer_mask"].any())  # chat: groups, answers apart
    assert cluster_scores.ClusterScores.get(ablated, "gdn", "no-such-corpus") is None


def test_sums_per_cluster_are_the_per_position_sums(ablated):
    full = load_file(str(ablated / "scores" / "gdn" / "chat.safetensors"))
    rec = cluster_scores.collapse(full)
    w = full["weight"].double()
    for cluster in torch.unique(full["group"]).tolist():
        here, there = full["group"] == cluster, rec["group"] == cluster
        assert float(rec["weight"][there].sum()) == pytest.approx(float(w[here].sum()))
        for q in ("kl_top", "top1"):
            want = float((full[q].double() * w)[here].sum())
            assert float((rec[q] * rec["weight"])[there].sum()) == pytest.approx(want, rel=1e-12, abs=1e-15)
        m = here & full["answer_mask"].bool()
        want = float((full["dlogp"].double() * w)[m].sum())
        assert float((rec["dlogp"] * rec["weight"])[there & rec["answer_mask"]].sum()) == pytest.approx(
            want, rel=1e-12, abs=1e-15
        )


def test_compare_and_the_verdicts_from_cluster_scores_equal_those_from_positions(ablated, tmp_path, capsys):
    bare = _without_scores(ablated, tmp_path / "bare")
    for a, b in (("gdn", "build"), ("attention", "gdn-1")):
        assert main(["compare", str(ablated), a, b]) == 0
        full = capsys.readouterr().out
        assert main(["compare", str(bare), a, b]) == 0
        assert capsys.readouterr().out == full
    results = json.loads((ablated / "results.json").read_text())
    x, y = _recomputed(results, ablated), _recomputed(results, bare)
    assert x["verdicts"]["engine_noise"]["kl"] is not None  # the build's two engines measured the noise
    assert sum(bool(v.get("vs_build")) for v in y["variants"]) == 3  # gdn-1, gdn, attention
    _close(x, y)
    _close(results, x)  # and what ablate wrote is what is recomputed


def test_budget_from_cluster_scores_equals_budget_from_positions(ablated, tmp_path, capsys):
    full = tmp_path / "full"
    shutil.copytree(ablated, full, ignore=shutil.ignore_patterns("cache"))
    bare = _without_scores(ablated, tmp_path / "bare")
    outs = []
    for d in (full, bare):
        assert main(["budget", str(d)]) == 0
        outs.append(capsys.readouterr().out.replace(str(d), "DIR"))
    assert outs[0] == outs[1] and "KL intervals: none" not in outs[1]
    a, b = (json.loads((d / "budget.json").read_text()) for d in (full, bare))
    a.pop("folder", None), b.pop("folder", None)
    _close(json.loads(json.dumps(a).replace(str(full), "DIR")), json.loads(json.dumps(b).replace(str(bare), "DIR")))


def test_rows_scored_on_other_positions_are_refused_from_cluster_scores_too(ablated, tmp_path, capsys):
    bare = _without_scores(ablated, tmp_path / "bare")
    f = bare / cluster_scores.FILE_NAME
    tensors, meta = _load_with_metadata(f)
    key = "attention/wiki-en/positions_sha256"
    tensors[key] = torch.flip(tensors[key], [0])
    save_file(tensors, str(f), metadata=meta)
    assert main(["compare", str(bare), "attention", "build"]) != 0
    err = capsys.readouterr().err
    assert "different positions or tokens of wiki-en" in err and len(err.strip().splitlines()) == 1


def test_a_folder_with_some_per_position_files_compares_in_one_form(ablated, tmp_path, capsys):
    mixed = tmp_path / "mixed"
    shutil.copytree(ablated, mixed, ignore=shutil.ignore_patterns("cache"))
    shutil.rmtree(mixed / "scores" / "gdn")  # gdn from the cluster file, build from its per-position files
    assert main(["compare", str(ablated), "gdn", "build"]) == 0
    want = capsys.readouterr().out
    assert main(["compare", str(mixed), "gdn", "build"]) == 0
    assert capsys.readouterr().out == want


def test_the_command_remakes_the_file_keeps_rows_without_scores_and_refuses_a_folder_with_neither(ablated, tmp_path, capsys):
    d = tmp_path / "run"
    shutil.copytree(ablated, d, ignore=shutil.ignore_patterns("cache"))
    (d / cluster_scores.FILE_NAME).unlink()
    assert main(["cluster-scores", str(d)]) == 0
    assert (d / cluster_scores.FILE_NAME).read_bytes() == (ablated / cluster_scores.FILE_NAME).read_bytes()
    assert "5 finished rows from scores/" in capsys.readouterr().out
    bare = _without_scores(ablated, tmp_path / "bare")  # only the file: its records are kept as they are
    assert main(["cluster-scores", str(bare)]) == 0
    assert "5 kept as the file held them" in capsys.readouterr().out
    assert (bare / cluster_scores.FILE_NAME).read_bytes() == (ablated / cluster_scores.FILE_NAME).read_bytes()
    (bare / cluster_scores.FILE_NAME).unlink()
    before = sorted(p.name for p in bare.iterdir())
    assert main(["cluster-scores", str(bare)]) != 0
    err = capsys.readouterr().err
    assert "has no scores of a finished row" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in bare.iterdir()) == before
    assert main(["cluster-scores", str(tmp_path / "nowhere")]) != 0
    assert "is not a folder" in capsys.readouterr().err


def _load_with_metadata(path: Path) -> tuple[dict, dict]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _records(folder: Path) -> set[str]:
    return {k.rsplit("/", 1)[0] for k in load_file(str(folder / cluster_scores.FILE_NAME))}


def test_a_row_added_to_a_folder_without_scores_keeps_the_others(ablated, pairs, tmp_path, capsys):
    bare = _without_scores(ablated, tmp_path / "bare")
    assert main(["compare", str(bare), "gdn", "build"]) == 0
    want = capsys.readouterr().out
    results = json.loads((bare / "results.json").read_text())
    build = results["inputs"]["build"]["source"]
    plan = results["plan"]["source"]
    args = ["ablate", "all", build, results["inputs"]["base"]["source"], "-o", str(bare), "--plan", plan]
    assert main([*args, "--device", "cpu", "--no-time", "-q", "--add", f"again={build}"]) == 0
    capsys.readouterr()  # ablate prints its table
    assert {r.split("/")[0] for r in _records(bare)} == {"build", "gdn-1", "gdn", "attention", "build-again", "again"}
    assert main(["compare", str(bare), "gdn", "build"]) == 0
    assert capsys.readouterr().out == want


def test_a_row_whose_scores_were_deleted_keeps_its_records_through_a_rerun(ablated, tmp_path, capsys):
    d = tmp_path / "run"
    shutil.copytree(ablated, d)
    shutil.rmtree(d / "scores" / "gdn")
    results = json.loads((d / "results.json").read_text())
    args = ["ablate", "all", results["inputs"]["build"]["source"], results["inputs"]["base"]["source"], "-o", str(d)]
    assert main([*args, "--plan", results["plan"]["source"], "--device", "cpu", "--no-time", "-q"]) == 0
    assert "gdn/chat" in _records(d)
    assert main(["compare", str(d), "gdn", "build"]) == 0
    capsys.readouterr()
    assert main(["cluster-scores", str(d)]) == 0
    assert "1 kept as the file held them (gdn)" in capsys.readouterr().out


def test_a_cluster_file_of_another_folder_or_a_damaged_one_is_refused_in_one_line(ablated, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(ablated, other, ignore=shutil.ignore_patterns("scores", "cache"))
    results = json.loads((other / "results.json").read_text())
    results["inputs"]["base"]["digest"] = "0" * 64  # as if scored against another base
    (other / "results.json").write_text(json.dumps(results))
    f = other / cluster_scores.FILE_NAME
    for damage, says in (
        (None, "holds the scores of another build or base"),
        (lambda: f.write_bytes(f.read_bytes()[:5000]), "cannot be read as cluster scores"),
        (lambda: f.write_bytes(b""), "cannot be read as cluster scores"),
        (lambda: shutil.copy(ablated / "scores" / "gdn" / "chat.safetensors", f), "is not a splicer cluster-scores file"),
    ):
        if damage:
            damage()
        for cmd in (["compare", str(other), "gdn", "build"], ["budget", str(other)]):
            assert main(cmd) != 0, (cmd, says)
            err = capsys.readouterr().err
            assert says in err and len(err.strip().splitlines()) == 1, err


def test_a_damaged_per_position_file_is_one_line_and_leaves_the_cluster_file(ablated, tmp_path, capsys):
    d = tmp_path / "run"
    shutil.copytree(ablated, d, ignore=shutil.ignore_patterns("cache"))
    before = (d / cluster_scores.FILE_NAME).read_bytes()
    bad = d / "scores" / "gdn" / "chat.safetensors"
    bad.write_bytes(bad.read_bytes()[:100])
    assert main(["cluster-scores", str(d)]) != 0
    err = capsys.readouterr().err
    assert f"{bad} cannot be read as a row's scores" in err and len(err.strip().splitlines()) == 1
    assert (d / cluster_scores.FILE_NAME).read_bytes() == before


def test_the_file_is_as_readable_as_results_json(ablated):
    mode = (ablated / cluster_scores.FILE_NAME).stat().st_mode & 0o777
    assert mode == (ablated / "results.json").stat().st_mode & 0o777


COMMITTED = sorted((Path(__file__).parents[1] / "results").rglob(cluster_scores.FILE_NAME))


@pytest.mark.parametrize("path", COMMITTED, ids=[str(p.parent.relative_to(p.parents[3])) for p in COMMITTED])
def test_every_committed_interval_is_recomputed_from_the_committed_cluster_scores(path):
    """The verdicts a GPU run wrote into results.json (paired intervals, the engine noise folded in) come out of the
    cluster scores committed beside it: the raw data behind each interval of a results README."""
    results = json.loads((path.parent / "results.json").read_text())
    again = _recomputed(results, path.parent)
    assert any(v.get("vs_build") for v in again["variants"])
    _close(results, again)


def test_the_committed_results_hold_cluster_scores():
    assert len(COMMITTED) >= 3  # results/trained-h200/run-3: ablate0, ablate1, score0
