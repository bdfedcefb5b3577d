"""Where the wall time of an `splicer ablate` run went, from its DIR/ablate.log (all invocations of one job).

    python scripts/ablate_timeline.py ABLATE_LOG [PLAN_ROWS] > timeline.json

Per invocation: its start, the time before its first row (splices, the base pass, compiling ahead), and per row the
wall from the row's first line (its splice or engine start) to its "ok" line, with the engine start inside it. With
PLAN_ROWS (the plan's row count) it adds what one invocation from cold would take: the first invocation's time before
its first row plus PLAN_ROWS times the mean row wall of all finished rows (an estimate, named as one).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from datetime import datetime

LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ) (.*)$")


def _t(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").timestamp()


def timeline(lines: list[str]) -> dict:
    invocations, cur, row = [], None, None
    for line in lines:
        m = LINE.match(line.strip())
        if not m:
            continue
        t, text = _t(m.group(1)), m.group(2)
        if text.startswith("ablate "):
            cur = {"started": m.group(1), "_t0": t, "before_first_row_s": None, "rows": [], "_last": t}
            invocations.append(cur)
            row = None
            continue
        name, _, rest = text.partition(": ")
        if cur is None:
            continue
        cur["_last"] = t
        if name in ("base pass", "compiling ahead"):
            row = None  # splices made ahead of the base pass belong to the time before the first row
            continue
        if row is None or row["name"] != name:
            row = {"name": name, "_t0": t, "engine_start_s": None, "wall_s": None}
        if rest.startswith("engine start: done in"):
            row["engine_start_s"] = float(rest.split("done in ")[1].split(" s")[0])
        if rest.startswith("ok"):
            row["wall_s"] = t - row["_t0"]
            if cur["before_first_row_s"] is None:
                cur["before_first_row_s"] = row["_t0"] - cur["_t0"]
            cur["rows"].append({k: v for k, v in row.items() if not k.startswith("_")})
            row = None
    for inv in invocations:
        inv["wall_s"] = inv.pop("_last") - inv.pop("_t0")
    walls = [r["wall_s"] for inv in invocations for r in inv["rows"]]
    return {"invocations": invocations, "rows_finished": len(walls),
            "mean_row_wall_s": round(statistics.mean(walls), 1) if walls else None}


def main() -> None:
    data = timeline(open(sys.argv[1]).read().splitlines())
    if len(sys.argv) > 2 and data["mean_row_wall_s"] is not None:
        n = int(sys.argv[2])
        first = data["invocations"][0]["before_first_row_s"]
        data["estimate_one_invocation_s"] = {"plan_rows": n, "before_first_row_s": first,
                                             "value": round(first + n * data["mean_row_wall_s"], 1)}
    json.dump(data, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
