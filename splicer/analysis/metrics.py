"""Fidelity metrics of a variant against the base, per position and per corpus.

Per position (t predicts token t+1):
  top1     variant's most likely token == base's most likely token
  kl_top   KL(base || variant) over the base's top-k with everything else lumped into one
           "rest" bucket. By the data-processing inequality this is a lower bound on the full
           KL when the variant's log-probs at the base's top-k ids are exact (torch backend, and
           vLLM where it serves prompt_logprob_token_ids); with only the variant's own top-k
           (older vLLM) they are filled in from it (see fill_missing), which bounds nothing: the
           filled id's term falls, the lumped rest's rises
  tail     the base's probability mass outside its top-k
  kl_full  exact KL over the whole vocabulary, where both full distributions are at hand
  dlogp    log p_base(next) - log p_variant(next); its mean over the base's own greedy
           answers is dNLL (extra nats per token)
Corpus summaries use intervals over sequences (positions within a sequence are not
independent): a seeded bootstrap over sequences, top-1's included, read as the estimate ± Student's t
x the bootstrap's standard error (small_sample_half_width). The independent unit is a sequence unless a
score file carries a `group` per position (sequences that share an effect: the chat corpus's conversations that
share a business and history, chat.py): then whole groups are resampled and counted. Fewer than MIN_SEQUENCES units
give no interval ("too few sequences", or "too few groups" where groups were counted). Differences between two variants on the same positions: paired_comparison; decode-time
differences: decode_difference.
"""

from __future__ import annotations

import math
import statistics

import torch

Z95 = 1.959963984540054

# The fewest independent units (sequences, or groups of them) an interval is computed from. A variance from fewer
# rests on at most 3 degrees of freedom, and a top-1 difference (mostly zeros) often has none at all: simulated at 97 %
# agreement and 30 positions a sequence, two variants that do not differ got a zero-width interval 25 % of the time
# with 2 sequences (and were called significant 16 % of the time), 4.5 % with 3, 1 % with 4 and 0.25 % with 5. At 5
# (the demo's smallest corpus) null rejections stay at or under 7 % (tests/test_verdicts.py) and coverage near 95 %
# (tests/test_calibration.py).
MIN_SEQUENCES = 5
TOO_FEW = f"too few sequences for an interval (fewer than {MIN_SEQUENCES} in a corpus)"
TOO_FEW_GROUPS = (
    f"too few groups for an interval (fewer than {MIN_SEQUENCES} groups of sequences that share a prompt in a corpus)"
)
# The short note tables print for each reason.
TOO_FEW_NOTE = {TOO_FEW: "too few sequences", TOO_FEW_GROUPS: "too few groups"}


def units(pos: dict[str, torch.Tensor]) -> tuple[torch.Tensor, str]:
    """The independent unit of every position of a score record and what the units are: its `group` where the record
    carries one (score files written before groups existed do not), else its sequence."""
    return (pos["group"], "groups") if "group" in pos else (pos["seq_index"], "sequences")


def kl_top_lumped(base_lp: torch.Tensor, var_lp: torch.Tensor) -> torch.Tensor:
    """[N, k] log-probs of the base's top-k under base and variant -> [N] lumped KL."""
    base_lp, var_lp = base_lp.double(), var_lp.double()
    p, q = base_lp.exp(), var_lp.exp()
    head = (p * (base_lp - var_lp)).sum(-1)
    p_rest = (1 - p.sum(-1)).clamp_min(0)
    q_rest = (1 - q.sum(-1)).clamp_min(1e-12)
    rest = torch.where(
        p_rest > 1e-12, p_rest * (torch.log(p_rest.clamp_min(1e-300)) - torch.log(q_rest)), torch.zeros_like(p_rest)
    )
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


def top1_agreement(base_ids: torch.Tensor, base_lp: torch.Tensor, var_ids: torch.Tensor, var_lp: torch.Tensor) -> torch.Tensor:
    """[N, k] top-k ids and log-probs of base and variant -> [N] bool: base and variant agree on the most likely token.

    A tie among the largest log-probs (BF16 logits tie often) makes "the" argmax an accident of the sort order, on
    either side. Agreement is counted when the base's tied maxima and the variant's tied maxima share a token: ties are
    defined the same way on both sides (equal to the row's largest log-prob), so the rule is symmetric in base and
    variant and does not depend on the order of the vocabulary. Without ties it is plain argmax equality.
    """
    tb = base_lp == base_lp.amax(-1, keepdim=True)  # the row's largest, whatever order the engine listed its top-k in
    tv = var_lp == var_lp.amax(-1, keepdim=True)
    same = base_ids[:, :, None] == var_ids[:, None, :]
    return (same & tb[:, :, None] & tv[:, None, :]).flatten(1).any(-1)


def small_sample_half_width(se: float, clusters: int, strata: int = 1) -> float:
    """Half-width of a 95 % interval from a cluster bootstrap's standard error `se`: Student's t with df = clusters -
    strata, and the n/df correction of the bootstrap's (biased, divide-by-n) variance. With few independent units
    (5-12 sequences) percentile intervals are too short (a null difference came out significant 15 % of the time in
    simulation at 5 and 12 clusters, against 5 % here; tests/test_verdicts.py, tests/test_calibration.py)."""
    df = max(clusters - strata, 1)
    return t975(df) * math.sqrt(clusters / df) * se


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def bootstrap_mean_ci(
    values: torch.Tensor,
    seq_index: torch.Tensor,
    reps: int = 1000,
    seed: int = 0,
    weight: torch.Tensor | None = None,
    bounds: tuple[float, float] = (-math.inf, math.inf),
) -> list[float] | None:
    """95 % interval of the (weighted) mean of `values`, resampling whole units (seq_index: the unit of each value, a
    sequence or a group of them): the estimate ± Student's t x the bootstrap's standard error
    (small_sample_half_width), clipped to `bounds` (the range the quantity can take). None with fewer than
    MIN_SEQUENCES units (no interval those can support)."""
    if values.numel() == 0:
        return None
    values = values.double()
    w = torch.ones_like(values) if weight is None else weight.double()
    _, unit = torch.unique(seq_index.long(), return_inverse=True)
    n_seq = int(unit.max()) + 1
    sums = torch.zeros(n_seq, dtype=torch.float64).index_add_(0, unit, values * w)
    counts = torch.zeros(n_seq, dtype=torch.float64).index_add_(0, unit, w)
    keep = counts > 0
    sums, counts = sums[keep], counts[keep]
    if len(sums) < MIN_SEQUENCES:
        return None
    g = torch.Generator().manual_seed(seed)
    draw = torch.randint(0, len(sums), (reps, len(sums)), generator=g)
    means = sums[draw].sum(1) / counts[draw].sum(1)
    mean = float(sums.sum() / counts.sum())
    half = small_sample_half_width(float(means.std()), len(sums))
    return [max(bounds[0], mean - half), min(bounds[1], mean + half)]


def summarize(pos: dict[str, torch.Tensor], reps: int = 1000) -> dict:
    """Per-position records of one corpus -> the corpus row of results.json.

    Means count each position by its weight (a position repeating an earlier sequence's counts 0, see
    ablate.first_occurrence_weights); every interval resamples whole sequences, top-1's included (whole groups where
    the records carry a `group` per position). An interval is None with fewer than MIN_SEQUENCES units.
    """
    seq = pos["seq_index"]
    unit, unit_name = units(pos)
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
        "sequences": int(torch.unique(seq[counted]).numel()),
        # the units the intervals resampled, when they are groups of sequences (else the sequences above)
        "groups": int(torch.unique(unit[counted]).numel()) if unit_name == "groups" else None,
        "top1": mean(top1),
        "top1_ci": bootstrap_mean_ci(top1, unit, reps, weight=w, bounds=(0.0, 1.0)),
        "top1_ties": "symmetric",  # top1_agreement's rule; summaries without it counted only the base's ties
        "kl": mean(kl),
        "kl_ci": bootstrap_mean_ci(kl, unit, reps, weight=w, bounds=(0.0, math.inf)),
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
        out["kl_full_ci"] = bootstrap_mean_ci(pos["kl_full"], unit, reps, weight=w, bounds=(0.0, math.inf))
    mask = pos.get("answer_mask")
    if mask is not None and bool(mask.any()):
        m = mask.bool()
        d = pos["dlogp"][m]
        out["dnll"] = mean(pos["dlogp"], m.double())
        out["dnll_ci"] = bootstrap_mean_ci(d, unit[m], reps, weight=w[m])
        out["answer_positions"] = int((w * m.double()).sum())
    return out


# ---------------------------------------------------------------- paired verdicts


def t975(df: int) -> float:
    """Two-sided 95 % quantile of Student's t (df >= 1); exact enough for intervals (scipy is not a dependency)."""
    table = {
        1: 12.706,
        2: 4.303,
        3: 3.182,
        4: 2.776,
        5: 2.571,
        6: 2.447,
        7: 2.365,
        8: 2.306,
        9: 2.262,
        10: 2.228,
        12: 2.179,
        15: 2.131,
        20: 2.086,
        30: 2.042,
        60: 2.000,
    }
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

    strata: name -> {"a": [N], "b": [N], "cluster": [N] int (the independent unit: a sequence, a conversation, or a
    group of sequences that share an effect), "unit": what the clusters are ("sequences" when left out, or "groups";
    metrics.units), "weight": [N] or None (0 drops a position counted elsewhere, e.g. a chat prefix shared with an
    earlier conversation)}. Each result says how many clusters it resampled ("clusters") and what they are ("unit"). The pooled estimate weighs every counted position equally across
    strata (position-weighted); its bootstrap resamples clusters within each stratum, a and b always together.
    Intervals are the estimate ± t(df) x the bootstrap's standard error x sqrt(n / df), with n clusters and df = n -
    strata (small_sample_half_width). The difference is significant when diff_ci excludes 0, the ratio when rel_ci
    does (rel_significant): each verdict comes from the interval shown beside it. A stratum with fewer than
    MIN_SEQUENCES clusters has no intervals and no verdicts ("why" says so), and neither has the pooled estimate then.
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
        n = int((sums[2] > 0).sum())  # clusters with a counted position
        sums = sums[:, sums[2] > 0]
        draw = torch.randint(0, max(n, 1), (reps, n), generator=g)
        draws = sums[:, draw].sum(-1)  # [3, reps]: resampled sums of a, b and weight
        unit = s.get("unit", "sequences")
        per[name] = _comparison(
            sums.sum(-1), draws, n, unit, few=(TOO_FEW_GROUPS if unit == "groups" else TOO_FEW) if n < MIN_SEQUENCES else None
        )
        pooled_point += sums.sum(-1)
        pooled_draws.append(draws)
    out = {"per_stratum": per}
    if pooled_draws:
        unit_names = {p["unit"] for p in per.values()}
        out["pooled"] = _comparison(
            pooled_point,
            torch.stack(pooled_draws).sum(0),
            sum(p["clusters"] for p in per.values()),
            unit_names.pop() if len(unit_names) == 1 else "sequences or groups",
            strata=len(per),
            few=next((p["why"] for p in per.values() if p.get("why") in TOO_FEW_NOTE), None),
        )
    return out


def _comparison(
    point: torch.Tensor, draws: torch.Tensor, clusters: int, unit: str, strata: int = 1, few: str | None = None
) -> dict:
    """few: why there is no interval (TOO_FEW or TOO_FEW_GROUPS), None when there is one."""
    sa, sb, sw = point.tolist()
    if sw <= 0:
        return {
            "a": None,
            "b": None,
            "diff": None,
            "diff_ci": None,
            "rel": None,
            "rel_ci": None,
            "significant": None,
            "rel_significant": None,
            "positions": 0.0,
            "clusters": clusters,
            "unit": unit,
        }
    diff = (sa - sb) / sw
    rel = (sa / sb - 1) if sb else None
    out = {
        "a": sa / sw,
        "b": sb / sw,
        "diff": diff,
        "diff_ci": None,
        "rel": rel,
        "rel_ci": None,
        "significant": None,
        "rel_significant": None,
        "positions": sw,
        "clusters": clusters,
        "unit": unit,
        "df": max(clusters - strata, 1),
    }
    if few:
        return dict(out, why=few)
    ma, mb = draws[0] / draws[2], draws[1] / draws[2]
    half = small_sample_half_width(float((ma - mb).std()), clusters, strata)
    out["diff_ci"] = [diff - half, diff + half]
    out["significant"] = excludes_zero(out["diff_ci"])
    if rel is not None and bool((mb != 0).all()):
        rh = small_sample_half_width(float((ma / mb - 1).std()), clusters, strata)
        out["rel_ci"] = [rel - rh, rel + rh]
        out["rel_significant"] = excludes_zero(out["rel_ci"])
    return out


def identical_pairs(unit: str, against: str = "the build's") -> dict:
    """The paired difference where no unit (item, sequence, prompt) differs between the two sides: 0, with no interval
    and no verdict. A bootstrap over such units draws the same difference every time, so its standard error is 0 and
    its interval [0, 0] would say nothing about a difference, only that this sample has none; tables and reports print
    the 0 with why (formatting.fmt_paired_pp), never a verdict. "discordant": 0 marks it."""
    return {
        "diff": 0.0,
        "ci": None,
        "significant": None,
        "discordant": 0,
        "why": f"no {unit} differs from {against}: no interval",
    }


def excludes_zero(ci: list[float] | None) -> bool | None:
    """The verdict of an interval: True when it excludes 0 (significant, resolved); None without one."""
    return None if ci is None else bool(ci[0] > 0 or ci[1] < 0)


def fold_engine_noise(cmp: dict, noise: dict | None) -> dict:
    """A paired comparison (one stratum's or the pooled result of paired_comparison) with the engine's own run-to-run
    noise folded into its intervals, when that noise was measured in the same run.

    The bootstrap resamples sequences with each variant's scores as its engine produced them once; an engine that is not
    deterministic (vLLM's batch-dependent kernels) scores the same variant a little differently on every start, and that
    shift is in no resampled unit. Engines of the build scored on the same positions measure it: the difference d of two
    of them has the variance of (a variant's shift - the build's shift), so d² estimates that variance with one degree
    of freedom (k engines: 2 x the variance of their means, k - 1 degrees). The two variances are added (the
    bootstrap's is (half / t(df))²) and the interval is Student's t with Welch-Satterthwaite's degrees of freedom: a
    noise measured small barely widens it, one measured large on one degree of freedom widens it a lot. d also carries
    the positions' own scatter, which the bootstrap already counts, so the folded interval errs on the wide side.
    Welch-Satterthwaite is slightly liberal when the noise rests on one degree of freedom and dominates: simulated with
    two build engines and a noise ten times the sampling error, the interval covered about 92 %; from 95 % with three.
    noise: {"diff": sd, "rel": sd of the ratio, "df": ..., "rows": [...]} (verdicts.engine_noise); None leaves the
    intervals as the bootstrap gave them (the noise is then not in them). The bootstrap-only intervals are kept as
    sampling_diff_ci / sampling_rel_ci, so folding again (results.json is rewritten after every row) starts from them.
    """
    out = dict(cmp)
    base_diff, base_rel = cmp.get("sampling_diff_ci", cmp.get("diff_ci")), cmp.get("sampling_rel_ci", cmp.get("rel_ci"))
    out.update(sampling_diff_ci=base_diff, sampling_rel_ci=base_rel, diff_ci=base_diff, rel_ci=base_rel, engine_noise=noise)
    for key, ci_key, flag in (("diff", "diff_ci", "significant"), ("rel", "rel_ci", "rel_significant")):
        ci, x = out[ci_key], cmp.get(key)
        if ci is None or x is None:
            continue
        sd = (noise or {}).get(key)
        if sd:
            df_boot, df_noise = max(int(cmp.get("df") or 1), 1), max(int(noise.get("df") or 1), 1)
            v_boot, v_noise = ((ci[1] - ci[0]) / 2 / t975(df_boot)) ** 2, sd * sd
            df = (v_boot + v_noise) ** 2 / (v_boot**2 / df_boot + v_noise**2 / df_noise)
            half = t975(max(int(df), 1)) * math.sqrt(v_boot + v_noise)
            out[ci_key] = [x - half, x + half]
        out[flag] = excludes_zero(out[ci_key])
    return out


def engine_level(blocks: list[float]) -> float:
    """One engine's decode ms/token from its blocks: their median. A stray block (a hiccup of the host, 25 % slower
    than the rest) moves the mean of seven by several percent and the median not at all; with the 5-7 blocks a
    plan times the median still stands when two or three blocks are off, at a cost of about 1/3 more variance than the
    mean's when blocks scatter normally, which matters little since engines differ by more than blocks do."""
    return statistics.median(blocks)


def engine_level_variance(blocks: list[float]) -> float:
    """Variance of engine_level from the blocks' own scatter: (pi/2) sigma² / n, the median's large-sample variance,
    with sigma from the median absolute deviation (x 1.4826), which one stray block does not inflate."""
    if len(blocks) < 2:
        return 0.0
    m = statistics.median(blocks)
    sigma = 1.4826 * statistics.median(abs(x - m) for x in blocks)
    return math.pi / 2 * sigma * sigma / len(blocks)


def decode_difference(
    variant: list[list[float]], reference: list[list[float]], extra_groups: list[list[list[float]]] = ()
) -> dict:
    """Relative decode-time difference of a variant from a reference (the build), with a 95 % interval.

    Each argument: per engine, the per-block ms/token that engine measured (a block = one timed generation). An
    engine's level is the median of its blocks (engine_level: robust to a stray block). Engines differ from each other
    by more than blocks of one engine do, so the interval carries both: the variance of one engine's level is the
    larger of the between-engine variance (from every variant with two or more engines here, the reference timed on at
    least two) and the within-engine variance of a level from its blocks (a floor, so that engines that happen to agree
    closely do not make an interval shorter than their blocks support); Student's t with the between-engine degrees
    of freedom. "resolved" when the interval excludes 0. The engines are those of one run: how far an engine of another
    run (another day, another start of the machine) lands is not in the interval.
    extra_groups: other variants' engines (each a list like `variant`), used only for that spread.
    """
    groups = [g for g in (*variant, *reference, *(e for x in extra_groups for e in x)) if g]
    if not variant or not reference or not all(variant) or not all(reference):
        return {"rel": None, "rel_ci": None, "resolved": None, "engines": [len(variant), len(reference)], "df": 0}

    def levels(engines):
        return [engine_level(g) for g in engines]

    between_ss, between_df = 0.0, 0
    for engines in (variant, reference, *extra_groups):
        if len(engines) > 1 and all(engines):
            m = levels(engines)
            mu = sum(m) / len(m)
            between_ss += sum((x - mu) ** 2 for x in m)
            between_df += len(m) - 1
    if between_df == 0:
        return {
            "rel": None,
            "rel_ci": None,
            "resolved": None,
            "engines": [len(variant), len(reference)],
            "df": 0,
            "why": "no variant was timed on two engines: the engine-to-engine spread is unknown",
        }
    # Var(one engine's level) = between-engine variance + within; the spread of engine levels estimates both together,
    # and the within part (averaged over engines) is its floor.
    within = [engine_level_variance(g) for g in groups if len(g) > 1]
    engine_var = max(between_ss / between_df, sum(within) / len(within) if within else 0.0)
    v, r = levels(variant), levels(reference)
    mv, mr = sum(v) / len(v), sum(r) / len(r)
    se = math.sqrt(engine_var / len(v) + engine_var / len(r))
    half = t975(between_df) * se
    rel, lo, hi = mv / mr - 1, (mv - half) / mr - 1, (mv + half) / mr - 1
    return {
        "rel": rel,
        "rel_ci": [lo, hi],
        "resolved": bool(lo > 0 or hi < 0),
        "variant_ms": mv,
        "reference_ms": mr,
        "engines": [len(v), len(r)],
        "df": between_df,
        "engine_sd_ms": math.sqrt(engine_var),
        "engine_summary": "median of blocks",
    }
