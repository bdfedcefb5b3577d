"""What a serial `splicer ablate` plan cannot go below on the machine that ran it, and where its rows' minutes go.

    python scripts/plan_floor.py ABLATE_LOG RESULTS_JSON PLAN_ROWS > floor.json

From the stage log (all invocations, as scripts/ablate_timeline.py reads it) and results.json:
- the base pass's wall from cold (ablate_timeline's base_pass_s: the first invocation that scored it, not read it
  from its cache);
- the rows whose engine started in a worker that was already running (worker_start_s under a second: vLLM imported
  and the expert hash memoized, as every row after the first of one invocation), each row's cycle (from the previous
  row's "ok" line to its own) split into the seconds before its first line (the next folder prepared), its engine
  start (with vLLM's own phases of it), scoring, timing and the seconds after timing to its "ok" line (the engine's
  release, results.json and the tables written);
- floor_s: the base pass plus PLAN_ROWS rows at the mean of those rows' cycles, i.e. the plan if every variant's
  compile were hidden behind the base pass and every row ran in a warm worker;
- estimate_s: the same rows after the time the run actually spent before its first row (ablate_timeline's
  before_first_row_s, or its lower bound when the first invocation was stopped before a row:
  before_first_row_is_a_lower_bound), with the rows at their measured mean.
Arithmetic on one run's figures, named as such; nothing here is a measurement of its own.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ablate_timeline import before_first_row_bound, timeline  # noqa: E402

INIT_PHASES = ("compile_s", "profiling_warmup_s", "graph_capture_s")


def _engine_phases(breakdown: dict) -> dict:
    """The engine start's phases as vLLM logged them, and the rest of its init (init_engine_s less the three phases
    inside it: the KV cache's allocation, the CUDA-graph memory estimate, warm-up kernels)."""
    if "init_engine_s" not in breakdown:
        return {}
    phases = {k: breakdown[k] for k in ("model_load_s", "init_engine_s", *INIT_PHASES) if k in breakdown}
    phases["init_rest_s"] = round(breakdown["init_engine_s"] - sum(breakdown.get(k, 0.0) for k in INIT_PHASES), 2)
    return {"engine": phases}


def floor(log_lines: list[str], results: dict, plan_rows: int) -> dict:
    t = timeline(log_lines)
    base_s = next((i["base_pass_s"] for i in t["invocations"] if i["base_pass_s"] is not None), None)
    if base_s is None:
        raise SystemExit("no base pass scored in this log (only cached or stopped ones): nothing to take its time from")
    walls = {r["name"]: r["wall_s"] for inv in t["invocations"] for r in inv["rows"]}
    # A row's cycle: from the previous row's "ok" line to its own (the first row of an invocation: its own lines),
    # so that the seconds between one row's end and the next row's first line are counted too.
    cycles = {}
    for inv in t["invocations"]:
        prev = None
        for r in inv["rows"]:
            cycles[r["name"]] = r["end_s"] - prev if prev is not None else r["wall_s"]
            prev = r["end_s"]
    first = t["invocations"][0]
    before = first["before_first_row_s"]
    if before is None:  # stopped before its first row: the least it can have been
        before = before_first_row_bound(t["invocations"])
    warm = []
    for v in results["variants"]:
        eng, el = v.get("engine") or {}, v.get("elapsed") or {}
        # a row whose worker start is not recorded is not known to have run in a running worker
        if v.get("status") != "ok" or v["name"] not in walls or eng.get("worker_start_s") is None or eng["worker_start_s"] >= 1:
            continue
        start = el.get("load_s", 0.0)
        scoring = sum(x for k, x in el.items() if k.startswith("score_") and k.endswith("_s"))
        timing = el.get("time_s", 0.0)
        warm.append(
            {
                "name": v["name"],
                "cycle_s": cycles[v["name"]],
                "wall_s": walls[v["name"]],
                "before_start_s": round(cycles[v["name"]] - walls[v["name"]], 2),
                "engine_start_s": round(start, 2),
                "scoring_s": round(scoring, 2),
                "timing_s": round(timing, 2),
                "after_timing_s": round(walls[v["name"]] - start - scoring - timing, 2),
                **_engine_phases(eng.get("startup_breakdown") or {}),
            }
        )
    if not warm:
        raise SystemExit("no row started in a running worker: nothing to take a row's wall from")
    mean = {
        k: round(statistics.mean(r[k] for r in warm), 2)
        for k in ("cycle_s", "wall_s", "before_start_s", "engine_start_s", "scoring_s", "timing_s", "after_timing_s")
    }
    return {
        "plan_rows": plan_rows,
        "base_pass_s": base_s,
        "before_first_row_s": before,
        "warm_rows": warm,
        "warm_row_mean": mean,
        "floor_s": round(base_s + plan_rows * mean["cycle_s"], 1),
        "estimate_s": round(before + plan_rows * mean["cycle_s"], 1),
        # the time before the first row is then a bound (before_first_row_bound); the rows are at their measured mean
        "before_first_row_is_a_lower_bound": first["before_first_row_s"] is None,
    }


def main() -> None:
    lines = open(sys.argv[1]).read().splitlines()
    results = json.loads(open(sys.argv[2]).read())
    json.dump(floor(lines, results, int(sys.argv[3])), sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
