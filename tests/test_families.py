"""Families beyond qwen3_5_moe: each fixture made from transformers' own model class (real names and layouts), an INT4
build made with compressed-tensors, then inspect's lint, a splice of every class, the torch backend on CPU (restoring
every class scores exactly as the base), a split fused group refused, and the arch tables' knowledge kept in arch/."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import torch

from splicer.arch import families, get_architecture
from splicer.checkpoint import open_checkpoint
from splicer.cli import main
from splicer.errors import SplicerError
from splicer.fixtures.families import FAMILY_FIXTURES, write_family_pair
from splicer.splice.core import splice
from splicer.splice.inspect import inspect_checkpoint as _inspect

FAMILIES = sorted(FAMILY_FIXTURES)


def inspect_checkpoint(folder: Path) -> dict:
    return _inspect(open_checkpoint(str(folder), "build"))


@pytest.fixture(scope="module")
def family_pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: write_family_pair(root / f, f) for f in FAMILIES}


def _logits(folder: Path, seq: list[int]) -> torch.Tensor:
    from splicer.backends.torch_ref import TorchBackend

    b = TorchBackend(device="cpu")
    b.load(folder)
    with torch.no_grad():
        out = b.model(torch.tensor([seq])).logits[0].float()
    b.unload()
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fixture_has_the_families_real_names_and_a_clean_lint(family_pairs, family):
    build = family_pairs[family]["int4"]
    config = json.loads((build / "config.json").read_text())
    arch = get_architecture(config)
    info = inspect_checkpoint(build)
    assert info["model_type"] == FAMILY_FIXTURES[family].model_type
    # Named as a release names it: without it vLLM served the qwen3 fixtures as embedding models (results/gpu-families).
    for folder in (build, family_pairs[family]["base"]):
        arch_names = json.loads((folder / "config.json").read_text())["architectures"]
        assert len(arch_names) == 1 and arch_names[0].endswith("ForCausalLM"), arch_names
    quantized = {c for c, row in info["classes"].items() if row["quantized"]}
    assert quantized == set(arch.classes) - set(FAMILY_FIXTURES[family].absent_classes)
    # vLLM 0.26's DeepSeek loader makes a router bias only for topk_method = noaux_tc (the released config's value):
    # a fixture holding the bias without it failed to load on the H200 (results/gpu-families/call-2).
    base_names = json.loads((family_pairs[family]["base"] / "model.safetensors.index.json").read_text())["weight_map"]
    if family == "deepseek_v3" and any(n.endswith("e_score_correction_bias") for n in base_names):
        assert config.get("topk_method") == "noaux_tc" and config.get("scoring_func") == "sigmoid"
    assert not info["lint"]["issues"], info["lint"]["issues"]
    names = json.loads((build / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(re.fullmatch(r"model\.layers\.\d+\.self_attn\.o_proj\.weight_packed", n) for n in names)
    if "experts" in arch.classes:  # per expert on disk, as the Qwen releases ship; the router kept in BF16 and ignored
        assert any(re.fullmatch(r"model\.layers\.\d+\.mlp\.experts\.7\.down_proj\.weight_packed", n) for n in names)
        assert any(re.fullmatch(r"model\.layers\.\d+\.mlp\.gate\.weight", n) for n in names)
        assert r"re:.*mlp\.gate$" in config["quantization_config"]["ignore"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_class_splices_and_restoring_all_scores_exactly_as_the_base(family_pairs, family, tmp_path):
    p = family_pairs[family]
    arch = get_architecture(json.loads((p["int4"] / "config.json").read_text()))
    seq = list(range(5, 69))
    base = _logits(p["base"], seq)
    build = _logits(p["int4"], seq)
    assert not torch.equal(build, base)
    # Peaked like a trained model's next-token distributions (norms start at transformers' own init), so the table's
    # top-20 KL means something on the fixture.
    assert torch.softmax(base, -1).topk(20, -1).values.sum(-1).mean() > 0.5
    for cls in arch.classes:
        if cls in FAMILY_FIXTURES[family].absent_classes:
            continue
        out = tmp_path / cls
        record = splice(str(p["int4"]), str(p["base"]), out, cls, progress=False)
        assert record["restored_classes"] == [cls]
        assert not inspect_checkpoint(out)["lint"]["issues"]
    everything = tmp_path / "all"
    splice(str(p["int4"]), str(p["base"]), everything, "all", progress=False)
    assert "quantization_config" not in json.loads((everything / "config.json").read_text())
    assert torch.equal(_logits(everything, seq), base)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_split_fused_group_is_refused(family_pairs, family, tmp_path, capsys):
    """Restoring one shard of the attention's fused group (q of qkv_proj; q_a of DeepSeek's fused_qkv_a_proj)."""
    p = family_pairs[family]
    arch = get_architecture(json.loads((p["int4"] / "config.json").read_text()))
    shard, (fused, _) = next((s, g) for s, g in arch.fused_shards.items() if s.startswith("self_attn."))
    code = main(
        [
            "splice",
            "--restore",
            "attention",
            "--modules",
            r".*\." + re.escape(shard.split(".")[-1]),
            str(p["int4"]),
            str(p["base"]),
            "-o",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and fused.split(".")[-1] in err[0] and not (tmp_path / "out").exists()


def test_the_gpu_script_splits_a_fused_group_by_hand_and_inspect_flags_it(family_pairs, tmp_path):
    """scripts/gpu/split_group_check.py makes, for vLLM to refuse, the checkpoint splice will not: one shard of a fused
    group restored and named in ignore. inspect flags it; the build it starts from is left as it was."""
    import importlib.util

    from tests.conftest import tree_digest

    path = Path(__file__).parents[1] / "scripts" / "gpu" / "split_group_check.py"
    spec = importlib.util.spec_from_file_location("split_group_check", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    p = family_pairs["deepseek_v3"]
    before = tree_digest(p["int4"])
    split = script.make_split(p["int4"], p["base"], tmp_path / "split")
    assert split["module"] == "model.layers.0.self_attn.q_a_proj" and split["fused"] == "self_attn.fused_qkv_a_proj"
    issues = _inspect(open_checkpoint(tmp_path / "split", "build"))["lint"]["issues"]
    # Both readings: the tensors on disk disagree, and vLLM's rule for the fused layer refuses it (what the GPU run
    # compares with the message vLLM itself gives).
    assert sorted(i["check"] for i in issues) == ["fused-shards-disagree", "vllm-refuses"]
    assert all("fused_qkv_a_proj" in i["detail"] for i in issues)
    assert tree_digest(p["int4"]) == before


def test_experts_only_build_of_the_moe_family_restores_to_the_base(family_pairs, tmp_path):
    p = family_pairs["qwen3_moe"]
    seq = list(range(5, 69))
    out = tmp_path / "experts"
    splice(str(p["experts-g32"]), str(p["base"]), out, "experts", progress=False)
    assert torch.equal(_logits(out, seq), _logits(p["base"], seq))


def test_a_plan_row_naming_a_class_the_family_lacks_is_skipped_with_the_reason(family_pairs, tmp_path):
    p = family_pairs["llama"]
    plan = tmp_path / "plan.toml"
    plan.write_text(
        'name = "p"\ntop_k = 5\n[[corpus]]\nname = "r"\nkind = "random"\nchunk_tokens = 16\nmax_chunks = 2\n'
        '[[row]]\nname = "build"\nrestore = []\n[[row]]\nname = "gdn"\nrestore = ["gdn"]\n'
        '[[row]]\nname = "mlp"\nrestore = ["mlp"]\n'
    )
    code = main(
        ["ablate", "all", str(p["int4"]), str(p["base"]), "-o", str(tmp_path / "run"), "--plan", str(plan), "-q", "--no-time"]
    )
    assert code == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert {"name": "gdn", "reason": "llama has no class gdn"} in results["skipped"]
    assert "gdn: skipped (llama has no class gdn)." in (tmp_path / "run" / "report.md").read_text()
    assert [v["name"] for v in results["variants"] if v["status"] == "ok"] == ["build", "mlp"]


def test_unknown_model_type_names_the_supported_ones():
    with pytest.raises(SplicerError, match="not supported .*qwen3_moe.*llama"):
        get_architecture({"model_type": "gpt2"})


# Fragments of tensor and module names, chat tokens and model classes: architecture knowledge that belongs in an arch
# table. String literals (not comments or docstrings) of splicer's modules outside arch/ must not spell them.
NAME_FRAGMENTS = re.compile(
    r"(?<![-\w])mtp\.|language_model\.|linear_attn|self_attn|shared_expert|experts\.|(gate|up|down|q|k|v|o)_proj|in_proj_|"
    r"model\.layers|embed_tokens|<\|im_end\|>|ForCausalLM|ForConditionalGeneration|lm_head\.|\.lm_head"
)
# Family-specific by design, each with its reason: splicer/fixtures/ (the qwen3_5_moe fixture and stand-in generators
# and the family fixture specs, test data made from transformers' classes), the config.json field schema, the demo's
# tokenizer; and splicer/trained/, which makes one family's model (qwen3_5_moe, trained) and the plans of its run, as
# fixtures/core.py does.
EXEMPT = {"io/config_schema.py", "corpora/demo_tokenizer.py"}
EXEMPT_FOLDERS = {"arch", "trained", "fixtures"}


def _string_literals(tree: ast.AST):
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def test_no_module_outside_arch_hard_codes_a_tensor_or_module_name():
    root = Path(__file__).parents[1] / "splicer"
    found = []
    for path in sorted(root.rglob("*.py")):
        if EXEMPT_FOLDERS & set(path.relative_to(root).parts) or path.relative_to(root).as_posix() in EXEMPT:
            continue
        for line, text in _string_literals(ast.parse(path.read_text())):
            if NAME_FRAGMENTS.search(text):
                found.append(f"{path.relative_to(root)}:{line}: {text[:60]!r}")
    assert not found, "names that belong in splicer/arch/:\n" + "\n".join(found)


def test_every_family_table_is_consistent():
    for arch in families():
        assert len(set(arch.classes)) == len(arch.classes)
        assert {c for c, _ in arch.class_patterns} <= set(arch.classes)
        assert {c for c, _ in arch.vllm_kernel_classes} <= set(arch.classes)
        assert arch.decoder_roots and arch.lm_head_names and arch.source


def test_resolve_rows_skips_with_a_reason_each_kind_of_row_it_cannot_run():
    from splicer.plans.plan import Plan, Row, resolve_rows

    rows = [
        Row("build", restore=[]),
        Row("gdn", restore=["gdn"]),
        Row("attention", restore=["attention"]),
        Row("experts", restore=["experts"]),
        Row("all-but-mlp", keep=["mlp"]),
        Row("all", keep=[]),
        Row("build-again", restore=[], repeat=True),
        Row("build-twice", restore=[]),
        Row("base", base=True),
    ]
    plan = Plan("p", "", 5, [], None, rows, "test")
    rows.append(Row("gdn-and-mtp", restore=["gdn", "mtp"]))
    todo, skipped = resolve_rows(plan, "llama", ("attention", "mlp", "lm_head"), ["attention", "mlp"], [])
    assert [(p.row.name, p.restored, p.splice_name) for p in todo] == [
        ("build", [], "build"),
        ("attention", ["attention"], "attention"),
        ("all", ["attention", "mlp"], "all"),
        ("build-again", [], "build"),
        ("base", None, "base"),
    ]
    reasons = {s["name"]: s["reason"] for s in skipped}
    assert reasons["gdn"] == "llama has no class gdn"
    assert reasons["gdn-and-mtp"] == "llama has no classes gdn, mtp"
    assert reasons["experts"] == "llama has no class experts"
    assert reasons["all-but-mlp"] == "same variant as attention"
    assert reasons["build-twice"] == "same variant as build"
    _, frozen = resolve_rows(plan, "llama", ("attention", "mlp", "lm_head"), ["attention", "mlp"], ["mlp"])
    assert {"name": "all", "reason": "needs BF16 mlp, which the base keeps quantized"} in frozen


def test_the_demo_plan_on_a_dense_family_runs_its_classes_and_skips_the_rest(family_pairs, tmp_path):
    p = family_pairs["llama"]
    assert (
        main(["ablate", "all", str(p["int4"]), str(p["base"]), "-o", str(tmp_path / "run"), "--plan", "demo", "-q", "--no-time"])
        == 0
    )
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    ok = {v["name"]: v for v in results["variants"] if v["status"] == "ok"}
    assert {"build", "lm_head", "attention", "mlp", "all", "base"} <= set(ok)
    assert {s["name"]: s["reason"] for s in results["skipped"]}["gdn"] == "llama has no class gdn"
    assert all(m["kl"] == 0 for m in ok["all"]["metrics"].values())  # every class restored: exactly the base
    assert all(m["kl"] > 0.05 for m in ok["build"]["metrics"].values())


@pytest.mark.parametrize("family", [f for f in FAMILIES if FAMILY_FIXTURES[f].mtp_layer])
def test_the_mtp_decoder_layer_is_its_own_class_and_restores_apart(family_pairs, family, tmp_path):
    """DeepSeek-V3 and GLM-4.5 store their MTP head as decoder layer num_hidden_layers: class mtp, not read by a decode
    step, untouched by a restore of attention, restored alone by --restore mtp; vLLM's drafter names its head ...head."""
    from safetensors import safe_open

    p = family_pairs[family]
    config = json.loads((p["int4"] / "config.json").read_text())
    arch = get_architecture(config)
    n = config["num_hidden_layers"]
    mtp = f"model.layers.{n}."
    assert arch.mtp_prefix == mtp and arch.module_class(mtp + "self_attn.o_proj") == "mtp"
    assert arch.module_class(f"model.layers.{n - 1}.self_attn.o_proj") == "attention"
    assert arch.vllm_layer(mtp + "shared_head.head").name == mtp + "head"
    assert arch.vllm_layer(mtp + "eh_proj").kind == "unquantized"
    info = inspect_checkpoint(p["int4"])
    assert info["classes"]["mtp"]["quantized"] and info["classes"]["mtp"]["bytes_per_decode_step"] == 0

    def packed(folder):
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        return {k.rsplit(".", 1)[0] for k in index if k.endswith(".weight_packed")}

    before = packed(p["int4"])
    attention = tmp_path / "attention"
    splice(str(p["int4"]), str(p["base"]), attention, "attention", progress=False)
    gone = before - packed(attention)
    assert gone and not any(m.startswith(mtp) for m in gone)  # the MTP layer's attention stays as built
    only_mtp = tmp_path / "mtp"
    splice(str(p["int4"]), str(p["base"]), only_mtp, "mtp", progress=False)
    gone = before - packed(only_mtp)
    assert gone and all(m.startswith(mtp) for m in gone)
    assert not inspect_checkpoint(only_mtp)["lint"]["issues"]
    index = json.loads((only_mtp / "model.safetensors.index.json").read_text())["weight_map"]
    name = mtp + "self_attn.o_proj.weight"
    with (
        safe_open(str(only_mtp / index[name]), "pt") as a,
        safe_open(
            str(p["base"] / json.loads((p["base"] / "model.safetensors.index.json").read_text())["weight_map"][name]), "pt"
        ) as b,
    ):
        assert torch.equal(a.get_tensor(name), b.get_tensor(name))  # the base's BF16 tensor, byte for byte


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_the_mtp_layer_follows_num_nextn_predict_layers_and_layers_names_it(family_pairs, family, tmp_path, capsys):
    """num_nextn_predict_layers = 0: no MTP layer (layer N is not class mtp); more than one: refused in one line rather
    than reading the second MTP layer as a decoder layer; `--layers N` at the MTP layer says to use --restore mtp."""
    from splicer.cli import main

    config = json.loads((family_pairs[family]["int4"] / "config.json").read_text())
    n = config["num_hidden_layers"]
    assert get_architecture(dict(config, num_nextn_predict_layers=0)).mtp_prefix is None
    assert get_architecture(dict(config, num_nextn_predict_layers=0)).module_class(f"model.layers.{n}.self_attn.o_proj") != "mtp"
    with pytest.raises(SplicerError, match="num_nextn_predict_layers = 2"):
        get_architecture(dict(config, num_nextn_predict_layers=2))
    assert get_architecture(config).mtp_layer_index == n
    code = main(
        [
            "splice",
            "--restore",
            "attention",
            "--layers",
            str(n),
            str(family_pairs[family]["int4"]),
            str(family_pairs[family]["base"]),
            "-o",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err
    assert code != 0 and f"layer {n} is the MTP head" in err and "--restore mtp" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["1", None, -1, True, 1.0])
def test_a_num_nextn_predict_layers_that_is_not_a_count_is_refused_with_the_fix(family_pairs, value):
    config = json.loads((family_pairs["deepseek_v3"]["int4"] / "config.json").read_text())
    with pytest.raises(SplicerError, match=r"num_nextn_predict_layers = .*must be a whole number.*fix config.json"):
        get_architecture(dict(config, num_nextn_predict_layers=value))


def test_restoring_mtp_of_a_checkpoint_without_an_mtp_layer_says_so(family_pairs, tmp_path, capsys):
    """Kimi-K2 ships num_nextn_predict_layers = 0: --restore mtp names that, not an MTP layer with nothing quantized."""
    from splicer.cli import main

    p = family_pairs["kimi_k2"]
    code = main(["splice", "--restore", "mtp", str(p["int4"]), str(p["base"]), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no MTP layer" in err[0] and "num_nextn_predict_layers = 0" in err[0]
    assert "drop mtp" in err[0] and not (tmp_path / "out").exists()


def test_additivity_leaves_the_mtp_head_out(tmp_path):
    """DeepSeek/GLM: all-but-experts restores the MTP layer too, which no scoring pass runs; the Additivity footnote
    compares it with the single-class rows all the same."""
    from splicer.analysis.table import render_markdown

    def row(name, restored, kl):
        return {"name": name, "status": "ok", "restored": restored, "metrics": {"c": {"kl": kl, "positions": 10, "top1": 0.5}}}

    results = {
        "variants": [
            row("build", [], 1.0),
            row("attention", ["attention"], 0.8),
            row("mlp", ["mlp"], 0.7),
            row("all-but-experts", ["attention", "mlp", "mtp"], 0.5),
        ],
        "corpora": {"c": {}},
    }
    text = render_markdown(results)
    assert "Additivity: the single-class KL reductions (attention, mlp) add up to 1.00×" in text


def test_inspect_flags_a_config_that_names_no_architectures(family_pairs, tmp_path):
    """vLLM 0.26 served the qwen3 fixtures, whose config.json had "architectures": null, as embedding models."""
    import shutil

    src = family_pairs["qwen3"]["int4"]
    bare = tmp_path / "bare"
    shutil.copytree(src, bare)
    config = json.loads((bare / "config.json").read_text())
    config["architectures"] = None
    (bare / "config.json").write_text(json.dumps(config))
    checks = [i["check"] for i in inspect_checkpoint(bare)["lint"]["issues"]]
    assert checks == ["no-architectures"]
    assert not inspect_checkpoint(src)["lint"]["issues"]


def test_tensors_of_another_family_are_named_by_inspect_and_refused_by_splice_and_ablate(family_pairs, tmp_path, capsys):
    """qwen3_moe tensors under a config that says llama: inspect says the tensors fit qwen3_moe (instead of listing the
    routed experts under "other" with no lint problem), and splice and ablate refuse in that one line, writing nothing;
    every family's own fixture stays clean (test_the_fixture_has_the_families_real_names_and_a_clean_lint)."""
    import shutil

    from .conftest import tree_digest

    pair = {}
    for kind in ("int4", "base"):
        pair[kind] = tmp_path / kind
        shutil.copytree(family_pairs["qwen3_moe"][kind], pair[kind])
        config = json.loads((pair[kind] / "config.json").read_text())
        (pair[kind] / "config.json").write_text(json.dumps(dict(config, model_type="llama")))
    before = {k: tree_digest(p) for k, p in pair.items()}
    assert main(["inspect", str(pair["int4"])]) == 0
    report = capsys.readouterr().out
    assert "lint: no problems" not in report
    assert re.search(
        r"model-type .*model_type 'llama', but \d+ of its tensors fit no class .*mlp\.experts\..* the tensors "
        r"fit qwen3_moe: set model_type to the checkpoint's own \(qwen3_moe\)",
        report,
    ), report
    plan = tmp_path / "p.toml"
    plan.write_text(
        'name = "p"\n[[corpus]]\nname = "en"\nkind = "builtin"\ntext = "wiki-en"\nchunk_tokens = 32\n'
        'max_chunks = 1\n[[row]]\nname = "build"\nrestore = []\n[[row]]\nname = "attention"\nrestore = ["attention"]\n'
    )
    for argv, out in (
        (
            ["splice", "-q", "--restore", "attention", str(pair["int4"]), str(pair["base"]), "-o", str(tmp_path / "o")],
            tmp_path / "o",
        ),
        (
            [
                "ablate",
                "all",
                str(pair["int4"]),
                str(pair["base"]),
                "-o",
                str(tmp_path / "a"),
                "--plan",
                str(plan),
                "-q",
                "--no-time",
                "--device",
                "cpu",
            ],
            tmp_path / "a",
        ),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "fit qwen3_moe" in err[0] and "model_type 'llama'" in err[0], (argv[0], err)
        assert not out.exists()
    assert {k: tree_digest(p) for k, p in pair.items()} == before
