"""Where a run's wall time went, by stage, from its results.json: written by ablate, printed by the table."""

from __future__ import annotations


def time_breakdown(results: dict) -> dict:
    """Seconds spent per stage over the rows run (a resumed run counts the rows it kept from earlier runs too).

    "waiting for engines" is what the run waited for engine starts; compile and weight loading are summed over the
    engines (the base's included) and can exceed it when starts overlap each other or scoring (--overlap-starts).
    """
    parts = {
        "base pass": 0.0,
        "splice": 0.0,
        "waiting for engines": 0.0,
        "compile, summed over engines": 0.0,
        "weight loading, summed over engines": 0.0,
        "scoring": 0.0,
        "timing": 0.0,
    }
    base = (results.get("base_pass") or {}).get("timings") or {}
    parts["base pass"] = sum(v for k, v in base.items() if k.endswith("_s"))
    engines = [(results.get("base_pass") or {}).get("engine")]
    for v in results.get("variants", []):
        e = v.get("elapsed") or {}
        parts["splice"] += e.get("splice_s", 0.0)
        parts["waiting for engines"] += e.get("load_s", 0.0)
        parts["scoring"] += sum(x for k, x in e.items() if k.startswith("score_"))
        parts["timing"] += e.get("time_s", 0.0)
        engines.append(v.get("engine"))
    for engine in engines:
        sb = (engine or {}).get("startup_breakdown") or {}
        parts["compile, summed over engines"] += sb.get("compile_s", 0.0)
        parts["weight loading, summed over engines"] += sb.get("model_load_s", sb.get("weights_load_s", 0.0))
    if any(v.get("gpu") is not None for v in results.get("variants", [])):
        # Rows spread over GPUs ran side by side: their stages add up to more than the wall time.
        from .verdicts import lanes_word

        over = "Ray lanes" if lanes_word(results) == "Ray lane" else "GPUs"
        parts = {
            (f"{k}, summed over {over}" if k in ("waiting for engines", "scoring", "timing") else k): x for k, x in parts.items()
        }
    if results.get("elapsed_s") is not None:
        parts["this run, wall"] = results["elapsed_s"]
    runs = results.get("runs") or []
    if len(runs) > 1 and all(r.get("elapsed_s") is not None for r in runs):
        # An interrupted run records its time up to its last finished row: work cut off after that is not counted.
        parts[f"all {len(runs)} runs of this job, wall"] = sum(r["elapsed_s"] for r in runs)
    return {k: round(x, 1) for k, x in parts.items() if x}
