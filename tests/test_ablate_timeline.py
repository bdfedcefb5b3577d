"""scripts/ablate_timeline.py: the derived timings in results/h200-fulldims/run-*/timeline.json come from it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "ablate_timeline.py"


def _timeline():
    spec = importlib.util.spec_from_file_location("ablate_timeline", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.timeline


LOG = """\
2026-12-01T06:00:00Z ablate all of plan p: B against R into D
2026-12-01T06:00:00Z gdn: splice gdn: started
2026-12-01T06:00:04Z gdn: splice gdn: done in 4.0 s
2026-12-01T06:00:04Z base pass: started
2026-12-01T06:02:00Z base pass: done in 116.0 s
2026-12-01T06:02:01Z compiling ahead: waiting for the last engines to compile: started
2026-12-01T06:02:30Z compiling ahead: waiting for the last engines to compile: done in 29.0 s
2026-12-01T06:02:31Z build: engine start: started
2026-12-01T06:03:11Z build: engine start: done in 40.0 s
2026-12-01T06:03:21Z build: ok, 1 of 2 rows of this run
2026-12-01T06:03:22Z gdn: engine start: started
2026-12-01T06:03:40Z gdn: engine start: stopped after 18.0 s (KeyboardInterrupt: )
splicer: interrupted; rerun the same command to start again
2026-12-01T06:10:00Z ablate all of plan p: B against R into D
2026-12-01T06:10:00Z base pass: cached
2026-12-01T06:10:02Z gdn: engine start: started
2026-12-01T06:10:52Z gdn: engine start: done in 50.0 s
2026-12-01T06:11:02Z gdn: ok, 1 of 1 rows of this run
"""


def test_rows_are_timed_from_their_first_line_and_splices_made_ahead_count_before_the_first_row():
    t = _timeline()(LOG.splitlines())
    first, resumed = t["invocations"]
    assert first["before_first_row_s"] == 151  # splice ahead, base pass and compiling: 06:00:00 -> 06:02:31
    assert first["rows"] == [{"name": "build", "engine_start_s": 40.0, "wall_s": 50}]  # gdn was interrupted
    assert first["wall_s"] == 220
    assert resumed["before_first_row_s"] == 2 and resumed["rows"][0]["wall_s"] == 60
    assert t["rows_finished"] == 2 and t["mean_row_wall_s"] == 55
