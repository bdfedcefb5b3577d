"""Seed 000's exporter fix-ups as splice options: the MTP head back from the base, tokenizer files verbatim, dead ignore entries."""

from __future__ import annotations

import json
import shutil

import pytest

from splicer.arch.qwen3_5_moe import QWEN3_5_MOE
from splicer.checkpoint import open_checkpoint
from splicer.splice.core import MTP_SHARD, splice
from splicer.splice.inspect import inspect_checkpoint

from .test_splice import bit_equal, load_all

MTP_IGNORE = QWEN3_5_MOE.mtp_ignore


@pytest.fixture(scope="module")
def nomtp(pairs, tmp_path_factory):
    from splicer.fixtures.core import write_build

    return write_build(pairs["fused"]["base"], tmp_path_factory.mktemp("nomtp") / "build", "lowlatency-nomtp")


def test_restore_mtp_adds_the_base_head(pairs, nomtp, tmp_path):
    assert not any(k.startswith("mtp.") for k in load_all(nomtp))
    out = tmp_path / "out"
    record = splice(str(nomtp), str(pairs["fused"]["base"]), out, "gdn,mtp", progress=False)
    got, base = load_all(out), load_all(pairs["fused"]["base"])
    mtp = [k for k in base if k.startswith("mtp.")]
    assert record["mtp_tensors_added"] == len(mtp) > 0
    assert all(bit_equal(got[k], base[k]) for k in mtp)  # verbatim, in the base's own layout
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert {index[k] for k in mtp} == {MTP_SHARD}
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in got
    # the build's ignore list already had re:.*mtp.*, so nothing is added for the head
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert MTP_IGNORE not in qc["ignore"]
    assert inspect_checkpoint(open_checkpoint(out, "o"))["lint"]["issues"] == []


def test_restore_mtp_adds_an_ignore_entry_when_none_covers_it(pairs, nomtp, tmp_path):
    build = tmp_path / "build"
    shutil.copytree(nomtp, build)
    cfg = json.loads((build / "config.json").read_text())
    cfg["quantization_config"]["ignore"].remove("re:.*mtp.*")
    (build / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    splice(str(build), str(pairs["fused"]["base"]), out, "mtp", progress=False)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert MTP_IGNORE in qc["ignore"]
    assert inspect_checkpoint(open_checkpoint(out, "o"))["lint"]["issues"] == []


def test_mtp_cannot_be_added_twice(pairs, tmp_path):
    """A build that kept its BF16 MTP head: nothing to restore there."""
    from splicer.errors import SplicerError

    with pytest.raises(SplicerError, match="class mtp has no quantized modules"):
        splice(str(pairs["fused"]["lowlatency"]), str(pairs["fused"]["base"]), tmp_path / "x", "mtp", progress=False)


def test_tokenizer_from_base(pairs, tmp_path):
    build = tmp_path / "build"
    shutil.copytree(pairs["fused"]["lowlatency"], build)
    tok = json.loads((build / "tokenizer.json").read_text())
    (build / "tokenizer.json").write_text(json.dumps(tok, indent=1))  # re-serialised, as transformers 5.14 did
    out = tmp_path / "out"
    record = splice(str(build), str(pairs["fused"]["base"]), out, "lm_head", tokenizer_from_base=True, progress=False)
    assert (out / "tokenizer.json").read_bytes() == (pairs["fused"]["base"] / "tokenizer.json").read_bytes()
    assert "tokenizer.json" in record["files_from_base"] and "chat_template.jinja" in record["files_from_base"]
    plain = tmp_path / "plain"
    splice(str(build), str(pairs["fused"]["base"]), plain, "lm_head", progress=False)
    assert (plain / "tokenizer.json").read_bytes() == (build / "tokenizer.json").read_bytes()


def test_drop_dead_ignore(pairs, tmp_path):
    build = tmp_path / "build"
    shutil.copytree(pairs["fused"]["lowlatency"], build)
    cfg = json.loads((build / "config.json").read_text())
    dead = [f"model.language_model.layers.{i}.linear_attn" for i in range(3)] + ["model.language_model.layers.0.linear_attn.norm"]
    cfg["quantization_config"]["ignore"] += dead
    (build / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    record = splice(str(build), str(pairs["fused"]["base"]), out, "attention", drop_dead_ignore=True, progress=False)
    assert record["ignore_dropped"] == dead
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert not set(dead) & set(qc["ignore"]) and r"re:.*mlp\.gate$" in qc["ignore"]  # needed by compressed-tensors: kept
    assert inspect_checkpoint(open_checkpoint(out, "o"))["lint"]["issues"] == []
