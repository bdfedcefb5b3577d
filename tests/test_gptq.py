"""GPTQ (seed 003's format): the packing, inspect, splice under GPTQModel's and vLLM's readings, and the torch backend."""

from __future__ import annotations

import json
import re

import pytest
import torch

from splicer.checkpoint import open_checkpoint
from splicer.formats.gptq_tensors import dequantize_gptq, quantize_gptq
from splicer.splice.core import splice
from splicer.splice.inspect import inspect_checkpoint

from .test_splice import base_per_expert, bit_equal, load_all


@pytest.fixture(scope="module")
def gptq_build(pairs, tmp_path_factory):
    from splicer.fixtures.core import write_build

    return write_build(pairs["fused"]["base"], tmp_path_factory.mktemp("gptq") / "build", "gptq-experts-g32")


def _unpack_by_hand(t: dict, bits: int = 4):
    """Independent GPTQ v1 reading with plain bit arithmetic: w[n,k] = s[k//g,n] * (nibble(qweight[k//8,n], k%8) - (nibble(qzeros[k//g, n//8], n%8) + 1))."""
    qw, qz, sc = t["qweight"].to(torch.int64) & 0xFFFFFFFF, t["qzeros"].to(torch.int64) & 0xFFFFFFFF, t["scales"].float()
    per = 32 // bits
    k_dim, n_dim = qw.shape[0] * per, sc.shape[1]
    g = k_dim // sc.shape[0]
    k = torch.arange(k_dim)
    n = torch.arange(n_dim)
    q = (qw[k // per][:, n] >> (bits * (k % per))[:, None]) & (2**bits - 1)  # [K, N]
    z = ((qz[:, n // per] >> (bits * (n % per))[None, :]) & (2**bits - 1)) + 1  # [K/g, N]
    return (sc[k // g] * (q - z[k // g]).float()).t()  # [N, K]


def test_packing_unpacks_to_the_rtn_values():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 256, generator=g) * 0.05).bfloat16()
    t = quantize_gptq(w, 4, 32)
    assert t["qweight"].shape == (32, 96) and t["qzeros"].shape == (8, 12) and t["scales"].shape == (8, 96)
    assert t["scales"].dtype == torch.float16 and t["g_idx"].tolist() == [k // 32 for k in range(256)]
    assert (t["qzeros"] == 0x77777777).all()  # symmetric 4-bit: zero point 8, stored as 7 (v1)
    by_hand = _unpack_by_hand(t)
    assert torch.equal(dequantize_gptq(t, 4, torch.float32), by_hand)
    # round to nearest: within half a step, except where the symmetric range clips the top value (one step)
    step = t["scales"].float().t().repeat_interleave(32, dim=1)
    err = (by_hand - w.float()).abs()
    clipped = (by_hand / step).round() == 7
    assert (err[~clipped] <= step[~clipped] * 0.501).all() and (err[clipped] <= step[clipped] * 1.001).all()


def test_inspect_gptq_build(gptq_build):
    info = inspect_checkpoint(open_checkpoint(gptq_build, "b"))
    assert info["quant_method"] == "gptq" and info["format"] == "gptq"
    assert info["classes"]["experts"]["quantized"] == 96 and info["classes"]["experts"]["schemes"] == ["int4 g32"]
    assert info["classes"]["mtp"]["quantized"] == 0 and info["lint"]["issues"] == []


def _negative(name: str, dynamic: dict) -> bool:
    """vLLM's and GPTQModel's rule: the first `-:` pattern that re.matches excludes the module."""
    return any(k.startswith("-:") and re.match(k[2:], name) for k in dynamic)


def test_splice_gptq_experts_of_some_layers(pairs, gptq_build, tmp_path):
    out = tmp_path / "out"
    splice(str(gptq_build), str(pairs["fused"]["base"]), out, "experts", layers="0,2", progress=False)
    got, build, base = load_all(out), load_all(gptq_build), base_per_expert(load_all(pairs["fused"]["base"]))
    for layer in (0, 2):
        m = f"model.language_model.layers.{layer}.mlp.experts.3.down_proj"
        assert bit_equal(got[f"{m}.weight"], base[f"{m}.weight"]) and f"{m}.qweight" not in got
    kept = "model.language_model.layers.1.mlp.experts.3.down_proj"
    assert all(bit_equal(got[f"{kept}.{s}"], build[f"{kept}.{s}"]) for s in ("qweight", "qzeros", "scales", "g_idx"))
    dynamic = json.loads((out / "config.json").read_text())["quantization_config"]["dynamic"]
    # vLLM decides a GPTQ MoE layer on its `...mlp.experts` prefix alone; hand-written vLLM names:
    assert _negative("language_model.model.layers.0.mlp.experts", dynamic)
    assert _negative("language_model.model.layers.2.mlp.experts", dynamic)
    assert not _negative("language_model.model.layers.1.mlp.experts", dynamic)
    assert not _negative("language_model.model.layers.3.mlp.experts", dynamic)
    assert _negative("model.language_model.layers.2.mlp.experts.5.up_proj", dynamic)  # GPTQModel's HF names
    assert list(dynamic)[:2] == json.loads((out / "splice.json").read_text())["ignore_added"]  # first, ahead of any + rule
    assert inspect_checkpoint(open_checkpoint(out, "o"))["lint"]["issues"] == []


def test_splice_gptq_all_gives_the_base(pairs, gptq_build, tmp_path):
    out = tmp_path / "out"
    splice(str(gptq_build), str(pairs["fused"]["base"]), out, "all", progress=False)
    got, base = load_all(out), base_per_expert(load_all(pairs["fused"]["base"]))
    assert set(got) == set(base) and all(bit_equal(got[k], base[k]) for k in base)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_torch_backend_reads_gptq(pairs, gptq_build):
    from splicer.backends.torch_ref import TorchBackend

    b, ref = TorchBackend("cpu"), TorchBackend("cpu")
    b.load(gptq_build)
    ref.load(pairs["fused"]["base"])
    pb, pr = dict(b.model.named_parameters()), dict(ref.model.named_parameters())
    name = "model.layers.1.mlp.experts.down_proj"
    rel = ((pb[name].float() - pr[name].float()).norm() / pr[name].float().norm()).item()
    assert 0.03 < rel < 0.15  # 4-bit g32
    assert torch.equal(pb["model.layers.0.linear_attn.in_proj_qkv.weight"], pr["model.layers.0.linear_attn.in_proj_qkv.weight"])
