"""`inspect --base`, `splice --unquantized-from-base` and the report's residual sentence on cases found by a review:
tensors the base stores otherwise, a base of another model or a quantized one, a noisy noise floor, tiny shares."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from splicer.analysis.report import findings
from splicer.checkpoint import INDEX_NAME, open_checkpoint
from splicer.cli import main
from splicer.fixtures.core import FixtureSpec, write_pair
from splicer.splice.core import splice
from splicer.splice.unquantized import compare_unquantized, unquantized_names

MTP_EXPERT = "mtp.layers.0.mlp.experts.3.down_proj.weight"


def _copy_with(src: Path, dst: Path, change: dict[str, callable]) -> Path:
    """A copy of a checkpoint with some tensors changed; changed shards are new files, never written through."""
    shutil.copytree(src, dst)
    wm = json.loads((dst / INDEX_NAME).read_text())["weight_map"]
    for shard in sorted({wm[n] for n in change}):
        with safe_open(str(dst / shard), "pt") as f:
            tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        for n, fn in change.items():
            if n in tensors:
                tensors[n] = fn(tensors[n])
        (dst / shard).unlink()
        save_file(tensors, str(dst / shard), metadata=meta)
    return dst


def _nudge(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[0] += 0.5
    return t


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    wm = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
    out = {}
    for shard in sorted(set(wm.values())):
        with safe_open(str(folder / shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def fused_mtp_changed(pairs, tmp_path_factory) -> tuple[Path, Path]:
    """Fused-experts base; lowlatency build (MTP head kept BF16, its experts stored one per expert) with one MTP
    expert weight changed."""
    src, base = pairs["fused"]["lowlatency"], pairs["fused"]["base"]
    build = _copy_with(src, tmp_path_factory.mktemp("fused_mtp") / "build", {MTP_EXPERT: _nudge})
    return build, base


def test_every_unquantized_tensor_is_compared_or_counted(fused_mtp_changed, capsys):
    """The build's unquantized MTP experts are per-expert while the fused base holds them as one 3-D tensor: they
    cannot be compared name for name, so they are counted and named, and the summary does not read as all equal."""
    build, base = fused_mtp_changed
    b = open_checkpoint(build, "build")
    c = compare_unquantized(b, open_checkpoint(base, "base"))
    assert MTP_EXPERT in unquantized_names(b) and MTP_EXPERT in c.not_compared
    assert c.compared + len(c.not_compared) == len(unquantized_names(b))
    assert main(["inspect", str(build), "--base", str(base)]) == 0
    out = capsys.readouterr().out
    assert f"{len(c.not_compared)} unquantized tensors of the build were not compared" in out


def test_restore_all_unquantized_from_base_names_what_it_could_not_cover(fused_mtp_changed, tmp_path):
    """With a fused base the per-expert MTP experts keep the build's values, and splice.json says so."""
    build, base = fused_mtp_changed
    out = tmp_path / "out"
    record = splice(str(build), str(base), out, "all", progress=False, unquantized_from_base=True)
    assert MTP_EXPERT in record["unquantized_not_compared"]
    assert MTP_EXPERT in json.loads((out / "splice.json").read_text())["unquantized_not_compared"]


@pytest.fixture(scope="module")
def other_model_base(tmp_path_factory) -> Path:
    """A qwen3_5_moe base with twice the hidden size: not the base of the fixture builds."""
    return write_pair(tmp_path_factory.mktemp("other"), FixtureSpec(experts_layout="per_expert", preset="gpu"), kinds=())["base"]


def test_inspect_base_rejects_a_base_of_another_model(pairs, other_model_base, capsys):
    """inspect --base refuses a base of another model in one line, as splice does (hidden_size differs)."""
    build = pairs["per_expert"]["lowlatency"]
    rc = main(["inspect", str(build), "--base", str(other_model_base)])
    out, err = capsys.readouterr()
    assert rc != 0 and "hidden_size" in err, out[-400:]


def test_inspect_base_rejects_a_quantized_base(pairs, capsys):
    """Another build passed as BASE: refused, as splice refuses it."""
    rc = main(["inspect", str(pairs["fused"]["lowlatency"]), "--base", str(pairs["fused"]["experts-g32"])])
    out, err = capsys.readouterr()
    assert rc != 0 and "quantized" in err, out[-400:]


def test_report_needs_more_than_one_corpus_barely_above_a_noisy_floor():
    """An engine with run-to-run noise: the noise floor's KL is 1e-4 [0.9e-4, 1.1e-4]; the all row is 1.15e-4
    [1.02e-4, 1.28e-4] on one corpus of five and at the floor on the others: no sentence about error outside every
    class."""
    floor = {"positions": 100, "kl": 1e-4, "kl_ci": [0.9e-4, 1.1e-4], "top1": 0.999}
    corpora = ["a", "b", "c", "d", "e"]

    def row(name, restored, kl, ci):
        m = {c: {"positions": 100, "kl": 1e-4, "kl_ci": [0.9e-4, 1.1e-4], "top1": 0.999} for c in corpora}
        m["a"] = {"positions": 100, "kl": kl, "kl_ci": list(ci), "top1": 0.999}
        rel = {"rel": -0.98, "rel_ci": [-0.99, -0.97], "significant": True, "rel_significant": True}
        return {"name": name, "status": "ok", "restored": restored, "metrics": m, "vs_build": {"kl": {"pooled": rel}}}

    build = row("build", [], 5e-3, (4.5e-3, 5.5e-3))
    results = {
        "quantized_classes": ["gdn", "experts"],
        "noise_floor": {c: dict(floor) for c in corpora},
        "variants": [build, row("all", ["gdn", "experts"], 1.15e-4, (1.02e-4, 1.28e-4))],
    }
    text = " ".join(findings(results))
    assert "differs from the base outside its quantized modules" not in text


def test_summary_does_not_print_zero_percent_for_a_real_difference(pairs, tmp_path, capsys):
    """One element of the embedding changed: the share is not printed as 0.0 %."""
    src, base = pairs["per_expert"]["lowlatency"], pairs["per_expert"]["base"]
    wm = json.loads((src / INDEX_NAME).read_text())["weight_map"]
    embed = next(n for n in wm if n.endswith("embed_tokens.weight"))
    build = _copy_with(src, tmp_path / "build", {embed: _nudge})
    assert main(["inspect", str(build), "--base", str(base)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "embed_tokens" in x)
    assert not re.search(r"\b0\.0 % of elements differ", line) and "under 0.1 % of elements differ" in line, line
