"""Every format splicer reads: fixtures made with compressed-tensors' presets and compressors (native FP8 and AWQ in
their own layouts), read by inspect, dequantized by the torch backend, spliced class by class, and refused when a fused
group would split; the skip lists of native FP8 and AWQ read as vLLM and transformers read them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from splicer.backends.torch_ref import TorchBackend
from splicer.checkpoint import open_checkpoint
from splicer.cli import main
from splicer.fixtures.core import write_build
from splicer.formats.quantize import PRESETS, dequantize_module, preset_scheme, quantize_weight
from splicer.splice.inspect import inspect_checkpoint
from splicer.splice.modules import list_modules

# build kind -> (what inspect reports for attention, the format in config.json, largest relative weight error)
FORMATS = {
    "w8a8": ("int8 channel", "int-quantized", 0.02),
    "fp8-dynamic": ("fp8 channel", "float-quantized", 0.05),
    "fp8-block": ("fp8 block128x128", "float-quantized", 0.05),
    "nvfp4a16": ("nvfp4 g16", "nvfp4-pack-quantized", 0.15),
    "w8a16": ("int8 g128", "pack-quantized", 0.02),
    "mixed": ("fp8 channel", "mixed-precision", 0.05),
    "fp8-native": ("fp8 block128x128", "block128x128", 0.05),
    "awq": ("int4 g128", "gemm", 0.15),
    "fbgemm-fp8": ("fp8 channel", "per-channel", 0.05),
}
# Builds whose routed experts stay BF16 (their format's loaders quantize no MoE layer).
BF16_EXPERTS = ("fbgemm-fp8",)


@pytest.fixture(scope="module")
def builds(pairs, tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    return {kind: write_build(pairs["fused"]["base"], root / kind, kind) for kind in FORMATS}


SEQS = [list(range(10, 60)), list(range(300, 340))]


@pytest.fixture(scope="module")
def base_model(pairs):
    """The base loaded once for every format: its parameters and its scores of SEQS."""
    base = TorchBackend("cpu")
    base.load(pairs["fused"]["base"])
    return {"params": {n: p.detach().clone() for n, p in base.model.named_parameters()}, "scores": base.score(SEQS, top_k=20)}


def _lint_issues(info: dict, kind: str) -> list[dict]:
    """inspect's lint issues, less the one every AWQ MoE build has by design: transformers 5 cannot load AWQ experts."""
    return [i for i in info["lint"]["issues"] if not (kind == "awq" and i["check"] == "hf-cannot-load")]


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
    assert _lint_issues(info, kind) == []
    if kind == "awq":
        assert [(i["check"], i["naming"]) for i in info["lint"]["issues"]] == [("hf-cannot-load", "hf")]
    if kind == "mixed":
        assert info["classes"]["experts"]["schemes"] == ["nvfp4 g16"] and info["classes"]["lm_head"]["schemes"] == ["int8 g128"]


@pytest.mark.parametrize("kind", FORMATS)
def test_torch_backend_dequantizes_each_format(base_model, builds, kind):
    build = TorchBackend("cpu")
    build.load(builds[kind])
    pb, pq = base_model["params"], dict(build.model.named_parameters())
    bound = FORMATS[kind][2]
    for name in (
        "model.layers.0.linear_attn.in_proj_qkv.weight",
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.1.mlp.experts.gate_up_proj",
        "model.layers.2.mlp.shared_expert.down_proj.weight",
    ):
        rel = _rel(pq[name], pb[name])
        if kind in BF16_EXPERTS and "experts" in name:
            assert rel == 0, (name, rel)
            continue
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
        assert _lint_issues(inspect_checkpoint(spliced), kind) == []
        restored = next(
            n for n, m in after.items() if m.cls == cls and n in list_modules(build) and list_modules(build)[n].quantized
        )
        with safe_open(str(out / spliced.weight_map[f"{restored}.weight"]), "pt") as f:
            got = f.get_tensor(f"{restored}.weight")
        assert got.dtype == torch.bfloat16 and not any(t.startswith(restored + ".weight_") for t in spliced.weight_map)


@pytest.mark.parametrize("kind", FORMATS)
def test_all_restored_scores_as_the_base(pairs, base_model, builds, kind, tmp_path):
    out = tmp_path / "all"
    assert main(["splice", "--restore", "all", str(builds[kind]), str(pairs["fused"]["base"]), "-o", str(out)]) == 0
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    spliced = TorchBackend("cpu")
    spliced.load(out)
    for a, b in zip(base_model["scores"], spliced.score(SEQS, top_k=20)):
        assert torch.equal(a.topk_logprobs, b.topk_logprobs) and torch.equal(a.topk_ids, b.topk_ids)


@pytest.mark.parametrize("kind", FORMATS)
def test_split_fused_group_is_refused_in_each_format(pairs, builds, kind, tmp_path, capsys):
    code = main(
        [
            "splice",
            "--restore",
            "attention",
            "--modules",
            r"q_proj$",
            str(builds[kind]),
            str(pairs["fused"]["base"]),
            "-o",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "would split" in err and "qkv_proj" in err
    assert not (tmp_path / "out").exists()


def test_awq_layout_reads_back_through_compressed_tensors_and_autoawq_formula():
    """quantize_awq's packing, read back by compressed-tensors' AutoAWQ converter and by AutoAWQ's own formula
    (packing_utils.dequantize_gemm: shift out the nibbles, undo the [0,2,4,6,1,3,5,7] order, (q - z) * s, transpose),
    written here independently of splicer.formats.awq_tensors."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    from splicer.formats.awq_tensors import awq_to_compressed_tensors, dequantize_awq, quantize_awq

    torch.manual_seed(2)
    w = (torch.randn(96, 256) / 20).to(torch.bfloat16)
    t = quantize_awq(w, 64)
    assert [tuple(t[k].shape) for k in ("qweight", "qzeros", "scales")] == [(256, 12), (4, 12), (4, 96)]
    assert t["scales"].dtype == torch.float16 and t["qweight"].dtype == torch.int32
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=64)
    g = w.float().reshape(96, 4, 64)
    scale, zero = calculate_qparams(g.amin(-1), g.amax(-1), args)
    values, got_scale, got_zero = awq_to_compressed_tensors(t, 64)
    assert torch.equal(values, quantize(w.float(), scale.half().float(), zero, args, dtype=torch.int8))
    assert torch.equal(got_zero.to(torch.int8), zero.to(torch.int8)) and torch.equal(got_scale, scale.half())
    shifts = torch.arange(0, 32, 4)
    reverse = torch.arange(96).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].reshape(-1)

    def unpack(x):
        return ((x[:, :, None] >> shifts) & 15).reshape(x.shape[0], -1)[:, reverse]

    rows = torch.arange(256) // 64
    reference = ((unpack(t["qweight"]) - unpack(t["qzeros"])[rows]).float() * t["scales"].float()[rows]).t()
    assert torch.allclose(dequantize_awq(t, 64, torch.float32), reference, atol=1e-6)
    assert _rel(reference, w) < 0.15


def _edit_quant_config(src, dst, edit):
    """A copy of build `src` (tensors hard-linked) with its quantization_config changed by `edit`."""
    import os

    dst.mkdir()
    for p in src.iterdir():
        if p.name != "config.json":
            os.link(p, dst / p.name)
    config = json.loads((src / "config.json").read_text())
    edit(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _lint(folder, kind="fp8-native"):
    return _lint_issues(inspect_checkpoint(open_checkpoint(folder, "build")), kind)


def test_native_fp8_one_listed_expert_unquantizes_the_layer_in_vllm(builds, tmp_path):
    """vLLM's FP8 loader skips a whole MoE layer when its prefix is a substring of any listed name with "experts" in
    it; transformers decides the layer's fused experts module by its own name, so it still quantizes them."""
    expert = "model.language_model.layers.1.mlp.experts.3.gate_proj"
    folder = _edit_quant_config(builds["fp8-native"], tmp_path / "b", lambda qc: qc["modules_to_not_convert"].append(expert))
    issues = _lint(folder)
    assert [(i["check"], i["naming"]) for i in issues] == [("stored-quantized-read-bf16", "vllm")] * 20 + [("more", "vllm")]
    assert "layers.1.mlp.experts.0." in issues[0]["detail"]


def test_fbgemm_fp8_experts_stored_fp8_are_flagged(builds, tmp_path):
    """vLLM's FBGEMM FP8 loader quantizes only LinearBase layers, so a MoE layer loads BF16 whatever the list says, and
    transformers replaces only nn.Linear: layer 1's experts stored FP8 under fbgemm_fp8 are flagged, not read as FP8."""
    import os

    from safetensors.torch import load_file, save_file

    from splicer.formats.fbgemm_fp8 import FORMAT

    src, folder = builds["fbgemm-fp8"], tmp_path / "b"
    folder.mkdir()
    index = json.loads((src / "model.safetensors.index.json").read_text())
    experts = "model.language_model.layers.1.mlp.experts."
    shards = {f for t, f in index["weight_map"].items() if t.startswith(experts)}
    for p in src.iterdir():
        if p.name not in shards and p.name != "model.safetensors.index.json":
            os.link(p, folder / p.name)
    for shard in shards:
        tensors = load_file(str(src / shard))
        for name in [t for t in tensors if t.startswith(experts) and t.endswith(".weight")]:
            packed = quantize_weight(tensors.pop(name), FORMAT.module_scheme({}, None))
            for leaf, t in packed.items():
                tensors[name.rpartition(".")[0] + "." + leaf] = t.contiguous()
                index["weight_map"][name.rpartition(".")[0] + "." + leaf] = shard
        save_file(tensors, str(folder / shard), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    issues = inspect_checkpoint(open_checkpoint(folder, "build"))["lint"]["issues"]
    checks = {(i["check"], i["naming"]) for i in issues}
    assert ("stored-quantized-read-bf16", "vllm") in checks and ("hf-cannot-load", "hf") in checks
    assert all("layers.1.mlp.experts." in i["detail"] for i in issues if i["check"] == "stored-quantized-read-bf16")


def test_awq_substring_entry_on_one_shard_is_refused_as_vllm_would(builds, tmp_path):
    """AWQ entries are substrings: `self_attn.q_proj` listed alone leaves k/v quantized, and vLLM refuses the fused
    qkv_proj with shards that disagree."""
    folder = _edit_quant_config(builds["awq"], tmp_path / "b", lambda qc: qc["modules_to_not_convert"].append("self_attn.q_proj"))
    checks = {(i["check"], i["naming"]) for i in _lint(folder, "awq")}
    assert ("vllm-refuses", "vllm") in checks and ("stored-quantized-read-bf16", "hf") in checks
    assert any("some but not all shards" in i["detail"] and "qkv_proj" in i["detail"] for i in _lint(folder, "awq"))


def test_awq_empty_list_is_detected_by_vllm_and_spliced_into_a_full_list(pairs, builds, tmp_path):
    """With no modules_to_not_convert vLLM lists, itself, the parent of every tensor that is float while its siblings
    are (auto_awq.py maybe_update_config). That names `...linear_attn` (its A_log and dt_bias), a substring of every
    GDN projection, so vLLM builds the quantized GDN projections unquantized; and it misses BF16 routed experts (the
    MoE check wants an entry inside the layer prefix `...mlp.experts`). A splice that adds entries turns the detection
    off, so it writes the modules stored unquantized too, by full name, and the result reads clean."""
    folder = _edit_quant_config(builds["awq"], tmp_path / "b", lambda qc: qc.update(modules_to_not_convert=None))
    details = [i["detail"] for i in _lint(folder, "awq") if i["naming"] == "vllm" and i["check"] != "more"]
    assert any(
        d.startswith(
            "model.language_model.layers.0.linear_attn.in_proj_qkv is stored packed but the config reads it as unquantized"
        )
        for d in details
    )
    assert any(d.startswith("mtp.layers.0.mlp.experts.0.") and "stored BF16" in d for d in details)
    assert not any("self_attn" in d for d in details)
    out = tmp_path / "out"
    assert main(["splice", "--restore", "attention", str(folder), str(pairs["fused"]["base"]), "-o", str(out)]) == 0
    listed = json.loads((out / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert "model.language_model.layers.0.linear_attn.in_proj_a" in listed and "lm_head" in listed
    assert (
        "model.language_model.layers.3.self_attn.q_proj" in listed and "model.language_model.layers.0.linear_attn" not in listed
    )
    assert _lint(out, "awq") == []


def test_native_fp8_ignored_layers_key_is_the_one_spliced(pairs, builds, tmp_path):
    """A build that lists under ignored_layers (vLLM's key; transformers takes it as an alias) gets its entries there."""

    def to_ignored_layers(qc):
        qc["ignored_layers"] = qc.pop("modules_to_not_convert")

    folder = _edit_quant_config(builds["fp8-native"], tmp_path / "b", to_ignored_layers)
    assert _lint(folder) == []
    out = tmp_path / "out"
    assert main(["splice", "--restore", "gdn", str(folder), str(pairs["fused"]["base"]), "-o", str(out)]) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "modules_to_not_convert" not in qc and "model.language_model.layers.0.linear_attn.in_proj_qkv" in qc["ignored_layers"]
    assert _lint(out) == []


def test_native_fp8_empty_ignored_layers_beside_a_full_list_is_left_empty(pairs, builds, tmp_path):
    """vLLM reads modules_to_not_convert when ignored_layers is empty; a splice that filled ignored_layers would hide
    that list from it, so the entries go to modules_to_not_convert."""
    folder = _edit_quant_config(builds["fp8-native"], tmp_path / "b", lambda qc: qc.update(ignored_layers=[]))
    out = tmp_path / "out"
    assert main(["splice", "--restore", "gdn", str(folder), str(pairs["fused"]["base"]), "-o", str(out)]) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["ignored_layers"] == [] and "model.language_model.layers.0.linear_attn.in_proj_qkv" in qc["modules_to_not_convert"]
    assert _lint(out) == []


def test_native_fp8_block_wider_than_a_small_dimension():
    """A 2 x 256 weight in 128 x 128 blocks has a 1 x 2 scale: block 128x128 by the config, though the scale's shape
    alone would also fit 2x128."""
    from splicer.formats.layouts import weight_scale_strategy
    from splicer.formats.quantize import quantize_native_fp8

    stored = quantize_native_fp8(torch.randn(2, 256, dtype=torch.bfloat16), [128, 128])
    assert tuple(stored["weight_scale_inv"].shape) == (1, 2)
    assert weight_scale_strategy((2, 256), (1, 2), (128, 128)) == "block128x128"
    assert weight_scale_strategy((2, 256), (1, 2)) == "block2x128"


def test_torch_backend_refuses_an_awq_layout_it_cannot_read(pairs, builds, tmp_path, capsys):
    folder = _edit_quant_config(builds["awq"], tmp_path / "b", lambda qc: qc.update(version="gemv"))
    code = main(
        ["score", str(pairs["fused"]["base"]), str(folder), "-o", str(tmp_path / "out"), "--backend", "torch", "--plan", "demo"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "torch backend cannot read AWQ version 'gemv'" in err and len(err.strip().splitlines()) == 1


def test_inspect_flags_an_awq_config_vllm_refuses(builds, tmp_path):
    folder = _edit_quant_config(builds["awq"], tmp_path / "b", lambda qc: qc.update(bits="4"))
    assert any(i["check"] == "config-invalid" and "AWQ bits '4'" in i["detail"] for i in _lint(folder, "awq"))


def test_native_fp8_two_lists_that_differ_are_reported(builds, tmp_path):
    folder = _edit_quant_config(builds["fp8-native"], tmp_path / "b", lambda qc: qc.update(ignored_layers=["lm_head"]))
    assert "skip-lists-differ" in {i["check"] for i in _lint(folder)}


@pytest.mark.parametrize(
    "kind, edit, message",
    [
        ("fp8-native", lambda qc: qc.update(activation_scheme="static"), "block FP8 needs activation_scheme 'dynamic'"),
        ("fp8-native", lambda qc: qc.update(weight_block_size=[128]), "weight_block_size [128] is not two positive integers"),
        ("fp8-native", lambda qc: qc.update(modules_to_not_convert="lm_head"), "must be a list of module names"),
        ("awq", lambda qc: qc.update(bits=8), "AWQ bits 8"),
        ("awq", lambda qc: qc.update(version="gemv"), "AWQ version 'gemv'"),
        ("awq", lambda qc: qc.pop("zero_point"), "no zero_point"),
        ("fbgemm-fp8", lambda qc: qc.pop("activation_scale_ub"), "needs a positive activation_scale_ub"),
        ("fbgemm-fp8", lambda qc: qc.pop("modules_to_not_convert"), "has no modules_to_not_convert"),
    ],
)
def test_bad_skip_list_configs_are_refused(pairs, builds, tmp_path, capsys, kind, edit, message):
    """Configs vLLM's FP8 or AWQ loader would refuse: splice says so in one line and writes nothing."""
    folder = _edit_quant_config(builds[kind], tmp_path / "b", edit)
    code = main(["splice", "--restore", "gdn", str(folder), str(pairs["fused"]["base"]), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "qc, named",
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quant_method 'modelopt'"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemv"}, "AWQ version 'gemv'"),
    ],
)
def test_inspect_says_plainly_which_formats_it_cannot_read(builds, tmp_path, capsys, qc, named):
    folder = _edit_quant_config(builds["w8a16"], tmp_path / "b", lambda old: (old.clear(), old.update(qc)))
    assert main(["inspect", str(folder)]) == 2
    err = capsys.readouterr().err
    assert named in err and "splicer cannot read" in err and "--backend vllm" in err and len(err.strip().splitlines()) == 1


def _with_static_input_scales(src, dst, native: bool):
    """A copy of an FP8 build whose activations are static: every quantized module gets an `input_scale` [1] (as
    llm-compressor's FP8 scheme or a static native FP8 export stores it), and the config says so. Native FP8 takes
    static activations with per-tensor weight scales only (vLLM refuses blocks with them), so its block-quantized
    weights are dequantized and quantized again per tensor."""
    from safetensors.torch import load_file, save_file

    from splicer.formats.quantize import native_fp8_scheme, quantize_native_fp8

    dst.mkdir()
    index = json.loads((src / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(src / shard))
        for name in [n for n in tensors if n.endswith((".weight_scale", ".weight_scale_inv"))]:
            module = name.rpartition(".")[0]
            if native:
                stored = {"weight": tensors.pop(f"{module}.weight"), "weight_scale_inv": tensors.pop(name)}
                del index["weight_map"][name]
                per_tensor = quantize_native_fp8(dequantize_module(stored, native_fp8_scheme([128, 128])))
                tensors.update({f"{module}.{k}": v for k, v in per_tensor.items()})
                index["weight_map"][f"{module}.weight_scale"] = shard
            tensors[f"{module}.input_scale"] = torch.tensor([0.02], dtype=torch.float32)
            index["weight_map"][f"{module}.input_scale"] = shard
        save_file(tensors, str(dst / shard), metadata={"format": "pt"})
    for p in src.iterdir():
        if not p.name.endswith(".safetensors") and p.name not in ("config.json", "model.safetensors.index.json"):
            (dst / p.name).write_bytes(p.read_bytes())
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((src / "config.json").read_text())
    qc = config["quantization_config"]
    if native:
        qc["activation_scheme"] = "static"
        del qc["weight_block_size"]
    else:
        for g in qc["config_groups"].values():
            g["input_activations"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("kind, scheme", [("fp8-dynamic", "fp8 channel"), ("fp8-native", "fp8 tensor")])
def test_fp8_with_static_activation_scales_splices(pairs, builds, kind, scheme, tmp_path):
    """FP8 with activation scales: a restored module's input_scale goes with its other quantized tensors, and both
    readers read the result."""
    folder = _with_static_input_scales(builds[kind], tmp_path / "static", native=kind == "fp8-native")
    info = inspect_checkpoint(open_checkpoint(folder, "build"))
    assert info["classes"]["gdn"]["schemes"] == ["bf16", scheme] and _lint_issues(info, kind) == []
    out = tmp_path / "gdn"
    assert main(["splice", "--restore", "gdn", str(folder), str(pairs["fused"]["base"]), "-o", str(out)]) == 0
    weight_map = open_checkpoint(out, "out").weight_map
    assert not any(t.endswith("linear_attn.in_proj_qkv.input_scale") for t in weight_map)
    assert any(t.endswith("self_attn.q_proj.input_scale") for t in weight_map)
    assert _lint(out) == []
    out = tmp_path / "all"
    assert main(["splice", "--restore", "all", str(folder), str(pairs["fused"]["base"]), "-o", str(out)]) == 0
    assert not any(t.endswith((".input_scale", ".weight_scale")) for t in open_checkpoint(out, "out").weight_map)


@pytest.mark.parametrize("backend", ["vllm", "torch"])
def test_a_build_splicer_cannot_read_is_left_to_vllm(pairs, builds, tmp_path, backend):
    """A checkpoint row in a format splicer's tables do not cover (bitsandbytes here) is opened and checked against
    the base for the vLLM backend, which loads it as it is; the torch backend, which must dequantize it, refuses it in
    one line before the run."""
    from splicer.ablate.common import AblateSettings
    from splicer.ablate.run import open_checkpoint_rows
    from splicer.arch import all_classes
    from splicer.errors import SplicerError
    from splicer.plans.plan import add_checkpoints, load_plan

    folder = _edit_quant_config(
        builds["w8a16"],
        tmp_path / "bnb",
        lambda qc: (qc.clear(), qc.update(quant_method="bitsandbytes", load_in_4bit=True, bnb_4bit_quant_type="nf4")),
    )
    plan = load_plan("demo", all_classes())
    add_checkpoints(plan, [f"bnb={folder}"])
    base = open_checkpoint(pairs["fused"]["base"], "base")
    if backend == "vllm":
        rows = open_checkpoint_rows(plan, {"bnb"}, base, AblateSettings(backend="vllm"))
        assert rows["bnb"].quantization_config["quant_method"] == "bitsandbytes"
    else:
        with pytest.raises(
            SplicerError,
            match=r"row bnb: .*the torch backend cannot read quant_method 'bitsandbytes'; "
            r"score it with --backend vllm",
        ):
            open_checkpoint_rows(plan, {"bnb"}, base, AblateSettings(backend="torch"))


@pytest.mark.parametrize(
    "kind, qc, stored",
    [
        ("awq", {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, "GPTQ or AWQ"),
        ("fp8-native", {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}, "FP8"),
    ],
)
def test_a_config_of_another_format_than_the_tensors_is_named(builds, tmp_path, capsys, kind, qc, stored):
    folder = _edit_quant_config(builds[kind], tmp_path / "b", lambda old: (old.clear(), old.update(qc)))
    assert main(["inspect", str(folder)]) == 2
    err = capsys.readouterr().err
    assert (
        f"is stored as {stored}" in err
        and f"says quant_method {qc['quant_method']!r}" in err
        and len(err.strip().splitlines()) == 1
    )


def test_every_format_implements_the_interface_and_has_a_storage_layout():
    """The registry holds one QuantFormat per quant_method, each with every method of the interface, and the layout
    table and the registry name the same quant_methods (a format without a layout could not list its modules)."""
    from splicer.formats.base import QuantFormat
    from splicer.formats.layouts import READ_QUANT_METHODS
    from splicer.formats.registry import registry

    formats = registry()
    assert set(formats) == set(READ_QUANT_METHODS)
    for method, fmt in formats.items():
        assert isinstance(fmt, QuantFormat) and fmt.quant_method == method
        assert not getattr(type(fmt), "__abstractmethods__", None), method


@pytest.mark.parametrize("qc", [{"quant_method": "bitsandbytes"}, {"quant_method": "awq_marlin"}, {"quant_method": None}])
def test_one_lookup_refuses_an_unknown_quant_method_naming_every_registered_format(qc):
    from splicer.errors import SplicerError
    from splicer.formats.registry import read_format, registry

    with pytest.raises(SplicerError) as err:
        read_format(qc, "build b")
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"build b uses quant_method {qc['quant_method']!r}; splicer handles ")
    for fmt in registry().values():
        assert fmt.read_as in message


@pytest.mark.parametrize(
    "qc, method",
    [
        ({"quant_method": "compressed-tensors", "config_groups": {}}, "compressed-tensors"),
        ({"quant_method": "gptq", "bits": 4}, "gptq"),
        ({"quant_method": "awq", "version": "gemm"}, "awq"),
        ({"quant_method": "fp8"}, "fp8"),
        ({"quant_method": "fbgemm_fp8"}, "fbgemm_fp8"),
        ({}, "compressed-tensors"),  # no config: read as one that targets nothing
        ({"quant_method": "bitsandbytes"}, "compressed-tensors"),
    ],
)
def test_the_lookup_picks_the_format_by_quant_method(qc, method):
    from splicer.formats.registry import format_of, format_or_default

    assert format_or_default(qc).quant_method == method
    known = ("compressed-tensors", "gptq", "awq", "fp8", "fbgemm_fp8")
    assert (format_of(qc) is None) == (qc.get("quant_method") not in known)
