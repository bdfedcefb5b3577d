"""Where the wall time of an `splicer ablate` run went, from its DIR/ablate.log (all invocations of one job).

    python scripts/ablate_timeline.py ABLATE_LOG [PLAN_ROWS] [RESULTS_JSON] > timeline.json

Per invocation: its start, the time before its first row (splices, the base pass, compiling ahead), and per row the
wall from the row's first line (its splice or engine start) to its "ok" line, with the engine start inside it (rows
of a run spread over GPUs interleave in the log: each row is followed by its own name). With PLAN_ROWS (the number of
engines the plan runs) it adds what one invocation from cold would take, an estimate named as one: serially, the
first invocation's time before its first row plus PLAN_ROWS times the mean row wall of all finished rows (a first
invocation stopped before any row gives a lower bound on its time before the first row instead, `value_at_least`:
see before_first_row_bound). With
RESULTS_JSON of a run spread over GPUs (rows record their "gpu"): each GPU's rows of the first invocation as they ran,
then every row finished later (and the mean row wall for each row not finished) given to the GPU free first, as the
run's shared row queue does, except each GPU's last engine of the build (build-end-gpuN), which runs last on its own
GPU; the estimate is when the last GPU is done.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from datetime import datetime
from pathlib import Path

from splicer.io import results_record

LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ) (.*)$")
END_ENGINE = re.compile(r".+-end-gpu(\S+)")  # a GPU's last engine of the build in a run spread over GPUs (spread.py)


def _t(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").timestamp()


def timeline(lines: list[str]) -> dict:
    invocations, cur, open_rows = [], None, {}
    for line in lines:
        m = LINE.match(line.strip())
        if not m:
            continue
        t, text = _t(m.group(1)), m.group(2)
        if text.startswith("ablate "):
            cur = {
                "started": m.group(1),
                "_t0": t,
                "before_first_row_s": None,
                "base_pass_done": False,
                "base_pass_s": None,
                "rows": [],
                "_last": t,
            }
            invocations.append(cur)
            open_rows = {}
            continue
        name, _, rest = text.partition(": ")
        if cur is None:
            continue
        cur["_last"] = t
        if name == "base pass" and rest == "cached":
            cur["_base_cached"] = True
        if name == "base pass" and rest.startswith("done in"):
            cur["base_pass_done"] = True  # finished, scored here or read from its cache
            if not cur.get("_base_cached"):  # the seconds of a base pass scored in this invocation
                cur["base_pass_s"] = float(rest.split("done in ")[1].split(" s")[0])
        if name in ("base pass", "compiling ahead"):
            open_rows = {}  # splices made ahead of the base pass belong to the time before the first row
            continue
        if re.fullmatch(r"gpu \S+", name):  # a GPU's own line (spread over GPUs: waiting for its compiles)
            continue
        row = open_rows.setdefault(name, {"name": name, "_t0": t, "engine_start_s": None, "wall_s": None})
        if rest.startswith("engine start: done in"):
            row["engine_start_s"] = float(rest.split("done in ")[1].split(" s")[0])
        if rest.startswith("ok"):
            row["wall_s"] = t - row["_t0"]
            row["end_s"] = t - cur["_t0"]  # from the invocation's start to the row's "ok" line
            if cur["before_first_row_s"] is None:
                cur["before_first_row_s"] = row["_t0"] - cur["_t0"]
            cur["rows"].append({k: v for k, v in row.items() if not k.startswith("_")})
            del open_rows[name]
    for inv in invocations:
        inv["wall_s"] = inv.pop("_last") - inv.pop("_t0")
        inv.pop("_base_cached", None)
    walls = [r["wall_s"] for inv in invocations for r in inv["rows"]]
    return {
        "invocations": invocations,
        "rows_finished": len(walls),
        "mean_row_wall_s": round(statistics.mean(walls), 1) if walls else None,
    }


def spread_estimate(data: dict, plan_rows: int, gpu_of: dict) -> dict:
    """One invocation from cold of a run spread over GPUs (see the module's docstring)."""
    first, *later = data["invocations"]
    gpus = sorted(set(gpu_of.values()), key=str)
    free = {g: first["before_first_row_s"] for g in gpus}
    for row in first["rows"]:
        free[gpu_of[row["name"]]] = max(free[gpu_of[row["name"]]], row["end_s"])
    after_first = {str(g): round(v, 1) for g, v in free.items()}

    def finish(walls: list[tuple[str | None, float]]) -> float:
        # A GPU's last engine of the build (build-end-gpuN) runs on that GPU after its other rows; every other row
        # goes to the GPU free first.
        lanes = dict(free)
        last = [(m.group(1), wall) for name, wall in walls if name and (m := END_ENGINE.fullmatch(name))]
        for name, wall in walls:
            if not (name and END_ENGINE.fullmatch(name)):
                g = min(lanes, key=lambda k: lanes[k])
                lanes[g] += wall
        for gpu, wall in last:
            key = next((g for g in lanes if str(g) == gpu), None)
            lanes[key if key is not None else min(lanes, key=lambda k: lanes[k])] += wall
        return round(max(lanes.values()), 1)

    missing = max(0, plan_rows - data["rows_finished"])
    rest = [(r["name"], r["wall_s"]) for inv in later for r in inv["rows"]]
    first_mean = statistics.mean(r["wall_s"] for r in first["rows"])
    return {
        "plan_rows": plan_rows,
        "gpus": len(gpus),
        "before_first_row_s": first["before_first_row_s"],
        "gpu_free_after_first_invocation_s": after_first,
        "value": finish(rest + [(None, data["mean_row_wall_s"])] * missing),
        # The later invocations' rows started in fresh processes, slower than the first invocation's: the same
        # estimate with every row after the first invocation at the first invocation's mean row wall.
        "first_invocation_mean_row_wall_s": round(first_mean, 1),
        "value_at_first_invocation_mean": finish([(n, first_mean) for n, _ in rest] + [(None, first_mean)] * missing),
    }


def before_first_row_bound(invocations: list[dict]) -> float:
    """The least time one invocation would spend before its first row, when the first was stopped before any: its
    wall plus the next one's wait before its first row if the first finished its base pass (the next then only waited
    for what was left), else the longer of the two (the next redid the base pass)."""
    first = invocations[0]
    later = next((i["before_first_row_s"] for i in invocations[1:] if i["before_first_row_s"] is not None), 0)
    if first["base_pass_done"]:
        return first["wall_s"] + later
    return max(first["wall_s"], later)


def main() -> None:
    data = timeline(open(sys.argv[1]).read().splitlines())
    if len(sys.argv) > 2 and data["mean_row_wall_s"] is not None:
        n = int(sys.argv[2])
        first = data["invocations"][0]["before_first_row_s"]
        gpu_of = {}
        if len(sys.argv) > 3:
            gpu_of = {
                v["name"]: v["gpu"] for v in results_record.read(Path(sys.argv[3]).parent)["variants"] if v.get("gpu") is not None
            }
        if first is None and gpu_of:
            data["estimate_one_invocation_s"] = {
                "plan_rows": n,
                "none": "the first invocation finished no row, so no GPU's time before its first row is known",
            }
        elif gpu_of:
            data["estimate_one_invocation_s"] = spread_estimate(data, n, gpu_of)
        elif first is None:  # stopped before it finished a row (e.g. while compiling ahead)
            bound = before_first_row_bound(data["invocations"])
            data["estimate_one_invocation_s"] = {
                "plan_rows": n,
                "before_first_row_s": None,
                "first_invocation_stopped_before_a_row_after_s": data["invocations"][0]["wall_s"],
                "before_first_row_at_least_s": bound,
                # at the finished rows' mean: resumed rows that compiled their own engines would raise it
                "value_at_least": round(bound + n * data["mean_row_wall_s"], 1),
            }
        else:
            data["estimate_one_invocation_s"] = {
                "plan_rows": n,
                "before_first_row_s": first,
                "value": round(first + n * data["mean_row_wall_s"], 1),
            }
    json.dump(data, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
