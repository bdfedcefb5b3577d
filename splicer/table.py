"""`splicer table`: results.json -> the "where the error comes from" table (Markdown, CSV or JSON)."""

from __future__ import annotations

import csv
import io
import json
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


def _rows(results: dict) -> tuple[list[str], list[list], list[str]]:
    corpora = list(results.get("corpora", {}))
    variants = results["variants"]
    build = next((v for v in variants if v["name"] == "build" and v.get("status") == "ok"), None)
    build_kl = _mean_kl(build) if build else None
    build_ms = build.get("decode_ms_per_token") if build else None
    headers = ["variant", "restored to BF16", "size GB"]
    for c in corpora:
        headers += [f"top-1 {c}", f"KL {c}"]
    has_dnll = any((m or {}).get("dnll") is not None for v in variants for m in (v.get("metrics") or {}).values())
    if has_dnll:
        headers.append("dNLL")
    bw = results.get("bandwidth_bytes_per_s")
    headers += ["decode ms/tok"] + ([f"floor ms @ {bw / 1e12:g} TB/s"] if bw else []) + ["Δ decode", "ΔKL vs build"]
    band = timing_noise_band(results)
    rows = []
    for v in variants:
        restored = v["restored"] if isinstance(v["restored"], str) else (", ".join(v["restored"]) or "none (the build)")
        if v.get("status") != "ok":
            rows.append([v["name"], restored, "", *[""] * (2 * len(corpora)), *([""] if has_dnll else []), "", *([""] if bw else []),
                         "", f"failed: {v.get('error', '')[:80]}"])
            continue
        noisy = all(v.get("within_noise", {}).values()) and v.get("within_noise")
        row = [v["name"] + (" ≈" if noisy else ""), restored, f"{v['size_bytes'] / 1e9:.3f}"]
        for c in corpora:
            m = v["metrics"].get(c, {})
            row += [f"{100 * m['top1']:.1f} %", f"{m['kl']:.4f}"]
        if has_dnll:
            d = next((m["dnll"] for m in v["metrics"].values() if m.get("dnll") is not None), None)
            row.append(f"{d:+.4f}" if d is not None else "")
        ms = v.get("decode_ms_per_token")
        row.append(f"{ms:.2f}" if ms is not None else "-")
        if bw:  # the time the step's weight bytes take at the card's bandwidth: how far decode is from the memory floor
            step = v.get("bytes_per_decode_step")
            row.append(f"{1000 * step / bw:.3f}" if step else "")
        if ms is not None and build_ms and v["name"] != "build":
            d = ms / build_ms - 1
            row.append(f"{100 * d:+.1f} %" + (" ≈" if band is not None and abs(d) <= band and not v.get("repeat_of") else ""))
        else:
            row.append("")
        kl = _mean_kl(v)
        row.append(f"{100 * (kl / build_kl - 1):+.1f} %" if kl is not None and build_kl and v["name"] != "build" else "")
        rows.append(row)
    notes = _footnotes(results, build_kl)
    return headers, rows, notes


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
    text = tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)
    text += "\n\n" + "\n".join(f"- {n}" for n in notes)
    speed = speed_rows(results)
    if speed and results.get("backend") == "vllm":  # start-up, weight memory and compile come from vLLM's log
        text += "\n\nSpeed per variant (engine start, weight memory and compile time as vLLM logged them):\n\n"
        text += tabulate(speed[1], headers=speed[0], tablefmt="github", disable_numparse=True)
        methods = sorted({(v.get("timing") or {}).get("method") for v in results.get("variants", [])} - {None})
        if methods:
            text += "\n\nDecode timed as " + "; and as ".join(methods) + "."
    return text


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
    headers, rows, _ = _rows(results)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(headers)
        w.writerows(rows)
        return buf.getvalue()
    if fmt == "json":
        return json.dumps([dict(zip(headers, r)) for r in rows], indent=2, ensure_ascii=False)
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
