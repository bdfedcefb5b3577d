"""What the stand-in plan would take from cold if every row's engine had copied its experts from --expert-cache, from a
run where some did: arithmetic, not a run.

    python scripts/estimate_cached_plan.py TIMELINE_JSON RESULTS_JSON > estimate-all-cached.json

TIMELINE_JSON: scripts/ablate_timeline.py's output with PLAN_ROWS; RESULTS_JSON: the run's results.json. The estimate is
the first invocation's time before its first row plus PLAN_ROWS times the mean row wall of the rows whose engine's
expert_cache record says "load".
"""

from __future__ import annotations

import json
import statistics
import sys


def main(timeline_path: str, results_path: str) -> dict:
    t = json.load(open(timeline_path))
    r = json.load(open(results_path))

    def record(v):
        engine = v.get("engine") or (v.get("timings") or {}).get("engine") or {}
        return engine.get("expert_cache") or {}

    loaded = {v["name"] for v in r["variants"] if record(v).get("do") == "load"}
    walls = [row["wall_s"] for inv in t["invocations"] for row in inv["rows"] if row["name"] in loaded]
    if not walls:
        raise SystemExit("no row of this run copied its experts from the cache: nothing to estimate from")
    est = t["estimate_one_invocation_s"]
    mean = statistics.mean(walls)
    return {
        "what": "arithmetic, not a run: the first invocation's time before its first row plus plan_rows times the mean "
        "row wall of the rows whose engines copied their experts from the cache",
        "command": "python scripts/estimate_cached_plan.py timeline.json call-6/results.json",
        "rows_with_cached_experts": sorted(loaded),
        "their_row_walls_s": walls,
        "mean_row_wall_s": mean,
        "plan_rows": est["plan_rows"],
        "before_first_row_s": est["before_first_row_s"],
        "value_s": est["before_first_row_s"] + est["plan_rows"] * mean,
    }


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(json.dumps(main(sys.argv[1], sys.argv[2]), indent=1))
