"""scripts/plan_floor.py: results/engine-starts/try-5/floor.json comes from it."""

from __future__ import annotations

import pytest

from .scripts_import import load_script

LOG = """\
2026-12-01T06:00:00Z ablate all of plan p: B against R into D
2026-12-01T06:00:00Z base pass: started
2026-12-01T06:01:40Z base pass: done in 100.0 s
2026-12-01T06:01:41Z compiling ahead: waiting for the last engines to compile: started
2026-12-01T06:03:00Z compiling ahead: waiting for the last engines to compile: stopped after 79.0 s
2026-12-01T06:10:00Z ablate all of plan p: B against R into D
2026-12-01T06:10:00Z base pass: cached
2026-12-01T06:10:02Z build: engine start: started
2026-12-01T06:11:02Z build: ok, 1 of 3 rows of this run
2026-12-01T06:11:04Z gdn: engine start: started
2026-12-01T06:11:34Z gdn: ok, 2 of 3 rows of this run
2026-12-01T06:11:36Z lm_head: engine start: started
2026-12-01T06:12:16Z lm_head: ok, 3 of 3 rows of this run
"""


def _row(name, worker_start_s, load_s):
    return {
        "name": name,
        "status": "ok",
        "engine": {
            "worker_start_s": worker_start_s,
            "startup_breakdown": {
                "model_load_s": 6.0,
                "init_engine_s": 15.0,
                "compile_s": 3.0,
                "profiling_warmup_s": 2.0,
                "graph_capture_s": 4.0,
            },
        },
        "elapsed": {"load_s": load_s, "score_random_s": 3.0, "score_chat_s": 1.0, "time_s": 5.0, "positions_per_s_random": 9.0},
    }


def test_the_floor_takes_rows_of_a_running_worker_and_the_base_pass_from_cold():
    f = load_script("scripts/plan_floor.py").floor
    results = {"variants": [_row("build", 25.0, 50.0), _row("gdn", 0.0, 20.0), _row("lm_head", 0.0, 28.0)]}
    out = f(LOG.splitlines(), results, 8)
    # build's worker was started for it (vLLM imported there): not a row of a running worker
    assert [r["name"] for r in out["warm_rows"]] == ["gdn", "lm_head"]
    gdn = out["warm_rows"][0]
    assert gdn.pop("engine")["init_rest_s"] == 15.0 - 3.0 - 2.0 - 4.0  # init less compile, profiling, capture
    # 2 s from build's "ok" to gdn's first line belong to gdn's cycle
    assert gdn == {
        "name": "gdn",
        "cycle_s": 32,
        "wall_s": 30,
        "before_start_s": 2,
        "engine_start_s": 20.0,
        "scoring_s": 4.0,
        "timing_s": 5.0,
        "after_timing_s": 1.0,
    }
    assert out["warm_row_mean"]["cycle_s"] == 37 and out["base_pass_s"] == 100.0
    assert out["floor_s"] == 100 + 8 * 37
    # the first invocation stopped before a row: 180 s, plus the second's 2 s before its first row; a lower bound
    assert out["before_first_row_s"] == 182 and out["estimate_s"] == 182 + 8 * 37 and out["before_first_row_is_a_lower_bound"]


def test_a_log_without_a_base_pass_from_cold_is_refused():
    f = load_script("scripts/plan_floor.py").floor
    with pytest.raises(SystemExit, match="base pass"):
        f(LOG.replace("base pass: done in 100.0 s", "base pass: cached").splitlines(), {"variants": []}, 8)
    # a cached base pass logs "done in 0.0 s" too: that is not its time from cold
    cached_first = LOG.replace(
        "2026-12-01T06:01:40Z base pass: done in 100.0 s",
        "2026-12-01T06:00:00Z base pass: cached\n2026-12-01T06:00:00Z base pass: done in 0.0 s",
    )
    with pytest.raises(SystemExit, match="base pass"):
        f(cached_first.splitlines(), {"variants": []}, 8)
