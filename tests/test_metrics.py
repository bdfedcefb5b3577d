"""Each metric against an independent, straightforward computation on random distributions."""

from __future__ import annotations

import math
import random

import pytest
import torch

from splicer.ablate import position_records
from splicer.analysis.metrics import (
    bootstrap_mean_ci,
    fill_missing,
    kl_full,
    kl_top_lumped,
    summarize,
    wilson,
)
from splicer.corpora.core import Corpus


def _random_dists(n, v, seed, sharp=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(n, v, generator=g, dtype=torch.float64) * sharp, -1)


def _slow_kl_lumped(p_full: list[float], q_full: list[float], k: int) -> float:
    top = sorted(range(len(p_full)), key=lambda i: -p_full[i])[:k]
    kl = sum(p_full[i] * math.log(p_full[i] / q_full[i]) for i in top)
    pr = 1 - sum(p_full[i] for i in top)
    qr = 1 - sum(q_full[i] for i in top)
    return kl + (pr * math.log(pr / qr) if pr > 0 else 0.0)


def test_kl_lumped_matches_loop_and_bounds_full_kl():
    base, var = _random_dists(50, 300, 0), _random_dists(50, 300, 1)
    var = torch.log_softmax(base + 0.3 * var, -1)  # a perturbed copy
    top = base.topk(20, -1)
    got = kl_top_lumped(top.values, var.gather(1, top.indices))
    full = kl_full(base, var)
    for i in range(50):
        p, q = base[i].exp().tolist(), var[i].exp().tolist()
        assert got[i].item() == pytest.approx(_slow_kl_lumped(p, q, 20), rel=1e-5, abs=1e-7)
        assert full[i].item() == pytest.approx(sum(a * math.log(a / b) for a, b in zip(p, q)), rel=1e-5)
        assert got[i] <= full[i] + 1e-6  # data-processing inequality: coarse-graining lowers KL


def test_kl_is_zero_for_identical_distributions():
    base = _random_dists(10, 100, 2)
    top = base.topk(20, -1)
    assert kl_top_lumped(top.values, top.values).abs().max() < 1e-6
    assert kl_full(base, base).abs().max() < 1e-9


def test_fill_missing_exact_when_present_and_kth_value_otherwise():
    base_ids = torch.tensor([[3, 1, 7]])
    var_ids = torch.tensor([[1, 3, 9]])
    var_lp = torch.tensor([[-0.5, -1.0, -2.0]])
    got = fill_missing(base_ids, var_ids, var_lp)
    assert got.tolist() == [[-1.0, -0.5, -2.0]]  # 7 is not in the variant's top-3: its 3rd value bounds it


def test_the_kl_from_the_variants_own_top_k_bounds_neither_the_exact_nor_the_full_kl():
    """What the table's wording of an own-top-k run says: filling a missing id with the variant's k-th log-prob lowers
    that id's term and raises the lumped rest's, so the sum can exceed the exact lumped KL and even the full KL."""
    # vocabulary A, B, C; base p = (0.4, 0.6, 0), its top-1 is A; variant q = (0.05, 0.9, 0.05), its top-1 is B
    p = torch.tensor([0.4, 0.6, 1e-30])
    q = torch.tensor([0.05, 0.9, 0.05])
    full = float(kl_full(p.log()[None], q.log()[None])[0])
    exact = float(kl_top_lumped(p.log()[None, :1], q.log()[None, :1])[0])
    filled = fill_missing(torch.tensor([[0]]), torch.tensor([[1]]), q.log()[None, 1:2])
    own = float(kl_top_lumped(p.log()[None, :1], filled)[0])
    assert exact <= full + 1e-6  # the data-processing inequality, for exact log-probs
    assert own > full > exact  # 0.751 > 0.589 > 0.556: no bound either way


def test_wilson_against_textbook_values():
    lo, hi = wilson(50, 100)
    assert (round(lo, 4), round(hi, 4)) == (0.4038, 0.5962)
    lo, hi = wilson(100, 100)
    assert hi == 1.0 and round(lo, 4) == 0.9630


def test_bootstrap_interval_covers_mean_and_collapses_for_constants():
    random.seed(0)
    vals = torch.tensor([random.gauss(1.0, 0.5) for _ in range(400)])
    seq = torch.arange(400) // 10
    lo, hi = bootstrap_mean_ci(vals, seq, reps=500)
    assert lo < vals.mean().item() < hi and hi - lo < 0.3
    lo, hi = bootstrap_mean_ci(torch.full((40,), 2.0), torch.arange(40) // 4, reps=100)
    assert lo == pytest.approx(2.0) and hi == pytest.approx(2.0)


def test_position_records_and_summary_by_hand():
    """Two chat sequences: prompt lengths 3 and 2; dNLL must average exactly the answer positions."""
    corpus = Corpus("chat", "chat", [[5, 6, 7, 8, 9], [1, 2, 3, 4]], prompt_lens=[3, 2])
    n = 4 + 3
    g = torch.Generator().manual_seed(3)
    base_lp = torch.log_softmax(torch.randn(n, 50, generator=g), -1)
    var_lp = torch.log_softmax(torch.randn(n, 50, generator=g), -1)
    targets = torch.tensor([6, 7, 8, 9, 2, 3, 4])
    bt, vt = base_lp.topk(20, -1), var_lp.topk(20, -1)
    base = {
        "topk_ids": bt.indices,
        "topk_logprobs": bt.values,
        "lengths": torch.tensor([4, 3]),
        "target_logprobs": base_lp.gather(1, targets[:, None])[:, 0],
        "full": base_lp,
    }
    var = {
        "topk_ids": vt.indices,
        "topk_logprobs": vt.values,
        "target_logprobs": var_lp.gather(1, targets[:, None])[:, 0],
        "full": var_lp,
    }
    rec = position_records(base, var, corpus, var_lp.gather(1, bt.indices))
    # answers: seq 0 tokens 8, 9 (predicted at positions 2, 3); seq 1 tokens 3, 4 (positions 1, 2 -> 5, 6 overall)
    assert rec["answer_mask"].tolist() == [False, False, True, True, False, True, True]
    s = summarize(rec, reps=50)
    answer = [2, 3, 5, 6]
    expected = sum(base["target_logprobs"][i] - var["target_logprobs"][i] for i in answer) / 4
    assert s["dnll"] == pytest.approx(float(expected), rel=1e-5)
    assert s["answer_positions"] == 4 and s["positions"] == 7
    top1 = sum(int(bt.indices[i, 0] == vt.indices[i, 0]) for i in range(n)) / n
    assert s["top1"] == pytest.approx(top1)
    assert s["kl_full"] == pytest.approx(float(kl_full(base_lp, var_lp).double().mean()), rel=1e-5)


def test_hub_corpus_through_the_datasets_api(monkeypatch, pairs):
    """kind = "hub" reads rows from datasets.load_dataset(..., streaming=True) (a stand-in module here: no network)."""
    import sys
    import types

    from transformers import AutoTokenizer

    from splicer.corpora.core import build_corpus

    asked = {}

    def load_dataset(name, config, split, streaming):
        asked.update(name=name, config=config, split=split, streaming=streaming)
        return iter([{"text": "The river rises in a chain of low hills. " * 40} for _ in range(10)])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    tok = AutoTokenizer.from_pretrained(str(pairs["fused"]["base"]))
    spec = {
        "name": "wiki-en",
        "kind": "hub",
        "dataset": "Salesforce/wikitext",
        "config": "wikitext-2-raw-v1",
        "split": "test",
        "field": "text",
        "chunk_tokens": 64,
        "max_chunks": 5,
    }
    c = build_corpus(spec, tok, 4096, None)
    assert asked == {"name": "Salesforce/wikitext", "config": "wikitext-2-raw-v1", "split": "test", "streaming": True}
    assert len(c.sequences) == 5 and all(len(s) == 64 for s in c.sequences)


def _tied_topk(logits: torch.Tensor, order: torch.Tensor, k: int = 8):
    """Top-k of logits [N, V] as an engine that breaks ties by its own id order would return them: order[i] is id i's
    place in that order (ids earlier in it come first among equal values)."""
    lp = torch.log_softmax(logits.double(), -1).float()
    key = lp.double() * 1e6 - order.double()[None, :] * 1e-3  # value first, then the engine's id order
    idx = key.topk(k, -1).indices
    return idx, lp.gather(1, idx)


def test_top1_agreement_is_symmetric_and_the_vocabulary_order_changes_nothing():
    """Ties on either side (BF16 logits tie often): another valid tie order, i.e. the vocabulary in another order, must
    not change which positions agree, and swapping base and variant must not either. (Ties that run past the top-k an
    engine returns are beyond any rule: the data here keep them inside it.)"""
    g = torch.Generator().manual_seed(5)
    n, vocab = 400, 12
    base_logits = torch.round(torch.randn(n, vocab, generator=g) * 3)  # coarse values: ties at the top are common
    var_logits = torch.round(base_logits + 0.8 * torch.randn(n, vocab, generator=g))
    corpus = Corpus("c", "text", [list(range(n + 1))])
    agree = []
    for seed in (0, 1, 2):
        order = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
        (bi, bl), (vi, vl) = _tied_topk(base_logits, order), _tied_topk(var_logits, order)
        base = {"lengths": torch.tensor([n]), "topk_ids": bi, "topk_logprobs": bl, "target_logprobs": torch.zeros(n)}
        var = {"topk_ids": vi, "topk_logprobs": vl, "target_logprobs": torch.zeros(n)}
        agree.append(position_records(base, var, corpus, None)["top1"])
    var_ties = (vl[:, 1] == vl[:, 0]).float().mean()
    assert var_ties > 0.05  # the data do have ties among the variant's maxima
    assert all(torch.equal(agree[0], a) for a in agree[1:])
    from splicer.analysis.metrics import top1_agreement

    assert torch.equal(top1_agreement(bi, bl, vi, vl), top1_agreement(vi, vl, bi, bl))  # symmetric
    # without ties it is plain argmax equality
    plain = top1_agreement(
        torch.tensor([[3, 1]]), torch.tensor([[-0.1, -2.0]]), torch.tensor([[1, 3]]), torch.tensor([[-0.2, -1.0]])
    )
    assert plain.tolist() == [False]
    # the rule reads the largest log-prob of each row, not the first column: a top-k listed in another order agrees alike
    perm = torch.randperm(bi.shape[1], generator=g)
    assert torch.equal(top1_agreement(bi[:, perm], bl[:, perm], vi.flip(1), vl.flip(1)), top1_agreement(bi, bl, vi, vl))


def test_a_corpus_of_too_few_sequences_has_no_interval_and_the_interval_is_t_based():
    from splicer.analysis.metrics import MIN_SEQUENCES, small_sample_half_width

    vals = torch.tensor([0.1, 0.3, 0.2, 0.5, 0.4, 0.9, 0.6, 0.2])
    assert bootstrap_mean_ci(vals, torch.arange(8) // 2) is None  # 4 sequences
    seq = torch.arange(8) * MIN_SEQUENCES // 8  # 5 sequences
    lo, hi = bootstrap_mean_ci(vals, seq, reps=4000)
    sums = torch.zeros(5, dtype=torch.float64).index_add_(0, seq, vals.double())
    counts = torch.zeros(5, dtype=torch.float64).index_add_(0, seq, torch.ones(8, dtype=torch.float64))
    # the bootstrap's standard error of a ratio estimator is close to the delta method's; t(4) x sqrt(5/4) widens it
    mean = float(vals.mean())
    resid = sums / counts.mean() - mean * counts / counts.mean()
    se = float(resid.std(correction=0)) / math.sqrt(5)
    half = small_sample_half_width(se, 5)
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.1) and lo < mean < hi
    # a grouped unit: 8 sequences in 2 groups are 2 units, too few (both counts reported)
    rec = {
        "seq_index": torch.arange(8),
        "group": torch.arange(8) // 4,
        "top1": torch.ones(8, dtype=torch.bool),
        "kl_top": vals,
        "tail": torch.zeros(8),
        "dlogp": torch.zeros(8),
    }
    s = summarize(rec, reps=50)
    assert s["sequences"] == 8 and s["groups"] == 2 and s["kl_ci"] is None and s["top1_ci"] is None


def _chat_scores(corpus, seed):
    """Random base and variant scores of every position of corpus, as the base pass and a row would store them."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([len(s) - 1 for s in corpus.sequences])
    n = int(lengths.sum())
    base_lp = torch.log_softmax(torch.randn(n, 50, generator=g), -1)
    targets = torch.cat([torch.tensor(s[1:]) for s in corpus.sequences])
    bt = base_lp.topk(20, -1)
    base = {
        "topk_ids": bt.indices,
        "topk_logprobs": bt.values,
        "lengths": lengths,
        "target_logprobs": base_lp.gather(1, targets[:, None])[:, 0],
    }
    out = []
    for _ in range(2):
        # variants shifted per group, so that conversations of one group share their effect
        shift = torch.randn(max(corpus.groups) + 1, generator=g)[torch.tensor(corpus.groups)].repeat_interleave(lengths)
        var_lp = torch.log_softmax(
            base_lp + torch.randn(n, 50, generator=g) * 0.3 + shift[:, None] * torch.randn(50, generator=g), -1
        )
        vt = var_lp.topk(20, -1)
        var = {"topk_ids": vt.indices, "topk_logprobs": vt.values, "target_logprobs": var_lp.gather(1, targets[:, None])[:, 0]}
        out.append(position_records(base, var, corpus, var_lp.gather(1, bt.indices)))
    return out


def test_chat_score_records_carry_the_group_and_every_interval_resamples_groups(tmp_path):
    """24 conversations are 12 groups of 2 (chat.group): the score records carry each position's group, the summary
    counts 24 sequences in 12 groups, and compare's and budget's paired intervals resample the 12 groups (not the 24
    sequences);
    score files without groups (written before them) still compare, a sequence per unit."""
    from safetensors.torch import save_file

    from splicer.analysis.metrics import TOO_FEW_GROUPS, paired_comparison
    from splicer.analysis.verdicts import compare_scores
    from splicer.corpora.chat import group

    seqs = [[1000 + i, *range(i, i + 7)] for i in range(24)]
    corpus = Corpus("chat", "chat", seqs, prompt_lens=[4] * 24, groups=[group(i) for i in range(24)])
    a, b = _chat_scores(corpus, 5)
    assert a["group"].tolist() == [group(i) for i in range(24) for _ in range(7)]
    s = summarize(a, reps=50)
    assert s["sequences"] == 24 and s["groups"] == 12 and s["kl_ci"] is not None
    for row, rec in (("a", a), ("b", b)):
        (tmp_path / "scores" / row).mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in rec.items()}, str(tmp_path / "scores" / row / "chat.safetensors"))
    c = compare_scores(tmp_path, "a", "b", ["chat"], reps=400)
    for q in ("kl", "top1", "dnll"):
        assert c[q]["per_stratum"]["chat"]["clusters"] == 12 and c[q]["per_stratum"]["chat"]["unit"] == "groups", q
    by = {
        unit: paired_comparison(
            {"chat": {"a": a["kl_top"], "b": b["kl_top"], "cluster": a[unit], "weight": a["weight"]}}, reps=400
        )["per_stratum"]["chat"]["diff_ci"]
        for unit in ("group", "seq_index")
    }
    assert c["kl"]["per_stratum"]["chat"]["diff_ci"] == pytest.approx(by["group"]) and by["group"] != pytest.approx(
        by["seq_index"]
    )
    # budget's strata (the prediction against a measured row) resample the same groups
    from types import SimpleNamespace

    from splicer.analysis.budget import PositionScores

    stratum = PositionScores(tmp_path, ["chat"]).strata(SimpleNamespace(build_row="a"), (), "chat", other="b")["chat"]
    assert stratum["unit"] == "groups" and torch.equal(stratum["cluster"], a["group"])
    assert paired_comparison({"chat": stratum}, reps=400)["per_stratum"]["chat"]["clusters"] == 12
    for row, rec in (("a", a), ("b", b)):  # an old score file: no group
        save_file(
            {k: v.contiguous() for k, v in rec.items() if k != "group"}, str(tmp_path / "scores" / row / "chat.safetensors")
        )
    old = compare_scores(tmp_path, "a", "b", ["chat"], reps=400)["kl"]["per_stratum"]["chat"]
    assert old["clusters"] == 24 and old["unit"] == "sequences" and old["diff_ci"] == pytest.approx(by["seq_index"])
    # fewer than MIN_SEQUENCES groups: no interval, and the reason names groups, not sequences
    four = a["group"] % 4
    few = paired_comparison({"chat": {"a": a["kl_top"], "b": b["kl_top"], "cluster": four, "unit": "groups"}}, reps=50)
    assert few["per_stratum"]["chat"]["why"] == TOO_FEW_GROUPS and few["pooled"]["why"] == TOO_FEW_GROUPS
    assert few["per_stratum"]["chat"]["diff_ci"] is None and few["per_stratum"]["chat"]["clusters"] == 4
