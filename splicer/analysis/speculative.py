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

from .metrics import MIN_SEQUENCES, decode_difference, excludes_zero, small_sample_half_width

# A drafter whose tokens are (almost) never accepted was built from missing or random weights (a checkpoint whose
# MTP tensors vLLM did not find, or found under names it skipped); one whose every token is accepted is not drafting
# at all (the target's own logits served as the draft). Neither is a measurement of the drafter's quality: such a row
# is flagged with the reason, not tabulated. A trained drafter sits well inside (seed 000: 53-57 % at k = 2).
BROKEN_BELOW = 0.02
BROKEN_ABOVE = 0.98

FLAG_LOW = (
    "acceptance {rate:.1f} % over {n} draft tokens: vLLM's drafter did not draft from trained weights (the MTP tensors "
    "missing or left random); not a result"
)
FLAG_HIGH = (
    "acceptance {rate:.1f} % over {n} draft tokens: every draft token accepted, so the drafter is not drafting "
    "(acceptance pinned at 1); not a result"
)


def _draws(strata: list[str], reps: int, seed: int) -> torch.Tensor:
    """[reps, N] prompt indices: each replicate resamples the prompts of every corpus within that corpus."""
    g = torch.Generator().manual_seed(seed)
    cols = []
    for name in dict.fromkeys(strata):
        idx = torch.tensor([i for i, s in enumerate(strata) if s == name])
        cols.append(idx[torch.randint(0, len(idx), (reps, len(idx)), generator=g)])
    return torch.cat(cols, 1)


def ratio(num: list[float], den: list[float], strata: list[str], reps: int = 2000, seed: int = 0) -> dict:
    """sum(num) / sum(den) over prompts, with its 95 % interval (None with fewer than MIN_SEQUENCES prompts)."""
    n, d = torch.tensor(num, dtype=torch.float64), torch.tensor(den, dtype=torch.float64)
    total = float(d.sum())
    if total <= 0:
        return {"value": None, "ci": None, "prompts": len(num)}
    value = float(n.sum()) / total
    out = {"value": value, "ci": None, "prompts": len(num)}
    if len(num) < MIN_SEQUENCES:
        return dict(out, why=f"fewer than {MIN_SEQUENCES} prompts")
    draw = _draws(strata, reps, seed)
    ds = d[draw].sum(1)
    reps_ok = ds > 0
    vals = n[draw].sum(1)[reps_ok] / ds[reps_ok]
    half = small_sample_half_width(float(vals.std()), len(num), len(set(strata)))
    return dict(out, ci=[value - half, value + half])


def paired_ratio_difference(
    a: tuple[list[float], list[float]], b: tuple[list[float], list[float]], strata: list[str], reps: int = 2000, seed: int = 0
) -> dict:
    """(sum a_num / sum a_den) - (sum b_num / sum b_den) on the same prompts, resampled together, with its interval."""
    an, ad, bn, bd = (torch.tensor(x, dtype=torch.float64) for x in (*a, *b))
    if float(ad.sum()) <= 0 or float(bd.sum()) <= 0:
        return {"diff": None, "ci": None, "significant": None}
    diff = float(an.sum() / ad.sum() - bn.sum() / bd.sum())
    out = {"diff": diff, "ci": None, "significant": None, "prompts": len(strata)}
    if len(strata) < MIN_SEQUENCES:
        return out
    draw = _draws(strata, reps, seed)
    sad, sbd = ad[draw].sum(1), bd[draw].sum(1)
    ok = (sad > 0) & (sbd > 0)
    vals = (an[draw].sum(1) / sad - bn[draw].sum(1) / sbd)[ok]
    half = small_sample_half_width(float(vals.std()), len(strata), len(set(strata)))
    out["ci"] = [diff - half, diff + half]
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


def flag(prompts: list[dict]) -> str | None:
    """Why this engine's acceptance is no result (BROKEN_BELOW / BROKEN_ABOVE), or None."""
    accepted = sum(p["accepted"] for p in prompts)
    drafted = sum(p["draft_tokens"] for p in prompts)
    if drafted <= 0:
        return "vLLM counted no draft tokens: speculative decoding did not run"
    rate = accepted / drafted
    if rate < BROKEN_BELOW:
        return FLAG_LOW.format(rate=100 * rate, n=drafted)
    if rate > BROKEN_ABOVE:
        return FLAG_HIGH.format(rate=100 * rate, n=drafted)
    return None


def _blocks(engine: dict) -> list[float]:
    t = engine.get("timing") or {}
    return [x for x in t.get("per_run_ms") or [] if x is not None] if t.get("decode_ms_per_token") is not None else []


def summarize(record: dict, reps: int = 2000) -> dict:
    """record: DIR/speculative.json -> {row: {str(k): figures}}; k "0" holds the row's plain decode only."""
    strata = [p["corpus"] for p in record.get("prompts", [])]
    engines = [e for e in record.get("engines", []) if e.get("status") == "ok"]
    by = {}
    for e in engines:
        by.setdefault(e["row"], {}).setdefault(int(e["k"]), []).append(e)
    build = record.get("build_row", "build")
    # Engine-to-engine spread of decode: every (row, k) timed on two or more engines (the build, first and last).
    repeated = [[_blocks(x) for x in es] for ks in by.values() for es in ks.values() if len(es) > 1]
    repeated = [g for g in repeated if all(g)]
    out: dict = {}
    for row, ks in by.items():
        plain = [b for b in (_blocks(x) for x in ks.get(0, [])) if b]
        rows = out.setdefault(row, {})
        if plain:
            rows["0"] = {"decode_ms_per_token": _median_of(ks[0]), "engines": len(plain)}
        for k, es in sorted(ks.items()):
            if k == 0:
                continue
            first = es[0]
            prompts = first["per_prompt"]
            fig = {"engines": len(es), "startup_s": first.get("startup_s")}
            reason = flag(prompts)
            changed = [i for i, p in enumerate(prompts) if p.get("same_as_plain") is False]
            fig["greedy_changed_prompts"] = len(changed) if any("same_as_plain" in p for p in prompts) else None
            fig["repeat_agrees"] = (
                all(x["per_prompt"] == prompts for x in es[1:]) if len(es) > 1 else None
            )  # a second engine of the same row and k accepted exactly the same drafts
            if reason:
                rows[str(k)] = dict(fig, flagged=reason)
                continue
            c = _columns(prompts)
            fig["acceptance"] = ratio(c["accepted"], c["draft_tokens"], strata, reps)
            fig["per_position"] = [ratio(pos, c["drafts"], strata, reps, seed=i + 1) for i, pos in enumerate(c["per_pos"])]
            # mean accepted length = 1 + accepted / drafts
            length = ratio(c["accepted"], c["drafts"], strata, reps)
            fig["mean_accepted_length"] = {
                "value": 1 + length["value"] if length["value"] is not None else None,
                "ci": [1 + x for x in length["ci"]] if length["ci"] else None,
            }
            fig["draft_tokens"] = sum(c["draft_tokens"])
            mtp_blocks = [b for b in (_blocks(x) for x in es) if b]
            if mtp_blocks:
                fig["decode_ms_per_token"] = _median_of(es)
            if mtp_blocks and plain:
                # with the drafter against the same row without it: rel < 0 means speculative decoding is faster
                fig["decode_vs_plain"] = decode_difference(mtp_blocks, plain, repeated)
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
                (a["accepted"], a["draft_tokens"]), (b["accepted"], b["draft_tokens"]), strata, reps
            )
    return out


def _median_of(engines: list[dict]) -> float | None:
    vals = [(e.get("timing") or {}).get("decode_ms_per_token") for e in engines]
    vals = [v for v in vals if v is not None]
    return sum(vals) / len(vals) if vals else None


def load(out) -> dict | None:
    """DIR/speculative.json, summarised (None when DIR has none or it cannot be read)."""
    import json
    from pathlib import Path

    path = Path(out) / FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    return {"record": record, "summary": record.get("summary") or summarize(record)}


FILE = "speculative.json"


def _pct(fig: dict | None, digits: int = 1) -> str:
    if not fig or fig.get("value") is None:
        return ""
    ci = fig.get("ci")
    text = f"{100 * fig['value']:.{digits}f} %"
    return text + (f" [{100 * ci[0]:.{digits}f}, {100 * ci[1]:.{digits}f}]" if ci else "")


def _diff_pp(cmp: dict | None) -> str:
    if not cmp or cmp.get("diff") is None:
        return ""
    ci = cmp.get("ci")
    text = f"{100 * cmp['diff']:+.1f}"
    if ci:
        text += f" [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]" + ("" if cmp.get("significant") else " n.s.")
    return text


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
                    _pct(fig.get("acceptance")),
                    " / ".join(_pct(p, 0).split(" [")[0] for p in fig.get("per_position") or []),
                    f"{length['value']:.2f}" + (f" [{length['ci'][0]:.2f}, {length['ci'][1]:.2f}]" if length.get("ci") else "")
                    if length.get("value") is not None
                    else "",
                    _diff_pp(fig.get("vs_build")) if name != spec["record"].get("build_row") else "",
                    f"{plain:.3f} → {mtp:.3f}" if plain is not None and mtp is not None else "",
                    _decode_cell(fig),
                ]
            )
    return rows


def note(spec: dict) -> str:
    r = spec["record"]
    s = r.get("settings") or {}
    n = len(r.get("prompts") or [])
    corpora = len({p["corpus"] for p in r.get("prompts") or []})
    skipped = "; ".join(f"{x['row']}: {x['reason']}" for x in r.get("skipped") or [])
    return (
        f"MTP acceptance from `splicer mtp`: each variant started in vLLM with its own MTP head as the speculative "
        f"decoder (method {s.get('method')}, k draft tokens), {n} prompts ({s.get('prompts_per_corpus')} per corpus of "
        f"{corpora}, their first {s.get('prompt_tokens')} tokens) each generated greedily for {s.get('new_tokens')} "
        "tokens on its own; acceptance = accepted / drafted tokens, per position = drafts whose first i tokens were all "
        "accepted, mean accepted length = 1 + accepted / drafts, from vLLM's spec-decode counters; intervals resample "
        "prompts within corpora; Δ acceptance is paired with the build on the same prompts; Δ decode compares the same "
        "variant with and without the drafter, its interval from the engine-to-engine spread of the engines timed twice "
        "(the build, first and last). A drafter with acceptance under "
        f"{100 * BROKEN_BELOW:.0f} % or over {100 * BROKEN_ABOVE:.0f} % is flagged, not a result."
        + (f" Not measured: {skipped}." if skipped else "")
    )


def sentences(spec: dict) -> list[str]:
    """The report's sentences on MTP acceptance, every figure from the summary."""
    out = []
    summary, build = spec["summary"], spec["record"].get("build_row", "build")
    for name, ks in summary.items():
        for key in sorted((k for k in ks if k != "0"), key=int):
            fig = ks[key]
            if fig.get("flagged"):
                out.append(f"MTP k={key}, {name}: flagged, {fig['flagged']}.")
                continue
            acc = fig.get("acceptance") or {}
            if acc.get("value") is None:
                continue
            text = f"MTP k={key}, {name}: acceptance {_pct(acc)}"
            length = (fig.get("mean_accepted_length") or {}).get("value")
            if length is not None:
                text += f", {length:.2f} tokens per target step"
            vs = fig.get("vs_build")
            if name != build and vs and vs.get("diff") is not None:
                verdict = "" if vs.get("significant") else ", not significant"
                text += f"; {_diff_pp(vs).replace(' n.s.', '')} pp against the build{verdict}"
            d = fig.get("decode_vs_plain")
            if d and d.get("rel") is not None:
                lo, hi = d["rel_ci"]
                how = "faster" if d["rel"] < 0 else "slower"
                resolved = "resolved" if d.get("resolved") else "not resolved"
                text += (
                    f"; decode with the drafter {100 * d['rel']:+.1f} % [{100 * lo:+.1f}, {100 * hi:+.1f}] against "
                    f"without ({d['variant_ms']:.3f} vs {d['reference_ms']:.3f} ms/token: {how}, {resolved})"
                )
            if fig.get("greedy_changed_prompts"):
                text += f"; greedy tokens differed from the engine without the drafter in {fig['greedy_changed_prompts']} prompts"
            out.append(text + ".")
    return out
