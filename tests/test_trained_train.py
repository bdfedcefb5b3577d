"""The training stage on a tiny recipe: what it writes is the model it trained, as transformers reads it back."""

import json
import subprocess
import sys

import pytest
import torch

from splicer.trained import train as T


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from splicer.corpora.demo_tokenizer import demo_texts, write_tokenizer
    from splicer.fixtures.core import CHAT_TEMPLATE

    d = tmp_path_factory.mktemp("data")
    texts = demo_texts()
    write_tokenizer(d / "tokenizer", 512, CHAT_TEMPLATE)
    paras = [p for t in texts for p in t.split("\n\n") if p.strip()]
    (d / "train.jsonl").write_text("".join(json.dumps({"text": p, "source": "demo"}) + "\n" for p in paras))
    (d / "heldout").mkdir()
    (d / "heldout" / "en.txt").write_text(texts[0][:3000])
    return d


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    torch.set_num_threads(1)
    r = T.recipe("tiny", steps=2)
    model, report = T.train(data, r, torch.device("cpu"), log=lambda s: None)
    out = tmp_path_factory.mktemp("out") / "base"
    T.write_trained_base(out, data, model, report, r)
    return model, report, out


def test_written_base_is_the_trained_model(trained):
    from transformers import Qwen3_5MoeForConditionalGeneration

    model, _, out = trained
    # In float32 from the written BF16 values on both sides, so only the order of arithmetic differs (in BF16 a
    # near-tie between two experts can route a token differently and move its logits far).
    hf = Qwen3_5MoeForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    m = model.to(torch.bfloat16).to(torch.float32)
    with torch.no_grad():
        want = m.lm_head(m.model(input_ids=ids).last_hidden_state)
        got = hf(input_ids=ids).logits
    assert (got - want).abs().max().item() < 1e-3 * want.abs().max().item()


def test_release_layout_with_trained_mtp(trained):
    model, _, out = trained
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.language_model.layers.0.mlp.experts.3.gate_proj.weight" in names
    assert not any(n.endswith("experts.gate_up_proj") for n in names)
    for n in (
        "mtp.fc.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.norm.weight",
        "mtp.layers.0.self_attn.q_proj.weight",
        "mtp.layers.0.mlp.experts.0.down_proj.weight",
        "lm_head.weight",
    ):
        assert n in names
    from safetensors import safe_open

    with safe_open(str(out / names["mtp.fc.weight"]), "pt") as f:
        fc = f.get_tensor("mtp.fc.weight")
    assert torch.equal(fc, model.mtp.fc.weight.detach().to(torch.bfloat16))
    # The tokenizer is the data stage's, with its chat template.
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert "im_start" in json.dumps(cfg) or (out / "chat_template.jinja").exists()


def test_report_has_baselines_and_samples(trained):
    _, report, _ = trained
    held = report["heldout"]["en"]
    assert held["bigram"] < held["unigram"]
    assert {"loss", "mtp_loss", "mtp_top1", "bigram_weight"} <= set(held)
    assert set(report["samples"]) == {src for src, _ in T.SAMPLE_PROMPTS}
    assert report["steps_done"] == 2


def test_missing_data_is_one_line(tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "splicer.trained.train",
            str(tmp_path / "nodata"),
            str(tmp_path / "o"),
            "--recipe",
            "tiny",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "splicer.trained.data" in p.stderr
    assert not (tmp_path / "o").exists()


def test_ngram_baselines_known_values():
    train = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])
    held = torch.tensor([0, 1, 0, 1])
    b = T.ngram_baselines(train, held, vocab=2)
    assert b["bigram"] < 0.2 < b["unigram"]


def test_summary_table_from_reports(trained, tmp_path):
    from splicer.trained import summary

    _, _, out = trained
    text = summary.summary([out / "train_report.json"])
    held = json.loads((out / "train_report.json").read_text())["heldout"]["en"]
    assert "| seed 0" in text and f"{held['loss']:.3f}" in text and f"{held['bigram'] - held['loss']:.3f}" in text
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert summary.main([str(bad)]) == 2
