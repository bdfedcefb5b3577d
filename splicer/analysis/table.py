"""`splicer table`: results.json -> the "where the error comes from" table (Markdown, CSV or JSON).

Markdown is for reading and pasting into a model card: a caption line (build, base, backend, corpora and their
positions), the table, then notes. CSV and JSON carry the same rows as numbers, for plots and comparisons. All three
are made from `records()`: the Markdown cells are those numbers formatted, so the formats cannot disagree.

CSV and JSON columns, one per quantity (JSON: a list of objects, numbers as numbers, null where a value is missing;
CSV: plain decimal numbers, no units, an empty cell where a value is missing, true/false for flags). <corpus> is each
corpus name of the run (results.json "corpora"), in order:

  variant                        the row's name
  restored                       classes restored to BF16, comma-separated; "" for the build, "base" for the base row
  status                         "ok", or "error" for a row that failed (its numbers are then all missing)
  error                          why the row failed
  repeat_of                      the row whose variant this row runs again (timing repeats)
  size_gb                        bytes on disk / 1e9
  top1_<corpus>                  top-1 agreement with the base, as a fraction (Markdown shows %)
  top1_<corpus>_ci_low, _ci_high its 95 % interval (bootstrap over sequences; chat: over groups of conversations that share a
                                 prompt); every interval is missing for a corpus of fewer than 5 such units
                                 (metrics.MIN_SEQUENCES: too few for one)
  kl_<corpus>                    KL(base || variant) over the base's top-k (the plan's top_k, results.json "top_k") with the
                                 rest lumped, nats per position
  kl_<corpus>_ci_low, _ci_high   its 95 % interval (sequences, or chat groups, resampled; Student's t on the bootstrap's standard error)
  dnll_<corpus>                  extra nats per token on the base's greedy answers (corpora with answers: chat)
  dnll_<corpus>_ci_low, _ci_high its 95 % interval
  decode_ms_per_token            batch-1 decode ms per token; missing when not timed or not resolved
  bytes_per_decode_step          weight bytes one batch-1 decode step reads (routed experts: top-k of E)
  floor_ms_per_token             the time those bytes take at --bandwidth-gbs; missing without it
  decode_change_vs_build         the row's decode time relative to the build's, a fraction (Markdown: "Δ decode" in %),
                                 over every engine of each (the build is timed on 2+ engines: rows with repeat = true)
  decode_change_ci_low, _high    its 95 % interval (Student's t on the engine-to-engine spread of this run; verdicts.py)
  decode_change_resolved         true when that interval excludes 0 (Markdown: "not resolved" when false); it holds within
                                 the run: how far engines of another run land is not in the interval
  kl_change_vs_build             KL relative to the build's, a fraction, pooled over corpora position-weighted, paired on
                                 the same positions ("ΔKL vs build")
  kl_change_ci_low, _ci_high     its 95 % interval (stratified bootstrap over sequences or chat groups, both rows resampled together, the
                                 engine's measured run-to-run noise folded in where the build was scored on 2+ engines)
  kl_change_significant          true when that interval excludes 0 (Markdown: "n.s." when false)
  top1_change_vs_build           top-1 minus the build's top-1, a fraction, pooled like ΔKL (Markdown: percentage points)
  top1_change_ci_low, _ci_high   its 95 % interval
  top1_change_significant        true when that interval excludes 0
  change_note                    why the score changes have no interval and no verdict ("too few sequences", "too few groups"), else missing
Where the run holds a build re-made without some classes (a checkpoint row with requantized_without; `--add-requantized`),
every row also has these, empty (null) but on that build's rows:
  requantized_without            the classes that build left in BF16, comma-separated
  splice_row                     the row that splices the same classes into the build
  splice_minus_requantized_kl    the splice's KL minus the re-made build's, nats per position, pooled, paired
  splice_minus_requantized_kl_ci_low, _ci_high  its 95 % interval (as kl_change_*)
  splice_minus_requantized_rel   the same as a fraction of the re-made build's KL
  splice_minus_requantized_rel_ci_low, _ci_high, _significant  its interval, and true when it excludes 0
  splice_minus_requantized_top1  the splice's top-1 minus the re-made build's, a fraction, with _ci_low, _ci_high
  splice_minus_requantized_note  why there is no pair (no splice row, or it failed), or how the re-made build's quantized
                                 classes differ from the build's without those
The build and rows that repeat another row (more engines of it, for timing) have no changes of their own.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from pathlib import Path

from ..backends import results_wording
from ..errors import SplicerError
from ..io import results_record
from .formatting import fmt_change_verdict
from .metrics import TOO_FEW_NOTE, excludes_zero


def _dnll_corpora(results: dict) -> list[str]:
    """Corpora on which some variant has a dNLL (those with generated answers)."""
    return [
        c
        for c in results.get("corpora", {})
        if any(((v.get("metrics") or {}).get(c) or {}).get("dnll") is not None for v in results["variants"])
    ]


def _ci(m: dict, key: str) -> tuple[float | None, float | None]:
    ci = m.get(f"{key}_ci")
    return (ci[0], ci[1]) if ci else (None, None)


def _pooled(v: dict, quantity: str) -> dict:
    return (((v.get("vs_build") or {}).get(quantity) or {}).get("pooled")) or {}


def records(results: dict) -> list[dict]:
    """One dict per variant, the columns of the module docstring: the numbers every output format is made from."""
    corpora = list(results.get("corpora", {}))
    dnll_corpora = _dnll_corpora(results)
    variants = results["variants"]
    bw = results.get("bandwidth_bytes_per_s")
    out = []
    for v in variants:
        ok = v.get("status") == "ok"
        restored = v["restored"] if isinstance(v["restored"], str) else ",".join(v["restored"])
        if restored == "checkpoint":  # another build of the model, scored as it is: say which format it is
            ck = v.get("checkpoint") or {}
            # once each: a GPTQ or AWQ checkpoint's format is its method's name ("gptq gptq" says it twice)
            restored = "checkpoint: " + (
                " ".join(dict.fromkeys(str(x) for x in (ck.get("quant_method"), ck.get("format")) if x)) or "not quantized"
            )
        rec = {
            "variant": v["name"],
            "restored": restored,
            "status": "ok" if ok else "error",
            "error": None if ok else (v.get("error") or ""),
            "repeat_of": v.get("repeat_of"),
            "size_gb": v["size_bytes"] / 1e9 if ok and v.get("size_bytes") is not None else None,
        }
        metrics = (v.get("metrics") or {}) if ok else {}
        for c in corpora:
            m = metrics.get(c) or {}
            for key in ("top1", "kl"):
                lo, hi = _ci(m, key)
                rec.update({f"{key}_{c}": m.get(key), f"{key}_{c}_ci_low": lo, f"{key}_{c}_ci_high": hi})
        for c in dnll_corpora:
            m = metrics.get(c) or {}
            lo, hi = _ci(m, "dnll")
            rec.update({f"dnll_{c}": m.get("dnll"), f"dnll_{c}_ci_low": lo, f"dnll_{c}_ci_high": hi})
        ms = v.get("decode_ms_per_token") if ok else None
        step = v.get("bytes_per_decode_step") if ok else None
        rec["decode_ms_per_token"] = ms
        rec["bytes_per_decode_step"] = step
        # the time the step's weight bytes take at the card's bandwidth: how far decode is from the memory floor
        rec["floor_ms_per_token"] = 1000 * step / bw if bw and step else None
        d = (v.get("decode_vs_build") or {}) if ok else {}
        lo, hi = d.get("rel_ci") or (None, None)
        rec.update(
            {
                "decode_change_vs_build": d.get("rel"),
                "decode_change_ci_low": lo,
                "decode_change_ci_high": hi,
                "decode_change_resolved": d.get("resolved"),
            }
        )
        kl, top1 = (_pooled(v, "kl"), _pooled(v, "top1")) if ok else ({}, {})
        # each verdict from the interval shown beside it (ΔKL's is the ratio's, not the difference's)
        lo, hi = kl.get("rel_ci") or (None, None)
        rec.update(
            {
                "kl_change_vs_build": kl.get("rel"),
                "kl_change_ci_low": lo,
                "kl_change_ci_high": hi,
                "kl_change_significant": excludes_zero(kl.get("rel_ci")),
            }
        )
        lo, hi = top1.get("diff_ci") or (None, None)
        rec.update(
            {
                "top1_change_vs_build": top1.get("diff"),
                "top1_change_ci_low": lo,
                "top1_change_ci_high": hi,
                "top1_change_significant": excludes_zero(top1.get("diff_ci")),
            }
        )
        rec["change_note"] = TOO_FEW_NOTE.get(kl.get("why")) or TOO_FEW_NOTE.get(top1.get("why"))
        if any(w.get("vs_splice") for w in variants):
            vs = (v.get("vs_splice") or {}) if ok else {}
            pooled = (vs.get("kl") or {}).get("pooled") or {}
            top = (vs.get("top1") or {}).get("pooled") or {}
            lo, hi = pooled.get("diff_ci") or (None, None)
            rlo, rhi = pooled.get("rel_ci") or (None, None)
            tlo, thi = top.get("diff_ci") or (None, None)
            notes = [n for n in (vs.get("why"), vs.get("note")) if n]
            rec.update(
                {
                    "requantized_without": ",".join(vs["classes"]) if vs.get("classes") else None,
                    "splice_row": vs.get("splice"),
                    "splice_minus_requantized_kl": pooled.get("diff"),
                    "splice_minus_requantized_kl_ci_low": lo,
                    "splice_minus_requantized_kl_ci_high": hi,
                    "splice_minus_requantized_rel": pooled.get("rel"),
                    "splice_minus_requantized_rel_ci_low": rlo,
                    "splice_minus_requantized_rel_ci_high": rhi,
                    "splice_minus_requantized_rel_significant": excludes_zero(pooled.get("rel_ci")) if vs else None,
                    "splice_minus_requantized_top1": top.get("diff"),
                    "splice_minus_requantized_top1_ci_low": tlo,
                    "splice_minus_requantized_top1_ci_high": thi,
                    "splice_minus_requantized_note": "; ".join(notes) or None,
                }
            )
        out.append(rec)
    return out


def _fmt(x: float | None, spec: str, suffix: str = "", missing: str = "") -> str:
    return missing if x is None else f"{x:{spec}}{suffix}"


def _rows(results: dict) -> tuple[list[str], list[list], list[str]]:
    """The Markdown table: headers, rows of formatted cells (from records()), notes."""
    corpora = list(results.get("corpora", {}))
    dnll_corpora = _dnll_corpora(results)
    headers = ["variant", "restored to BF16", "size GB"]
    for c in corpora:
        headers += [f"top-1 {c}", f"KL {c}"]
    if dnll_corpora:
        headers.append("dNLL")
    bw = results.get("bandwidth_bytes_per_s")
    headers += ["decode ms/tok"] + ([f"floor ms @ {bw / 1e12:g} TB/s"] if bw else [])
    headers += ["Δ decode [95 %]", "ΔKL, % of build's [95 %]", "Δtop-1 vs build, pp [95 %]"]
    rows = []
    for r in records(results):
        # a space after the commas between entries, not those inside one (gdn@0,2, attention)
        restored = re.sub(r",(?=[A-Za-z_])", ", ", r["restored"]) or "none (the build)"
        if r["status"] != "ok":
            rows.append(
                [
                    r["variant"],
                    restored,
                    "",
                    *[""] * (2 * len(corpora)),
                    *([""] if dnll_corpora else []),
                    "",
                    *([""] if bw else []),
                    "",
                    "",
                    f"failed: {r['error'][:80]}",
                ]
            )
            continue
        name = r["variant"] + (f" (engine of {r['repeat_of']})" if r["repeat_of"] else "")
        row = [name, restored, _fmt(r["size_gb"], ".3f")]
        for c in corpora:
            top1 = r[f"top1_{c}"]
            row += [_fmt(None if top1 is None else 100 * top1, ".1f", " %"), _fmt(r[f"kl_{c}"], ".4f")]
        if dnll_corpora:  # one column: the first corpus with answers that this row has a dNLL on
            row.append(_fmt(next((r[f"dnll_{c}"] for c in dnll_corpora if r[f"dnll_{c}"] is not None), None), "+.4f"))
        row.append(_fmt(r["decode_ms_per_token"], ".2f", missing="-"))
        if bw:
            row.append(_fmt(r["floor_ms_per_token"], ".3f"))
        row.append(
            fmt_change_verdict(
                r["decode_change_vs_build"],
                r["decode_change_ci_low"],
                r["decode_change_ci_high"],
                r["decode_change_resolved"],
                100,
                " %",
                "not resolved",
            )
        )
        row.append(
            fmt_change_verdict(
                r["kl_change_vs_build"],
                r["kl_change_ci_low"],
                r["kl_change_ci_high"],
                r["kl_change_significant"],
                100,
                " %",
                "n.s.",
                note=r["change_note"],
            )
        )
        row.append(
            fmt_change_verdict(
                r["top1_change_vs_build"],
                r["top1_change_ci_low"],
                r["top1_change_ci_high"],
                r["top1_change_significant"],
                100,
                "",
                "n.s.",
                note=r["change_note"],
            )
        )
        rows.append(row)
    return headers, rows, _footnotes(results)


def caption(results: dict) -> str:
    """One line naming what the table measured: build, base, backend, corpora and positions (for a model card)."""
    inputs = results.get("inputs") or results.get("job") or {}
    build = (inputs.get("build") or {}).get("given") or (inputs.get("build") or {}).get("source") or "unknown"
    base = (inputs.get("base") or {}).get("given") or (inputs.get("base") or {}).get("source") or "unknown"
    backend = results.get("backend") or ((results.get("job") or {}).get("settings") or {}).get("backend") or "unknown"
    if results_wording(backend).engine_in_caption and results.get("engine_version"):
        backend += f" ({results['engine_version']})"
    parts = []
    first = next((v for v in results.get("variants", []) if v.get("status") == "ok" and v.get("metrics")), {})
    for name, c in (results.get("corpora") or {}).items():
        notes = [f"{c['answer_tokens']:,} of them answer tokens"] if c.get("answer_tokens") else []
        counted = ((first.get("metrics") or {}).get(name) or {}).get("positions")
        if isinstance(counted, (int, float)) and counted < c.get("positions", 0):
            notes.append(f"{counted:,.0f} counted, the rest repeat an earlier conversation's prefix")
        parts.append(f"{name} {c.get('positions', 0):,}" + (f" ({'; '.join(notes)})" if notes else ""))
    total = sum(c.get("positions", 0) for c in (results.get("corpora") or {}).values())
    corpora = f"positions scored per corpus: {', '.join(parts)}; {total:,} in all" if parts else "no corpora"
    return f"Build `{build}` against base `{base}`, backend {backend}; {corpora}."


def _kl_bound(results: dict) -> str:
    """What the KL columns are, which depends on what the backend returned (its results_wording for the run's recorded
    kl_support: exact log-probs at the base's top-k ids, or the variant's own top-k) and on the plan's top_k (recorded
    in results.json; a file written before it was recorded says so rather than guess)."""
    k = results.get("top_k")
    top = f"top-{k}" if isinstance(k, int) else "top-k (top-k not recorded in this results.json)"
    kth = f"its {k}th log-prob" if isinstance(k, int) else "its k-th log-prob"
    wording = results_wording(results.get("backend"), results.get("kl_support"))
    return wording.kl_bound.format(top=top, k=k if isinstance(k, int) else "k", kth=kth)


def _top1_rule(results: dict) -> str:
    """How top-1 read ties, from the rows' own summaries (a resumed run may keep rows scored by an older splicer)."""
    summaries = [
        m
        for v in results.get("variants", [])
        if v.get("status") == "ok"
        for m in (v.get("metrics") or {}).values()
        if isinstance(m, dict)
    ]
    if summaries and all(m.get("top1_ties") == "symmetric" for m in summaries):
        return (
            "top-1 counts agreement when the base's tied maxima and the variant's share a token (ties read the same "
            "way on both sides, so no sort order decides)"
        )
    return "top-1 counts a variant's choice among tied maxima of the base as agreement (the variant's own ties not read)"


def _footnotes(results: dict) -> list[str]:
    from .metrics import MIN_SEQUENCES
    from .verdicts import engine_means_text, lanes_word, noise_text, per_gpu_engines_text, pooled_kl

    notes = []
    method = (results.get("verdicts") or {}).get("method")
    if method:
        notes.append(
            f"ΔKL and Δtop-1 vs build: {method}; n.s. = not significant; {noise_text(results)}. ΔKL is relative to "
            "the build's KL (`splicer compare DIR ROW build` gives it per corpus). A corpus of fewer than "
            f"{MIN_SEQUENCES} sequences (chat: groups of conversations that share a prompt) supports no interval: "
            '"too few sequences" ("too few groups") then stands for both.'
        )
    engines = (results.get("verdicts") or {}).get("build_engines")
    d = next((v["decode_vs_build"] for v in results["variants"] if (v.get("decode_vs_build") or {}).get("rel") is not None), None)
    timed = any(r.get("decode_ms_per_token") for r in results["variants"])
    if d and engines and engines.get("by_gpu"):
        lane = lanes_word(results)
        ref = f"the mean of the build's engines' levels on the row's own {lane}"
        spread = f"the build's engines on each {lane} ({per_gpu_engines_text(engines)})"
    elif d:
        ref = f"the mean of the build's {d['engines'][1]} engines' levels, {d['reference_ms']:.3f} ms/token"
        spread = (
            (f"the build's engines ({engine_means_text(engines)}; largest difference {100 * engines['spread']:.2f} %)")
            if engines
            else "engines of the rows timed more than once"
        )
    if d:
        level = (
            "the median of its timed blocks, which a stray block does not move"
            if d.get("engine_summary")
            else "the mean of its timed blocks, as splicer computed it when this results.json was written"
        )
        notes.append(
            f"Δ decode vs build: the mean of a row's engines' levels (an engine's level: {level}) against {ref}; the interval is Student's t on the spread "
            f"between {spread}, df {d['df']}, never narrower than the blocks' own scatter allows; not resolved = the "
            "interval includes 0. Resolved holds within this run: engines of another run can land further apart, "
            "and that is not in the interval."
        )
    elif timed:
        notes.append(
            "Δ decode vs build: not computed: the build was timed on fewer than two engines, so the engine-to-engine "
            "spread is unknown (run the plan's `repeat = true` row of the build too, e.g. build-again)."
        )
    elif results.get("timing_settings") is None and results.get("variants"):
        notes.append("Decode was not timed in this run (--no-time).")
    overlapped = ((results.get("job") or {}).get("settings") or {}).get("overlap_starts") or any(
        str((r.get("timing") or {}).get("state", "")).startswith(("woken", "slept")) for r in results["variants"]
    )
    if overlapped and timed:
        # results/h200-fulldims (runs 2-8, second-wake): in overlapped runs, with or without sleep mode, engines of the
        # build sat at ~4.0-4.12 or ~4.38-4.55 ms/token, while serially started ones stayed at 4.34-4.39.
        notes.append(
            "Decode was timed in a run with overlapped engine starts (--overlap-starts): on an H200 engines of one "
            "variant so timed landed at two levels about 6 % apart, against 0.2-1.0 % between serially started "
            "engines; for decode verdicts run without --overlap-starts."
        )
    # Recomputed from the rows rather than read back, so results written by older versions get today's labels.
    from .breakdown import time_breakdown

    tb = time_breakdown(results) if results.get("time_breakdown") is not None else None
    if tb:
        notes.append("Wall time of the run: " + ", ".join(f"{k} {v:.0f} s" for k, v in tb.items()) + ".")
    if note := expert_cache_note(results):
        notes.append(note)
    nf = results.get("noise_floor") or {}
    if nf:
        parts = [f"{c}: top-1 {100 * m['top1']:.1f} %, KL {m['kl']:.4f}" for c, m in nf.items()]
        notes.append(
            "Noise floor (the base scored again, as every row is scored; a reference level for what the engine's "
            "own nondeterminism costs, not a significance threshold): " + "; ".join(parts) + "."
        )
    ok = {
        v["name"]: v
        for v in results["variants"]
        if v.get("status") == "ok" and isinstance(v["restored"], list) and not v.get("repeat_of")
    }
    build = ok.get("build")
    build_kl = pooled_kl(build) if build else None
    # The MTP head (drafter) never runs in a scoring pass: a row's restore of it changes no score, so it is left out of
    # the comparison (DeepSeek's and GLM's all-but-experts rows restore it with the rest).
    from ..splice.selection import DRAFTER_CLASS

    scored = lambda v: set(v["restored"]) - {DRAFTER_CLASS}  # noqa: E731
    singles = {next(iter(scored(v))): v for v in ok.values() if len(scored(v)) == 1 and len(v["restored"]) == 1}
    union = set(singles)
    together = next((v for v in ok.values() if scored(v) == union and len(union) > 1), None)
    if build_kl and together and singles:
        red_all = build_kl - pooled_kl(together)
        red_sum = sum(build_kl - pooled_kl(v) for v in singles.values())
        if red_all:
            notes.append(
                f"Additivity: the single-class KL reductions ({', '.join(sorted(singles))}) add up to "
                f"{red_sum / red_all:.2f}× the reduction of restoring them together ({together['name']}); 1.00 = additive "
                "(KL pooled over corpora, position-weighted)."
            )
    for s in results.get("skipped", []):
        notes.append(f"Row {s['name']} skipped: {s['reason']}.")
    b = results.get("backend_info") or {}
    notes.append(
        f"Backend {results.get('backend')} ({results.get('engine_version')}, {results.get('device')}); "
        f"{_kl_bound(results)}; {_top1_rule(results)}; "
        "dNLL = extra nats per token on the base's greedy chat answers; "
        f"decode = batch-1 ms/token{' on ' + b['device'] if b.get('device') else ''}."
    )
    env = b.get("engine_env") or {}
    if env:
        what = ", ".join(f"{k}={v}" for k, v in sorted(env.items()))
        why = (
            " (Triton autotuning off: every tuned kernel ran its first valid config, so prefill speed and TTFT are not "
            "those of vLLM's defaults)"
            if str(env.get("VLLM_TRITON_FORCE_FIRST_CONFIG", "")).lower() in ("1", "true")
            else ""
        )
        notes.append(f"Engine environment set for this run: {what}{why}.")
    return notes


def speed_rows(results: dict) -> tuple[list[str], list[list]] | None:
    """Per variant: decode spread, TTFT, weight memory and engine start as the engine reported them, scoring speed."""
    variants = [v for v in results.get("variants", []) if v.get("status") == "ok" and (v.get("engine") or v.get("timing"))]
    base = results.get("base_pass") or {}
    if not variants:
        return None
    # "engine start" is vLLM's own start (building LLM() in the worker, without the worker's one-time import); "waited"
    # is what the row waited for it, less when it was started ahead of its turn (--overlap-starts).
    headers = [
        "variant",
        "decode ms/tok median [IQR] (min-max)",
        "TTFT ms median (min-max)",
        "weights GiB",
        "engine start s",
        "waited s",
        "weight load s",
        "compile s",
        "scoring positions/s (all corpora)",
    ]
    positions = sum(c.get("positions", 0) for c in results.get("corpora", {}).values())
    rows = []
    entries = [("base pass", base.get("engine") or {}, None, (base.get("timings") or {}))] if base.get("engine") else []
    entries += [(v["name"], v.get("engine") or {}, v.get("timing"), v.get("elapsed") or {}) for v in variants]
    for name, eng, timing, elapsed in entries:
        sb = eng.get("startup_breakdown") or {}
        t = timing or {}
        dec = (
            (
                f"{t['decode_ms_per_token']:.2f} [{t['decode_iqr'][0]:.2f}, {t['decode_iqr'][1]:.2f}] "
                f"({t['decode_min_max'][0]:.2f}-{t['decode_min_max'][1]:.2f})"
            )
            if t.get("decode_ms_per_token")
            else ""
        )
        if timing and t.get("decode_ms_per_token") is None and "per_run_ms" in t:
            dec = "not resolved"  # timed, but the estimate was not positive (the runs are in results.json)
        ttft = f"{t['ttft_ms']:.0f} ({t['ttft_min_max'][0]:.0f}-{t['ttft_min_max'][1]:.0f})" if t.get("ttft_ms") else ""
        secs = sum(x for k, x in elapsed.items() if k.startswith("score_") and k.endswith("_s"))
        pps = positions / secs if timing is not None and secs else None  # all corpora together; the base pass adds a noise pass
        waited, start = elapsed.get("load_s"), eng.get("startup_s")
        rows.append(
            [
                name,
                dec,
                ttft,
                f"{sb['weight_memory_gib']:.2f}" if "weight_memory_gib" in sb else "",
                f"{start:.0f}" if start is not None else "",
                f"{waited:.0f}" if waited is not None else "",
                f"{sb['model_load_s']:.0f}" if "model_load_s" in sb else "",
                f"{sb['compile_s']:.0f}" if "compile_s" in sb else "",
                f"{pps:,.0f}" if pps else "",
            ]
        )
    return headers, rows


def splice_vs_requantized_rows(results: dict) -> tuple[list[str], list[list]] | None:
    """Per re-quantized build (a checkpoint row with requantized_without): the splice of the same classes and the
    re-made build, each against the build, and their paired difference."""
    ok = {v["name"]: v for v in results.get("variants", []) if v.get("status") == "ok"}
    pairs = [v for v in ok.values() if v.get("vs_splice")]
    if not pairs:
        return None

    def vs_build(name):
        kl = (((ok.get(name) or {}).get("vs_build") or {}).get("kl") or {}).get("pooled") or {}
        if kl.get("rel") is None:
            return ""
        ci, note = kl.get("rel_ci") or (None, None), TOO_FEW_NOTE.get(kl.get("why"))
        return fmt_change_verdict(kl["rel"], *ci, excludes_zero(kl.get("rel_ci")), 100, " %", "n.s.", note=note)

    def paired(cmp, scale, unit, digits, rel=False):
        cmp = (cmp or {}).get("pooled") or {}
        x, ci = (cmp.get("rel"), cmp.get("rel_ci")) if rel else (cmp.get("diff"), cmp.get("diff_ci"))
        if x is None:
            return ""
        note = TOO_FEW_NOTE.get(cmp.get("why"))
        return fmt_change_verdict(x, *(ci or (None, None)), excludes_zero(ci), scale, unit, "n.s.", digits, note=note)

    headers = [
        "classes left in BF16",
        "splice (row)",
        "splice ΔKL vs build [95 %]",
        "re-quantized (row)",
        "re-quantized ΔKL vs build [95 %]",
        "splice − re-quantized, KL nats [95 %]",
        "splice − re-quantized, % of re-quantized's KL",
        "splice − re-quantized, Δtop-1 pp",
        "note",
    ]
    rows = []
    for v in pairs:
        vs = v["vs_splice"]
        classes, splice = ", ".join(vs["classes"]), vs.get("splice")
        if not splice or not vs.get("kl"):
            # why there is no pair, and the note on what the re-made build quantizes, as the CSV's note column has both
            note = "; ".join(n for n in (vs.get("why"), vs.get("note")) if n)
            rows.append([classes, "none", "", v["name"], vs_build(v["name"]), "", "", "", note])
            continue
        rows.append(
            [
                classes,
                splice,
                vs_build(splice),
                v["name"],
                vs_build(v["name"]),
                paired(vs["kl"], 1, "", 5),
                paired(vs["kl"], 100, " %", 1, rel=True),
                paired(vs.get("top1"), 100, "", 2),
                vs.get("note", ""),
            ]
        )
    return headers, rows


SPLICE_VS_REQUANTIZED_NOTE = (
    "Splice against re-quantize: the splice restores the classes into this build and shows the build without their own "
    "error; the re-quantized build is the quantizer's recipe run again with them left in BF16, every later layer "
    "re-fitted to them. Their difference is paired on the same positions, pooled over corpora, with the ΔKL intervals' "
    "method; positive: the splice leaves more KL than re-quantizing would (`splicer compare DIR SPLICE REQUANTIZED` "
    "gives it per corpus)."
)


def render_markdown(results: dict, out: Path | None = None) -> str:
    """The table.md of a results folder; with out, the sections of the later stages' files in out too (tasks.json,
    speculative.json, mtp-teacher-forced.json)."""
    from tabulate import tabulate

    headers, rows, notes = _rows(results)
    text = caption(results) + "\n\n" + tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)
    text += "\n\n" + "\n".join(f"- {n}" for n in notes)
    pairs = splice_vs_requantized_rows(results)
    if pairs:
        text += "\n\nSplice against re-quantize:\n\n"
        text += tabulate(pairs[1], headers=pairs[0], tablefmt="github", disable_numparse=True)
        text += f"\n\n- {SPLICE_VS_REQUANTIZED_NOTE}"
    if out is not None:  # what the later stages wrote into DIR, each its own section
        from . import speculative, task_scores, teacher_forced

        order = [v["name"] for v in results.get("variants", [])]
        for module, title in (
            (task_scores, "Task accuracy (lm-evaluation-harness)"),
            (speculative, "MTP acceptance (speculative decoding in vLLM)"),
            (teacher_forced, "MTP acceptance, teacher-forced (torch reference)"),
        ):
            spec = module.load(out)
            if spec:
                rows = module.table_rows(spec, order)
                text += f"\n\n{title}:\n\n" + tabulate(rows, headers=module.HEADERS, tablefmt="github", disable_numparse=True)
                text += f"\n\n- {module.note(spec)}"
    speed = speed_rows(results)
    heading = results_wording(results.get("backend")).start_up_heading
    if speed and heading:
        text += f"\n\n{heading}\n\n"
        text += tabulate(speed[1], headers=speed[0], tablefmt="github", disable_numparse=True)
        methods = sorted({(v.get("timing") or {}).get("method") for v in results.get("variants", [])} - {None})
        if methods:
            text += "\n\nDecode timed as " + "; and as ".join(methods) + "."
    return text


def _plain(x):
    """NaN and infinities are not numbers in JSON and no CSV reader agrees on them: missing, like any other gap."""
    return None if isinstance(x, float) and not math.isfinite(x) else x


def _csv_cell(x) -> str:
    """Missing -> empty; flags -> true/false; floats as plain decimals (repr's digits, so exact, but never 1e-05)."""
    if x is None:
        return ""
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, float):
        from decimal import Decimal

        text = format(Decimal(repr(x)), "f")
        return text if "." in text else text + ".0"
    return str(x)


def render(out_dir: Path, fmt: str = "markdown") -> str:
    results = results_record.load(out_dir)
    if fmt == "markdown":
        return render_markdown(results, Path(out_dir))
    if fmt in ("csv", "json"):
        recs = [{k: _plain(x) for k, x in r.items()} for r in records(results)]
        if fmt == "json":
            return json.dumps(recs, indent=2, ensure_ascii=False, allow_nan=False)
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(list(recs[0]) if recs else ["variant"])
        for r in recs:
            w.writerow([_csv_cell(x) for x in r.values()])
        return buf.getvalue()
    raise SplicerError(f"unknown --format {fmt!r}; use markdown, csv or json")


def compare(out_dir: Path, a: str, b: str) -> str:
    """Paired differences between any two finished variants on the same positions (verdicts.compare_scores)."""
    from tabulate import tabulate

    from .cluster_scores import FILE_NAME as CLUSTER_FILE
    from .verdicts import compare_scores, fold_noise, noise_text

    out_dir = Path(out_dir)
    results = results_record.load(out_dir)
    ok = {v["name"] for v in results["variants"] if v.get("status") == "ok"}
    for name in (a, b):
        if name not in ok:
            raise SplicerError(
                f"variant {name!r} has no finished scores in {out_dir}; finished: {', '.join(sorted(ok)) or 'none'}"
            )
    try:
        # The resamples ablate used for the table's intervals, so that compare ROW build repeats them exactly.
        reps = int((results.get("verdicts") or {}).get("bootstrap") or 2000)
        c = compare_scores(out_dir, a, b, list(results.get("corpora", {})), reps)
    except ValueError as e:
        raise SplicerError(f"{e}; rerun splicer ablate on {out_dir}") from None
    if c is None:
        from .verdicts import load_scores

        corpora = list(results.get("corpora", {}))
        lacking = [r for r in (a, b) if not any(load_scores(out_dir, r, c) is not None for c in corpora)] or [a, b]
        raise SplicerError(
            f"no scores of {' and '.join(lacking)} in {out_dir / 'scores'} or {out_dir / CLUSTER_FILE} (they were "
            f"deleted or never copied); compare needs both rows' scores, as splicer ablate wrote them"
        )
    c = fold_noise(c, (results.get("verdicts") or {}).get("engine_noise"))

    def cell(cmp, scale, digits, rel=False):
        if not cmp or cmp.get("diff") is None:
            return ""
        x, ci = (cmp["rel"], cmp["rel_ci"]) if rel else (cmp["diff"], cmp["diff_ci"])
        if x is None:
            return ""
        note = TOO_FEW_NOTE.get(cmp.get("why"))
        return fmt_change_verdict(x, *(ci or (None, None)), excludes_zero(ci), scale, "", "n.s.", digits, note=note)

    rows = []
    pooled = "pooled over corpora (position-weighted)"
    names = [*c["kl"]["per_stratum"], pooled]
    for corpus in names:
        pick = (
            (lambda q: (c[q] or {}).get("pooled"))
            if corpus == pooled
            else (lambda q: ((c[q] or {}).get("per_stratum") or {}).get(corpus))
        )
        kl = pick("kl")
        rows.append(
            [
                corpus,
                f"{kl['positions']:,.0f}",
                f"{kl['clusters']:,} {kl.get('unit', 'sequences')}",
                cell(kl, 1, 5),
                cell(kl, 100, 1, rel=True),
                cell(pick("top1"), 100, 2),
                cell(pick("dnll"), 1, 5),
            ]
        )
    table = tabulate(
        rows,
        headers=[
            "corpus",
            "positions counted",
            "units resampled",
            f"ΔKL {a} − {b}, nats [95 %]",
            f"ΔKL, % of {b}'s KL",
            "Δtop-1, pp",
            "ΔdNLL, nats/token",
        ],
        tablefmt="github",
        disable_numparse=True,
    )
    from .verdicts import METHOD

    return table + f"\n\n{a} − {b}: {METHOD}; n.s. = not significant; {noise_text(results)}."


def expert_cache_note(results: dict) -> str | None:
    """How the run's engines got their routed experts under --expert-cache (each engine's record from the vLLM
    backend's loader), or None when no engine used it."""
    base = results.get("base_pass") or {}
    engines = [("base pass", base.get("engine") or {})] + [(v["name"], v.get("engine") or {}) for v in results["variants"]]
    used = [(n, e["expert_cache"]) for n, e in engines if e.get("expert_cache")]
    if not used:
        return None
    loaded = [n for n, r in used if r.get("do") == "load"]
    saved = [n for n, r in used if r.get("do") == "save" and r.get("saved")]
    other = [f"{n} ({r.get('why') or r.get('do')})" for n, r in used if n not in loaded and n not in saved]
    parts = [f"copied from the cache into {len(loaded)} of {len(used)} engines" + (f" ({', '.join(loaded)})" if loaded else "")]
    if saved:
        parts.append(f"saved by {', '.join(saved)}")
    if other:
        parts.append("loaded the normal way: " + "; ".join(other))
    return "Routed experts (--expert-cache): " + "; ".join(parts) + "."
