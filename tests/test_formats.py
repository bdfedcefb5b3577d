"""Every compressed-tensors format splicer reads: fixtures made with compressed-tensors' presets and compressors,
read by inspect, dequantized by the torch backend, spliced class by class, and refused when a fused group would split."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from splicer.backends.torch_ref import TorchBackend
from splicer.cli import main
from splicer.checkpoint import open_checkpoint
from splicer.fixtures import write_build
from splicer.inspect import inspect_checkpoint
from splicer.modules import list_modules
from splicer.quantize import PRESETS, dequantize_module, preset_scheme, quantize_weight

# build kind -> (what inspect reports for attention, the format in config.json, largest relative weight error)
FORMATS = {
    "w8a8": ("int8 channel", "int-quantized", 0.02),
    "fp8-dynamic": ("fp8 channel", "float-quantized", 0.05),
    "fp8-block": ("fp8 block128x128", "float-quantized", 0.05),
    "nvfp4a16": ("nvfp4 g16", "nvfp4-pack-quantized", 0.15),
    "w8a16": ("int8 g128", "pack-quantized", 0.02),
    "mixed": ("fp8 channel", "mixed-precision", 0.05),
}


@pytest.fixture(scope="module")
def builds(pairs, tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    return {kind: write_build(pairs["fused"]["base"], root / kind, kind) for kind in FORMATS}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("preset", PRESETS)
def test_dequantize_matches_compressed_tensors(preset):
    """Our dequantizer (dequantize with the scheme's args) agrees with the format's own compressor where that one is
    right (weights whose dims the block divides), and round to nearest lands near the weight."""
    from compressed_tensors.compressors import BaseCompressor

    torch.manual_seed(0)
    w = (torch.randn(256, 384) / 20).to(torch.bfloat16)
    scheme = preset_scheme(preset)
    stored = quantize_weight(w, scheme)
    ours = dequantize_module(stored, scheme, torch.float32)
    theirs = BaseCompressor.get_value_from_registry(scheme.format).decompress(dict(stored), scheme)["weight"].float()
    assert torch.allclose(ours, theirs, rtol=1e-2, atol=1e-6)
    assert _rel(ours, w) < {"W4A16": 0.15, "NVFP4A16": 0.15}.get(preset, 0.05)


def test_block_fp8_whose_block_does_not_divide_the_weight():
    """FP8_BLOCK on a 200 x 136 weight: 2 x 2 scales of 128 x 128 tiles, the last ones short; dequantized with the
    scheme's block size, not one guessed from the scale's shape."""
    torch.manual_seed(1)
    w = (torch.randn(200, 136) / 20).to(torch.bfloat16)
    scheme = preset_scheme("FP8_BLOCK")
    stored = quantize_weight(w, scheme)
    assert tuple(stored["weight_scale"].shape) == (2, 2)
    assert _rel(dequantize_module(stored, scheme), w) < 0.05


@pytest.mark.parametrize("kind", FORMATS)
def test_inspect_reads_each_format(builds, kind):
    scheme, fmt, _ = FORMATS[kind]
    info = inspect_checkpoint(open_checkpoint(builds[kind], "build"))
    assert info["format"] == fmt
    assert info["classes"]["attention"]["schemes"] == [scheme]
    assert info["classes"]["attention"]["quantized"] == info["classes"]["attention"]["modules"]
    assert info["lint"]["issues"] == []
    if kind == "mixed":
        assert info["classes"]["experts"]["schemes"] == ["nvfp4 g16"] and info["classes"]["lm_head"]["schemes"] == ["int8 g128"]


@pytest.mark.parametrize("kind", FORMATS)
def test_torch_backend_dequantizes_each_format(pairs, builds, kind):
    base, build = TorchBackend("cpu"), TorchBackend("cpu")
    base.load(pairs["fused"]["base"])
    build.load(builds[kind])
    pb, pq = dict(base.model.named_parameters()), dict(build.model.named_parameters())
    bound = FORMATS[kind][2]
    for name in ("model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.3.self_attn.q_proj.weight",
                 "model.layers.1.mlp.experts.gate_up_proj", "model.layers.2.mlp.shared_expert.down_proj.weight"):
        rel = _rel(pq[name], pb[name])
        assert 0 < rel < (0.15 if kind == "mixed" and "experts" in name else bound), (name, rel)
    assert torch.equal(pq["model.layers.0.linear_attn.in_proj_a.weight"], pb["model.layers.0.linear_attn.in_proj_a.weight"])


@pytest.mark.parametrize("kind", FORMATS)
def test_splice_each_class_of_each_format(pairs, builds, kind, tmp_path):
    """Each class restored alone: its quantized tensors gone, the base's BF16 weight in their place, the rest as built,
    and both readers of the new config agree with the tensors (inspect's lint is clean)."""
    build = open_checkpoint(builds[kind], "build")
    quantized = sorted({m.cls for m in list_modules(build).values() if m.quantized})
    for cls in quantized:
        out = tmp_path / cls
        assert main(["splice", "--restore", cls, str(builds[kind]), str(pairs["fused"]["base"]), "-o", str(out)]) == 0
        spliced = open_checkpoint(out, "out")
        after = list_modules(spliced)
        assert all(not m.quantized for m in after.values() if m.cls == cls)
        assert all(m.quantized for n, m in list_modules(build).items() if m.quantized and m.cls != cls and n in after)
        assert inspect_checkpoint(spliced)["lint"]["issues"] == []
        restored = next(n for n, m in after.items() if m.cls == cls and n in list_modules(build) and list_modules(build)[n].quantized)
        with safe_open(str(out / spliced.weight_map[f"{restored}.weight"]), "pt") as f:
            got = f.get_tensor(f"{restored}.weight")
        assert got.dtype == torch.bfloat16 and not any(t.startswith(restored + ".weight_") for t in spliced.weight_map)


@pytest.mark.parametrize("kind", FORMATS)
def test_all_restored_scores_as_the_base(pairs, builds, kind, tmp_path):
    out = tmp_path / "all"
    assert main(["splice", "--restore", "all", str(builds[kind]), str(pairs["fused"]["base"]), "-o", str(out)]) == 0
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    seqs = [list(range(10, 60)), list(range(300, 340))]
    base, spliced = TorchBackend("cpu"), TorchBackend("cpu")
    base.load(pairs["fused"]["base"])
    spliced.load(out)
    for a, b in zip(base.score(seqs, top_k=20), spliced.score(seqs, top_k=20)):
        assert torch.equal(a.topk_logprobs, b.topk_logprobs) and torch.equal(a.topk_ids, b.topk_ids)


@pytest.mark.parametrize("kind", FORMATS)
def test_split_fused_group_is_refused_in_each_format(pairs, builds, kind, tmp_path, capsys):
    code = main(["splice", "--restore", "attention", "--modules", r"q_proj$", str(builds[kind]), str(pairs["fused"]["base"]),
                 "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "would split" in err and "qkv_proj" in err
    assert not (tmp_path / "out").exists()
