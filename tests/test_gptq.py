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
    """vLLM's and GPTQModel's rule: the first rule whose pattern re.matches decides; a `-:` rule excludes the module."""
    for k in dynamic:
        if re.match(k[2:] if k[:2] in ("-:", "+:") else k, name):
            return k.startswith("-:")
    return False


def _with_config(src, dst, edit):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_a_positive_dynamic_rule_before_an_exclusion_keeps_the_module_quantized(pairs, gptq_build, tmp_path):
    """GPTQModel and vLLM stop at the first `dynamic` rule that matches: a `+:` override listed before the `-:` rule
    that leaves attention in BF16 claims layer 3's attention as 8-bit for GPTQModel, which finds it stored unquantized;
    vLLM reads it unquantized all the same, from its scan of the packed tensors."""
    build = _with_config(
        gptq_build, tmp_path / "build", lambda qc: qc.update(dynamic={"+:.*\\.3\\.self_attn.*": {"bits": 8}, **qc["dynamic"]})
    )
    issues = inspect_checkpoint(open_checkpoint(build, "b"))["lint"]["issues"]
    flagged = {i["naming"] for i in issues if ".3.self_attn." in i["detail"]}
    assert flagged == {"hf"}, issues
    assert not [i for i in issues if ".1.self_attn." in i["detail"]]  # the exclusion still holds elsewhere


def test_a_splice_puts_its_exclusions_before_a_positive_rule(pairs, gptq_build, tmp_path):
    """A build whose `dynamic` opens with a `+:` rule over every decoder expert: the splice's `-:` rules for the restored
    experts go first, so GPTQModel and vLLM (whose MoE layers read `dynamic` only) both read them unquantized."""
    from splicer.arch.qwen3_5_moe import QWEN3_5_MOE
    from splicer.formats.gptq import dynamic_rule

    RULE = "+:(model\\.language_model|language_model\\.model)\\.layers\\.\\d+\\.mlp\\.experts.*"  # both namings, not the MTP's
    build = _with_config(gptq_build, tmp_path / "build", lambda qc: qc.update(dynamic={RULE: {}, **qc["dynamic"]}))
    assert inspect_checkpoint(open_checkpoint(build, "b"))["lint"]["issues"] == []
    out = tmp_path / "out"
    splice(str(build), str(pairs["fused"]["base"]), out, "experts", layers="0", progress=False)
    dynamic = json.loads((out / "config.json").read_text())["quantization_config"]["dynamic"]
    moe0 = QWEN3_5_MOE.to_vllm_name("model.language_model.layers.0.mlp.experts")
    assert dynamic_rule(dynamic, moe0) is False and dynamic_rule(dynamic, moe0.replace(".0.", ".1.")) == {}
    assert _negative("model.language_model.layers.0.mlp.experts.3.up_proj", dynamic)
    assert inspect_checkpoint(open_checkpoint(out, "o"))["lint"]["issues"] == []


def test_a_configs_own_module_list_is_what_vllm_reads(gptq_build, tmp_path):
    """With modules_in_block_to_quantize in the config vLLM reads that list, not the checkpoint: naming q_proj without
    k_proj and v_proj splits the fused qkv_proj, which vLLM refuses before it reads `dynamic`, even where a `-:` rule
    excludes attention."""
    build = _with_config(
        gptq_build, tmp_path / "build", lambda qc: qc.update(modules_in_block_to_quantize=[["self_attn.q_proj"]])
    )
    issues = inspect_checkpoint(open_checkpoint(build, "b"))["lint"]["issues"]
    refused = [i for i in issues if i["naming"] == "vllm" and "some but not all shards" in i["detail"]]
    assert refused and "self_attn.qkv_proj" in refused[0]["detail"], issues


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


@pytest.fixture(scope="module")
def gptq_mtp_build(pairs, tmp_path_factory):
    """A GPTQ build whose MTP layer's experts are quantized too (GPTQModel quantized the drafter's decoder layer), its
    fc left in BF16 and no rule naming mtp yet."""
    import splicer.fixtures.core as core
    from splicer.arch.qwen3_5_moe import QWEN3_5_MOE

    orig = core._PLANS["gptq-experts-g32"]

    def plan(kind):
        p = orig(kind)
        p.qc["dynamic"].pop("-:.*mtp.*")
        return core.BuildPlan(p.qc, lambda m: (4, 32) if QWEN3_5_MOE.expert_parts(m) else None, p.quantize)

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(core._PLANS, "gptq-experts-g32", plan)
        return core.write_build(pairs["fused"]["base"], tmp_path_factory.mktemp("gptq-mtp") / "build", "gptq-experts-g32")


def test_a_mtp_exclusion_anywhere_unquantizes_the_drafters_layers_from_vllm_0_27(gptq_mtp_build, tmp_path, monkeypatch):
    """vLLM 0.27+ (qwen3_5_mtp.py) builds every MTP decoder layer unquantized when any `-:` key contains "mtp",
    whatever it matches: a rule for the drafter's fc alone leaves its INT4 experts with nowhere to load there, not on 0.26."""
    before = inspect_checkpoint(open_checkpoint(gptq_mtp_build, "b"))["lint"]["issues"]
    assert [i["detail"] for i in before] == ["mtp.fc is stored BF16 but the config reads it as gptq"]  # GPTQModel's view
    build = _with_config(gptq_mtp_build, tmp_path / "build", lambda qc: qc["dynamic"].update({"-:mtp\\.fc$": {}}))
    issues = inspect_checkpoint(open_checkpoint(build, "b"))["lint"]["issues"]
    mtp = [i for i in issues if i["naming"] == "vllm" and i["detail"].startswith("mtp.layers.0.mlp.experts")]
    assert mtp and mtp[0]["check"] == "stored-quantized-read-bf16", issues
    assert not [i for i in issues if i["naming"] == "hf"]  # GPTQModel reads the rule as written
    notes = " ".join(inspect_checkpoint(open_checkpoint(build, "b"))["lint"]["notes"])
    assert "vLLM 0.26 reads" in notes and "modules otherwise than vLLM 0.33" in notes
    monkeypatch.setenv("SPLICER_VLLM_VERSION", "0.26.0")
    assert inspect_checkpoint(open_checkpoint(build, "b"))["lint"]["issues"] == []


def test_per_module_bits_of_a_dynamic_rule_are_checked_against_the_tensors(gptq_build, tmp_path):
    """A `+:` rule that gives the experts 8 bits makes both readers build them 8-bit over 4-bit tensors; one that gives
    them 3 bits is refused by vLLM's GPTQ loader (4- and 8-bit symmetric only)."""
    rule = "+:.*mlp\\.experts.*"
    eight = _with_config(gptq_build, tmp_path / "eight", lambda qc: qc.update(dynamic={rule: {"bits": 8}, **qc["dynamic"]}))
    issues = inspect_checkpoint(open_checkpoint(eight, "b"))["lint"]["issues"]
    mismatch = [i for i in issues if i["check"] == "scheme-mismatch"]
    assert {i["naming"] for i in mismatch} == {"hf", "vllm"}, issues
    assert f"dynamic rule {rule!r} reads it as 8-bit g32, tensors are 4-bit g32" in mismatch[0]["detail"]
    three = _with_config(gptq_build, tmp_path / "three", lambda qc: qc.update(dynamic={rule: {"bits": 3}, **qc["dynamic"]}))
    refused = [i for i in inspect_checkpoint(open_checkpoint(three, "b"))["lint"]["issues"] if i["check"] == "refused"]
    assert len(refused) == 1 and "3-bit symmetric GPTQ" in refused[0]["detail"] and "4- and 8-bit" in refused[0]["detail"]


def test_a_module_list_mixing_names_and_lists_is_read_as_vllm_reads_it(gptq_build, tmp_path):
    """vLLM flattens modules_in_block_to_quantize only when its first item is a list, then iterates every item (a name
    there is read letter by letter, which makes single letters match everything); a name first and a list after it
    is refused."""
    from splicer.formats.gptq import listed_modules

    assert listed_modules({"modules_in_block_to_quantize": [["a.b", "c"], "de"]}) == ["a.b", "c", "d", "e"]
    assert listed_modules({"modules_in_block_to_quantize": []}) is None  # vLLM scans the checkpoint
    assert listed_modules({"modules_in_block_to_quantize": [[]]}) == []
    build = _with_config(
        gptq_build, tmp_path / "build", lambda qc: qc.update(modules_in_block_to_quantize=["mlp.experts", ["self_attn.q_proj"]])
    )
    issues = inspect_checkpoint(open_checkpoint(build, "b"))["lint"]["issues"]
    assert any(i["naming"] == "vllm" and "mixes names and lists of names" in i["detail"] for i in issues), issues
