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
independent): a seeded bootstrap over sequences, top-1's included. Differences between two
variants on the same positions: paired_comparison; decode-time differences: decode_difference.
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


def bootstrap_mean_ci(values: torch.Tensor, seq_index: torch.Tensor, reps: int = 1000, seed: int = 0,
                      weight: torch.Tensor | None = None) -> tuple[float, float]:
    """95 % interval of the (weighted) mean of `values`, resampling whole sequences."""
    if values.numel() == 0:
        return (float("nan"), float("nan"))
    values = values.double()
    w = torch.ones_like(values) if weight is None else weight.double()
    n_seq = int(seq_index.max()) + 1
    sums = torch.zeros(n_seq, dtype=torch.float64).index_add_(0, seq_index.long(), values * w)
    counts = torch.zeros(n_seq, dtype=torch.float64).index_add_(0, seq_index.long(), w)
    keep = counts > 0
    sums, counts = sums[keep], counts[keep]
    if len(sums) == 0:
        return (float("nan"), float("nan"))
    g = torch.Generator().manual_seed(seed)
    draw = torch.randint(0, len(sums), (reps, len(sums)), generator=g)
    means = sums[draw].sum(1) / counts[draw].sum(1)
    lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return (lo, hi)


def summarize(pos: dict[str, torch.Tensor], reps: int = 1000) -> dict:
    """Per-position records of one corpus -> the corpus row of results.json.

    Means count each position by its weight (a position repeating an earlier sequence's counts 0, see
    ablate.first_occurrence_weights); every interval resamples whole sequences, top-1's included.
    """
    seq = pos["seq_index"]
    w = pos["weight"].double() if "weight" in pos else torch.ones(seq.numel(), dtype=torch.float64)
    counted = w > 0
    n = float(w.sum())
    top1 = pos["top1"].double()
    kl = pos["kl_top"].double()

    def mean(x, m=None):
        ww = w if m is None else w * m
        return float((x.double() * ww).sum() / ww.sum()) if float(ww.sum()) > 0 else float("nan")

    def quantile(x, q):
        x = x.double()[counted]
        return float(torch.quantile(x, q)) if x.numel() else float("nan")

    out = {
        "positions": int(n) if n == int(n) else n,
        "positions_scored": int(seq.numel()),
        "top1": mean(top1),
        "top1_ci": list(bootstrap_mean_ci(top1, seq, reps, weight=w)),
        "kl": mean(kl),
        "kl_ci": list(bootstrap_mean_ci(kl, seq, reps, weight=w)),
        "kl_median": quantile(kl, 0.5),
        "kl_p99": quantile(kl, 0.99),
        "kl_p999": quantile(kl, 0.999),
        "base_tail_mass": mean(pos["tail"]),
        "base_ties": mean(pos["base_tie"]) if "base_tie" in pos else None,
        "kl_full": None,
        "kl_full_ci": None,
        "dnll": None,
        "dnll_ci": None,
        "answer_positions": 0,
    }
    if "kl_full" in pos:
        out["kl_full"] = mean(pos["kl_full"])
        out["kl_full_ci"] = list(bootstrap_mean_ci(pos["kl_full"], seq, reps, weight=w))
    mask = pos.get("answer_mask")
    if mask is not None and bool(mask.any()):
        m = mask.bool()
        d = pos["dlogp"][m]
        out["dnll"] = mean(pos["dlogp"], m.double())
        out["dnll_ci"] = list(bootstrap_mean_ci(d, seq[m], reps, weight=w[m]))
        out["answer_positions"] = int((w * m.double()).sum())
    return out


# ---------------------------------------------------------------- paired verdicts


def _t975(df: int) -> float:
    """Two-sided 95 % quantile of Student's t (df >= 1); exact enough for intervals (scipy is not a dependency)."""
    table = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
             12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000}
    if df in table:
        return table[df]
    if df > 60:
        return Z95 + 2.4 / df  # within 0.001 of the exact value from df 60 on
    lower = max(k for k in table if k < df)
    upper = min(k for k in table if k > df)
    return table[lower] + (table[upper] - table[lower]) * (df - lower) / (upper - lower)


def paired_comparison(strata: dict[str, dict], reps: int = 2000, seed: int = 0) -> dict:
    """Means of two variants' per-position values on the same positions, their difference and ratio, each with a 95 %
    interval from a paired, stratified cluster bootstrap, per stratum and pooled.

    strata: name -> {"a": [N], "b": [N], "cluster": [N] int (the independent unit: a sequence, a conversation),
    "weight": [N] or None (0 drops a position counted elsewhere, e.g. a chat prefix shared with an earlier
    conversation)}. The pooled estimate weighs every counted position equally across strata (position-weighted);
    its bootstrap resamples clusters within each stratum, a and b always together. A difference is significant when
    its interval excludes 0. Intervals are the estimate ± t(df) x the bootstrap's standard error x sqrt(n / df), with n
    clusters and df = n - strata (see _comparison).
    """
    g = torch.Generator().manual_seed(seed)
    per, pooled_draws, pooled_point = {}, [], torch.zeros(3, dtype=torch.float64)
    for name, s in strata.items():
        a, b = s["a"].double(), s["b"].double()
        w = torch.ones_like(a) if s.get("weight") is None else s["weight"].double()
        _, cluster = torch.unique(s["cluster"].long(), return_inverse=True)
        n = int(cluster.max()) + 1 if cluster.numel() else 0
        sums = torch.zeros(3, n, dtype=torch.float64)
        for row, v in enumerate((a * w, b * w, w)):
            sums[row].index_add_(0, cluster, v)
        draw = torch.randint(0, max(n, 1), (reps, n), generator=g)
        draws = sums[:, draw].sum(-1)  # [3, reps]: resampled sums of a, b and weight
        per[name] = _comparison(sums.sum(-1), draws, n)
        pooled_point += sums.sum(-1)
        pooled_draws.append(draws)
    out = {"per_stratum": per}
    if pooled_draws:
        out["pooled"] = _comparison(pooled_point, torch.stack(pooled_draws).sum(0), sum(p["clusters"] for p in per.values()),
                                    strata=len(per))
    return out


def _comparison(point: torch.Tensor, draws: torch.Tensor, clusters: int, strata: int = 1) -> dict:
    sa, sb, sw = point.tolist()
    if sw <= 0:
        return {"a": None, "b": None, "diff": None, "diff_ci": None, "rel": None, "rel_ci": None, "significant": None,
                "positions": 0.0, "clusters": clusters}
    ma, mb = draws[0] / draws[2], draws[1] / draws[2]
    # The bootstrap's standard error with Student's t and the n/(n-1) correction, rather than its percentiles: with few
    # independent units (a corpus of 5-12 sequences) percentile intervals are too short (a null difference came out
    # significant 15 % of the time in simulation at 5 and 12 clusters, against 5 % here; tests/test_verdicts.py).
    df = max(clusters - strata, 1)
    widen = _t975(df) * math.sqrt(clusters / df) if clusters > 1 else float("nan")
    diff = (sa - sb) / sw
    half = widen * float((ma - mb).std())
    diff_ci = [diff - half, diff + half]
    rel = (sa / sb - 1) if sb else None
    rel_ci = None
    if rel is not None and bool((mb != 0).all()):
        rh = widen * float((ma / mb - 1).std())
        rel_ci = [rel - rh, rel + rh]
    significant = bool(diff_ci[0] > 0 or diff_ci[1] < 0) if clusters > 1 else None  # one cluster: no interval
    return {"a": sa / sw, "b": sb / sw, "diff": diff, "diff_ci": diff_ci, "rel": rel, "rel_ci": rel_ci,
            "significant": significant, "positions": sw, "clusters": clusters, "df": df}


def decode_difference(variant: list[list[float]], reference: list[list[float]],
                      extra_groups: list[list[list[float]]] = ()) -> dict:
    """Relative decode-time difference of a variant from a reference (the build), with a 95 % interval.

    Each argument: per engine, the per-block ms/token that engine measured (a block = one timed generation). Engines
    differ from each other by more than blocks of one engine do, so the interval carries both: the between-engine
    variance is estimated from every variant with two or more engines here (the reference is timed on at least two),
    and the interval uses Student's t with that many degrees of freedom. "resolved" when the interval excludes 0.
    extra_groups: other variants' engines (each a list like `variant`), used only for that spread.
    """
    groups = [g for g in (*variant, *reference, *(e for x in extra_groups for e in x)) if g]
    if not variant or not reference or not all(variant) or not all(reference):
        return {"rel": None, "rel_ci": None, "resolved": None, "engines": [len(variant), len(reference)], "df": 0}

    def engine_means(engines):
        return [sum(g) / len(g) for g in engines]

    def within(engines):  # variance of one engine's mean from its blocks, averaged over engines
        terms = [(sum((x - sum(g) / len(g)) ** 2 for x in g) / (len(g) - 1)) / len(g) for g in engines if len(g) > 1]
        return sum(terms) / len(terms) if terms else 0.0

    between_ss, between_df = 0.0, 0
    for engines in (variant, reference, *extra_groups):
        if len(engines) > 1 and all(engines):
            m = engine_means(engines)
            mu = sum(m) / len(m)
            between_ss += sum((x - mu) ** 2 for x in m)
            between_df += len(m) - 1
    if between_df == 0:
        return {"rel": None, "rel_ci": None, "resolved": None, "engines": [len(variant), len(reference)], "df": 0,
                "why": "no variant was timed on two engines: the engine-to-engine spread is unknown"}
    # Var(one engine's mean) = between-engine variance + within; the spread of engine means estimates both together.
    engine_var = max(between_ss / between_df, within(groups))
    v, r = engine_means(variant), engine_means(reference)
    mv, mr = sum(v) / len(v), sum(r) / len(r)
    se = math.sqrt(engine_var / len(v) + engine_var / len(r))
    half = _t975(between_df) * se
    rel, lo, hi = mv / mr - 1, (mv - half) / mr - 1, (mv + half) / mr - 1
    return {"rel": rel, "rel_ci": [lo, hi], "resolved": bool(lo > 0 or hi < 0), "variant_ms": mv, "reference_ms": mr,
            "engines": [len(v), len(r)], "df": between_df, "engine_sd_ms": math.sqrt(engine_var)}
