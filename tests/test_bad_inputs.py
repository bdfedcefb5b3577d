"""Bad input to `splicer splice` / `inspect`: one line naming problem and fix, exit 2, no traceback, nothing written,
inputs byte-identical afterwards. Each case runs the real CLI entry point in-process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from splicer.cli import main

from .conftest import tree_digest
from .test_ablate import PLAN


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _truncate_a_shard(folder: Path) -> None:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"]["model.language_model.layers.0.linear_attn.in_proj_qkv.weight_packed"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])


def _edit_config(folder: Path, fn) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    fn(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


def _drop_shard_from_disk(folder: Path) -> None:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    (folder / index["weight_map"]["model.language_model.layers.3.self_attn.q_proj.weight_packed"]).unlink()


def _mismatched_base(tmp: Path) -> Path:
    from splicer.fixtures.core import FixtureSpec, write_base

    return write_base(tmp / "other_base", FixtureSpec(text_overrides={"hidden_size": 128}))


def _unpacked_build(base: Path, tmp: Path) -> Path:
    """Config says pack-quantized, but the shards are plain BF16 (the base's shards copied in)."""
    dst = _copy(base, tmp / "unpacked")
    build_cfg = json.loads((base.parent / "lowlatency" / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(build_cfg))
    return dst


def _plan(tmp: Path, text: str) -> Path:
    path = tmp / "plan.toml"
    path.write_text(text)
    return path


def _file(tmp: Path, name: str, data: bytes) -> Path:
    path = tmp / name
    path.write_bytes(data)
    return path


def _other_vocab_base(tmp: Path) -> Path:
    from splicer.fixtures.core import FixtureSpec, write_base

    return write_base(tmp / "vocab_base", FixtureSpec(text_overrides={"vocab_size": 1024}))


def _group_96(folder: Path) -> None:
    _edit_config(folder, lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=96))


def _ablate(p, t, *extra, plan=None, build=None, base=None):
    return [
        "ablate",
        "all",
        str(build or p["lowlatency"]),
        str(base or p["base"]),
        "-o",
        str(t / "out"),
        "-q",
        "--no-time",
        "--device",
        "cpu",
        "--plan",
        str(plan or _plan(t, PLAN)),
        *extra,
    ]


def _partly_quantized_reference(p, t: Path) -> Path:
    """The build with every class but the experts restored: a reference that keeps the build's INT4 experts."""
    from splicer.splice.core import splice

    splice(str(p["lowlatency"]), str(p["base"]), t / "reference", "gdn,attention,shared_expert,lm_head", progress=False)
    return t / "reference"


# (id, argv builder, expected message fragment). Builders get (pairs, tmp) and return argv.
CASES = [
    (
        "fixture-unknown-family",
        lambda p, t: ["fixture", str(t / "out"), "--family", "gpt2"],
        "--family 'gpt2': no fixture for it",
    ),
    (
        "fixture-family-with-full-dims",
        lambda p, t: ["fixture", str(t / "out"), "--family", "llama", "--full-dims"],
        "drop --preset, --builds",
    ),
    (
        "unknown-class",
        lambda p, t: ["splice", "--restore", "gdn,rotary", str(p["lowlatency"]), str(p["base"]), "-o", str(t / "out")],
        "unknown class 'rotary'",
    ),
    (
        "empty-class-list",
        lambda p, t: ["splice", "--restore", " , ", str(p["lowlatency"]), str(p["base"]), "-o", str(t / "out")],
        "--restore is empty",
    ),
    (
        "class-not-quantized",
        lambda p, t: ["splice", "--restore", "lm_head", str(p["experts-g32"]), str(p["base"]), "-o", str(t / "out")],
        "nothing to restore",
    ),
    (
        "missing-build-folder",
        lambda p, t: ["splice", "--restore", "gdn", str(t / "nope"), str(p["base"]), "-o", str(t / "out")],
        "does not exist",
    ),
    (
        "missing-base-folder",
        lambda p, t: ["splice", "--restore", "gdn", str(p["lowlatency"]), str(t / "nope"), "-o", str(t / "out")],
        "does not exist",
    ),
    (
        "build-not-quantized",
        lambda p, t: ["splice", "--restore", "gdn", str(p["base"]), str(p["base"]), "-o", str(t / "out")],
        "not a quantized build",
    ),
    (
        "base-is-quantized",
        lambda p, t: ["splice", "--restore", "gdn", str(p["lowlatency"]), str(p["experts-g32"]), "-o", str(t / "out")],
        "itself quantized",
    ),
    (
        "quantized-base-unlike-build",
        lambda p, t: [
            "splice",
            "--restore",
            "gdn",
            "--allow-quantized-base",
            str(p["lowlatency"]),
            str(p["experts-g32"]),
            "-o",
            str(t / "out"),
        ],
        "and the build has not",
    ),
    (
        "restore-class-quantized-in-base",
        lambda p, t: [
            "splice",
            "--restore",
            "experts",
            "--allow-quantized-base",
            str(p["lowlatency"]),
            str(_partly_quantized_reference(p, t)),
            "-o",
            str(t / "out"),
        ],
        "quantized in the base too",
    ),
    (
        "mismatched-base",
        lambda p, t: ["splice", "--restore", "gdn", str(p["lowlatency"]), str(_mismatched_base(t)), "-o", str(t / "out")],
        "hidden_size=128",
    ),
    (
        "truncated-shard",
        lambda p, t: [
            "splice",
            "--restore",
            "gdn",
            str(_mut(p["lowlatency"], t, _truncate_a_shard)),
            str(p["base"]),
            "-o",
            str(t / "out"),
        ],
        "truncated",
    ),
    (
        "invalid-config-json",
        lambda p, t: [
            "splice",
            "--restore",
            "gdn",
            str(_mut(p["lowlatency"], t, lambda f: (f / "config.json").write_text("{not json"))),
            str(p["base"]),
            "-o",
            str(t / "out"),
        ],
        "not valid JSON",
    ),
    (
        "index-names-missing-shard",
        lambda p, t: [
            "splice",
            "--restore",
            "gdn",
            str(_mut(p["lowlatency"], t, _drop_shard_from_disk)),
            str(p["base"]),
            "-o",
            str(t / "out"),
        ],
        "which is missing",
    ),
    (
        "not-compressed-tensors",
        lambda p, t: [
            "splice",
            "--restore",
            "gdn",
            str(
                _mut(
                    p["lowlatency"],
                    t,
                    lambda f: _edit_config(f, lambda c: c["quantization_config"].update(quant_method="bitsandbytes")),
                )
            ),
            str(p["base"]),
            "-o",
            str(t / "out"),
        ],
        "quant_method 'bitsandbytes'",
    ),
    (
        "invalid-ignore-regex",
        lambda p, t: [
            "splice",
            "--restore",
            "gdn",
            str(
                _mut(
                    p["lowlatency"],
                    t,
                    lambda f: _edit_config(f, lambda c: c["quantization_config"]["ignore"].append("re:.*(visual")),
                )
            ),
            str(p["base"]),
            "-o",
            str(t / "out"),
        ],
        "not a valid regex",
    ),
    (
        "unsupported-model-type",
        lambda p, t: [
            "splice",
            "--restore",
            "gdn",
            str(_mut(p["lowlatency"], t, lambda f: _edit_config(f, lambda c: c.update(model_type="gpt2")))),
            str(p["base"]),
            "-o",
            str(t / "out"),
        ],
        "model_type 'gpt2' is not supported",
    ),
    (
        "config-packed-tensors-not",
        lambda p, t: ["splice", "--restore", "gdn", str(_unpacked_build(p["base"], t)), str(p["base"]), "-o", str(t / "out")],
        "no module is stored quantized",
    ),
    (
        "out-exists",
        lambda p, t: ["splice", "--restore", "gdn", str(p["lowlatency"]), str(p["base"]), "-o", str(_existing(t))],
        "exists; pass --force",
    ),
    (
        "out-inside-build",
        lambda p, t: ["splice", "--restore", "gdn", str(p["lowlatency"]), str(p["base"]), "-o", str(p["lowlatency"] / "sub")],
        "inside an input folder",
    ),
    (
        "split-fused-group",
        lambda p, t: [
            "splice",
            "--restore",
            "attention",
            "--modules",
            r"q_proj$",
            str(p["lowlatency"]),
            str(p["base"]),
            "-o",
            str(t / "out"),
        ],
        "would split",
    ),
    (
        "bad-layers",
        lambda p, t: [
            "splice",
            "--restore",
            "gdn",
            "--layers",
            "one",
            str(p["lowlatency"]),
            str(p["base"]),
            "-o",
            str(t / "out"),
        ],
        "--layers",
    ),
    (
        "hub-id-offline",
        lambda p, t: ["splice", "--restore", "gdn", "nobody/no-such-build", str(p["base"]), "-o", str(t / "out")],
        "HF_HUB_OFFLINE",
    ),
    (
        "base-other-vocab",
        lambda p, t: ["splice", "--restore", "gdn", str(p["lowlatency"]), str(_other_vocab_base(t)), "-o", str(t / "out")],
        "vocab_size=1024",
    ),
    (
        "group-size-not-dividing",
        lambda p, t: [
            "splice",
            "--restore",
            "gdn",
            str(_mut(p["lowlatency"], t, _group_96)),
            str(p["base"]),
            "-o",
            str(t / "out"),
        ],
        "does not divide the input dim",
    ),
    ("plan-unknown-key", lambda p, t: _ablate(p, t, plan=_plan(t, 'colour = "red"\n' + PLAN)), "unknown key 'colour'"),
    ("plan-unknown-class", lambda p, t: _ablate(p, t, plan=_plan(t, PLAN.replace('["gdn"]', '["gnd"]'))), "unknown class 'gnd'"),
    ("plan-empty", lambda p, t: _ablate(p, t, plan=_plan(t, 'name = "empty"\n')), "declares no [[row]]"),
    ("plan-not-toml", lambda p, t: _ablate(p, t, plan=_plan(t, "[[row]\nname = 1")), "not valid TOML"),
    ("plan-unknown-name", lambda p, t: _ablate(p, t, plan="no-such-plan"), "no plan named 'no-such-plan'"),
    ("engine-cache-for-torch", lambda p, t: _ablate(p, t, "--engine-cache-dir", str(t / "c")), "apply to --backend vllm only"),
    (
        "overlap-negative",
        lambda p, t: _ablate(p, t, "--backend", "vllm", "--overlap-starts", "-1"),
        "--overlap-starts: -1 is outside",
    ),
    (
        "ablate-unknown-row",
        lambda p, t: [
            "ablate",
            "rotary",
            str(p["lowlatency"]),
            str(p["base"]),
            "-o",
            str(t / "out"),
            "--plan",
            str(_plan(t, PLAN)),
        ],
        "'rotary' is not in plan tiny",
    ),
    ("corpus-empty-file", lambda p, t: _ablate(p, t, "--corpus", f"wiki-en={_file(t, 'empty.txt', b'  ')}"), "hold no text"),
    (
        "corpus-not-utf8",
        lambda p, t: _ablate(p, t, "--corpus", f"wiki-en={_file(t, 'latin1.txt', 'Größe'.encode('latin-1'))}"),
        "not UTF-8",
    ),
    (
        "corpus-unknown-name",
        lambda p, t: _ablate(p, t, "--corpus", f"wiki-fr={_file(t, 'fr.txt', b'bonjour')}"),
        "has no corpus 'wiki-fr'",
    ),
    (
        "sequence-longer-than-context",
        lambda p, t: _ablate(p, t, plan=_plan(t, PLAN.replace("answer_tokens = 8", "answer_tokens = 5000"))),
        "context is 4096",
    ),
    ("ablate-hub-id-offline", lambda p, t: _ablate(p, t, base="nobody/no-such-base"), "HF_HUB_OFFLINE"),
    (
        "ablate-engine-arg-without-vllm",
        lambda p, t: _ablate(p, t, "--engine-arg", "max_model_len=2048"),
        "apply to --backend vllm only",
    ),
    (
        "ablate-engine-env-without-vllm",
        lambda p, t: _ablate(p, t, "--engine-env", "VLLM_TRITON_FORCE_FIRST_CONFIG=1"),
        "apply to --backend vllm only",
    ),
    ("ablate-engine-env-not-a-name", lambda p, t: _ablate(p, t, "--engine-env", "1X=2"), "should be NAME=VALUE"),
    (
        "ablate-engine-env-owned",
        lambda p, t: _ablate(p, t, "--engine-env", "CUDA_VISIBLE_DEVICES=1"),
        "use --gpus or --device cuda:N",
    ),
    ("inspect-missing", lambda p, t: ["inspect", str(t / "nope")], "does not exist"),
    # Values of another JSON type or out of range (the fuzz test, tests/test_fuzz.py, covers many more of each class).
    (
        "config-ignore-is-a-string",
        lambda p, t: [
            "splice",
            "--restore",
            "gdn",
            str(
                _mut(
                    p["lowlatency"],
                    t,
                    lambda f: _edit_config(f, lambda c: c["quantization_config"].update(ignore="re:.*visual.*")),
                )
            ),
            str(p["base"]),
            "-o",
            str(t / "out"),
        ],
        "quantization_config.ignore is a string",
    ),
    (
        "config-dim-out-of-range",
        lambda p, t: [
            "inspect",
            str(_mut(p["lowlatency"], t, lambda f: _edit_config(f, lambda c: c["text_config"].update(num_hidden_layers=0)))),
        ],
        "text_config.num_hidden_layers is 0",
    ),
    (
        "base-other-head-count",
        lambda p, t: [
            "splice",
            "--restore",
            "gdn",
            str(p["lowlatency"]),
            str(_mut(p["base"], t, lambda f: _edit_config(f, lambda c: c["text_config"].update(num_attention_heads=4)))),
            "-o",
            str(t / "out"),
        ],
        "num_attention_heads=4 but the build has 2",
    ),
    (
        "layers-out-of-range",
        lambda p, t: [
            "splice",
            "--restore",
            "experts",
            "--layers",
            "0-999999999",
            str(p["lowlatency"]),
            str(p["base"]),
            "-o",
            str(t / "out"),
        ],
        "out of range; this build has 4 decoder layers",
    ),
    (
        "layers-reversed",
        lambda p, t: [
            "splice",
            "--restore",
            "experts",
            "--layers",
            "3-1",
            str(p["lowlatency"]),
            str(p["base"]),
            "-o",
            str(t / "out"),
        ],
        "runs backwards",
    ),
    (
        "modules-invalid-regex",
        lambda p, t: [
            "splice",
            "--restore",
            "attention",
            "--modules",
            "self_attn(",
            str(p["lowlatency"]),
            str(p["base"]),
            "-o",
            str(t / "out"),
        ],
        "not a valid Python regular expression",
    ),
    (
        "plan-value-wrong-type",
        lambda p, t: _ablate(p, t, plan=_plan(t, PLAN.replace("top_k = 20", 'top_k = "20"'))),
        "top_k is a string",
    ),
    (
        "plan-value-out-of-range",
        lambda p, t: _ablate(p, t, plan=_plan(t, PLAN.replace("new_tokens = 12", "new_tokens = 1"))),
        "timing.new_tokens is 1",
    ),
    (
        "plan-name-is-a-path",
        lambda p, t: _ablate(p, t, plan=_plan(t, PLAN.replace('name = "gdn"', 'name = "../gdn"'))),
        "not a plain name",
    ),
    (
        "plan-rows-not-tables",
        lambda p, t: _ablate(p, t, plan=_plan(t, 'row = "build"\n' + PLAN[: PLAN.index("[[row]]")])),
        "row (an array of [[row]] tables) is a string",
    ),
    ("plan-is-a-folder", lambda p, t: _ablate(p, t, plan=_folder(t, "plan.toml")), "cannot read plan"),
    (
        "plan-too-many-conversations",
        lambda p, t: _ablate(p, t, plan=_plan(t, PLAN.replace("conversations = 3", "conversations = 500"))),
        "the built-in chat set has 72 conversations",
    ),
    (
        "module-packed-and-plain",
        lambda p, t: [
            "splice",
            "--restore",
            "gdn",
            str(_mut(p["lowlatency"], t, _plain_beside_packed)),
            str(p["base"]),
            "-o",
            str(t / "out"),
        ],
        "holds both packed tensors",
    ),
    (
        "corpus-text-not-a-string",
        lambda p, t: _ablate(p, t, "--corpus", "wiki-en=" + str(_file(t, "c.jsonl", b'{"text": 12}'))),
        "line 1: 'text' is 12, not a string",
    ),
]


def _plain_beside_packed(folder: Path) -> None:
    """A module stored both packed and as a BF16 weight: a restore would add a second `weight` of that name."""
    import torch
    from safetensors.torch import load_file, save_file

    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.language_model.layers.0.linear_attn.out_proj"
    shard = folder / index["weight_map"][f"{name}.weight_packed"]
    tensors = load_file(str(shard))
    tensors[f"{name}.weight"] = torch.zeros(256, 256, dtype=torch.bfloat16)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index["weight_map"][f"{name}.weight"] = shard.name
    index_path.write_text(json.dumps(index))


def _folder(tmp: Path, name: str) -> Path:
    (tmp / name).mkdir()
    return tmp / name


def _mut(src: Path, tmp: Path, fn) -> Path:
    dst = _copy(src, tmp / "mutated")
    fn(dst)
    return dst


def _existing(tmp: Path) -> Path:
    (tmp / "out").mkdir()
    (tmp / "out" / "keep.txt").write_text("mine")
    return tmp / "out"


@pytest.mark.parametrize("case_id,argv,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input(pairs, tmp_path, monkeypatch, capsys, case_id, argv, fragment):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    p = pairs["fused"]
    args = argv(p, tmp_path)
    inputs = [Path(a) for a in args if Path(a).is_dir() and Path(a).name != "out"]
    before = {str(d): tree_digest(d) for d in inputs}
    outside_before = sorted(x.name for x in tmp_path.iterdir())
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("splicer: error: ") and fragment in lines[0], lines[0]
    assert "Traceback" not in err
    for d in inputs:
        assert tree_digest(d) == before[str(d)], f"{d} changed"
    # Nothing written: no OUT (unless it pre-existed, then untouched) and no partial folder left behind.
    after = sorted(x.name for x in tmp_path.iterdir())
    assert after == [n for n in outside_before] or set(after) - set(outside_before) <= {"hf-home"}
    assert not any(".splicer-partial" in x.name for x in tmp_path.iterdir())
    if case_id == "out-exists":
        assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
