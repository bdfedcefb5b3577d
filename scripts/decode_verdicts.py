"""Decode differences against the build recomputed from a run's committed per-block times with splicer's current
method (verdicts.decode_vs_build: each engine's level the median of its blocks), beside the figures the run stored in
results.json when it ran (an older splicer: the mean of each engine's blocks).

    python scripts/decode_verdicts.py RUN_DIR/results.json ...

A results.json keeps every engine's per-block ms/token (`timing.per_run_ms`), so its decode verdicts can be recomputed
whenever the method changes; its score verdicts need the per-position scores, which the older GPU runs did not keep.
"""

from __future__ import annotations

import sys
from pathlib import Path

from splicer.analysis.verdicts import build_engine_agreement, decode_vs_build
from splicer.io import results_record


def _pct(x: float) -> str:
    return f"{100 * x:+.2f}"


def lines(path: str) -> list[str]:
    results = results_record.read(Path(path).parent)
    out = [f"{path}"]
    engines = build_engine_agreement(results)
    if engines:
        out.append(f"  build engines (median of blocks): {', '.join(f'{m:.3f}' for m in engines['mean_ms'])} ms/token")
    for v in results.get("variants", []):
        if v.get("status") != "ok" or v.get("repeat_of") or v["name"] == "build":
            continue
        now, then = decode_vs_build(results, v["name"]), v.get("decode_vs_build") or {}
        if not now or now.get("rel") is None:
            continue
        lo, hi = now["rel_ci"]
        verdict = "resolved" if now["resolved"] else "not resolved"
        stored = ""
        if then.get("rel") is not None and then.get("rel_ci"):
            stored = f"; stored by the run (mean of blocks) {_pct(then['rel'])} % [{_pct(then['rel_ci'][0])}, {_pct(then['rel_ci'][1])}]"
        gpu = f", GPU {now['gpu']}" if "gpu" in now else ""
        out.append(
            f"  {v['name']}: median of blocks {_pct(now['rel'])} % [{_pct(lo)}, {_pct(hi)}] {verdict} "
            f"(df {now['df']}{gpu}; {now['variant_ms']:.3f} vs {now['reference_ms']:.3f} ms/token){stored}"
        )
    return out


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print("\n".join(lines(p)))
