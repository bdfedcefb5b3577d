"""What a start cut would make of the stand-in plan's wall time, estimated from two committed measurements: the plan's
timeline (results/h200-fulldims/run-11/timeline.json: the time before the first row, each row's wall) and a start
profile that timed the cut against the auto start in one call (results/engine-starts/.../start-profile.json).

Every engine after the first saves auto's LLM() minus the cut's; the first engine, which saves what the cut reuses, pays
the saving start's extra time. This is arithmetic on two runs of different leases, not a measurement of the plan: the
plan itself, with the cut, is what answers it.

usage: python3 scripts/engine_start_estimate.py TIMELINE PROFILE CUT SAVE_START OUT.json
  e.g. CUT sharded_state_unprocessed with SAVE_START save-unprocessed, or expert_cache with expert_cache-prime
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    timeline_path, profile_path, cut, save_name, out = argv
    timeline = json.loads(Path(timeline_path).read_text())
    profile = json.loads(Path(profile_path).read_text())
    rows = {r["name"]: r for r in profile["summary"]["rows"]}
    auto, fast = rows["auto"], rows[cut]
    per_engine = auto["llm_init_s"] - fast["llm_init_s"]
    save_rec = next(s for s in profile["starts"] if s["name"] == save_name)
    # the saving start's own save: start_profile's sharded_state saves, or splicer's expert cache (its loader's record)
    saves = [v["save_s"] for v in (save_rec.get("saved") or {}).values() if "save_s" in v]
    saves += [save_rec["expert_cache"]["save_s"]] if "save_s" in (save_rec.get("expert_cache") or {}) else []
    if not saves:
        raise SystemExit(f"{save_name}: no save recorded in {profile_path}")
    save_s = saves[0]
    est = timeline["estimate_one_invocation_s"]
    n_rows = est["plan_rows"]
    before = est["value"]
    after = before - n_rows * per_engine + save_s
    result = {
        "timeline": timeline_path,
        "profile": profile_path,
        "cut": cut,
        "auto_llm_s": auto["llm_init_s"],
        "cut_llm_s": fast["llm_init_s"],
        "saved_per_engine_s": round(per_engine, 2),
        "save_s": save_s,
        "plan_rows": n_rows,
        "mean_row_wall_s": timeline["mean_row_wall_s"],
        "mean_row_wall_with_cut_s": round(timeline["mean_row_wall_s"] - per_engine, 1),
        "before_first_row_s": est["before_first_row_s"],
        "plan_estimate_s": before,
        "plan_estimate_with_cut_s": round(after, 1),
        "goal_s": 600,
    }
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
