"""The vLLM backend's engines started ahead of their turn (--overlap-starts): sleep mode, waking, the second wake before
timing, the cores and KV cache engines started ahead get, and an overlapped ablate scoring as a serial one.

tests/fake_vllm is NOT vLLM: it answers vLLM's calls with the torch reference, so these tests check splicer's own
scheduling of engines (worker processes, sleep and wake, compiling lanes, GPUs), not vLLM's. Split from
test_vllm_backend_protocol.py, whose stand-in engine and fixture they share.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from splicer.errors import SplicerError

from .test_vllm_backend_protocol import cuda_not_required, use_fake_vllm


@pytest.fixture
def fake_vllm(monkeypatch):
    return use_fake_vllm(monkeypatch)


def test_with_overlapped_starts_every_engine_sleeps_once_started_and_is_woken_at_its_turn(pairs, fake_vllm, tmp_path):
    """Every row is timed in one state: started (ahead or at its turn), put to sleep, woken. An engine started ahead
    waits asleep, so the one being timed is the only one awake on the GPU; serial runs never sleep."""
    b = fake_vllm.VllmBackend(log_dir=tmp_path, require_cuda=False, overlap_starts=1)
    assert b.sleep_between and b.engine_args["enable_sleep_mode"] is True
    seqs = [list(range(20, 60))]
    b.load(pairs["fused"]["lowlatency"])  # loaded at its turn: sleeps and wakes too
    assert b.load_info()["wake_s"] >= 0 and b.load_info()["sleep_s"] >= 0
    assert b.engine_metrics("fake:sleep_wake") == {"fake:sleep_wake": [1, 1]}
    b.prefetch(pairs["fused"]["base"])
    timing = b.time_decode(seqs[0], 3, 0, 1)
    assert timing["state"].startswith("woken") and b.workers[1].prefetched["info"]["sleep_s"] >= 0
    b.unload()
    b.load(pairs["fused"]["base"])  # the prefetched engine, asleep until now
    assert b.load_info()["prefetched"] and b.engine_metrics("fake:sleep_wake") == {"fake:sleep_wake": [1, 1]}
    assert len(list(b.score(seqs, 20, batch_size=1))) == 1  # awake: the fake refuses to serve a sleeping engine
    first_pid = b.load_info()["pid"]
    b.load(pairs["fused"]["lowlatency"])  # sleep mode allows one engine per process: this one gets a fresh worker
    assert b.load_info()["pid"] != first_pid and b.worker_starts == 3 and "retried_in_fresh_worker" not in b.load_info()
    b.close()
    # Serial engines never sleep (their timing state: the precompile test).
    serial = fake_vllm.VllmBackend(log_dir=tmp_path, require_cuda=False)
    assert not serial.sleep_between and "enable_sleep_mode" not in serial.engine_args
    with pytest.raises(SplicerError, match="enable_sleep_mode"):
        fake_vllm.VllmBackend(log_dir=tmp_path, require_cuda=False, overlap_starts=1, engine_args={"enable_sleep_mode": False})


def test_an_engine_that_does_not_wake_fully_is_an_error_not_a_timing(pairs, fake_vllm, tmp_path, monkeypatch):
    """vLLM 0.33's LLM.wake_up returns whether the engine is fully awake (0.26's returns None): False fails the load in
    one line instead of timing or scoring an engine whose weights are not all back on the GPU."""
    monkeypatch.setenv("FAKE_VLLM_API", "0.33")
    b = fake_vllm.VllmBackend(log_dir=tmp_path, require_cuda=False, overlap_starts=1)
    b.load(pairs["fused"]["lowlatency"])  # fully awake: True
    assert b.load_info()["wake_s"] >= 0
    b.close()
    monkeypatch.setenv("FAKE_VLLM_WAKE_INCOMPLETE", "1")
    b = fake_vllm.VllmBackend(log_dir=tmp_path, require_cuda=False, overlap_starts=1)
    with pytest.raises(RuntimeError, match=r"did not wake fully from sleep \(LLM.wake_up returned False\)"):
        b.load(pairs["fused"]["lowlatency"])
    b.close()


def test_rewake_before_timing_sleeps_and_wakes_the_engine_once_more_before_each_timing_only(pairs, fake_vllm, tmp_path):
    b = fake_vllm.VllmBackend(log_dir=tmp_path, require_cuda=False, overlap_starts=1, rewake_before_timing=True)
    seqs = [list(range(20, 60))]
    b.load(pairs["fused"]["lowlatency"])
    list(b.score(seqs, 20, batch_size=1))
    assert b.engine_metrics("fake:sleep_wake") == {"fake:sleep_wake": [1, 1]}  # scoring does not cycle it
    timing = b.time_decode(seqs[0], 3, 0, 1)
    assert b.engine_metrics("fake:sleep_wake") == {"fake:sleep_wake": [2, 2]}
    assert timing["state"].startswith("slept and woken a second time") and timing["rewake_wake_s"] >= 0
    assert b.describe()["rewake_before_timing"] is True
    b.close()
    with pytest.raises(SplicerError, match="needs vLLM's sleep mode"):
        fake_vllm.VllmBackend(log_dir=tmp_path, require_cuda=False, rewake_before_timing=True)


def test_engines_started_ahead_get_a_fixed_kv_cache_and_a_share_of_the_cores(fake_vllm, tmp_path, monkeypatch):
    """The settings of overlapped starts; their schedule (engines started ahead, each asleep until its turn, no timing
    while one starts) is checked through ablate in test_ablate_with_overlapped_starts_gives_the_same_scores. (Until
    the suite needed the time, a test here also drove prefetching by hand in workers without sleep mode, an option of
    the class that no CLI path uses.)"""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    b = fake_vllm.VllmBackend(log_dir=tmp_path, require_cuda=False, overlap_starts=2)
    assert b.engine_args["kv_cache_memory_bytes"] == 12 << 30  # fixed KV cache: no profiling against a moving GPU
    assert b.env["OMP_NUM_THREADS"] == "5"  # three workers share 16 cores
    assert len(b.workers) == 3 and all(w.proc is None for w in b.workers)  # nothing starts before a load or prefetch
    assert "OMP_NUM_THREADS" not in fake_vllm.VllmBackend(log_dir=tmp_path, require_cuda=False).env


def _ablate_overlapped(pairs, fake_vllm, tmp_path, monkeypatch, modes):
    from splicer.ablate import AblateSettings, run_ablate

    cuda_not_required(monkeypatch, fake_vllm)
    events = []
    scored = []
    orig_score = fake_vllm.VllmBackend.score

    def score_logged(self, *a, **k):
        scored.append(len(events))  # where in the load/prefetch/time sequence scoring happened
        yield from orig_score(self, *a, **k)

    monkeypatch.setattr(fake_vllm.VllmBackend, "score", score_logged)
    import splicer.splice.core

    orig_splice = splicer.splice.core.splice
    spliced = []

    def splice_logged(*a, **k):
        spliced.append((Path(a[2]).name, len(events)))  # which variant, and after how many load/prefetch/time events
        return orig_splice(*a, **k)

    monkeypatch.setattr(splicer.splice.core, "splice", splice_logged)
    for name in ("load", "prefetch", "time_decode"):
        method = getattr(fake_vllm.VllmBackend, name)

        def logged(self, *a, _name=name, _method=method, **k):
            if _name != "time_decode":
                events.append((_name, Path(a[0]).name))
            result = _method(self, *a, **k)
            if _name == "time_decode":
                events.append(("time", [w.pending is not None for w in self.workers]))
            return result

        monkeypatch.setattr(fake_vllm.VllmBackend, name, logged)
    plan = tmp_path / "p.toml"
    plan.write_text(
        'name = "p"\n[[corpus]]\nname = "en"\nkind = "builtin"\ntext = "wiki-en"\nchunk_tokens = 48\nmax_chunks = 2\n'
        "[timing]\nprompt_tokens = 16\nnew_tokens = 3\nwarmup = 0\nruns = 1\n"
        '[[row]]\nname = "build"\nrestore = []\n[[row]]\nname = "gdn"\nrestore = ["gdn"]\n[[row]]\nname = "all"\nkeep = []\n'
    )
    p = pairs["fused"]
    runs, logs, splices = {}, {}, {}
    for mode in modes:
        events.clear()
        scored.clear()
        spliced.clear()
        runs[mode] = run_ablate(
            "all",
            str(p["lowlatency"]),
            str(p["base"]),
            tmp_path / f"out-{mode}",
            str(plan),
            AblateSettings(
                backend="vllm", progress=False, bootstrap=20, backend_options=fake_vllm.VllmOptions(overlap_starts=mode)
            ),
        )
        # one line per event, "score" where a score call began (several per row: corpora, the base's noise pass)
        merged = []
        for i, e in enumerate(events + [None]):
            merged += ["score"] * scored.count(i)
            if e is not None:
                merged.append(e)
        logs[mode] = [m for k, m in enumerate(merged) if not (m == "score" and k and merged[k - 1] == "score")]
        splices[mode] = list(spliced)
    return runs, logs, splices


def test_ablate_with_overlapped_starts_gives_the_same_scores(pairs, fake_vllm, tmp_path, monkeypatch):
    # Serial and two ahead (one ahead is the same schedule with groups of one; its order was checked here until the
    # suite needed the time, and overlapped starts are no longer the way to time).
    runs, logs, splices = _ablate_overlapped(pairs, fake_vllm, tmp_path, monkeypatch, (0, 2))
    a = {v["name"]: v for v in runs[0]["variants"]}
    assert list(a) == ["build", "gdn", "all"]
    for mode in (2,):
        b = {v["name"]: v for v in runs[mode]["variants"]}
        assert list(b) == list(a)
        for name in a:
            assert b[name]["status"] == "ok" and a[name]["metrics"]["en"]["kl"] == pytest.approx(
                b[name]["metrics"]["en"]["kl"], abs=1e-9
            )
        assert all(b[n]["engine"].get("prefetched") for n in ("build", "gdn", "all"))  # each started ahead of its turn
        # Overlapped starts time every engine after a sleep, and vLLM's sleep mode allows one engine per process:
        # one worker process per engine (the base's and three rows').
        assert runs[mode]["backend_info"]["worker_starts"] == 4
        assert all(b[n]["timing"]["state"].startswith("woken") for n in ("build", "gdn", "all"))
    assert runs[0]["backend_info"]["worker_starts"] == 1  # serial: one process serves every engine
    assert all(not any(e[1]) for e in logs[2] if e[0] == "time")  # never timed while an engine was starting
    # One ahead: each row starts the next once it is timed. Two ahead: a group of two, and the next group only once
    # both of the group are timed, so that no row's timing waits behind a start begun after it was loaded.
    # Serial: each row scored, then timed (the order of the H200 run with a ±1 % noise band).
    assert [e if e == "score" or e[0] != "time" else "time" for e in logs[0]] == [
        ("load", "base"),
        "score",
        ("load", "lowlatency"),
        "score",
        "time",
        ("load", "gdn"),
        "score",
        "time",
        ("load", "all"),
        "score",
        "time",
    ]
    # With overlap the base's engine starts together with the first group (its start is the longest).
    assert [e if e == "score" or e[0] != "time" else "time" for e in logs[2]] == [
        ("prefetch", "base"),
        ("prefetch", "lowlatency"),
        ("prefetch", "gdn"),
        ("load", "base"),
        "score",
        ("load", "lowlatency"),
        "time",
        "score",
        ("load", "gdn"),
        "time",
        ("prefetch", "all"),
        "score",
        ("load", "all"),
        "time",
        "score",
    ]
    for mode in (2,):
        assert runs[mode]["base_pass"]["engine"]["prefetched"]  # the base's engine came from the start at t=0
        # Every splice is made while the first engines start, before the base's engine is even collected.
        no_scores = [e for e in logs[mode] if e != "score"]
        first_load = next(k for k, e in enumerate(no_scores) if e[0] == "load")  # in events, as the splices count them
        assert sorted(name for name, _ in splices[mode]) == ["all", "gdn"]
        assert all(at <= first_load for _, at in splices[mode])
    assert [at for _, at in splices[0]] == [3, 5]  # serial: each variant spliced at its turn, after the row before is timed
