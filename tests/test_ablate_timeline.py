"""scripts/ablate_timeline.py: the derived timings in results/h200-fulldims/run-*/timeline.json come from it."""

from __future__ import annotations

from .scripts_import import load_script


def _module():
    return load_script("scripts/ablate_timeline.py")


def _timeline():
    return _module().timeline


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
splicer: interrupted; rerun the same command to resume (finished work is kept)
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
    assert first["rows"] == [{"name": "build", "engine_start_s": 40.0, "wall_s": 50, "end_s": 201}]  # gdn was interrupted
    assert first["wall_s"] == 220
    assert resumed["before_first_row_s"] == 2 and resumed["rows"][0]["wall_s"] == 60
    assert t["rows_finished"] == 2 and t["mean_row_wall_s"] == 55


SPREAD_LOG = """\
2026-12-01T06:00:00Z ablate all of plan p: B against R into D
2026-12-01T06:00:00Z base pass: started
2026-12-01T06:00:01Z gdn: splice gdn: started
2026-12-01T06:00:05Z gdn: splice gdn: done in 4.0 s
2026-12-01T06:05:00Z base pass: done in 300.0 s
2026-12-01T06:05:01Z gpu 1: compiling ahead: waiting for the last engines to compile: started
2026-12-01T06:05:02Z gpu 1: compiling ahead: waiting for the last engines to compile: done in 1.0 s
2026-12-01T06:05:02Z build-gpu1: engine start: started
2026-12-01T06:05:30Z gpu 0: compiling ahead: waiting for the last engines to compile: done in 29.0 s
2026-12-01T06:05:30Z build: engine start: started
2026-12-01T06:06:02Z build-gpu1: engine start: done in 60.0 s
2026-12-01T06:06:12Z build-gpu1: ok, 1 of 4 rows of this run
2026-12-01T06:06:13Z gdn: engine start: started
2026-12-01T06:06:30Z build: engine start: done in 60.0 s
2026-12-01T06:06:40Z build: ok, 2 of 4 rows of this run
2026-12-01T06:06:41Z build-end-gpu0: engine start: started
splicer: interrupted; rerun the same command to resume (finished work is kept)
2026-12-01T06:10:00Z ablate all of plan p: B against R into D
2026-12-01T06:10:00Z base pass: cached
2026-12-01T06:10:01Z gdn: engine start: started
2026-12-01T06:11:11Z gdn: ok, 1 of 2 rows of this run
"""


def test_rows_spread_over_gpus_interleave_and_the_estimate_gives_later_rows_to_the_gpu_free_first():
    m = _module()
    t = m.timeline(SPREAD_LOG.splitlines())
    first, resumed = t["invocations"]
    # Interleaved rows: each from its own first line to its own "ok", the GPUs' own lines and splices ahead ignored.
    assert first["before_first_row_s"] == 302
    assert [(r["name"], r["wall_s"], r["end_s"]) for r in first["rows"]] == [("build-gpu1", 70, 372), ("build", 70, 400)]
    assert [(r["name"], r["wall_s"]) for r in resumed["rows"]] == [("gdn", 70)]
    est = m.spread_estimate(t, 4, {"build": "0", "build-gpu1": "1", "gdn": "1", "build-end-gpu0": "0"})
    # gdn (70 s) goes to GPU 1 (free at 372 s) -> 442; one row not finished (mean 70 s) to GPU 0 (free at 400) -> 470.
    assert est["gpu_free_after_first_invocation_s"] == {"0": 400, "1": 372} and est["value"] == 470
    assert est["value_at_first_invocation_mean"] == 470


def test_a_gpus_last_build_engine_is_estimated_last_on_its_own_gpu():
    m = _module()
    log = SPREAD_LOG.replace("06:10:01Z gdn:", "06:10:01Z build-end-gpu1:").replace("06:11:11Z gdn:", "06:11:11Z build-end-gpu1:")
    t = m.timeline(log.splitlines())
    est = m.spread_estimate(t, 4, {"build": "0", "build-gpu1": "1", "build-end-gpu1": "1"})
    # The unfinished row (70 s) goes to GPU 1, free first at 372 s -> 442; then build-end-gpu1 (70 s) last on GPU 1 -> 512,
    # not on GPU 0 (free at 400 s), which the free-first rule alone would pick.
    assert est["value"] == 512


def test_a_first_invocation_stopped_before_any_row_gives_a_lower_bound(tmp_path, monkeypatch, capsys):
    """Stopped while compiling ahead: its wall and the next invocation's wait before its first row are the least the
    time before the first row can be, and the estimate says it is a lower bound."""
    import sys

    log = "\n".join(
        [
            "2026-12-01T06:00:00Z ablate all of plan p: B against R into D",
            "2026-12-01T06:00:00Z base pass: started",
            "2026-12-01T06:03:00Z base pass: done in 180.0 s",
            "2026-12-01T06:03:01Z compiling ahead: waiting for the last engines to compile: started",
            "2026-12-01T06:05:00Z compiling ahead: waiting for the last engines to compile: stopped after 119.0 s",
            "2026-12-01T06:10:00Z ablate all of plan p: B against R into D",
            "2026-12-01T06:10:00Z base pass: cached",
            "2026-12-01T06:10:02Z build: engine start: started",
            "2026-12-01T06:10:32Z build: ok, 1 of 2 rows of this run",
            "2026-12-01T06:10:33Z gdn: engine start: started",
            "2026-12-01T06:11:13Z gdn: ok, 2 of 2 rows of this run",
        ]
    )
    (tmp_path / "ablate.log").write_text(log + "\n")
    monkeypatch.setattr(sys, "argv", ["ablate_timeline.py", str(tmp_path / "ablate.log"), "3"])
    _module().main()
    import json

    est = json.loads(capsys.readouterr().out)["estimate_one_invocation_s"]
    assert est["before_first_row_s"] is None and est["first_invocation_stopped_before_a_row_after_s"] == 300
    assert est["before_first_row_at_least_s"] == 302 and est["value_at_least"] == 302 + 3 * 35.0


def test_a_first_invocation_stopped_inside_its_base_pass_is_not_counted_twice():
    """The next invocation redid the base pass: the bound is the longer of the two waits, not their sum."""
    m = _module()
    log = [
        "2026-12-01T06:00:00Z ablate all of plan p: B against R into D",
        "2026-12-01T06:00:00Z base pass: started",
        "2026-12-01T06:02:40Z base pass: stopped after 160.0 s (KeyboardInterrupt: )",
        "2026-12-01T06:10:00Z ablate all of plan p: B against R into D",
        "2026-12-01T06:10:00Z base pass: started",
        "2026-12-01T06:13:20Z base pass: done in 200.0 s",
        "2026-12-01T06:13:22Z build: engine start: started",
        "2026-12-01T06:13:52Z build: ok, 1 of 1 rows of this run",
    ]
    t = m.timeline(log)
    assert not t["invocations"][0]["base_pass_done"] and t["invocations"][1]["base_pass_done"]
    assert m.before_first_row_bound(t["invocations"]) == 202


def test_a_spread_run_whose_first_invocation_finished_no_row_says_so(tmp_path, monkeypatch, capsys):
    import json
    import sys

    log = [
        "2026-12-01T06:00:00Z ablate all of plan p: B against R into D",
        "2026-12-01T06:00:00Z base pass: started",
        "2026-12-01T06:02:00Z base pass: stopped after 120.0 s (KeyboardInterrupt: )",
        "2026-12-01T06:10:00Z ablate all of plan p: B against R into D",
        "2026-12-01T06:10:02Z build: engine start: started",
        "2026-12-01T06:10:32Z build: ok, 1 of 1 rows of this run",
    ]
    (tmp_path / "ablate.log").write_text("\n".join(log) + "\n")
    (tmp_path / "results.json").write_text(json.dumps({"variants": [{"name": "build", "gpu": 0, "status": "ok"}]}))
    monkeypatch.setattr(sys, "argv", ["t", str(tmp_path / "ablate.log"), "4", str(tmp_path / "results.json")])
    _module().main()
    assert "finished no row" in json.loads(capsys.readouterr().out)["estimate_one_invocation_s"]["none"]
