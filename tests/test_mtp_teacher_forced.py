"""The teacher-forced MTP acceptance estimate (`splicer mtp DIR --teacher-forced`): the torch backend's MTP head is
the trained model's, hits are counted at the right positions, a quantized head loads dequantized, a family whose
drafter is not modeled is refused, and the stage end to end on a torch-backend folder (record, table, report,
resume). The estimate beside vLLM's figure on a vLLM folder is checked in tests/test_mtp.py, where the stand-in
engine runs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from splicer.analysis import teacher_forced as tf
from splicer.backends.torch_ref import TorchBackend
from splicer.cli import main
from splicer.errors import SplicerError

from .results_edits import with_failed_row


@pytest.fixture(scope="module")
def trained_base(tmp_path_factory):
    """The tiny recipe's model, untrained, written as a base in the release layout. Its MTP head passes the next
    token's embedding through (fc = [I, 0], the layer's writes to the residual zeroed), so that it guesses what the
    trunk predicts from that token alone: some of its drafts hit and some miss, where a random head's all miss."""
    from splicer.fixtures.core import write_base
    from splicer.trained import train as T

    r = T.recipe("tiny")
    model = T.build_model(r).eval()
    h = model.config.hidden_size
    layer = model.mtp.layers[0]
    with torch.no_grad():
        model.mtp.fc.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], 1))
        for w in (layer.self_attn.o_proj.weight, layer.mlp.experts.down_proj, layer.mlp.shared_expert.down_proj.weight):
            w.zero_()
    out = tmp_path_factory.mktemp("tf-trained") / "base"
    write_base(out, T.fixture_spec(r), tensors=T.export_tensors(model))
    with torch.no_grad():  # the written BF16 values, held in float32 (buffers such as inv_freq stay as they are)
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model, out


def test_the_backends_mtp_head_is_the_trained_models(trained_base):
    from splicer.backends.torch_mtp import draft_logits

    model, folder = trained_base
    backend = TorchBackend("cpu", dtype="float32")
    backend.load(folder)
    backend.load_drafter()
    ids = torch.randint(0, 500, (2, 26), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, want, _ = model(ids)
        hidden = backend.model.model(input_ids=ids[:, :-1]).last_hidden_state
        got = draft_logits(backend.drafter, backend.model.model, backend.model.lm_head, hidden[:, :-1], ids[:, 1:-1])
    # Same weights, same modules, float32 on both sides: only the order of arithmetic could differ.
    assert got.shape == want.shape and (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    # draft_hits on the trained model's own logits: the head's argmax at t against the trunk's at t+1
    # (the model reads ids[:, :-1], 25 tokens, and its MTP logits are for t = 0 .. 23: those of a sequence of 26)
    hits = backend.draft_hits(ids.tolist())
    expect = want.argmax(-1) == logits[:, 1:].argmax(-1)
    assert [h.tolist() for h in hits] == expect.tolist() and expect.shape == (2, 24)
    assert 0 < expect.sum() < expect.numel()  # hits and misses both counted


class _Trunk(nn.Module):
    """A trunk whose last hidden state at t is one-hot (x_t + 1) % V, so its own argmax at t is x_t + 1: embeddings
    one-hot, the head the identity."""

    def __init__(self, v):
        super().__init__()
        self.v = v
        self.embed_tokens = lambda ids: nn.functional.one_hot(ids, self.v).float()
        self.rotary_emb = lambda x, positions: None

    def forward(self, input_ids, use_cache=False):
        return SimpleNamespace(last_hidden_state=nn.functional.one_hot((input_ids + 1) % self.v, self.v).float())


class _Drafter(nn.Module):
    """Guesses x_{t+1} + 1 (the trunk's next argmax) when x_{t+1} is even, x_{t+1} itself (a miss) when it is odd."""

    def forward(self, next_embeds, hidden, position_embeddings):
        x = next_embeds.argmax(-1)
        guess = torch.where(x % 2 == 0, (x + 1) % next_embeds.shape[-1], x)
        return nn.functional.one_hot(guess, next_embeds.shape[-1]).float()


def test_hits_by_hand_on_a_small_case():
    backend = TorchBackend("cpu", dtype="float32")
    backend.model = SimpleNamespace(model=_Trunk(8), lm_head=nn.Identity())
    backend.drafter = _Drafter()
    # t = 0 .. T-3: x_{t+1} = 1, 2, 3, 4 -> a hit where x_{t+1} is even; two lengths, batched apart; T < 3 has none
    seqs = [[0, 1, 2, 3, 4, 5], [7, 2, 2, 5], [3, 4], [6, 6, 1, 0, 3, 7]]
    hits = backend.draft_hits(seqs, batch_size=1)
    assert [h.tolist() for h in hits] == [[False, True, False, True], [True, True], [], [True, False, True, False]]
    backend.drafter = None
    with pytest.raises(RuntimeError, match="load_drafter"):
        backend.draft_hits(seqs)


def test_a_quantized_mtp_head_loads_dequantized_and_runs(pairs):
    p = pairs["fused"]
    index = json.loads((p["experts-g32"] / "model.safetensors.index.json").read_text())["weight_map"]
    assert "mtp.layers.0.mlp.experts.0.gate_proj.weight_packed" in index  # the build quantizes the head's experts
    backend = TorchBackend("cpu")
    backend.load(p["experts-g32"])
    backend.load_drafter()
    fc = _tensor(p["base"], "mtp.fc.weight")
    base = _tensor(p["base"], "mtp.layers.0.mlp.experts.gate_up_proj")
    experts = backend.drafter.layers[0].mlp.experts.gate_up_proj.detach()
    assert torch.equal(backend.drafter.fc.weight.detach(), fc)  # unquantized: as stored
    err = (experts.float() - base.float()).abs()
    assert 0 < err.max().item() < 0.5 * base.float().abs().max().item()  # dequantized INT4 g32: near, not equal
    hits = backend.draft_hits([list(range(3, 20)), list(range(30, 47))])
    assert [h.shape for h in hits] == [torch.Size([15])] * 2


def _open(folder, name):
    from safetensors import safe_open

    shard = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][name]
    return safe_open(str(folder / shard), "pt")


def _tensor(folder, name):
    with _open(folder, name) as f:
        return f.get_tensor(name)


def test_a_family_without_a_modeled_drafter_is_refused_in_one_line():
    from splicer.arch import get_architecture

    for config, says in (
        ({"model_type": "deepseek_v3", "num_hidden_layers": 3}, "deepseek_v3's MTP drafter (eh_proj"),
        ({"model_type": "glm4_moe", "num_hidden_layers": 3}, "glm4_moe's MTP drafter"),
        ({"model_type": "qwen3_next"}, "qwen3_next's MTP drafter"),
        ({"model_type": "qwen3_moe"}, "qwen3_moe has no MTP head"),
    ):
        with pytest.raises(SplicerError) as e:
            TorchBackend.check_drafter(SimpleNamespace(arch=get_architecture(config)))
        assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    TorchBackend.check_drafter(SimpleNamespace(arch=get_architecture({"model_type": "qwen3_5_moe"})))


def test_the_agreement_sentence_claims_no_more_than_its_interval():
    seqs = [{"corpus": "a", "index": i, "positions": 20} for i in range(12)]
    record = {"build_row": "build", "sequences": seqs, "rows": {"build": {"status": "ok", "hits": [10] * 12}}}
    engine_record = {
        "build_row": "build",
        "prompts": [{"corpus": "a", "index": i} for i in range(8)],  # the engine's prompts: the first 8 sequences
        "engines": [],
    }

    def spec(accepted):
        per = [{"drafts": 20, "draft_tokens": 20, "accepted": a, "accepted_per_pos": [a]} for a in accepted]
        engine_record["engines"] = [{"row": "build", "k": 1, "status": "ok", "per_prompt": per}]
        from splicer.analysis import speculative

        return {
            "record": record,
            "summary": tf.summarize(record, reps=400),
            "engine": tf.engine_comparison(record, {"record": engine_record, "summary": speculative.summarize(engine_record)}),
        }

    near = spec([9, 11, 10, 12, 8, 10, 11, 9])
    cmp = near["engine"]["build"]
    assert cmp["sequences"] == 8 and cmp["estimate_shared"] == 0.5 and cmp["engine_shared"] == pytest.approx(80 / 160)
    assert cmp["vs_engine"]["diff"] == pytest.approx(0) and cmp["vs_engine"]["significant"] is False
    text = tf.sentences(near)[0]
    assert "no difference resolved" in text and "within" in text and "agree" not in text
    far = spec([16, 17, 15, 16, 18, 16, 14, 16])
    vs = far["engine"]["build"]["vs_engine"]
    assert vs["diff"] == pytest.approx(0.5 - 128 / 160) and vs["significant"] is True
    assert "a difference the interval resolves (the estimate reads low)" in tf.sentences(far)[0]
    row = tf.table_rows(far, ["build"])[0]
    assert (
        row[4].startswith("80.0 % [") and row[5].startswith("-30.0 [") and row[5].endswith("(on the 8 sequences both measured)")
    )


def test_a_flagged_estimate_is_not_compared_with_vllm_and_its_units_are_sequences():
    seqs = [{"corpus": "a", "index": i, "positions": 50} for i in range(6)]  # 300 positions: judged by the bounds
    record = {
        "build_row": "build",
        "sequences": seqs,
        "rows": {"build": {"status": "ok", "hits": [20, 22, 18, 21, 19, 20]}, "gdn": {"status": "ok", "hits": [0] * 6}},
    }
    per = [{"drafts": 20, "draft_tokens": 20, "accepted": 10, "accepted_per_pos": [10]} for _ in range(5)]
    engine_record = {
        "build_row": "build",
        "prompts": [{"corpus": "a", "index": i} for i in range(5)],
        "engines": [{"row": r, "k": 1, "status": "ok", "per_prompt": per} for r in ("build", "gdn")],
    }
    from splicer.analysis import speculative

    spec = {
        "record": record,
        "summary": tf.summarize(record, reps=200),
        "engine": tf.engine_comparison(record, {"record": engine_record, "summary": speculative.summarize(engine_record)}),
    }
    gdn = spec["summary"]["gdn"]
    assert "drafts almost never match" in gdn["flagged"] and "acceptance" not in gdn and "vs_build" not in gdn
    assert spec["summary"]["build"]["acceptance"]["sequences"] == 6
    assert spec["engine"]["gdn"]["estimate_flagged"] and "vs_engine" not in spec["engine"]["gdn"]
    assert "vs_engine" in spec["engine"]["build"]
    rows = {r[0]: r for r in tf.table_rows(spec, ["build", "gdn"])}
    assert rows["gdn"][1].startswith("flagged: acceptance 0.0 % over 300 positions") and rows["gdn"][3] == ""
    assert rows["gdn"][4].startswith("50.0 %") and rows["gdn"][5] == "no comparison: the estimate is flagged"
    assert rows["build"][5].endswith("(on the 5 sequences both measured)")
    text = " ".join(tf.sentences(spec, ["build", "gdn"]))
    assert "MTP teacher-forced, gdn: flagged, acceptance 0.0 % over 300 positions" in text and text.count("vLLM's k=1") == 1
    assert "need not equal the difference of the two columns beside it" in tf.note(spec)
    # too few sequences for an interval: the reason counts sequences, which is what the estimate resamples
    few = tf.summarize(dict(record, sequences=seqs[:3], rows={"build": {"status": "ok", "hits": [5, 6, 7]}}), reps=50)
    assert few["build"]["acceptance"]["why"] == "fewer than 5 sequences (or chat groups) in corpus a"


@pytest.fixture(scope="module")
def torch_dir(pairs, tmp_path_factory):
    """A torch-backend ablate folder of the build that quantizes the MTP head's experts: rows build and mtp (the head
    restored to BF16), six 32-token sequences."""
    root = tmp_path_factory.mktemp("tf-ablate")
    plan = root / "p.toml"
    plan.write_text(
        'name = "p"\n[[corpus]]\nname = "en"\nkind = "builtin"\ntext = "wiki-en"\nchunk_tokens = 32\nmax_chunks = 6\n'
        '[[row]]\nname = "build"\nrestore = []\n[[row]]\nname = "mtp"\nrestore = ["mtp"]\n'
    )
    p = pairs["fused"]
    out = root / "out"
    argv = ["ablate", "all", str(p["experts-g32"]), str(p["base"]), "-o", str(out), "--plan", str(plan), "--no-time", "-q"]
    assert main(argv) == 0
    return out


def test_teacher_forced_end_to_end_on_a_torch_folder_and_resume(torch_dir, capsys):
    out = torch_dir
    with with_failed_row(out):  # lm_head: a row whose ablate run failed
        for argv, says in (
            (["--teacher-forced", "--tokens", "1"], "--tokens sets vLLM's engines"),
            (["--device", "cpu"], "--device goes with --teacher-forced"),
            (["--force"], "--force goes with --teacher-forced"),
            (["--teacher-forced", "--rows", "nope"], "no finished row of that name"),
            (["--teacher-forced", "--rows", "lm_head"], "(its error: RuntimeError: out of memory); rerun ablate to finish it"),
        ):
            assert main(["mtp", str(out), *argv]) == 2
            err = capsys.readouterr().err.strip()
            assert err.count("\n") == 0 and says in err, err
            assert "no finished row" not in err or "nope" in err
    assert not (out / tf.FILE).exists()
    assert main(["mtp", str(out), "--teacher-forced", "--device", "cpu", "-q"]) == 0
    record = json.loads((out / tf.FILE).read_text())
    assert record["build_row"] == "build" and list(record["rows"]) == ["build", "mtp"]
    assert [s["positions"] for s in record["sequences"]] == [30] * 6 and record["backend"]["device"] == "cpu"
    for entry in record["rows"].values():
        assert entry["status"] == "ok" and len(entry["hits"]) == 6 and all(0 <= h <= 30 for h in entry["hits"])
    record_hits = record["rows"]["mtp"]["hits"]
    summary = record["summary"]
    assert summary["build"]["positions"] == 180 and "vs_build" in summary["mtp"] and "vs_build" not in summary["build"]
    assert summary["build"]["acceptance"]["sequences"] == 6 and "prompts" not in summary["build"]["acceptance"]
    # the fixture's heads hit nowhere, both of them: no sequence differs, so the difference has no interval, nor verdict
    assert record["rows"]["build"]["hits"] == record_hits
    vs = summary["mtp"]["vs_build"]
    assert vs["diff"] == 0 and vs["ci"] is None and vs["significant"] is None
    assert vs["why"] == "no sequence differs from the build's: no interval"
    table, report = (out / "table.md").read_text(), (out / "report.md").read_text()
    assert "| +0.0 (no sequence differs from the build's: no interval) |" in table and "[+0.0, +0.0]" not in table
    assert "+0.0 pp against the build (no sequence differs from the build's: no interval)." in report
    assert "MTP acceptance, teacher-forced (torch reference)" in table
    assert "| mtp " in table.split("teacher-forced (torch reference)")[1] and "No vLLM figure beside it" in table
    assert "MTP teacher-forced, build: first-position acceptance" in report
    assert "MTP teacher-forced, mtp: first-position acceptance" in report and "against the build" in report
    # resume: finished rows kept, a failed one run again, other settings start afresh
    record["rows"]["build"]["elapsed_s"] = 999.0  # a mark: a row run again would record its own time
    record["rows"]["mtp"] = {"status": "error", "error": "stopped"}
    (out / tf.FILE).write_text(json.dumps(record))
    assert main(["mtp", str(out), "--teacher-forced", "--device", "cpu", "-q"]) == 0
    again = json.loads((out / tf.FILE).read_text())["rows"]
    assert again["build"]["elapsed_s"] == 999.0 and again["mtp"]["status"] == "ok" and again["mtp"]["hits"] == record_hits
    # the same settings with other --rows: the finished rows stay beside them, none run again
    assert main(["mtp", str(out), "--teacher-forced", "--device", "cpu", "--rows", "build", "-q"]) == 0
    kept = json.loads((out / tf.FILE).read_text())
    assert set(kept["rows"]) == {"build", "mtp"} and kept["rows"]["build"]["elapsed_s"] == 999.0 and kept["rows_planned"] == 2
    # other settings never silently replace what is there: refused in one line naming the change; --force replaces
    before = (out / tf.FILE).read_text()
    capsys.readouterr()
    argv = ["mtp", str(out), "--teacher-forced", "--device", "cpu", "--sequences-per-corpus", "5", "--rows", "mtp", "-q"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "(--sequences-per-corpus: all -> 5)" in err and "--force" in err, err
    assert (out / tf.FILE).read_text() == before
    assert main([*argv, "--force"]) == 0
    fewer = json.loads((out / tf.FILE).read_text())
    assert len(fewer["sequences"]) == 5 and all(len(e["hits"]) == 5 for e in fewer["rows"].values())
    assert set(fewer["rows"]) == {"build", "mtp"}  # the build is measured with any --rows


def test_a_head_whose_drafts_never_match_is_flagged_not_tabulated(torch_dir, monkeypatch, capsys):
    """The bounds vLLM's drafters are flagged by (analysis.speculative.broken): the fixture's random heads hit nowhere,
    over fewer positions than the bounds need, so the test lowers that count."""
    from splicer.analysis import speculative

    monkeypatch.setattr(speculative, "FLAG_MIN_TOKENS", 100)
    out = torch_dir
    capsys.readouterr()
    assert main(["mtp", str(out), "--teacher-forced", "--device", "cpu", "--force", "-q"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "the build's teacher-forced estimate is flagged" in err, err
    summary = tf.load(out)["summary"]
    for row in ("build", "mtp"):
        assert "drafts almost never match" in summary[row]["flagged"] and "acceptance" not in summary[row]
        assert "vs_build" not in summary[row]
    section = (out / "table.md").read_text().split("MTP acceptance, teacher-forced (torch reference)")[1]
    n = f"{summary['build']['positions']:,} positions"
    assert f"| build     | flagged: acceptance 0.0 % over {n}" in section and "no sequence differs" not in section
    assert "is flagged, not a result" in section
    report = (out / "report.md").read_text()
    assert f"MTP teacher-forced, mtp: flagged, acceptance 0.0 % over {n}" in report
    assert "MTP teacher-forced, mtp: first-position acceptance" not in report
