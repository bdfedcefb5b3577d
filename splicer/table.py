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
  within_noise                   true when the row differs from the build by less than the noise floor on every
                                 corpus (Markdown: "≈" after the name); missing where not computed (the build)
  size_gb                        bytes on disk / 1e9
  top1_<corpus>                  top-1 agreement with the base, as a fraction (Markdown shows %)
  top1_<corpus>_ci_low, _ci_high its 95 % interval (bootstrap over sequences)
  kl_<corpus>                    KL(base || variant) over the base's top-20 with the rest lumped, nats per position
  kl_<corpus>_ci_low, _ci_high   its 95 % interval (sequences resampled)
  dnll_<corpus>                  extra nats per token on the base's greedy answers (corpora with answers: chat)
  dnll_<corpus>_ci_low, _ci_high its 95 % interval
  decode_ms_per_token            batch-1 decode ms per token; missing when not timed or not resolved
  bytes_per_decode_step          weight bytes one batch-1 decode step reads (routed experts: top-k of E)
  floor_ms_per_token             the time those bytes take at --bandwidth-gbs; missing without it
  decode_change_vs_build         decode_ms_per_token / the build's - 1, a fraction (Markdown: "Δ decode" in %)
  decode_change_in_noise_band    true when that change is inside the run's timing noise band (Markdown: "≈");
                                 missing for the build, repeat rows (they define the band) and runs without a band
  kl_change_vs_build             the mean over corpora of kl_<corpus> / the build's - 1, a fraction ("ΔKL vs build")
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

from .errors import SplicerError


def _load_scores(out: Path, row: str, corpus: str):
    from safetensors.torch import load_file

    p = out / "scores" / row / f"{corpus}.safetensors"
    return load_file(str(p)) if p.exists() else None


def paired_vs_build(results: dict, out: Path) -> None:
    """Paired differences of every variant against the build on the same positions, and the noise mark."""
    from .metrics import paired_difference

    ok = {v["name"]: v for v in results["variants"] if v.get("status") == "ok"}
    if "build" not in ok:
        return
    for name, v in ok.items():
        v["paired_vs_build"], v["within_noise"] = {}, {}
        if name == "build":
            continue
        for corpus in v["metrics"]:
            a, b = _load_scores(out, name, corpus), _load_scores(out, "build", corpus)
            if a is None or b is None:
                continue
            dkl = paired_difference(a["kl_top"], b["kl_top"], a["seq_index"])
            dtop1 = paired_difference(a["top1"].float(), b["top1"].float(), a["seq_index"])
            v["paired_vs_build"][corpus] = {"dkl": dkl, "dtop1": dtop1}
            noise = results.get("noise_floor", {}).get(corpus)
            if noise:
                v["within_noise"][corpus] = abs(dkl["mean"]) <= noise["kl"] and abs(dtop1["mean"]) <= 1 - noise["top1"]


def _mean_kl(v: dict) -> float | None:
    vals = [m["kl"] for m in v.get("metrics", {}).values() if m.get("kl") is not None]
    return sum(vals) / len(vals) if vals else None


def _dnll_corpora(results: dict) -> list[str]:
    """Corpora on which some variant has a dNLL (those with generated answers)."""
    return [c for c in results.get("corpora", {})
            if any(((v.get("metrics") or {}).get(c) or {}).get("dnll") is not None for v in results["variants"])]


def _ci(m: dict, key: str) -> tuple[float | None, float | None]:
    ci = m.get(f"{key}_ci")
    return (ci[0], ci[1]) if ci else (None, None)


def records(results: dict) -> list[dict]:
    """One dict per variant, the columns of the module docstring: the numbers every output format is made from."""
    corpora = list(results.get("corpora", {}))
    dnll_corpora = _dnll_corpora(results)
    variants = results["variants"]
    build = next((v for v in variants if v["name"] == "build" and v.get("status") == "ok"), None)
    build_kl = _mean_kl(build) if build else None
    build_ms = build.get("decode_ms_per_token") if build else None
    bw = results.get("bandwidth_bytes_per_s")
    band = timing_noise_band(results)
    out = []
    for v in variants:
        ok = v.get("status") == "ok"
        restored = v["restored"] if isinstance(v["restored"], str) else ",".join(v["restored"])
        wn = v.get("within_noise") if ok else None
        rec = {"variant": v["name"], "restored": restored, "status": "ok" if ok else "error",
               "error": None if ok else (v.get("error") or ""), "repeat_of": v.get("repeat_of"),
               "within_noise": all(wn.values()) if wn else None,
               "size_gb": v["size_bytes"] / 1e9 if ok and v.get("size_bytes") is not None else None}
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
        d = ms / build_ms - 1 if ok and ms is not None and build_ms and v["name"] != "build" else None
        rec["decode_change_vs_build"] = d
        rec["decode_change_in_noise_band"] = abs(d) <= band if d is not None and band is not None and not v.get("repeat_of") else None
        kl = _mean_kl(v) if ok else None
        rec["kl_change_vs_build"] = kl / build_kl - 1 if kl is not None and build_kl and v["name"] != "build" else None
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
    headers += ["decode ms/tok"] + ([f"floor ms @ {bw / 1e12:g} TB/s"] if bw else []) + ["Δ decode", "ΔKL vs build"]
    rows = []
    for r in records(results):
        restored = r["restored"].replace(",", ", ") or "none (the build)"
        if r["status"] != "ok":
            rows.append([r["variant"], restored, "", *[""] * (2 * len(corpora)), *([""] if dnll_corpora else []), "",
                         *([""] if bw else []), "", f"failed: {r['error'][:80]}"])
            continue
        row = [r["variant"] + (" ≈" if r["within_noise"] else ""), restored, _fmt(r["size_gb"], ".3f")]
        for c in corpora:
            top1 = r[f"top1_{c}"]
            row += [_fmt(None if top1 is None else 100 * top1, ".1f", " %"), _fmt(r[f"kl_{c}"], ".4f")]
        if dnll_corpora:  # one column: the first corpus with answers that this row has a dNLL on
            row.append(_fmt(next((r[f"dnll_{c}"] for c in dnll_corpora if r[f"dnll_{c}"] is not None), None), "+.4f"))
        row.append(_fmt(r["decode_ms_per_token"], ".2f", missing="-"))
        if bw:
            row.append(_fmt(r["floor_ms_per_token"], ".3f"))
        d = r["decode_change_vs_build"]
        row.append(_fmt(None if d is None else 100 * d, "+.1f", " %" + (" ≈" if r["decode_change_in_noise_band"] else "")))
        dkl = r["kl_change_vs_build"]
        row.append(_fmt(None if dkl is None else 100 * dkl, "+.1f", " %"))
        rows.append(row)
    build = next((v for v in results["variants"] if v["name"] == "build" and v.get("status") == "ok"), None)
    notes = _footnotes(results, _mean_kl(build) if build else None)
    return headers, rows, notes


def caption(results: dict) -> str:
    """One line naming what the table measured: build, base, backend, corpora and positions (for a model card)."""
    inputs = results.get("inputs") or results.get("job") or {}
    build = (inputs.get("build") or {}).get("source") or "unknown"
    base = (inputs.get("base") or {}).get("source") or "unknown"
    backend = results.get("backend") or ((results.get("job") or {}).get("settings") or {}).get("backend") or "unknown"
    if backend == "vllm" and results.get("engine_version"):
        backend += f" ({results['engine_version']})"
    parts = []
    for name, c in (results.get("corpora") or {}).items():
        answers = f" ({c['answer_tokens']:,} of them answer tokens)" if c.get("answer_tokens") else ""
        parts.append(f"{name} {c.get('positions', 0):,}{answers}")
    total = sum(c.get("positions", 0) for c in (results.get("corpora") or {}).values())
    corpora = f"positions scored per corpus: {', '.join(parts)}; {total:,} in all" if parts else "no corpora"
    return f"Build `{build}` against base `{base}`, backend {backend}; {corpora}."


def _timed_repeats(results: dict) -> list[tuple[dict, dict]]:
    """(first row, its repeat) for every repeat row whose variant was timed both times."""
    ok = {v["name"]: v for v in results.get("variants", []) if v.get("status") == "ok"}
    pairs = [(ok.get(v.get("repeat_of") or ""), v) for v in ok.values()]
    return [(a, b) for a, b in pairs if a and a.get("decode_ms_per_token") and b.get("decode_ms_per_token")]


def timing_noise_band(results: dict) -> float | None:
    """Largest relative decode-time difference between a row and its repeat (e.g. the build at start and end)."""
    spreads = [abs(b["decode_ms_per_token"] / a["decode_ms_per_token"] - 1) for a, b in _timed_repeats(results)]
    return max(spreads) if spreads else None


def _footnotes(results: dict, build_kl: float | None) -> list[str]:
    notes = []
    band = timing_noise_band(results)
    if band is not None:
        pairs = [f"{a['name']} {a['decode_ms_per_token']:.3f} → {b['name']} {b['decode_ms_per_token']:.3f} ms/token"
                 for a, b in _timed_repeats(results)]
        notes.append(f"Timing noise band ±{100 * band:.1f} % (the same variant timed twice in this run: {'; '.join(pairs)}); "
                     "Δ decode marked ≈ is inside it.")
    # Recomputed from the rows rather than read back, so results written by older versions get today's labels.
    from .ablate import time_breakdown

    tb = time_breakdown(results) if results.get("time_breakdown") is not None else None
    if tb:
        notes.append("Wall time of the run: " + ", ".join(f"{k} {v:.0f} s" for k, v in tb.items()) + ".")
    nf = results.get("noise_floor") or {}
    if nf:
        parts = [f"{c}: top-1 {100 * m['top1']:.1f} %, KL {m['kl']:.4f}" for c, m in nf.items()]
        notes.append("Noise floor (the base against itself, batched and ordered differently): " + "; ".join(parts)
                     + ". Rows marked ≈ differ from the build by less than that on every corpus.")
    ok = {v["name"]: v for v in results["variants"] if v.get("status") == "ok" and isinstance(v["restored"], list)}
    singles = {v["restored"][0]: v for v in ok.values() if len(v["restored"]) == 1}
    union = set(singles)
    together = next((v for v in ok.values() if set(v["restored"]) == union and len(union) > 1), None)
    if build_kl and together and singles:
        red_all = build_kl - _mean_kl(together)
        red_sum = sum(build_kl - _mean_kl(v) for v in singles.values())
        if red_all:
            notes.append(f"Additivity: the single-class KL reductions ({', '.join(sorted(singles))}) add up to "
                         f"{red_sum / red_all:.2f}× the reduction of restoring them together ({together['name']}); 1.00 = additive.")
    for s in results.get("skipped", []):
        notes.append(f"Row {s['name']} skipped: {s['reason']}.")
    b = results.get("backend_info") or {}
    notes.append(f"Backend {results.get('backend')} ({results.get('engine_version')}, {results.get('device')}); KL = KL(base ‖ variant) over the "
                 "base's top-20 with the rest lumped (a lower bound); dNLL = extra nats per token on the base's greedy chat answers; "
                 f"decode = batch-1 ms/token{' on ' + b['device'] if b.get('device') else ''}.")
    return notes


def speed_rows(results: dict) -> tuple[list[str], list[list]] | None:
    """Per variant: decode spread, TTFT, weight memory and engine start as the engine reported them, scoring speed."""
    variants = [v for v in results.get("variants", []) if v.get("status") == "ok" and (v.get("engine") or v.get("timing"))]
    base = results.get("base_pass") or {}
    if not variants:
        return None
    # "engine start" is vLLM's own start (building LLM() in the worker, without the worker's one-time import); "waited"
    # is what the row waited for it, less when it was started ahead of its turn (--overlap-starts).
    headers = ["variant", "decode ms/tok median [IQR] (min-max)", "TTFT ms median (min-max)", "weights GiB",
               "engine start s", "waited s", "weight load s", "compile s", "scoring positions/s (all corpora)"]
    positions = sum(c.get("positions", 0) for c in results.get("corpora", {}).values())
    rows = []
    entries = ([("base pass", base.get("engine") or {}, None, (base.get("timings") or {}))] if base.get("engine") else [])
    entries += [(v["name"], v.get("engine") or {}, v.get("timing"), v.get("elapsed") or {}) for v in variants]
    for name, eng, timing, elapsed in entries:
        sb = eng.get("startup_breakdown") or {}
        t = timing or {}
        dec = (f"{t['decode_ms_per_token']:.2f} [{t['decode_iqr'][0]:.2f}, {t['decode_iqr'][1]:.2f}] "
               f"({t['decode_min_max'][0]:.2f}-{t['decode_min_max'][1]:.2f})") if t.get("decode_ms_per_token") else ""
        if timing and t.get("decode_ms_per_token") is None and "per_run_ms" in t:
            dec = "not resolved"  # timed, but the estimate was not positive (the runs are in results.json)
        ttft = f"{t['ttft_ms']:.0f} ({t['ttft_min_max'][0]:.0f}-{t['ttft_min_max'][1]:.0f})" if t.get("ttft_ms") else ""
        secs = sum(x for k, x in elapsed.items() if k.startswith("score_") and k.endswith("_s"))
        pps = positions / secs if timing is not None and secs else None  # all corpora together; the base pass adds a noise pass
        waited, start = elapsed.get("load_s"), eng.get("startup_s")
        rows.append([name, dec, ttft, f"{sb['weight_memory_gib']:.2f}" if "weight_memory_gib" in sb else "",
                     f"{start:.0f}" if start is not None else "", f"{waited:.0f}" if waited is not None else "",
                     f"{sb['model_load_s']:.0f}" if "model_load_s" in sb else "",
                     f"{sb['compile_s']:.0f}" if "compile_s" in sb else "", f"{pps:,.0f}" if pps else ""])
    return headers, rows


def render_markdown(results: dict) -> str:
    from tabulate import tabulate

    headers, rows, notes = _rows(results)
    text = caption(results) + "\n\n" + tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)
    text += "\n\n" + "\n".join(f"- {n}" for n in notes)
    speed = speed_rows(results)
    if speed and results.get("backend") == "vllm":  # start-up, weight memory and compile come from vLLM's log
        text += "\n\nSpeed per variant (engine start, weight memory and compile time as vLLM logged them):\n\n"
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
    path = Path(out_dir) / "results.json"
    if not path.exists():
        raise SplicerError(f"{path} does not exist; run splicer ablate with -o {out_dir} first")
    try:
        results = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise SplicerError(f"{path} is not valid JSON; rerun splicer ablate to rewrite it") from None
    if fmt == "markdown":
        return render_markdown(results)
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
    """Paired differences between any two finished variants on the same positions (bootstrap over sequences)."""
    from tabulate import tabulate

    from .metrics import paired_difference

    out_dir = Path(out_dir)
    path = out_dir / "results.json"
    if not path.exists():
        raise SplicerError(f"{path} does not exist; run splicer ablate with -o {out_dir} first")
    results = json.loads(path.read_text())
    ok = {v["name"] for v in results["variants"] if v.get("status") == "ok"}
    for name in (a, b):
        if name not in ok:
            raise SplicerError(f"variant {name!r} has no finished scores in {out_dir}; finished: {', '.join(sorted(ok)) or 'none'}")
    rows = []
    for corpus in results.get("corpora", {}):
        sa, sb = _load_scores(out_dir, a, corpus), _load_scores(out_dir, b, corpus)
        if sa is None or sb is None:
            continue
        dkl = paired_difference(sa["kl_top"], sb["kl_top"], sa["seq_index"])
        dtop1 = paired_difference(sa["top1"].float(), sb["top1"].float(), sa["seq_index"])
        row = [corpus, f"{dkl['mean']:+.4f} [{dkl['ci'][0]:+.4f}, {dkl['ci'][1]:+.4f}]",
               f"{100 * dtop1['mean']:+.2f} [{100 * dtop1['ci'][0]:+.2f}, {100 * dtop1['ci'][1]:+.2f}]"]
        if "answer_mask" in sa:
            m = sa["answer_mask"].bool()
            d = paired_difference(-sa["dlogp"][m], -sb["dlogp"][m], sa["seq_index"][m])
            row.append(f"{-d['mean']:+.4f} [{-d['ci'][1]:+.4f}, {-d['ci'][0]:+.4f}]")
        else:
            row.append("")
        rows.append(row)
    return tabulate(rows, headers=["corpus", f"ΔKL {a} − {b} [95 %]", "Δtop-1 pp [95 %]", "ΔdNLL [95 %]"], tablefmt="github")
