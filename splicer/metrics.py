"""Fidelity metrics of a variant against the base, per position and per corpus.

Per position (t predicts token t+1):
  top1     variant's most likely token == base's most likely token
  kl_top   KL(base || variant) over the base's top-k with everything else lumped into one
           "rest" bucket. By the data-processing inequality this is a lower bound on the full
           KL when the variant's log-probs at the base's top-k ids are exact (torch backend);
           with vLLM's own top-k they are filled in conservatively (see fill_missing).
  tail     the base's probability mass outside its top-k
  kl_full  exact KL over the whole vocabulary, where both full distributions are at hand
  dlogp    log p_base(next) - log p_variant(next); its mean over the base's own greedy
           answers is dNLL (extra nats per token)
Corpus summaries use intervals over sequences (positions within a sequence are not
independent): Wilson for top-1, a seeded bootstrap over sequences for means.
"""

from __future__ import annotations

import math

import torch

Z95 = 1.959963984540054


def kl_top_lumped(base_lp: torch.Tensor, var_lp: torch.Tensor) -> torch.Tensor:
    """[N, k] log-probs of the base's top-k under base and variant -> [N] lumped KL."""
    base_lp, var_lp = base_lp.double(), var_lp.double()
    p, q = base_lp.exp(), var_lp.exp()
    head = (p * (base_lp - var_lp)).sum(-1)
    p_rest = (1 - p.sum(-1)).clamp_min(0)
    q_rest = (1 - q.sum(-1)).clamp_min(1e-12)
    rest = torch.where(p_rest > 1e-12, p_rest * (torch.log(p_rest.clamp_min(1e-300)) - torch.log(q_rest)), torch.zeros_like(p_rest))
    return (head + rest).float()


def kl_full(base_lp: torch.Tensor, var_lp: torch.Tensor) -> torch.Tensor:
    """[N, V] full log-softmax of base and variant -> [N] exact KL(base || variant)."""
    base_lp, var_lp = base_lp.double(), var_lp.double()
    return (base_lp.exp() * (base_lp - var_lp)).sum(-1).float()


def fill_missing(base_ids: torch.Tensor, var_ids: torch.Tensor, var_lp: torch.Tensor) -> torch.Tensor:
    """Variant log-probs at the base's top-k ids from the variant's own top-k.

    An id missing from the variant's top-k has probability at most the variant's k-th
    value; that value is used (an engine that returns only its own top-k cannot do better).
    """
    match = base_ids[:, :, None] == var_ids[:, None, :]  # [N, k_base, k_var]
    found = match.any(-1)
    vals = torch.where(match, var_lp[:, None, :], torch.full_like(var_lp[:, None, :], -math.inf)).amax(-1)
    floor = var_lp.min(-1, keepdim=True).values.expand_as(vals)
    return torch.where(found, vals, floor)


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def bootstrap_mean_ci(values: torch.Tensor, seq_index: torch.Tensor, reps: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95 % interval of the mean of `values`, resampling whole sequences."""
    if values.numel() == 0:
        return (float("nan"), float("nan"))
    values = values.double()
    n_seq = int(seq_index.max()) + 1
    sums = torch.zeros(n_seq, dtype=torch.float64).index_add_(0, seq_index.long(), values)
    counts = torch.zeros(n_seq, dtype=torch.float64).index_add_(0, seq_index.long(), torch.ones_like(values))
    keep = counts > 0
    sums, counts = sums[keep], counts[keep]
    g = torch.Generator().manual_seed(seed)
    draw = torch.randint(0, len(sums), (reps, len(sums)), generator=g)
    means = sums[draw].sum(1) / counts[draw].sum(1)
    lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return (lo, hi)


def summarize(pos: dict[str, torch.Tensor], reps: int = 1000) -> dict:
    """Per-position records of one corpus -> the corpus row of results.json."""
    seq = pos["seq_index"]
    n = int(seq.numel())
    top1 = pos["top1"].bool()
    k = int(top1.sum())
    kl = pos["kl_top"]
    out = {
        "positions": n,
        "top1": k / n if n else float("nan"),
        "top1_ci": list(wilson(k, n)),
        "kl": float(kl.double().mean()) if n else float("nan"),
        "kl_ci": list(bootstrap_mean_ci(kl, seq, reps)),
        "kl_median": float(kl.double().median()) if n else float("nan"),
        "kl_p99": float(torch.quantile(kl.double(), 0.99)) if n else float("nan"),
        "kl_p999": float(torch.quantile(kl.double(), 0.999)) if n else float("nan"),
        "base_tail_mass": float(pos["tail"].double().mean()) if n else float("nan"),
        "kl_full": None,
        "kl_full_ci": None,
        "dnll": None,
        "dnll_ci": None,
        "answer_positions": 0,
    }
    if "kl_full" in pos:
        out["kl_full"] = float(pos["kl_full"].double().mean())
        out["kl_full_ci"] = list(bootstrap_mean_ci(pos["kl_full"], seq, reps))
    mask = pos.get("answer_mask")
    if mask is not None and bool(mask.any()):
        d = pos["dlogp"][mask.bool()]
        out["dnll"] = float(d.double().mean())
        out["dnll_ci"] = list(bootstrap_mean_ci(d, seq[mask.bool()], reps))
        out["answer_positions"] = int(mask.sum())
    return out


def paired_difference(a: torch.Tensor, b: torch.Tensor, seq_index: torch.Tensor, reps: int = 1000) -> dict:
    """Mean of a - b on the same positions with a bootstrap interval over sequences."""
    d = a.double() - b.double()
    return {"mean": float(d.mean()), "ci": list(bootstrap_mean_ci(d, seq_index, reps))}
