"""A build whose unquantized tensors differ from the base: found by inspect --base, put back by splice
--unquantized-from-base, and named by the report when restoring every class does not reach the base."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from splicer.analysis.report import findings
from splicer.checkpoint import INDEX_NAME, open_checkpoint
from splicer.cli import main
from splicer.splice.core import splice
from splicer.splice.unquantized import compare_unquantized, pattern, summary

NORM = "model.language_model.layers.0.input_layernorm.weight"


def _offset_roundtrip(w: torch.Tensor) -> torch.Tensor:
    """What an offset-norm calibration wrapper in BF16 does to a weight: to 1 + w and back, rounding both ways."""
    return ((1.0 + w.float()).to(torch.bfloat16).float() - 1.0).to(torch.bfloat16)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / INDEX_NAME).read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def copy_with(src: Path, dst: Path, change: dict) -> Path:
    """A copy of a checkpoint with some tensors replaced (name -> function of the old tensor). Changed shards are new
    files: the copy may share inodes with the fixture, which is never written through."""
    shutil.copytree(src, dst)
    index = json.loads((dst / INDEX_NAME).read_text())["weight_map"]
    for shard in sorted({index[n] for n in change}):
        with safe_open(str(dst / shard), "pt") as f:
            tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        for n, fn in change.items():
            if n in tensors:
                tensors[n] = fn(tensors[n])
        (dst / shard).unlink()
        save_file(tensors, str(dst / shard), metadata=meta)
    return dst


def _named(folder: Path, suffix: str) -> str:
    return next(n for n in json.loads((folder / INDEX_NAME).read_text())["weight_map"] if n.endswith(suffix))


def _rounded(t: torch.Tensor) -> torch.Tensor:
    rounded = _offset_roundtrip(t)
    assert not torch.equal(rounded, t), "the fixture's norm must hold values the round trip changes"
    return rounded


def _nudged(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[0] += 0.5
    return t


@pytest.fixture(scope="module")
def rounded_build(pairs, tmp_path_factory) -> tuple[Path, Path, str]:
    """The per-expert lowlatency build with one layer norm rounded as llm-compressor 0.14 rounds offset norms, and
    the final norm nudged; returns (build, base, the norm's name)."""
    src, base = pairs["per_expert"]["lowlatency"], pairs["per_expert"]["base"]
    name, final = _named(src, "layers.0.input_layernorm.weight"), _named(src, "language_model.norm.weight")
    out = copy_with(src, tmp_path_factory.mktemp("rounded") / "build", {name: _rounded, final: _nudged})
    return out, base, name


def test_compare_finds_exactly_the_changed_tensors(rounded_build, pairs):
    build, base, name = rounded_build
    c = compare_unquantized(open_checkpoint(build, "build"), open_checkpoint(base, "base"))
    compared, diffs = c.compared, c.differences
    assert compared > 10
    by_name = {d.name: d for d in diffs}
    assert set(by_name) == {name, next(n for n in by_name if n.endswith("language_model.norm.weight"))}
    final = next(d for n, d in by_name.items() if n != name)
    assert final.elements_differing == 1 and final.max_abs_diff == pytest.approx(0.5, abs=0.01)
    assert 0 < by_name[name].elements_differing <= by_name[name].elements
    s = summary(c)
    assert s["differing"] == 2 and pattern(name) in s["by_pattern"]
    # the untouched build: nothing differs
    none = compare_unquantized(open_checkpoint(pairs["per_expert"]["lowlatency"], "build"), open_checkpoint(base, "base"))
    none = none.differences
    assert none == []


def test_splice_takes_base_values_only_when_asked(rounded_build, tmp_path):
    build, base, name = rounded_build
    base_t = _tensors(base)
    plain = tmp_path / "plain"
    splice(str(build), str(base), plain, "all", progress=False)
    fixed = tmp_path / "fixed"
    record = splice(str(build), str(base), fixed, "all", progress=False, unquantized_from_base=True)
    plain_t, fixed_t = _tensors(plain), _tensors(fixed)
    assert not torch.equal(plain_t[name], base_t[name])
    assert len(record["unquantized_from_base"]) == 2 and name in record["unquantized_from_base"]
    assert json.loads((fixed / "splice.json").read_text())["unquantized_from_base"] == record["unquantized_from_base"]
    # Every class restored and the unquantized tensors from the base: every tensor the two share equals the base's.
    shared = set(fixed_t) & set(base_t)
    assert name in shared and len(shared) > 10
    for k in shared:
        assert torch.equal(fixed_t[k], base_t[k].to(fixed_t[k].dtype)), k


def test_cli_inspect_base_lists_differences(rounded_build, pairs, capsys):
    build, base, _ = rounded_build
    assert main(["inspect", str(build), "--base", str(base)]) == 0
    out = capsys.readouterr().out
    assert "Unquantized tensors that differ from the base: 2 of" in out
    assert "model.language_model.layers.N.input_layernorm.weight: 1 tensor(s)" in out
    assert main(["inspect", str(pairs["per_expert"]["lowlatency"]), "--base", str(base), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["unquantized_vs_base"]["differing"] == 0 and info["unquantized_vs_base"]["compared"] > 10


def _variant(name, restored, kl_lo, rel=-0.937, rel_ci=(-0.941, -0.934)):
    metric = {"positions": 100, "kl": kl_lo * 1.2, "kl_ci": [kl_lo, kl_lo * 1.4], "top1": 0.99}
    return {
        "name": name,
        "status": "ok",
        "restored": restored,
        "metrics": {"a": dict(metric), "b": dict(metric)},
        "vs_build": {"kl": {"pooled": {"rel": rel, "rel_ci": list(rel_ci), "significant": True, "rel_significant": True}}},
    }


@pytest.mark.parametrize(
    ("restored", "kl_lo", "expected"),
    [
        (["gdn", "experts"], 4e-4, True),  # every quantized class, KL above the floor
        (["gdn", "experts"], 0.0, False),  # every class, at the base
        (["gdn"], 4e-4, False),  # not every class
        (["gdn@0-2", "experts"], 4e-4, False),  # part of a class
    ],
)
def test_report_names_error_outside_every_class(restored, kl_lo, expected):
    build = _variant("build", [], 5e-3)
    results = {
        "quantized_classes": ["gdn", "experts"],
        "noise_floor": {"a": {"kl": 0.0, "top1": 1.0}, "b": {"kl": 0.0, "top1": 1.0}},
        "variants": [build, _variant("all", restored, kl_lo)],
    }
    text = " ".join(findings(results))
    assert ("restores every quantized class and still leaves" in text) == expected
    if expected:
        assert "6.3 % of the build's [5.9, 6.6]" in text


@pytest.fixture(scope="module")
def smoothed_build(pairs, tmp_path_factory) -> tuple[Path, Path]:
    """The lowlatency build with an AWQ-like change: a post-attention norm and its layer's router scaled by 1/s, s."""
    src, base = pairs["per_expert"]["lowlatency"], pairs["per_expert"]["base"]
    norm, router = _named(src, "layers.0.post_attention_layernorm.weight"), _named(src, "layers.0.mlp.gate.weight")

    def scale(t: torch.Tensor) -> torch.Tensor:
        return torch.linspace(0.5, 2.0, t.shape[-1])

    change = {
        norm: lambda t: ((1 + t.float()) / scale(t) - 1).to(t.dtype),
        router: lambda t: (t.float() * scale(t)).to(t.dtype),
    }
    return copy_with(src, tmp_path_factory.mktemp("smoothed") / "build", change), base


def test_smoothing_is_told_from_rounding(rounded_build, smoothed_build):
    build, base, _ = rounded_build
    diffs = compare_unquantized(open_checkpoint(build, "build"), open_checkpoint(base, "base")).differences
    # the rounded norm is rounding; the nudged final norm is a change
    assert sorted(d.rounding_only for d in diffs) == [False, True]
    sb, sbase = smoothed_build
    c = compare_unquantized(open_checkpoint(sb, "build"), open_checkpoint(sbase, "base"))
    diffs = c.differences
    assert len(diffs) == 2 and not any(d.rounding_only for d in diffs)
    assert summary(c)["changed"] == 2


def test_unquantized_from_base_refused_for_a_partial_restore_of_a_smoothed_build(smoothed_build, tmp_path, capsys):
    build, base = smoothed_build
    out = tmp_path / "out"
    code = main(["splice", "--restore", "experts", str(build), str(base), "-o", str(out), "--unquantized-from-base", "-q"])
    err = capsys.readouterr().err
    assert code != 0 and not out.exists()
    assert "changed beyond rounding" in err and "--restore all" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    # every class restored whole: allowed, and the result holds the base's values everywhere they share a name
    assert main(["splice", "--restore", "all", str(build), str(base), "-o", str(out), "--unquantized-from-base", "-q"]) == 0
    got, want = _tensors(out), _tensors(base)
    for k in set(got) & set(want):
        assert torch.equal(got[k], want[k].to(got[k].dtype)), k


def test_inspect_warns_about_smoothing(smoothed_build, capsys):
    build, base = smoothed_build
    assert main(["inspect", str(build), "--base", str(base)]) == 0
    out = capsys.readouterr().out
    assert "Warning: 2 of them changed beyond rounding" in out


SMALL_PLAN = """name = "smoothing-warning"
description = "one spliced row, untimed"
top_k = 20

[[corpus]]
name = "wiki-en"
kind = "builtin"
text = "wiki-en"
chunk_tokens = 16
max_chunks = 2

[[row]]
name = "build"
restore = []

[[row]]
name = "gdn"
restore = ["gdn"]
"""


@pytest.mark.parametrize("smoothed", [True, False])
def test_ablate_log_warns_about_a_smoothed_build(smoothed, smoothed_build, pairs, tmp_path):
    build, base = smoothed_build if smoothed else (pairs["per_expert"]["lowlatency"], pairs["per_expert"]["base"])
    plan = tmp_path / "plan.toml"
    plan.write_text(SMALL_PLAN)
    out = tmp_path / "run"
    args = ["ablate", "all", str(build), str(base), "-o", str(out), "--plan", str(plan), "--device", "cpu", "--no-time", "-q"]
    assert main(args) == 0
    log = (out / "ablate.log").read_text()
    assert ("warning: the build's unquantized tensors were changed beyond rounding" in log) == smoothed
