"""Splice correctness on both expert layouts: tensors, index, config semantics, dequantization."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from splicer.checkpoint import INDEX_NAME, open_checkpoint
from splicer.errors import SplicerError
from splicer.splice.core import splice
from splicer.splice.modules import list_modules
from splicer.splice.rules import check

PACKED = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
EXPERT = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def load_all(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / INDEX_NAME).read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / shard), "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def base_per_expert(base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base with fused 3-D experts sliced per expert, the independent way (torch indexing)."""
    out = {}
    for k, t in base.items():
        m = EXPERT.match(k)
        if not m:
            out[k] = t
            continue
        for e in range(t.shape[0]):
            if m.group(2) == "gate_up_proj":
                half = t.shape[1] // 2
                out[f"{m.group(1)}.{e}.gate_proj.weight"] = t[e, :half]
                out[f"{m.group(1)}.{e}.up_proj.weight"] = t[e, half:]
            else:
                out[f"{m.group(1)}.{e}.down_proj.weight"] = t[e]
    return out


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def quantized_modules(tensors) -> set[str]:
    return {k.rpartition(".")[0] for k in tensors if k.endswith(".weight_packed")}


def class_of(module: str) -> str:
    from splicer.arch.qwen3_5_moe import QWEN3_5_MOE

    return QWEN3_5_MOE.module_class(module)


# vLLM-side names written out by hand (vLLM 0.26: hf_to_vllm_mapper + packed_modules_mapping),
# so these checks do not depend on splicer's own name mapping.
VLLM_SHARDS = {
    "gdn": [
        "language_model.model.layers.0.linear_attn.in_proj_qkv",
        "language_model.model.layers.0.linear_attn.in_proj_z",
        "language_model.model.layers.2.linear_attn.out_proj",
    ],
    "attention": [
        "language_model.model.layers.3.self_attn.q_proj",
        "language_model.model.layers.3.self_attn.k_proj",
        "language_model.model.layers.3.self_attn.v_proj",
        "language_model.model.layers.3.self_attn.o_proj",
    ],
    "shared_expert": [
        "language_model.model.layers.1.mlp.shared_expert.gate_proj",
        "language_model.model.layers.1.mlp.shared_expert.up_proj",
        "language_model.model.layers.3.mlp.shared_expert.down_proj",
    ],
    "experts": ["language_model.model.layers.0.mlp.experts.0.gate_proj", "language_model.model.layers.3.mlp.experts.0.down_proj"],
    "lm_head": ["language_model.lm_head"],
}


def vllm_ignored(name: str, ignore: list[str]) -> bool:
    """vLLM's rule: exact dotted names are renamed to vLLM's prefixes, regexes are re.match'ed unchanged."""
    for e in ignore:
        if e.startswith("re:"):
            if re.match(e[3:], name):
                return True
        else:
            renamed = e.replace("model.language_model.", "language_model.model.", 1) if "." in e else e
            if renamed == name:
                return True
    return False


CLASSES = ["gdn", "attention", "shared_expert", "lm_head", "experts", "all"]


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
@pytest.mark.parametrize("restore", CLASSES)
def test_splice_restores_exactly(pairs, tmp_path, layout, restore):
    p = pairs[layout]
    out = tmp_path / "out"
    record = splice(str(p["lowlatency"]), str(p["base"]), out, restore, progress=False)
    build = load_all(p["lowlatency"])
    base = base_per_expert(load_all(p["base"]))
    got = load_all(out)
    restored_classes = {"gdn", "attention", "shared_expert", "lm_head", "experts"} if restore == "all" else {restore}
    restored = {m for m in quantized_modules(build) if class_of(m) in restored_classes}
    assert restored and record["restored_modules"] == len(restored)

    # Restored modules: the base's tensor, bit for bit; no packed tensor left.
    for m in restored:
        assert bit_equal(got[f"{m}.weight"], base[f"{m}.weight"]), m
        assert not any(f"{m}.{s}" in got for s in PACKED), m
    # Everything else: the build's tensor, bit for bit.
    expected_names = {k for k in build if k.rpartition(".")[0] not in restored} | {f"{m}.weight" for m in restored}
    assert set(got) == expected_names
    for k in expected_names - {f"{m}.weight" for m in restored}:
        assert bit_equal(got[k], build[k]), k

    # Index: every tensor listed once, in the shard that holds it, with the exact total size.
    index = json.loads((out / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(got)
    for name, shard in index["weight_map"].items():
        with safe_open(str(out / shard), "pt") as f:
            assert name in f.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())

    # Side files verbatim; splice.json present.
    for side in ("generation_config.json", "chat_template.jinja", "README.md"):
        assert (out / side).read_bytes() == (p["lowlatency"] / side).read_bytes()
    assert json.loads((out / "splice.json").read_text())["restored_classes"]

    # Config semantics under vLLM naming (hand-written names, independent of splicer's mapping).
    qc = json.loads((out / "config.json").read_text()).get("quantization_config")
    if restore == "all":
        assert qc is None  # nothing quantized is left
        return
    ignore = qc["ignore"]
    for cls, names in VLLM_SHARDS.items():
        for n in names:
            assert vllm_ignored(n, ignore) == (cls in restored_classes), (cls, n)
    assert not vllm_ignored("mtp.layers.0.mlp.experts.0.gate_proj", [e for e in ignore if e != "re:.*mtp.*"])
    for e in ignore:
        assert (
            not e.startswith("re:")
            or e.endswith("$")
            or e in json.loads((p["lowlatency"] / "config.json").read_text())["quantization_config"]["ignore"]
        )
    if "lm_head" in restored_classes:
        assert all(not any("lm_head" in t for t in g["targets"]) for g in qc["config_groups"].values())
        assert "group_1" not in qc["config_groups"]  # it targeted only the head


@pytest.mark.parametrize("restore", ["gdn", "lm_head", "experts", "attention,shared_expert"])
def test_output_dequantizes_with_compressed_tensors(pairs, tmp_path, restore):
    """compressed-tensors' own dequantizer reads the spliced config: restored modules equal the base."""
    from compressed_tensors.entrypoints.convert.converters import (
        CompressedTensorsDequantizer,
    )

    p = pairs["fused"]
    out = tmp_path / "out"
    splice(str(p["lowlatency"]), str(p["base"]), out, restore, progress=False)
    deq = CompressedTensorsDequantizer(str(out)).process(load_all(out))
    assert not any(k.rpartition(".")[2] in PACKED for k in deq), "every packed module must be targeted and dequantized"
    base = base_per_expert(load_all(p["base"]))
    build_deq = CompressedTensorsDequantizer(str(p["lowlatency"])).process(load_all(p["lowlatency"]))
    classes = set(restore.split(","))
    for k, t in deq.items():
        module = k.rpartition(".")[0]
        if class_of(module) in classes:
            assert bit_equal(t, base[k]), k
        else:
            assert bit_equal(t, build_deq[k]), k


def test_restoring_everything_gives_the_base(pairs, tmp_path):
    p = pairs["fused"]
    out = tmp_path / "all"
    splice(str(p["lowlatency"]), str(p["base"]), out, "all", progress=False)
    got, base = load_all(out), base_per_expert(load_all(p["base"]))
    assert set(got) == set(base)
    assert all(bit_equal(got[k], base[k]) for k in base)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert {k: v for k, v in config.items()} == {
        k: v for k, v in json.loads((p["lowlatency"] / "config.json").read_text()).items() if k != "quantization_config"
    }


def test_experts_only_build_all_restores_mtp_experts(pairs, tmp_path):
    """Seed-004-like build: routed experts quantized in the decoder and in the MTP layer."""
    p = pairs["fused"]
    out = tmp_path / "all"
    record = splice(str(p["experts-g32"]), str(p["base"]), out, "all", progress=False)
    assert record["restored_classes"] == ["experts", "mtp"]
    got, base = load_all(out), base_per_expert(load_all(p["base"]))
    assert set(got) == set(base) and all(bit_equal(got[k], base[k]) for k in base)


def test_experts_only_build_keep_mtp(pairs, tmp_path):
    p = pairs["fused"]
    out = tmp_path / "experts"
    splice(str(p["experts-g32"]), str(p["base"]), out, "experts", progress=False)
    got = load_all(out)
    assert "mtp.layers.0.mlp.experts.0.gate_proj.weight_packed" in got
    assert "model.language_model.layers.0.mlp.experts.0.gate_proj.weight" in got
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert list(qc["config_groups"]) == ["group_0"]  # still targets the MTP experts
    ckpt = open_checkpoint(out, "out")
    assert check(list_modules(ckpt), qc, ckpt.arch).issues == []


def test_untouched_shards_are_hard_links(pairs, tmp_path):
    p = pairs["fused"]
    out = tmp_path / "out"
    record = splice(str(p["lowlatency"]), str(p["base"]), out, "lm_head", progress=False)
    assert record["shards"]["rewritten"] == 1 and record["shards"]["linked"] >= 5
    index = json.loads((out / INDEX_NAME).read_text())
    head_shard = index["weight_map"]["lm_head.weight"]
    for shard in set(index["weight_map"].values()):
        same_inode = (out / shard).stat().st_ino == (p["lowlatency"] / shard).stat().st_ino
        assert same_inode == (shard != head_shard), shard


def test_layer_subset_writes_explicit_layers(pairs, tmp_path):
    p = pairs["fused"]
    out = tmp_path / "out"
    splice(str(p["lowlatency"]), str(p["base"]), out, "gdn", layers="0,2", progress=False)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert vllm_ignored("language_model.model.layers.0.linear_attn.in_proj_qkv", qc["ignore"])
    assert not vllm_ignored("language_model.model.layers.1.linear_attn.in_proj_qkv", qc["ignore"])
    got = load_all(out)
    assert "model.language_model.layers.1.linear_attn.in_proj_qkv.weight_packed" in got
    assert "model.language_model.layers.2.linear_attn.in_proj_qkv.weight" in got


def test_splitting_a_fused_group_is_refused(pairs, tmp_path):
    p = pairs["fused"]
    with pytest.raises(SplicerError, match="split .*in_proj_qkvz"):
        splice(str(p["lowlatency"]), str(p["base"]), tmp_path / "out", "gdn", modules_regex=r"in_proj_qkv$", progress=False)
    with pytest.raises(SplicerError, match="split .*mlp.experts"):
        splice(str(p["lowlatency"]), str(p["base"]), tmp_path / "out", "experts", modules_regex=r"experts\.0\.", progress=False)
    assert not (tmp_path / "out").exists()


def test_hub_base_downloads_only_the_needed_shards(pairs, tmp_path, monkeypatch):
    """A Hub repo id as BASE: the index first, then only the shards that hold restored tensors (fake hub, no network)."""
    import fnmatch
    import shutil

    import huggingface_hub

    remote = pairs["fused"]["base"]
    snapshot = tmp_path / "cache" / "snapshot"
    asked = []

    def hf_hub_download(repo_id, filename, **kw):
        assert repo_id == "org/base"
        snapshot.mkdir(parents=True, exist_ok=True)
        shutil.copy(remote / filename, snapshot / filename)
        return str(snapshot / filename)

    def snapshot_download(repo_id, allow_patterns=None, **kw):
        asked.append(list(allow_patterns))
        snapshot.mkdir(parents=True, exist_ok=True)
        for f in remote.iterdir():
            if any(fnmatch.fnmatch(f.name, pat) for pat in allow_patterns):
                shutil.copy(f, snapshot / f.name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    out = tmp_path / "out"
    splice(str(pairs["fused"]["lowlatency"]), "org/base", out, "attention", progress=False)
    index = json.loads((remote / INDEX_NAME).read_text())["weight_map"]
    needed = {index["model.language_model.layers.3.self_attn.q_proj.weight"]}
    shards_asked = {p for p in asked[0] if p.endswith(".safetensors")}
    assert shards_asked == needed  # one of the base's six shards
    assert sorted(q.name for q in snapshot.glob("*.safetensors")) == sorted(needed)
    base = base_per_expert(load_all(remote))
    assert bit_equal(
        load_all(out)["model.language_model.layers.3.self_attn.q_proj.weight"],
        base["model.language_model.layers.3.self_attn.q_proj.weight"],
    )


def test_a_problem_the_build_already_has_does_not_block_other_splices(pairs, tmp_path):
    """Seed 000's recipe listed a bare `lm_head` in ignore while the head is stored INT8: compressed-tensors reads it as
    BF16, vLLM (which does not rename `lm_head`) as INT8. Restoring gdn must still work, and say what it inherited."""
    import shutil

    build = tmp_path / "build"
    shutil.copytree(pairs["fused"]["lowlatency"], build)
    cfg = json.loads((build / "config.json").read_text())
    cfg["quantization_config"]["ignore"].append("lm_head")
    (build / "config.json").write_text(json.dumps(cfg))
    record = splice(str(build), str(pairs["fused"]["base"]), tmp_path / "out", "gdn", progress=False)
    assert record["inherited_lint"] == ["hf: lm_head is stored packed but read otherwise"]
    # restoring the head itself clears it
    record = splice(str(build), str(pairs["fused"]["base"]), tmp_path / "out2", "lm_head", progress=False)
    assert record["inherited_lint"] == []


def test_verify_refuses_a_config_that_misreads_a_restored_module(pairs, monkeypatch, tmp_path):
    """The safety net itself: an ignore entry generator that writes HF-only regexes is caught before writing."""
    import splicer.formats.module_regexes as regexes

    orig = regexes.ignore_entries
    monkeypatch.setattr(
        regexes,
        "ignore_entries",
        lambda *a: [e.replace(r"(model\.language_model|language_model\.model)", r"model\.language_model") for e in orig(*a)],
    )
    with pytest.raises(SplicerError, match="would be misread .*vllm naming"):
        splice(str(pairs["fused"]["lowlatency"]), str(pairs["fused"]["base"]), tmp_path / "out", "gdn", progress=False)
    assert not (tmp_path / "out").exists()
