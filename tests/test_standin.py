"""The full-dims stand-in's code path at tiny dims: a partly quantized reference, rows that need BF16 experts
skipped, the repeat row, and the refusals around a quantized base."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from splicer.cli import main
from splicer.fixtures.core import FixtureSpec


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    from splicer.fixtures.standin import write_standin

    return write_standin(tmp_path_factory.mktemp("standin"), FixtureSpec(preset="tiny"), device="cpu", progress=False)


def _tensors(folder, names=None):
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name, shard in index.items():
        if names is None or name in names:
            with safe_open(str(folder / shard), "pt") as f:
                out[name] = f.get_tensor(name)
    return out


def test_reference_shares_the_build_experts_and_holds_the_rest_in_bf16(standin):
    build, ref = standin["build"], standin["reference"]
    for shard in sorted(p.name for p in build.glob("experts-*.safetensors")):
        assert (build / shard).stat().st_ino == (ref / shard).stat().st_ino  # hard links: written once
    b, r = _tensors(build), _tensors(ref)
    packed_b = {n for n in b if n.endswith("weight_packed")}
    packed_r = {n for n in r if n.endswith("weight_packed")}
    assert packed_r and all(".mlp.experts." in n for n in packed_r) and packed_r < packed_b
    assert r["lm_head.weight"].dtype == torch.bfloat16 and "lm_head.weight_packed" in b
    m = "model.language_model.layers.1.mlp.experts.3.gate_proj"
    assert tuple(b[f"{m}.weight_shape"].tolist()) == (128, 256) and b[f"{m}.weight_packed"].shape == (128, 32)
    cfg = json.loads((ref / "config.json").read_text())["quantization_config"]
    assert any("lm_head" in e for e in cfg["ignore"])


def test_stacked_quantization_equals_per_expert_quantization():
    """The stand-in quantizes a layer's experts stacked [E*N, K] in one call: the same bytes as one call per expert."""
    from splicer.formats.quantize import make_scheme, quantize_weight

    scheme = make_scheme(4, 128)
    w = (torch.randn(4 * 64, 256, generator=torch.Generator().manual_seed(0)) / 16).to(torch.bfloat16)
    stacked = quantize_weight(w, scheme)
    for e in range(4):
        one = quantize_weight(w[e * 64 : (e + 1) * 64].contiguous(), scheme)
        assert torch.equal(one["weight_packed"], stacked["weight_packed"][e * 64 : (e + 1) * 64])
        assert torch.equal(one["weight_scale"], stacked["weight_scale"][e * 64 : (e + 1) * 64])


def test_quantized_base_needs_the_flag_and_cannot_restore_its_quantized_classes(standin, tmp_path, capsys):
    build, ref = str(standin["build"]), str(standin["reference"])
    assert main(["splice", build, ref, "-o", str(tmp_path / "a"), "--restore", "gdn"]) == 2
    assert "--allow-quantized-base" in capsys.readouterr().err and not (tmp_path / "a").exists()
    assert main(["splice", build, ref, "-o", str(tmp_path / "b"), "--restore", "experts", "--allow-quantized-base"]) == 2
    err = capsys.readouterr().err
    assert "quantized in the base too" in err and "experts" in err and not (tmp_path / "b").exists()
    assert main(["splice", build, ref, "-o", str(tmp_path / "c"), "--restore", "gdn", "--allow-quantized-base", "-q"]) == 0
    got = _tensors(tmp_path / "c", {"model.language_model.layers.0.linear_attn.out_proj.weight"})
    want = _tensors(standin["reference"], set(got))
    assert all(torch.equal(got[k], want[k]) for k in got)


def test_ablate_against_a_partly_quantized_reference(standin, tmp_path):
    from splicer.ablate import AblateSettings, run_ablate

    plan = tmp_path / "p.toml"
    plan.write_text(
        'name = "p"\n[[corpus]]\nname = "rnd"\nkind = "random"\nchunk_tokens = 48\nmax_chunks = 3\nseed = 1\n'
        "[timing]\nprompt_tokens = 24\nnew_tokens = 16\nwarmup = 1\nruns = 3\n"
        '[[row]]\nname = "build"\nrestore = []\n[[row]]\nname = "experts-only"\nrestore = ["gdn", "attention", "shared_expert", "lm_head"]\n'
        '[[row]]\nname = "all"\nkeep = []\n[[row]]\nname = "experts"\nrestore = ["experts"]\n'
        '[[row]]\nname = "build-again"\nrestore = []\nrepeat = true\n'
    )
    res = run_ablate(
        "all",
        str(standin["build"]),
        str(standin["reference"]),
        tmp_path / "out",
        str(plan),
        AblateSettings(progress=False, bootstrap=50, device="cpu", allow_quantized_base=True),
    )
    rows = {v["name"]: v for v in res["variants"]}
    assert list(rows) == ["build", "experts-only", "build-again"]
    assert {s["name"] for s in res["skipped"]} == {"all", "experts"}
    assert all("which the base keeps quantized" in s["reason"] for s in res["skipped"])
    assert res["base_quantized_classes"] == ["experts"]
    assert rows["experts-only"]["metrics"]["rnd"]["kl"] == pytest.approx(0, abs=1e-6)
    assert rows["build"]["metrics"]["rnd"]["kl"] > 1e-3
    assert rows["build-again"]["repeat_of"] == "build"
    assert rows["build-again"]["metrics"]["rnd"]["kl"] == pytest.approx(rows["build"]["metrics"]["rnd"]["kl"])
    table = (tmp_path / "out" / "table.md").read_text()
    assert "the build's 2 engines" in table and "which the base keeps quantized" in table
    with pytest.raises(Exception, match="allow-quantized-base"):
        run_ablate(
            "all",
            str(standin["build"]),
            str(standin["reference"]),
            tmp_path / "out2",
            str(plan),
            AblateSettings(progress=False, bootstrap=50, device="cpu"),
        )
    assert not (tmp_path / "out2").exists()


def test_random_corpus_is_seeded_and_in_the_tokenizer_range(standin):
    from transformers import AutoTokenizer

    from splicer.corpora.core import build_corpus

    tok = AutoTokenizer.from_pretrained(str(standin["build"]))
    spec = {"name": "r", "kind": "random", "chunk_tokens": 16, "max_chunks": 4, "seed": 3}
    a, b = build_corpus(spec, tok, None, standin["build"]), build_corpus(spec, tok, None, standin["build"])
    c = build_corpus(dict(spec, seed=4), tok, None, standin["build"])
    assert a.sequences == b.sequences != c.sequences and len(a.sequences) == 4 and a.positions() == 60
    assert max(max(s) for s in a.sequences) < len(tok)


def _build_vs_base(root, spec):
    from splicer.analysis.metrics import fill_missing, kl_top_lumped
    from splicer.backends.torch_ref import TorchBackend
    from splicer.fixtures.core import write_pair

    p = write_pair(root, spec, kinds=("lowlatency",))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(10, 2000, (64,), generator=g).tolist() for _ in range(3)]
    b = TorchBackend("cpu")
    b.load(p["base"])
    base = list(b.score(seqs, 20, batch_size=3))
    b.load(p["lowlatency"])
    var = list(b.score(seqs, 20, batch_size=3))
    kl = torch.cat(
        [kl_top_lumped(x.topk_logprobs, fill_missing(x.topk_ids, y.topk_ids, y.topk_logprobs)) for x, y in zip(base, var)]
    )
    return kl.mean().item()


def test_residual_scale_keeps_a_deep_random_stack_out_of_chaos(tmp_path):
    """The stand-in's depth fix: with the tiny fixture's scales a 16-layer random stack is chaotic under INT4 rounding."""
    from splicer.fixtures.standin import RESIDUAL_SCALE

    over = {"num_hidden_layers": 16}
    chaotic = _build_vs_base(tmp_path / "a", FixtureSpec(preset="tiny", text_overrides=over))
    tamed = _build_vs_base(tmp_path / "b", FixtureSpec(preset="tiny", text_overrides=over, residual_scale=RESIDUAL_SCALE))
    assert chaotic > 1.0 and tamed < chaotic / 5, (chaotic, tamed)
