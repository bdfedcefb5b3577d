"""Each metric against an independent, straightforward computation on random distributions."""

from __future__ import annotations

import math
import random

import pytest
import torch

from splicer.ablate import position_records
from splicer.corpora import Corpus
from splicer.metrics import (
    bootstrap_mean_ci,
    fill_missing,
    kl_full,
    kl_top_lumped,
    summarize,
    wilson,
)


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
    base = {"topk_ids": bt.indices, "topk_logprobs": bt.values, "lengths": torch.tensor([4, 3]),
            "target_logprobs": base_lp.gather(1, targets[:, None])[:, 0], "full": base_lp}
    var = {"topk_ids": vt.indices, "topk_logprobs": vt.values, "target_logprobs": var_lp.gather(1, targets[:, None])[:, 0], "full": var_lp}
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

    from splicer.corpora import build_corpus

    asked = {}

    def load_dataset(name, config, split, streaming):
        asked.update(name=name, config=config, split=split, streaming=streaming)
        return iter([{"text": "The river rises in a chain of low hills. " * 40} for _ in range(10)])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    tok = AutoTokenizer.from_pretrained(str(pairs["fused"]["base"]))
    spec = {"name": "wiki-en", "kind": "hub", "dataset": "Salesforce/wikitext", "config": "wikitext-2-raw-v1", "split": "test",
            "field": "text", "chunk_tokens": 64, "max_chunks": 5}
    c = build_corpus(spec, tok, 4096, None)
    assert asked == {"name": "Salesforce/wikitext", "config": "wikitext-2-raw-v1", "split": "test", "streaming": True}
    assert len(c.sequences) == 5 and all(len(s) == 64 for s in c.sequences)
