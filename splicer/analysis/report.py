"""`splicer report DIR`: the findings of an ablate run as sentences, every figure computed from DIR/results.json.

A results README quotes these sentences rather than typing figures by hand; `ablate` writes them to DIR/report.md
beside table.md after every row. Verdicts follow verdicts.py: a score difference is "significant" when the 95 %
interval shown excludes 0 (a corpus of too few sequences gets neither interval nor verdict, and the sentence says so), a
decode difference "resolved" when its interval excludes 0, within the run; otherwise the sentence says not.
"""

from __future__ import annotations

from pathlib import Path

from ..io import results_record
from .formatting import fmt_change, fmt_other_dtypes
from .metrics import TOO_FEW_NOTE, excludes_zero


def _score_clause(cmp: dict | None, label: str, scale: float, unit: str, rel: bool, digits: int | None = None) -> str | None:
    if not cmp or cmp.get("diff") is None:
        return None
    x, ci = (cmp.get("rel"), cmp.get("rel_ci")) if rel else (cmp["diff"], cmp.get("diff_ci"))
    if x is None:
        return None
    lo, hi = ci if ci else (None, None)
    # the verdict of the interval shown (a ratio's for ΔKL, the difference's otherwise)
    verdict = ", not significant" if excludes_zero(ci) is False else ""
    if ci is None and cmp.get("why") in TOO_FEW_NOTE:
        verdict = f" ({TOO_FEW_NOTE[cmp['why']]} for an interval)"
    return f"{label} {fmt_change(x, lo, hi, scale, unit, digits)}{verdict}"


def _decode_clause(d: dict | None) -> str | None:
    if not d:
        return None
    if d.get("rel") is None:
        return f"decode not compared ({d.get('why', 'too few engines timed')})"
    lo, hi = d["rel_ci"]
    verdict = ", resolved within this run" if d.get("resolved") else ", not resolved"
    return f"decode {fmt_change(d['rel'], lo, hi)}{verdict} ({d['variant_ms']:.3f} vs {d['reference_ms']:.3f} ms/token)"


def _level(engines: dict) -> str:
    """How an engine's ms/token was summarized from its blocks (files written before the median: the mean)."""
    return "median of each engine's blocks" if engines.get("level") else "mean of each engine's blocks"


def _floor_top(floor: dict) -> float:
    """The noise floor's KL at the top of its interval (its point value where it has none)."""
    return (floor.get("kl_ci") or [None, floor.get("kl", 0.0)])[1]


def _residual_outside_classes(results: dict, variants: list[dict], build: dict | None) -> str | None:
    """A row that restores every quantized class whole yet stays measurably away from the base: the build changed
    tensors it did not quantize (a quantizer that rounds norms, say), and that error belongs to no class."""
    from .verdicts import pooled_kl

    classes = set(results.get("quantized_classes") or [])
    nf = results.get("noise_floor") or {}
    for v in variants:
        restored = v.get("restored")
        if not classes or not isinstance(restored, list) or any("@" in r for r in restored) or not classes <= set(restored):
            continue
        metrics = v.get("metrics") or {}
        above = [c for c, m in metrics.items() if m.get("kl_ci") and m["kl_ci"][0] > _floor_top(nf.get(c) or {})]
        # Most corpora, not one: a single corpus just over a noisy floor is not the build's own difference.
        if 2 * len(above) <= len(metrics):
            return None
        rel = ((v.get("vs_build") or {}).get("kl") or {}).get("pooled") or {}
        share = ""
        if build and rel.get("rel") is not None and rel.get("rel_ci"):
            lo, hi = (100 * (1 + x) for x in rel["rel_ci"])
            share = f" ({100 * (1 + rel['rel']):.1f} % of the build's [{lo:.1f}, {hi:.1f}])"
        return (
            f"{v['name']} restores every quantized class and still leaves KL {pooled_kl(v):.2g}{share}, above the noise "
            f"floor on {len(above)} of {len(metrics)} corpora: the build differs from the base outside its "
            "quantized modules, so that part of the error belongs to no class; `splicer inspect BUILD --base BASE` "
            "lists the tensors and `splicer splice --unquantized-from-base` gives them the base's values."
        )
    return None


def _other_dtypes(results: dict, variants: list[dict]) -> str | None:
    """The sentence for rows whose engine computed in another dtype than the base pass's engine (vLLM's dtype="auto"
    follows each checkpoint's config), or None: each engine records its dtype (backends/vllm_child.py)."""
    base = (((results.get("base_pass") or {}).get("engine")) or {}).get("dtype")
    rows = {v["name"]: (v.get("engine") or {}).get("dtype") for v in variants}
    return fmt_other_dtypes(
        "the base pass's engine", base, rows, "scores", f"--engine-arg dtype={base} puts every engine in one dtype"
    )


def findings(results: dict) -> list[str]:
    """One sentence per finding, in the table's row order."""
    from .verdicts import engine_means_text, lanes_word, noise_text, per_gpu_engines_text, pooled_kl

    out = []
    variants = [v for v in results.get("variants", []) if v.get("status") == "ok"]
    build = next((v for v in variants if v["name"] == "build"), None)
    engines = (results.get("verdicts") or {}).get("build_engines")
    if build:
        kl = pooled_kl(build)
        out.append(
            f"build: KL {kl:.4f} nats per position pooled over corpora (position-weighted; a chat prefix shared "
            "with an earlier conversation counted once)."
        )
        if (results.get("verdicts") or {}).get("method"):
            out.append(f"Score differences against the build: {noise_text(results)}.")
    if dtypes := _other_dtypes(results, variants):
        out.append(dtypes)
    if engines and engines.get("by_gpu"):
        out.append(
            f"The build on {engines['engines']} engines ({_level(engines)}), each row compared with "
            f"the build on its own {lanes_word(results)}: {per_gpu_engines_text(engines)}."
        )
    elif engines:
        ms = engine_means_text(engines)
        out.append(
            f"The build on {engines['engines']} engines: {ms} ms/token ({_level(engines)}); largest "
            f"difference between two of them {100 * engines['spread']:.2f} %."
        )
    for v in variants:
        if v["name"] == "build" or v.get("repeat_of"):
            continue
        vs = v.get("vs_build") or {}
        clauses = [
            c
            for c in (
                _score_clause((vs.get("kl") or {}).get("pooled"), "ΔKL", 100, " % of the build's KL", rel=True),
                _score_clause((vs.get("top1") or {}).get("pooled"), "Δtop-1", 100, " pp", rel=False),
                _score_clause((vs.get("dnll") or {}).get("pooled"), "ΔdNLL", 1, " nats/token", rel=False, digits=4),
                _decode_clause(v.get("decode_vs_build")),
            )
            if c
        ]
        if build and v.get("size_bytes") is not None and build.get("size_bytes") is not None:
            clauses.append(f"size {(v['size_bytes'] - build['size_bytes']) / 1e9:+.3f} GB")
        if v["restored"] == "checkpoint":
            what = f"another checkpoint, {v['checkpoint']['source']} ({v['checkpoint']['quant_method']})"
        else:
            what = "the base itself" if v["restored"] == "base" else "restores " + (", ".join(v["restored"]) or "nothing")
        if clauses:
            out.append(f"{v['name']} ({what}) against the build: " + "; ".join(clauses) + ".")
    for v in variants:
        vs = v.get("vs_splice")
        if not vs:
            continue
        classes = ", ".join(vs["classes"])
        note = f"; note: {vs['note']}" if vs.get("note") else ""
        if not vs.get("splice") or not vs.get("kl"):
            out.append(
                f"{v['name']} (the build re-made with {classes} in BF16): not compared with a splice ({vs.get('why')}){note}."
            )
            continue
        kl = vs["kl"].get("pooled") or {}
        clause = _score_clause(kl, "ΔKL", 100, " % of the re-made build's KL", rel=True)
        direction = ""
        if excludes_zero(kl.get("rel_ci")):
            direction = f": the splice leaves {'more' if kl['rel'] > 0 else 'less'} KL than re-quantizing without them"
        out.append(
            f"Splice against re-quantize ({classes} in BF16): row {vs['splice']} (the splice) minus row {v['name']} "
            f"(the build re-made by its quantizer), {clause}{direction}{note}."
        )
    residual = _residual_outside_classes(results, variants, build)
    if residual:
        out.append(residual)
    for v in results.get("variants", []):
        if v.get("status") != "ok":
            out.append(f"{v['name']}: failed ({(v.get('error') or '').splitlines()[0][:120]}).")
    for s in results.get("skipped") or []:
        out.append(f"{s['name']}: skipped ({s['reason']}).")
    nf = results.get("noise_floor") or {}
    if nf:
        out.append(
            "Noise floor (the base scored again as the rows are): "
            + "; ".join(f"{c} KL {m['kl']:.4f}, top-1 {100 * m['top1']:.1f} %" for c, m in nf.items())
            + "."
        )
    runs = results.get("runs") or []
    if runs and runs[-1].get("elapsed_s") is not None:
        last = runs[-1]
        out.append(
            f"This run: {len(last.get('rows_run', []))} rows in {last['elapsed_s']:.0f} s wall"
            + (" (finished)." if last.get("finished") else " (not finished).")
        )
    return out


def render_report(results: dict, out: Path | None = None) -> str:
    """The report.md of a results folder; with out, the sentences of the later stages' files in out too (budget.json's
    predictions against the re-made builds, tasks.json, speculative.json, mtp-teacher-forced.json)."""
    from . import budget, speculative, task_scores, teacher_forced
    from .table import caption

    lines = findings(results)
    if out is not None:
        lines += budget.requantized_sentences(out, results)
    tasks = task_scores.load(out) if out is not None else None
    if tasks:
        lines += task_scores.sentences(tasks)
    spec = speculative.load(out) if out is not None else None
    if spec:
        lines += speculative.sentences(spec, [v["name"] for v in results.get("variants", [])])
    forced = teacher_forced.load(out) if out is not None else None
    if forced:
        lines += teacher_forced.sentences(forced, [v["name"] for v in results.get("variants", [])])
    return caption(results) + "\n\n" + "\n".join(f"- {s}" for s in lines) + "\n"


def report(out_dir: Path) -> str:
    return render_report(results_record.load(out_dir), Path(out_dir))
