"""MTP acceptance figures from DIR/speculative.json (written by ablate.speculative): per row and number of
speculative tokens k, the acceptance rate, per draft position and as mean accepted length, each with a 95 % interval
over prompts; the paired difference from the build on the same prompts; decode ms/token with the drafter against
the same row without it; and drafters that vLLM evidently built from missing or random weights, flagged instead of
tabulated.

Counting, as vLLM's spec-decode metrics count (vllm/v1/spec_decode/metrics.py): a draft is one proposal of k tokens
for one decode step; acceptance rate = accepted draft tokens / draft tokens; position i's rate = drafts whose first
i+1 tokens were all accepted / drafts; mean accepted length = 1 + accepted / drafts (tokens a target step emits).
Every rate is a ratio of sums over the prompts, so its interval resamples whole prompts (the independent unit: one
greedy generation), stratified by corpus, and reads the estimate ± Student's t x the bootstrap's standard error
(metrics.small_sample_half_width), as every other interval of splicer does.
"""

from __future__ import annotations

import torch

from ..io import results_record
from .formatting import fmt_paired_clause, fmt_paired_pp, fmt_share
from .metrics import MIN_SEQUENCES, decode_difference, excludes_zero, identical_pairs, small_sample_half_width

# A drafter whose tokens are (almost) never accepted was built from missing or random weights (a checkpoint whose
# MTP tensors vLLM did not find, or found under names it skipped); one whose every token is accepted is not drafting
# at all (the target's own logits served as the draft). Neither is a measurement of the drafter's quality: such a row
# is flagged with the reason, not tabulated. A trained drafter sits well inside (seed 000: 53-57 % at k = 2).
BROKEN_BELOW = 0.02
BROKEN_ABOVE = 0.98
FLAG_MIN_TOKENS = 200  # draft tokens an engine needs before it is judged by these bounds

FLAG_LOW = (
    "acceptance {rate:.1f} % over {n} draft tokens: vLLM's drafter did not draft from trained weights (the MTP tensors "
    "missing or left random); not a result"
)
FLAG_HIGH = (
    "acceptance {rate:.1f} % over {n} draft tokens: every draft token accepted, so the drafter is not drafting "
    "(acceptance pinned at 1); not a result"
)


def prompt_clusters(prompts: list[dict]) -> tuple[list[str], list[int]]:
    """Each prompt's stratum (its corpus) and cluster (the independent unit: a prompt, or for chat prompts the group of
    conversations that share a prompt, corpora.chat), as indices."""
    strata = [p["corpus"] for p in prompts]
    keys = [(p["corpus"], p.get("group", p.get("index", i))) for i, p in enumerate(prompts)]
    index = {k: n for n, k in enumerate(dict.fromkeys(keys))}
    return strata, [index[k] for k in keys]


def _sums(values: list[float], cluster: list[int]) -> torch.Tensor:
    out = torch.zeros(max(cluster, default=-1) + 1, dtype=torch.float64)
    return out.index_add_(0, torch.tensor(cluster, dtype=torch.long), torch.tensor(values, dtype=torch.float64))


def _draws(
    strata: list[str], cluster: list[int], reps: int, seed: int, unit: str = "prompts"
) -> tuple[torch.Tensor | None, int, str | None]:
    """[reps, C] cluster indices, each replicate resampling the clusters of every corpus within that corpus; None (and
    why) when a corpus has fewer than MIN_SEQUENCES clusters, as every other interval of splicer requires. unit: what
    the clusters are made of (prompts here, the teacher-forced estimate's scored sequences)."""
    by = {}
    for s, c in zip(strata, cluster):
        by.setdefault(s, set()).add(c)
    small = [s for s, cs in by.items() if len(cs) < MIN_SEQUENCES]
    n = len(set(cluster))
    if small:
        return None, n, f"fewer than {MIN_SEQUENCES} {unit} (or chat groups) in corpus {small[0]}"
    g = torch.Generator().manual_seed(seed)
    cols = []
    for s in by:
        idx = torch.tensor(sorted(by[s]))
        cols.append(idx[torch.randint(0, len(idx), (reps, len(idx)), generator=g)])
    return torch.cat(cols, 1), n, None


def ratio(
    num: list[float],
    den: list[float],
    strata: list[str],
    reps: int = 2000,
    seed: int = 0,
    cluster: list[int] | None = None,
    bounds: tuple[float, float] = (0.0, 1.0),
    unit: str = "prompts",
) -> dict:
    """sum(num) / sum(den) over prompts, with its 95 % interval clipped to bounds (None, with why, when a corpus has
    too few prompts); cluster: each prompt's independent unit (default: the prompt itself); unit: what the entries
    are ("prompts", or the teacher-forced estimate's "sequences"), the key that counts them."""
    cluster = list(range(len(num))) if cluster is None else cluster
    n, d = _sums(num, cluster), _sums(den, cluster)
    total = float(d.sum())
    if total <= 0:
        return {"value": None, "ci": None, unit: len(num)}
    value = float(n.sum()) / total
    out = {"value": value, "ci": None, unit: len(num)}
    draw, clusters, why = _draws(strata, cluster, reps, seed, unit)
    if draw is None:
        return dict(out, why=why)
    ds = d[draw].sum(1)
    ok = ds > 0
    vals = n[draw].sum(1)[ok] / ds[ok]
    half = small_sample_half_width(float(vals.std()), clusters, len(set(strata)))
    return dict(out, ci=[max(bounds[0], value - half), min(bounds[1], value + half)])


def paired_ratio_difference(
    a: tuple[list[float], list[float]],
    b: tuple[list[float], list[float]],
    strata: list[str],
    reps: int = 2000,
    seed: int = 0,
    cluster: list[int] | None = None,
    unit: str = "prompts",
    against: str = "the build's",
) -> dict:
    """(sum a_num / sum a_den) - (sum b_num / sum b_den) on the same prompts, resampled together, with its interval;
    where every prompt's counts are the same on both sides, 0 with no interval (metrics.identical_pairs: `against`
    names the other side). unit: as ratio's."""
    cluster = list(range(len(strata))) if cluster is None else cluster
    an, ad, bn, bd = (_sums(x, cluster) for x in (*a, *b))
    if float(ad.sum()) <= 0 or float(bd.sum()) <= 0:
        return {"diff": None, "ci": None, "significant": None}
    if list(a[0]) == list(b[0]) and list(a[1]) == list(b[1]):
        return dict(identical_pairs(unit.removesuffix("s"), against), **{unit: len(strata)})
    diff = float(an.sum() / ad.sum() - bn.sum() / bd.sum())
    out = {"diff": diff, "ci": None, "significant": None, unit: len(strata)}
    draw, clusters, why = _draws(strata, cluster, reps, seed, unit)
    if draw is None:
        return dict(out, why=why)
    sad, sbd = ad[draw].sum(1), bd[draw].sum(1)
    ok = (sad > 0) & (sbd > 0)
    vals = (an[draw].sum(1) / sad - bn[draw].sum(1) / sbd)[ok]
    half = small_sample_half_width(float(vals.std()), clusters, len(set(strata)))
    out["ci"] = [max(-1.0, diff - half), min(1.0, diff + half)]
    out["significant"] = excludes_zero(out["ci"])
    return out


def _columns(prompts: list[dict]) -> dict:
    """Per prompt: accepted, draft tokens, drafts, and accepted per position (lists over prompts)."""
    k = max((len(p["accepted_per_pos"]) for p in prompts), default=0)
    return {
        "accepted": [p["accepted"] for p in prompts],
        "draft_tokens": [p["draft_tokens"] for p in prompts],
        "drafts": [p["drafts"] for p in prompts],
        "per_pos": [[(p["accepted_per_pos"] + [0] * k)[i] for p in prompts] for i in range(k)],
    }


def broken(accepted: float, drafted: float) -> str | None:
    """The one test of a drafter built from missing or random weights, for vLLM's engines (flag) and the teacher-forced
    estimate (teacher_forced.flag) alike: "low" when its share of accepted draft tokens is under BROKEN_BELOW, "high"
    when over BROKEN_ABOVE, each judged over FLAG_MIN_TOKENS draft tokens or more; else None."""
    if drafted < FLAG_MIN_TOKENS:  # too few to tell a broken drafter from chance (a good one accepts 20 of 20 often)
        return None
    rate = accepted / drafted
    return "low" if rate < BROKEN_BELOW else "high" if rate > BROKEN_ABOVE else None


def flag_rule(tokens: str = "draft tokens") -> str:
    """The bounds of `broken`, in words for a table's note."""
    return f"under {100 * BROKEN_BELOW:.0f} % or over {100 * BROKEN_ABOVE:.0f} % (over {FLAG_MIN_TOKENS} {tokens} or more)"


def flag(prompts: list[dict]) -> str | None:
    """Why this engine's acceptance is no result (`broken`), or None."""
    accepted = sum(p["accepted"] for p in prompts)
    drafted = sum(p["draft_tokens"] for p in prompts)
    if drafted <= 0:
        return "vLLM counted no draft tokens: speculative decoding did not run"
    how = broken(accepted, drafted)
    if how is None:
        return None
    return (FLAG_LOW if how == "low" else FLAG_HIGH).format(rate=100 * accepted / drafted, n=drafted)


def _blocks(engine: dict) -> list[float]:
    t = engine.get("timing") or {}
    return [x for x in t.get("per_run_ms") or [] if x is not None] if t.get("decode_ms_per_token") is not None else []


def summarize(record: dict, reps: int = 2000) -> dict:
    """record: DIR/speculative.json -> {row: {str(k): figures}}; k "0" holds the row's plain decode only."""
    strata, cluster = prompt_clusters(record.get("prompts", []))
    engines = [e for e in record.get("engines", []) if e.get("status") == "ok"]
    by: dict = {}
    for e in engines:
        by.setdefault(e["row"], {}).setdefault(int(e["k"]), []).append(e)
    build = record.get("build_row", "build")
    # Engine-to-engine spread of decode: every (row, k) timed on two or more engines (the build, first and last).
    repeated = {(r, k): [_blocks(x) for x in es] for r, ks in by.items() for k, es in ks.items() if len(es) > 1}
    repeated = {key: g for key, g in repeated.items() if all(g)}
    out: dict = {}
    for row, ks in by.items():
        plain = [b for b in (_blocks(x) for x in ks.get(0, [])) if b]
        rows = out.setdefault(row, {})
        if plain:
            rows["0"] = {"decode_ms_per_token": _mean_over_engines(ks[0]), "engines": len(plain)}
        for k, es in sorted(ks.items()):
            if k == 0:
                continue
            first = es[0]
            prompts = first["per_prompt"]
            fig = {"engines": len(es), "startup_s": first.get("startup_s")}
            reason = flag(prompts)
            changed = [i for i, p in enumerate(prompts) if p.get("same_as_plain") is False]
            fig["greedy_changed_prompts"] = len(changed) if any("same_as_plain" in p for p in prompts) else None
            # a second engine of the same row and k accepted exactly the same drafts
            fig["repeat_agrees"] = all(x["per_prompt"] == prompts for x in es[1:]) if len(es) > 1 else None
            if reason:
                rows[str(k)] = dict(fig, flagged=reason)
                continue
            c = _columns(prompts)
            fig["acceptance"] = ratio(c["accepted"], c["draft_tokens"], strata, reps, cluster=cluster)
            # position 1 with the acceptance's own resamples: at k = 1 the two are one quantity
            fig["per_position"] = [
                ratio(pos, c["drafts"], strata, reps, seed=i, cluster=cluster) for i, pos in enumerate(c["per_pos"])
            ]
            # mean accepted length = 1 + accepted / drafts, between 1 and k + 1
            length = ratio(c["accepted"], c["drafts"], strata, reps, cluster=cluster, bounds=(0.0, float(k)))
            fig["mean_accepted_length"] = {
                "value": 1 + length["value"] if length["value"] is not None else None,
                "ci": [1 + x for x in length["ci"]] if length["ci"] else None,
            }
            fig["draft_tokens"] = sum(c["draft_tokens"])
            mtp_blocks = [b for b in (_blocks(x) for x in es) if b]
            if mtp_blocks:
                fig["decode_ms_per_token"] = _mean_over_engines(es)
            if mtp_blocks and plain:
                # with the drafter against the same row without it (rel < 0: speculative decoding is faster); the
                # engine-to-engine spread from the other (row, k) pairs timed twice, these two counted once
                others = [g for key, g in repeated.items() if key not in ((row, k), (row, 0))]
                fig["decode_vs_plain"] = decode_difference(mtp_blocks, plain, others)
            rows[str(k)] = fig
    # The build on the same prompts: paired differences of acceptance (rows whose build figure is a result).
    for row, ks in out.items():
        if row == build or build not in by:
            continue
        for key, fig in ks.items():
            ref = (by[build].get(int(key)) or [None])[0]
            if key == "0" or "acceptance" not in fig or ref is None or "acceptance" not in out[build].get(key, {}):
                continue
            a, b = _columns(by[row][int(key)][0]["per_prompt"]), _columns(ref["per_prompt"])
            fig["vs_build"] = paired_ratio_difference(
                (a["accepted"], a["draft_tokens"]), (b["accepted"], b["draft_tokens"]), strata, reps, cluster=cluster
            )
    return out


def _mean_over_engines(engines: list[dict]) -> float | None:
    """The mean of the engines' decode ms/token (each engine's own figure is the median of its runs)."""
    vals = [(e.get("timing") or {}).get("decode_ms_per_token") for e in engines]
    vals = [v for v in vals if v is not None]
    return sum(vals) / len(vals) if vals else None


def load(out) -> dict | None:
    """DIR/speculative.json, summarised (None when DIR has none or it cannot be read)."""
    from pathlib import Path

    path = Path(out) / FILE
    record = results_record.read_stage_record(path)
    if record is None:
        return None
    # Recomputed from the per-prompt counts every time (milliseconds), so that a table always follows this splicer's
    # figures; the summary stored in the file is what the run that wrote it computed.
    return {"record": record, "summary": summarize(record)}


FILE = "speculative.json"


def _decode_cell(fig: dict) -> str:
    d = fig.get("decode_vs_plain")
    if not d or d.get("rel") is None:
        return ""
    lo, hi = d["rel_ci"]
    return f"{100 * d['rel']:+.1f} % [{100 * lo:+.1f}, {100 * hi:+.1f}]" + ("" if d.get("resolved") else " n.s.")


HEADERS = [
    "variant",
    "k",
    "acceptance [95 %]",
    "per position",
    "mean accepted length",
    "Δ acceptance vs build, pp",
    "decode ms/tok, no drafter → MTP",
    "Δ decode with MTP [95 %]",
]


def table_rows(spec: dict, order: list[str]) -> list[list[str]]:
    """One row per (variant, k) of DIR/speculative.json's summary, variants in the results table's order."""
    summary, rows = spec["summary"], []
    for name in [n for n in order if n in summary] + [n for n in summary if n not in order]:
        ks = summary[name]
        plain = (ks.get("0") or {}).get("decode_ms_per_token")
        for key in sorted((k for k in ks if k != "0"), key=int):
            fig = ks[key]
            if fig.get("flagged"):
                rows.append([name, key, f"flagged: {fig['flagged']}", "", "", "", "", ""])
                continue
            length = fig.get("mean_accepted_length") or {}
            mtp = fig.get("decode_ms_per_token")
            rows.append(
                [
                    name,
                    key,
                    fmt_share(fig.get("acceptance")),
                    " / ".join(fmt_share(p, 0).split(" [")[0] for p in fig.get("per_position") or []),
                    f"{length['value']:.2f}" + (f" [{length['ci'][0]:.2f}, {length['ci'][1]:.2f}]" if length.get("ci") else "")
                    if length.get("value") is not None
                    else "",
                    fmt_paired_pp(fig.get("vs_build")) if name != spec["record"].get("build_row") else "",
                    f"{plain:.3f} → {mtp:.3f}" if plain is not None and mtp is not None else "",
                    _decode_cell(fig),
                ]
            )
    return rows


def _state(record: dict) -> str:
    """What the file holds against what its run set out to measure (an interrupted run says so)."""
    planned, done = record.get("engines_planned"), [e for e in record.get("engines", []) if e.get("status") == "ok"]
    failed = [e for e in record.get("engines", []) if e.get("status") != "ok"]
    text = ""
    if planned and len(done) < planned:
        text += f" Incomplete: {len(done)} of the {planned} engines of this run finished; rerun splicer mtp to finish."
    if failed:
        text += " Failed: " + "; ".join(f"{e['row']} k={e['k']} ({str(e.get('error', ''))[:160]})" for e in failed) + "."
    return text


def note(spec: dict) -> str:
    r = spec["record"]
    s = r.get("settings") or {}
    prompts = r.get("prompts") or []
    per = {}
    for p in prompts:
        per[p["corpus"]] = per.get(p["corpus"], 0) + 1
    lengths = [p.get("tokens") for p in prompts if p.get("tokens")]
    skipped = "; ".join(f"{x['row']}: {x['reason']}" for x in r.get("skipped") or [])
    agree = [
        (name, k, fig["repeat_agrees"])
        for name, ks in spec["summary"].items()
        for k, fig in ks.items()
        if fig.get("repeat_agrees") is not None
    ]
    repeat = ""
    if agree:
        same = [f"k={k}" for _, k, a in agree if a]
        differ = [f"k={k}" for _, k, a in agree if not a]
        repeat = (
            f" The build's second engines accepted exactly the same drafts at {', '.join(same) or 'no k'}"
            + (f" and other drafts at {', '.join(differ)}" if differ else "")
            + "."
        )
    return (
        f"MTP acceptance from `splicer mtp`: each variant started in vLLM with its own MTP head as the speculative "
        f"decoder (method {s.get('method')}, k draft tokens), {len(prompts)} prompts ("
        + ", ".join(f"{n} of {c}" for c, n in per.items())
        + (
            (f"; {min(lengths)} tokens each" if min(lengths) == max(lengths) else f"; {min(lengths)} to {max(lengths)} tokens")
            if lengths
            else ""
        )
        + f") each generated greedily for {s.get('new_tokens')} tokens on its own; acceptance = accepted / drafted "
        "tokens, per position = drafts whose first i tokens were all accepted, mean accepted length = 1 + accepted / "
        "drafts, from vLLM's spec-decode counters; intervals resample prompts (chat: groups of conversations that share a "
        "prompt) within corpora; Δ acceptance is paired with the build on the same prompts; Δ decode compares the same "
        "variant with and without the drafter, its interval from the engine-to-engine spread of the variants timed "
        f"twice (the build, first and last). A drafter with acceptance {flag_rule()} is flagged, not a result."
        + repeat
        + (f" Not measured: {skipped}." if skipped else "")
        + _state(r)
    )


def sentences(spec: dict, order: list[str] | None = None) -> list[str]:
    """The report's sentences on MTP acceptance, every figure from the summary, rows in the table's order."""
    out = []
    summary, build = spec["summary"], spec["record"].get("build_row", "build")
    order = order or []
    names = [n for n in order if n in summary] + [n for n in summary if n not in order]
    for name, ks in ((n, summary[n]) for n in names):
        for key in sorted((k for k in ks if k != "0"), key=int):
            fig = ks[key]
            if fig.get("flagged"):
                out.append(f"MTP k={key}, {name}: flagged, {fig['flagged']}.")
                continue
            acc = fig.get("acceptance") or {}
            if acc.get("value") is None:
                continue
            text = f"MTP k={key}, {name}: acceptance {fmt_share(acc)}"
            length = (fig.get("mean_accepted_length") or {}).get("value")
            if length is not None:
                text += f", {length:.2f} tokens per target step"
            vs = fig.get("vs_build")
            if name != build and vs and vs.get("diff") is not None:
                text += f"; {fmt_paired_clause(vs)}"
            d = fig.get("decode_vs_plain")
            plain = (ks.get("0") or {}).get("decode_ms_per_token")
            if d and d.get("rel") is not None:
                lo, hi = d["rel_ci"]
                how = ("faster" if d["rel"] < 0 else "slower") if d.get("resolved") else "not resolved"
                text += (
                    f"; decode with the drafter {100 * d['rel']:+.1f} % [{100 * lo:+.1f}, {100 * hi:+.1f}] against "
                    f"without ({d['variant_ms']:.3f} vs {d['reference_ms']:.3f} ms/token: {how})"
                )
            elif fig.get("decode_ms_per_token") is not None and plain is not None:
                why = (d or {}).get("why") or "no interval"
                text += (
                    f"; decode {fig['decode_ms_per_token']:.3f} ms/token with the drafter, {plain:.3f} without "
                    f"(one engine each, {why})"
                )
            if fig.get("greedy_changed_prompts"):
                text += (
                    f"; the greedy tokens differed from the engine without the drafter in {fig['greedy_changed_prompts']} "
                    f"of {len(spec['record'].get('prompts') or [])} prompts"
                )
            out.append(text + ".")
    state = _state(spec["record"]).strip()
    if state:
        out.append(f"MTP acceptance: {state}")
    return out
