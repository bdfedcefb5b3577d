"""The vLLM backend's engines compiled ahead (--precompile) and rows spread over GPUs (--gpus): compiling lanes with
dummy weights that end before any timing, a variant that cannot compile ahead, closing while lanes compile, and an
ablate over two GPUs that times the build on each.

tests/fake_vllm is NOT vLLM: it answers vLLM's calls with the torch reference, so these tests check splicer's own
scheduling of engines (worker processes, sleep and wake, compiling lanes, GPUs), not vLLM's. Split from
test_vllm_backend_protocol.py, whose stand-in engine and fixture they share.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from splicer.errors import SplicerError

from .test_vllm_backend_protocol import cuda_not_required, use_fake_vllm


@pytest.fixture
def fake_vllm(monkeypatch):
    return use_fake_vllm(monkeypatch)


def test_precompile_builds_engines_ahead_with_dummy_weights_and_ends_before_any_timing(pairs, fake_vllm, tmp_path, monkeypatch):
    """--precompile: lanes build each queued variant once (dummy weights, fixed KV cache) beside the serving engine;
    their processes are gone before a row is timed, and the row's own engine finds its graphs compiled."""
    for var in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    # Multithreaded weight loading for the rows: the lanes' dummy loader refuses any loader config, so they drop it.
    user_args = {"gpu_memory_utilization": 0.5, "model_loader_extra_config": {"enable_multithread_load": True}}
    b = fake_vllm.VllmBackend(
        log_dir=tmp_path / "logs",
        require_cuda=False,
        precompile=2,
        cache_dir=tmp_path / "c",
        engine_args=user_args,
        engine_env={"FAKE_VLLM_ECHO": "from --engine-env"},
    )
    assert b.precompile_slots == 2 and not b.sleep_between
    assert b.describe()["engine_env"] == {"FAKE_VLLM_ECHO": "from --engine-env"}
    p = pairs["fused"]
    seqs = [list(range(20, 60))]
    assert b.precompile(p["lowlatency"]) and b.precompile(pairs["per_expert"]["lowlatency"])
    assert b.precompile(p["lowlatency"])  # queued once
    b.load(p["base"])  # the base pass's engine, beside the lanes: a fixed KV cache, and never timed
    assert b.load_info()["engine_args"]["kv_cache_memory_bytes"] == 12 << 30
    assert len(list(b.score(seqs, 20, batch_size=1))) == 1
    with pytest.raises(RuntimeError, match="finish_precompile"):
        b.time_decode(seqs[0], 2, 0, 1)
    b.unload()
    records = b.finish_precompile()
    assert sorted(Path(r["folder"]) for r in records) == sorted([p["lowlatency"], pairs["per_expert"]["lowlatency"]])
    assert all(r["error"] is None and r["compile_s"] > 0 for r in records)  # each compiled once, in a lane
    assert all(w.proc is None for w in b._lanes)  # the lanes' processes ended: one engine on the GPU from here on
    b.load(p["lowlatency"])
    info = b.load_info()
    assert info["startup_breakdown"]["compile_s"] == 0  # read from the cache the lane wrote
    assert info["engine_args"] == b.engine_args and "kv_cache_memory_bytes" not in info["engine_args"]
    assert b.time_decode(seqs[0], 2, 0, 1)["state"] == "fresh engine, the only one on the GPU"
    assert len(list(b.score(seqs, 20, batch_size=1))) == 1  # real weights: it serves (a dummy engine would refuse)
    b.load(p["experts-g32"])  # never compiled ahead: compiles at its own start
    assert b.load_info()["startup_breakdown"]["compile_s"] > 0
    b.close()
    # --engine-env reached all five engines: two compiled in the lanes, three served (base, lowlatency, experts-g32).
    echoed = [line for f in (tmp_path / "logs").glob("*.log") for line in f.read_text().splitlines() if "FAKE_VLLM_ECHO=" in line]
    assert len(echoed) == 5 and all(line.endswith("FAKE_VLLM_ECHO=from --engine-env") for line in echoed), echoed
    with pytest.raises(SplicerError, match="choose one"):
        fake_vllm.VllmBackend(log_dir=tmp_path, require_cuda=False, precompile=1, overlap_starts=1)


def test_a_variant_that_cannot_compile_ahead_is_recorded_and_compiles_at_its_turn(pairs, fake_vllm, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL_ON", "per_expert")
    b = fake_vllm.VllmBackend(log_dir=tmp_path, require_cuda=False, precompile=1)
    b.precompile(pairs["per_expert"]["lowlatency"])
    b.precompile(pairs["fused"]["lowlatency"])
    records = {Path(r["folder"]): r for r in b.finish_precompile()}
    assert "different quantization schemes" in records[pairs["per_expert"]["lowlatency"]]["error"]
    assert records[pairs["fused"]["lowlatency"]]["error"] is None  # the lane went on after the failure
    b.close()


def test_close_while_compiling_ahead_ends_the_lanes_without_waiting_for_their_engines(pairs, fake_vllm, tmp_path):
    import time

    b = fake_vllm.VllmBackend(log_dir=tmp_path, require_cuda=False, precompile=1)
    b.precompile(pairs["fused"]["lowlatency"])
    b.precompile(pairs["per_expert"]["lowlatency"])
    t0 = time.monotonic()
    b.close()  # as on Ctrl-C during the base pass
    assert time.monotonic() - t0 < 20 and not b._lane_threads
    assert all(w.proc is None or not w.proc.is_alive() for w in b._lanes)
    assert len(b.precompiled) <= 1  # the queued folder was dropped, not compiled


def test_ablate_with_precompile_scores_as_serial_and_times_every_row_alone(pairs, fake_vllm, tmp_path, monkeypatch):
    for var in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    from splicer.ablate import AblateSettings, run_ablate

    cuda_not_required(monkeypatch, fake_vllm)
    plan = tmp_path / "p.toml"
    plan.write_text(
        'name = "p"\n[[corpus]]\nname = "en"\nkind = "builtin"\ntext = "wiki-en"\nchunk_tokens = 48\nmax_chunks = 2\n'
        "[timing]\nprompt_tokens = 16\nnew_tokens = 3\nwarmup = 0\nruns = 1\n"
        '[[row]]\nname = "build"\nrestore = []\n[[row]]\nname = "gdn"\nrestore = ["gdn"]\n'
        '[[row]]\nname = "build-again"\nrestore = []\nrepeat = true\n'
    )
    p = pairs["fused"]
    runs = {}
    for n in (0, 2):
        runs[n] = run_ablate(
            "all",
            str(p["lowlatency"]),
            str(p["base"]),
            tmp_path / f"out-{n}",
            str(plan),
            AblateSettings(
                backend="vllm",
                progress=False,
                bootstrap=20,
                backend_options=fake_vllm.VllmOptions(precompile=n, engine_cache_dir=tmp_path / f"cache-{n}"),
            ),
        )
    serial, ahead = ({v["name"]: v for v in runs[n]["variants"]} for n in (0, 2))
    assert list(ahead) == ["build", "gdn", "build-again"]
    for name in serial:
        assert ahead[name]["status"] == "ok" and ahead[name]["metrics"]["en"]["kl"] == pytest.approx(
            serial[name]["metrics"]["en"]["kl"], abs=1e-9
        )
        assert ahead[name]["engine"]["startup_breakdown"]["compile_s"] == 0  # every row's graphs came from the lanes
        assert ahead[name]["timing"]["state"] == "fresh engine, the only one on the GPU"
    assert serial["gdn"]["engine"]["startup_breakdown"]["compile_s"] > 0
    compiled = runs[2]["runs"][-1]["precompiled"]
    assert sorted(Path(r["folder"]).name for r in compiled) == ["gdn", "lowlatency"]  # the build's two rows: one compile
    assert runs[2]["backend_info"]["precompile"] == 2


def test_ablate_spread_over_two_gpus_times_the_build_on_each_and_measures_one_row_at_a_time(
    pairs, fake_vllm, tmp_path, monkeypatch
):
    """--gpus 0,1: the base pass on GPU 0 while both GPUs compile; then each GPU times the build first and last, the
    other rows go to whichever GPU is free; the build scores alike on both; rows are scored and timed one at a time over
    both GPUs; each row's decode is compared with the build on its own GPU. Interrupted (Ctrl-C in a lane, here raised by
    the third row), the same command again keeps the rows written and runs the rest."""
    for var in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    import threading
    import time as _time

    from splicer.ablate import AblateSettings, run_ablate

    cuda_not_required(monkeypatch, fake_vllm)
    spans, lock = [], threading.Lock()
    orig_time, orig_score = fake_vllm.VllmBackend.time_decode, fake_vllm.VllmBackend.score

    def logged(fn, kind):
        def run(self, *a, **k):
            t0 = _time.perf_counter()
            out = fn(self, *a, **k)
            if kind == "score":
                out = list(out)
            _time.sleep(0.05)  # long enough that two unguarded measurements would overlap
            with lock:
                spans.append((self.device, kind, t0, _time.perf_counter()))
            return out

        return run

    monkeypatch.setattr(fake_vllm.VllmBackend, "time_decode", logged(orig_time, "time"))
    monkeypatch.setattr(fake_vllm.VllmBackend, "score", logged(orig_score, "score"))
    plan = tmp_path / "p.toml"
    plan.write_text(
        'name = "p"\n[[corpus]]\nname = "en"\nkind = "builtin"\ntext = "wiki-en"\nchunk_tokens = 48\nmax_chunks = 2\n'
        "[timing]\nprompt_tokens = 16\nnew_tokens = 3\nwarmup = 0\nruns = 2\n"
        '[[row]]\nname = "build"\nrestore = []\n[[row]]\nname = "gdn"\nrestore = ["gdn"]\n'
        '[[row]]\nname = "attention"\nrestore = ["attention"]\n[[row]]\nname = "lm_head"\nrestore = ["lm_head"]\n'
        '[[row]]\nname = "build-again"\nrestore = []\nrepeat = true\n'
    )
    p = pairs["fused"]
    import json

    import splicer.ablate.rows as ablate_mod  # where the rows stage calls run_row

    options = fake_vllm.VllmOptions(gpus=("0", "1"), precompile=3, engine_cache_dir=tmp_path / "c2")
    settings = dict(backend="vllm", progress=False, bootstrap=20, backend_options=options)
    real_run_row, calls = ablate_mod.run_row, []

    def interrupted_third(*a, **k):
        calls.append(a[0].row.name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_run_row(*a, **k)

    monkeypatch.setattr(ablate_mod, "run_row", interrupted_third)
    with pytest.raises(KeyboardInterrupt):
        run_ablate("all", str(p["lowlatency"]), str(p["base"]), tmp_path / "two", str(plan), AblateSettings(**settings))
    first = {v["name"]: v for v in json.loads((tmp_path / "two" / "results.json").read_text())["variants"]}
    assert first and all(v["status"] == "ok" for v in first.values())
    monkeypatch.setattr(ablate_mod, "run_row", real_run_row)
    two = run_ablate("all", str(p["lowlatency"]), str(p["base"]), tmp_path / "two", str(plan), AblateSettings(**settings))
    rows = {v["name"]: v for v in two["variants"]}
    for name, v in first.items():
        assert rows[name] == v  # kept as written, not run again
    assert set(two["runs"][-1]["rows_run"]) == set(rows) - set(first)
    assert not two["runs"][-1].get("precompiled")  # the base pass was cached: nothing compiled ahead
    assert set(rows) == {"build", "gdn", "attention", "lm_head", "build-gpu1", "build-end-gpu0", "build-end-gpu1"}
    assert all(v["status"] == "ok" for v in rows.values()), [v.get("error") for v in rows.values()]
    assert {s["name"]: s["reason"] for s in two["skipped"]}["build-again"].startswith("spread over GPUs")
    # Each GPU's first and last rows are engines of the build.
    order = [n for run in two["runs"] for n in run["rows_run"]]
    for gpu in ("0", "1"):
        mine = [n for n in order if rows[n]["gpu"] == gpu]
        assert len(mine) >= 2 and rows[mine[0]]["restored"] == [] and rows[mine[-1]]["restored"] == []
    assert {rows[n]["gpu"] for n in ("gdn", "attention", "lm_head")} <= {"0", "1"}
    # The build scores the same on both GPUs (the stand-in engine is deterministic), every restore differently.
    kls = {n: v["metrics"]["en"]["kl"] for n, v in rows.items()}
    assert len({round(kls[n], 9) for n in ("build", "build-gpu1", "build-end-gpu0", "build-end-gpu1")}) == 1
    assert len({round(kls[n], 9) for n in ("build", "gdn", "attention", "lm_head")}) == 4
    # Measurements never overlap across GPUs, and both GPUs measured.
    assert {d for d, _, _, _ in spans} == {"cuda:0", "cuda:1"}
    spans.sort(key=lambda s: s[2])
    for a, b in zip(spans, spans[1:]):
        assert b[2] >= a[3] or a[0] == b[0], (a, b)
    # Decode against the build on the row's own GPU, the spread pooled over both GPUs' builds (df 1 + 1).
    for name in ("gdn", "attention", "lm_head"):
        d = rows[name]["decode_vs_build"]
        assert d["gpu"] == rows[name]["gpu"] and d["engines"] == [1, 2] and d["df"] == 2
    engines = two["verdicts"]["build_engines"]
    assert set(engines["by_gpu"]) == {"0", "1"} and engines["engines"] == 4
    per_gpu = two["backend_info"]["per_gpu"]
    assert [g["cuda_device"] for g in per_gpu] == ["cuda:0", "cuda:1"] and [g["precompile"] for g in per_gpu] == [1, 2]
    assert per_gpu[0]["cpus"] and not set(per_gpu[0]["cpus"]) & set(per_gpu[1]["cpus"])
    # Compiled ahead in the first invocation (a GPU's records reach results.json with the next row it writes, so an
    # interrupt may leave some out); which process compiles what: test_compile_targets_fill_every_process_once_then_...
    compiled = [Path(r["folder"]).name for run in two["runs"] for r in run.get("precompiled") or []]
    assert compiled and set(compiled) <= {"attention", "gdn", "lm_head", "lowlatency"} and len(set(compiled)) == len(compiled)
    assert "each row compared with the build on its own GPU" in (tmp_path / "two" / "report.md").read_text()


def _queue_behind_a_held_lane(b, monkeypatch, folders):
    """Queue folders for compiling with the first lane held in the first of them until the returned event is set (the
    fake engine compiles in no time otherwise, leaving nothing for an added lane or a close() to meet)."""
    import threading

    first, busy, release = b._lanes[0], threading.Event(), threading.Event()

    def slow_build(folder, t0, args):
        busy.set()
        release.wait(30)

    monkeypatch.setattr(first, "send_load", slow_build)
    monkeypatch.setattr(
        first, "finish_load", lambda: {"spawn_to_ready_s": 1.0, "startup_breakdown": {"compile_s": 1.0}, "log": ""}
    )
    monkeypatch.setattr(first, "unload", lambda: None)
    for folder in folders:
        b.precompile(folder)
    assert busy.wait(30)
    return release


def test_a_lane_still_ending_its_engine_after_close_stopped_waiting_ends_quietly(pairs, fake_vllm, tmp_path, monkeypatch):
    """close() (Ctrl-C, a budget's stop) waits LANE_JOIN_S for each lane, then drops the lanes' queue. A lane that
    finishes its engine after that must end on its own queue, not die in its thread reading the dropped one."""
    import threading

    errors = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    b = fake_vllm.VllmBackend(log_dir=tmp_path, require_cuda=False, precompile=1)
    monkeypatch.setattr(b, "LANE_JOIN_S", 0.2)
    # an engine that takes longer to end than close() waits
    release = _queue_behind_a_held_lane(b, monkeypatch, [pairs["fused"]["lowlatency"]])
    threads = list(b._lane_threads)
    b.close()
    assert b._lane_queue is None and threads[0].is_alive()  # close() gave up on the lane
    release.set()
    threads[0].join(20)
    assert not threads[0].is_alive() and errors == []
    assert [r["error"] for r in b.precompiled] == [None]


def test_when_the_base_pass_engine_ends_one_more_lane_compiles_in_its_place(pairs, fake_vllm, tmp_path, monkeypatch, request):
    """The served engine's memory holds another compiling engine once it ends: with variants still queued, a second
    lane takes them while the first is busy; the lanes still end before anything is timed."""
    import time

    b = fake_vllm.VllmBackend(log_dir=tmp_path / "logs", require_cuda=False, precompile=1, cache_dir=tmp_path / "c")
    request.addfinalizer(b.close)  # a failed assertion must not leave worker processes for the interpreter to join
    p = pairs["fused"]
    queued = [p["lowlatency"], p["experts-g32"], pairs["per_expert"]["lowlatency"]]
    release = _queue_behind_a_held_lane(b, monkeypatch, queued)
    b.load(p["base"])  # the base pass's engine, beside the first lane
    assert len(b._lanes) == 1 and b.lanes_added == 0  # nothing added while it serves
    b.unload()
    assert len(b._lanes) == 2 and b.lanes_added == 1
    deadline = time.monotonic() + 30
    while b._lane_queue.qsize() > 1 and time.monotonic() < deadline:  # the added lane has taken the next variant
        time.sleep(0.02)
    release.set()
    records = b.finish_precompile()
    lanes = {Path(r["folder"]): r["lane"] for r in records}
    # the added lane took the next variant while the first was busy (the last goes to whichever lane was free first)
    assert lanes[queued[0]] == 0 and lanes[queued[1]] == 1 and set(lanes) == set(queued)
    assert all(r["error"] is None for r in records)
    assert all(w.proc is None for w in b._lanes) and b.describe()["precompile_lanes_added"] == 1
    b.load(p["experts-g32"])  # a row's engine: the added lane's compile is in the cache
    assert b.load_info()["startup_breakdown"]["compile_s"] == 0
    b.unload()
    assert len(b._lanes) == 2  # rows' engines ending add nothing: the lanes have ended
    b.close()


def test_no_lane_is_added_when_nothing_waits_to_compile(pairs, fake_vllm, tmp_path, request):
    import time

    b = fake_vllm.VllmBackend(log_dir=tmp_path / "logs", require_cuda=False, precompile=1, cache_dir=tmp_path / "c")
    request.addfinalizer(b.close)

    b.precompile(pairs["fused"]["lowlatency"])
    deadline = time.monotonic() + 60
    while b._lane_queue.qsize() and time.monotonic() < deadline:  # the one lane has taken the only variant
        time.sleep(0.05)
    b.load(pairs["fused"]["base"])
    b.unload()
    assert b.lanes_added == 0 and len(b._lanes) == 1
    b.finish_precompile()
    b.close()


def test_an_added_lane_that_cannot_start_hands_its_variant_back_and_ends(pairs, fake_vllm, tmp_path, monkeypatch, request):
    """With --process-per-variant too: the base pass's process ends, a lane is added; its engine fails (as out of
    memory would), so it records that, puts the variant back for the first lane and takes no more."""
    b = fake_vllm.VllmBackend(
        log_dir=tmp_path / "logs", require_cuda=False, precompile=1, cache_dir=tmp_path / "c", one_process=False
    )
    request.addfinalizer(b.close)
    p = pairs["fused"]
    queued = [p["lowlatency"], p["experts-g32"], pairs["per_expert"]["lowlatency"]]
    release = _queue_behind_a_held_lane(b, monkeypatch, queued)
    b.load(p["base"])
    monkeypatch.setenv("FAKE_VLLM_FAIL_ON", "fused")  # the added lane's engines fail on the fused pair's folders
    b.unload()
    assert b.lanes_added == 1
    b._lane_threads[-1].join(60)  # the added lane failed once and ended
    monkeypatch.delenv("FAKE_VLLM_FAIL_ON")
    release.set()
    records = b.finish_precompile()
    failed = [r for r in records if r["error"]]
    assert len(failed) == 1 and failed[0]["lane"] == 1 and failed[0]["requeued"]
    done = {Path(r["folder"]): r["lane"] for r in records if not r["error"]}
    assert done == {folder: 0 for folder in queued}  # the first lane compiled all three, the handed-back one too


def test_abort_stops_the_lanes_from_starting_another_engine(pairs, fake_vllm, tmp_path, monkeypatch, request):
    b = fake_vllm.VllmBackend(log_dir=tmp_path / "logs", require_cuda=False, precompile=1, cache_dir=tmp_path / "c")
    request.addfinalizer(b.close)
    release = _queue_behind_a_held_lane(b, monkeypatch, [pairs["fused"]["lowlatency"], pairs["fused"]["experts-g32"]])
    b.abort()  # as on Ctrl-C: the first engine is killed (here: released), the second must never start
    release.set()
    b._lane_threads[0].join(30)
    # every engine a lane starts leaves a record: only the first was started
    assert [Path(r["folder"]) for r in b.precompiled] == [pairs["fused"]["lowlatency"]]
