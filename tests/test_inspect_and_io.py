"""`inspect` figures and lint; the safetensors header reader and streaming writer."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from splicer.checkpoint import open_checkpoint
from splicer.cli import main
from splicer.errors import SplicerError
from splicer.io.safetensors_io import ByteSource, OutTensor, read_header, write_shard
from splicer.splice.inspect import inspect_checkpoint


def test_inspect_counts_classes(pairs):
    info = inspect_checkpoint(open_checkpoint(pairs["fused"]["lowlatency"], "build"))
    c = info["classes"]
    # tiny preset: 3 GDN layers x (qkv, z, out quantized; b, a BF16), 1 attention layer, 4 shared experts, 8 experts
    assert (c["gdn"]["modules"], c["gdn"]["quantized"]) == (15, 9)
    assert (c["attention"]["modules"], c["attention"]["quantized"]) == (4, 4)
    assert c["shared_expert"]["quantized"] == 12 and c["experts"]["quantized"] == 4 * 8 * 3
    assert c["lm_head"]["schemes"] == ["int8 g128"] and c["experts"]["schemes"] == ["int4 g128"]
    assert c["mtp"]["quantized"] == 0
    # routed experts: a decode step reads top-k of E (2 of 8)
    assert c["experts"]["bytes_per_decode_step"] == c["experts"]["bytes_on_disk"] * 2 // 8
    assert c["mtp"]["bytes_per_decode_step"] == 0
    assert info["total_bytes_on_disk"] == sum(
        h.tensors[t].nbytes for h in open_checkpoint(pairs["fused"]["lowlatency"], "b").headers.values() for t in h.tensors
    )
    assert info["lint"]["issues"] == []


def _lint(folder, tmp_path, edit):
    dst = tmp_path / "lint"
    shutil.copytree(folder, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return inspect_checkpoint(open_checkpoint(dst, "build"))["lint"]


def test_lint_dead_ignore_entries(pairs, tmp_path):
    """Seed 000 shipped 60 entries like layers.N.linear_attn: no Linear has that name."""
    lint = _lint(
        pairs["fused"]["lowlatency"],
        tmp_path,
        lambda qc: qc["ignore"].extend(
            [f"model.language_model.layers.{i}.linear_attn" for i in range(3)]
            + ["model.language_model.layers.0.linear_attn.norm"]
        ),
    )
    dead = [i for i in lint["issues"] if i["check"] == "dead-ignore"]
    assert len(dead) == 1 and dead[0]["detail"].startswith("4 ignore entries")


def test_lint_bare_lm_head_is_read_differently(pairs, tmp_path):
    """`lm_head` (no dot) is an exact HF name, but vLLM does not rename it, so only compressed-tensors ignores it."""
    lint = _lint(pairs["fused"]["lowlatency"], tmp_path, lambda qc: qc["ignore"].append("lm_head"))
    got = {(i["check"], i["naming"]) for i in lint["issues"]}
    assert ("stored-quantized-read-bf16", "hf") in got
    assert not any(n == "vllm" for _, n in got)


def test_lint_hf_regex_that_misses_in_vllm(pairs, tmp_path):
    """A regex written for HF names silently misses vLLM's names: the stored-BF16 module is read as INT4 there."""
    p = pairs["fused"]
    out = tmp_path / "spliced"
    assert main(["splice", "-q", "--restore", "attention", str(p["lowlatency"]), str(p["base"]), "-o", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["ignore"][-1] = r"re:model\.language_model\.layers\.3\.self_attn\.(q|k|v|o)_proj$"
    (out / "config.json").write_text(json.dumps(cfg))
    issues = inspect_checkpoint(open_checkpoint(out, "x"))["lint"]["issues"]
    assert {(i["check"], i["naming"]) for i in issues} == {("stored-bf16-read-quantized", "vllm")}


def test_lint_half_ignored_fused_layer(pairs, tmp_path):
    lint = _lint(pairs["fused"]["lowlatency"], tmp_path, lambda qc: qc["ignore"].append(r"re:.*in_proj_qkv$"))
    refuses = [i for i in lint["issues"] if i["check"] == "vllm-refuses"]
    assert refuses and "in_proj_qkvz" in refuses[0]["detail"]


def test_inspect_cli_json(pairs, capsys):
    assert main(["inspect", "--json", str(pairs["fused"]["experts-g32"])]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["classes"]["experts"]["schemes"] == ["int4 g32"] and info["classes"]["mtp"]["quantized"] == 24


def test_writer_roundtrip(tmp_path):
    src = {"a": torch.randn(3, 5).bfloat16(), "b": torch.arange(7, dtype=torch.int32), "c": torch.zeros(0, 4)}
    save_file(src, str(tmp_path / "src.safetensors"))
    hdr = read_header(tmp_path / "src.safetensors")
    out = [OutTensor(n, i.dtype, i.shape, ByteSource(i.path, i.start, i.nbytes)) for n, i in reversed(list(hdr.tensors.items()))]
    out.append(OutTensor("d", "I64", (2,), struct.pack("<2q", 4, 9)))
    write_shard(tmp_path / "dst.safetensors", out, {"format": "pt"})
    with safe_open(str(tmp_path / "dst.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        for k, t in src.items():
            assert torch.equal(f.get_tensor(k), t)
        assert f.get_tensor("d").tolist() == [4, 9]


def _raw(tmp_path, header: dict, data: bytes = b"") -> str:
    h = json.dumps(header).encode()
    p = tmp_path / "crafted.safetensors"
    p.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return p


@pytest.mark.parametrize(
    "header,data,msg",
    [
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
            "overlap",
        ),
        ({"a": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 1 << 42]}}, b"", "truncated"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "declares"),
        ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}}, b"\0" * 2, "invalid dtype"),
    ],
)
def test_crafted_headers_refused(tmp_path, header, data, msg):
    with pytest.raises(SplicerError, match=msg):
        read_header(_raw(tmp_path, header, data))


def test_huge_header_length_refused_before_reading(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", 1 << 50) + b"{}")
    with pytest.raises(SplicerError, match="header length"):
        read_header(p)


def test_match_name_mirrors_compressed_tensors():
    from compressed_tensors.utils.match import match_name as ct_match_name

    from splicer.formats.readings import match_name

    names = [
        "lm_head",
        "model.language_model.layers.0.linear_attn.in_proj_qkv",
        "mtp.layers.0.mlp.experts.3.up_proj",
        "model.visual.blocks.0.attn.qkv",
        "language_model.model.layers.3.self_attn.q_proj",
    ]
    targets = [
        "lm_head",
        "re:.*lm_head$",
        "Linear",
        r"re:.*mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)$",
        "re:.*visual.*",
        "model.language_model.layers.0.linear_attn.in_proj_qkv",
        r"re:(model\.language_model|language_model\.model)\.layers\.\d+\.self_attn\.(q|k|v|o)_proj$",
        "re:layers",
        "re:.*layers\\.0\\.",
    ]
    for n in names:
        for t in targets:
            assert match_name(n, t) == ct_match_name(n, t), (n, t)
