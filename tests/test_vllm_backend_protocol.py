"""The vLLM backend's child-process protocol, parsing and failure handling, against a stand-in engine on CPU.

tests/fake_vllm is NOT vLLM: it answers vLLM's calls with the torch reference, so these tests check splicer's own
plumbing (spawned worker, pipe protocol, prompt_logprobs parsing, errors, unload). vLLM itself runs in test_gpu_vllm.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from splicer.errors import SplicerError

FAKE = str(Path(__file__).parent / "fake_vllm")


def _fake_step_s() -> float:
    """The stand-in's seconds per decode step, read from its file (a real vllm may already be imported as `vllm`)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("fake_vllm_engine", Path(FAKE) / "vllm" / "__init__.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module.DECODE_STEP_S


@pytest.fixture
def fake_vllm(monkeypatch):
    monkeypatch.syspath_prepend(FAKE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([FAKE, str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    import importlib

    import splicer.backends.vllm_backend as vb

    importlib.reload(vb)
    return vb


def test_scores_match_the_reference_through_the_worker(pairs, fake_vllm, tmp_path):
    from splicer.backends.torch_ref import TorchBackend

    b = fake_vllm.VllmBackend(log_dir=tmp_path, require_cuda=False)
    seqs = [list(range(20, 60)), list(range(100, 130))]
    b.load(pairs["fused"]["lowlatency"])
    got = list(b.score(seqs, 20, batch_size=1))
    gen = b.generate([seqs[0]], 4, [])
    timing = b.time_decode(seqs[0], 4, 0, 2)
    info = b.load_info()
    b.unload()
    assert b.proc is not None and b.proc.is_alive()  # one worker for the run: the next variant reuses it
    b.load(pairs["fused"]["lowlatency"])
    again = list(b.score(seqs[:1], 20, batch_size=1))
    assert b.load_info()["pid"] == info["pid"] and b.worker_starts == 1
    assert torch.equal(again[0].topk_ids, got[0].topk_ids)
    assert (tmp_path / "lowlatency-2.log").exists()  # a second load of the same folder keeps the first log
    b.close()
    assert b.proc is None
    ref = TorchBackend("cpu")
    ref.load(pairs["fused"]["lowlatency"])
    want = list(ref.score(seqs, 20, batch_size=1))
    for g, w in zip(got, want):
        assert torch.equal(g.topk_ids, w.topk_ids) and torch.allclose(g.topk_logprobs, w.topk_logprobs)
        assert torch.allclose(g.target_logprobs, w.target_logprobs)
    assert len(gen[0]) == 4 and timing["runs"] == 2 and info["vllm"] == "0.0.0-fake"
    # Decode from the engine's token times (stats on by default): the stand-in stamps its first and last token around
    # its sleeps, so that is at least its step. The wall-clock difference is recorded beside it, run by run; on a busy
    # CPU it may come out unresolved (see the next tests), but never as a time that is not positive.
    assert timing["method"].startswith("engine") and timing["decode_ms_per_token"] >= 1000 * _fake_step_s()
    wall = timing["wall_diff"]
    assert len(wall["per_run_ms"]) == 2 and (wall["decode_ms_per_token"] is None or wall["decode_ms_per_token"] > 0)
    assert timing["decode_ms_per_token"] != wall["decode_ms_per_token"]
    assert isinstance(info["layers"], dict) and "error" not in info["layers"]  # the kernel probe ran in the worker
    assert info["model_runner"] == "vllm.FakeModelRunner"  # which runner served (0.29+: the V2 one by default)


def test_engine_refusal_is_an_error_and_the_worker_is_gone(pairs, fake_vllm, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL_ON", "lowlatency")
    b = fake_vllm.VllmBackend(log_dir=tmp_path, require_cuda=False)
    with pytest.raises(RuntimeError, match="different quantization schemes"):
        b.load(pairs["fused"]["lowlatency"])
    assert b.proc is None
    assert "Traceback" in (tmp_path / "lowlatency.log").read_text()  # the engine's own output is kept
    monkeypatch.setenv("FAKE_VLLM_FAIL_ON", "no-such-folder")
    b.load(pairs["fused"]["base"])  # the next variant gets a fresh worker
    assert b.worker_starts == 2 and b.proc.is_alive()
    b.close()


def test_flat_and_dict_prompt_logprobs_parse_alike():
    """The fast path (vLLM's FlatLogprobs) and the per-position dicts give the same scores, and bad layouts are refused."""
    import sys

    sys.path.insert(0, FAKE)
    try:
        from vllm import FlatLogprobs, Logprob
    finally:
        sys.path.remove(FAKE)
    from splicer.backends.vllm_outputs import (
        scores_from_flat_logprobs,
        scores_from_prompt_logprobs,
    )

    prompt, k = [5, 9, 9, 2], 3
    # position t: actual token prompt[t+1], top-3 (actual sometimes inside, sometimes outside)
    tops = [[9, 1, 4], [7, 9, 3], [8, 6, 5]]
    lps = [[-0.5, -1.0, -2.0], [-0.2, -0.9, -3.0], [-0.1, -0.4, -0.7]]
    actual_lp = [-0.5, -0.9, -5.0]
    actual_rank = [1, 2, 9]
    flat = FlatLogprobs([0], [0], [], [], [])
    dicts = [None]
    for t in range(3):
        flat.start_indices.append(len(flat.token_ids))
        flat.token_ids += [prompt[t + 1], *tops[t]]
        flat.logprobs += [actual_lp[t], *lps[t]]
        flat.ranks += [actual_rank[t], 1, 2, 3]
        flat.end_indices.append(len(flat.token_ids))
        d = {tok: Logprob(lp, r + 1) for r, (tok, lp) in enumerate(zip(tops[t], lps[t]))}
        d.setdefault(prompt[t + 1], Logprob(actual_lp[t], actual_rank[t]))
        dicts.append(d)
    a, b = scores_from_flat_logprobs(prompt, flat, k), scores_from_prompt_logprobs(prompt, dicts, k)
    assert torch.equal(a.topk_ids, b.topk_ids) and torch.equal(a.topk_logprobs, b.topk_logprobs)
    assert torch.equal(a.target_logprobs, b.target_logprobs) and torch.equal(a.target_logprobs, torch.tensor(actual_lp))
    with pytest.raises(RuntimeError, match="actual next token"):
        scores_from_flat_logprobs([5, 9, 9, 3], flat, k)
    with pytest.raises(RuntimeError, match="entries"):
        scores_from_flat_logprobs(prompt, flat, 4)


def test_startup_breakdown_reads_vllm_0_26_log_lines():
    from splicer.backends.vllm_logs import startup_breakdown

    # The format strings of vLLM 0.26.0 (default_loader.py, gpu_model_runner.py, monitor.py, core.py), filled in.
    log = (
        "INFO [default_loader.py:431] Loading weights took 27.51 seconds\n"
        "INFO [gpu_model_runner.py:5348] Model loading took 19.87 GiB memory and 30.123456 seconds\n"
        "INFO [monitor.py:48] torch.compile took 47.02 s in total\n"
        "INFO [monitor.py:81] Initial profiling/warmup run took 64.36 s\n"
        "INFO [gpu_model_runner.py:6845] Graph capturing finished in 12 secs, took 0.45 GiB\n"
        "INFO [core.py:341] init engine (profile, create kv cache, warmup model) took 201.50 s (compilation: 47.02 s)\n"
    )
    assert startup_breakdown(log) == {
        "weights_load_s": 27.51,
        "model_load_s": 30.123456,
        "weight_memory_gib": 19.87,
        "compile_s": 47.02,
        "profiling_warmup_s": 64.36,
        "graph_capture_s": 12.0,
        "init_engine_s": 201.5,
    }


def test_startup_breakdown_reads_vllm_0_33_tagged_lines_of_a_target_and_its_drafter():
    """vLLM 0.33 tags each compiled model's compile and warm-up lines (compilation/monitor.py, "%storch.compile took",
    the tag "[backbone] " or the drafter's); an engine with a drafter loads weights, compiles and warms up once per
    model, so the engine's figure is their sum, and the init line's compilation total is the engine's own."""
    from splicer.backends.vllm_logs import startup_breakdown

    log = (
        "INFO [default_loader.py:431] Loading weights took 27.50 seconds\n"
        "INFO [default_loader.py:431] Loading weights took 1.25 seconds\n"
        "INFO [gpu_model_runner.py:5348] Model loading took 20.10 GiB memory and 31.000000 seconds\n"
        "INFO [monitor.py:62] [backbone] torch.compile took 40.00 s in total\n"
        "INFO [monitor.py:62] [eagle_head] torch.compile took 7.00 s in total\n"
        "INFO [monitor.py:93] [backbone] Initial profiling/warmup run took 60.00 s\n"
        "INFO [monitor.py:93] [eagle_head] Initial profiling/warmup run took 4.50 s\n"
        "INFO [core.py:341] init engine (profile, create kv cache, warmup model) took 210.00 s (compilation: 47.50 s)\n"
    )
    got = startup_breakdown(log)
    # the engine's own total (which counts what the two lines do not, e.g. an encoder's) wins over their sum
    assert got["weights_load_s"] == 28.75 and got["compile_s"] == 47.5 and got["profiling_warmup_s"] == 64.5
    assert got["compile_s_by_model"] == {"backbone": 40.0, "eagle_head": 7.0}
    assert got["profiling_warmup_s_by_model"] == {"backbone": 60.0, "eagle_head": 4.5}
    assert "weights_load_s_by_model" not in got  # the loader's line names no model
    # without the init line the per-model lines' sum stands
    assert startup_breakdown(log.rsplit("INFO [core.py", 1)[0])["compile_s"] == 47.0
    # without a compile cache (VLLM_DISABLE_COMPILE_CACHE=1) 0.33 times compiling and the warm-up run together
    together = "INFO [monitor.py:62] [backbone] torch.compile and initial profiling/warmup run together took 88.25 s in total\n"
    assert startup_breakdown(together) == {"compile_and_warmup_s": 88.25, "compile_and_warmup_s_by_model": {"backbone": 88.25}}


def test_ablate_with_the_vllm_backend_path(pairs, fake_vllm, tmp_path, monkeypatch):
    """ablate --backend vllm end to end (stand-in engine): top-k filled from the engine's own top-k, engine info kept."""
    from splicer.ablate import AblateSettings, run_ablate

    orig = fake_vllm.VllmBackend.__init__
    monkeypatch.setattr(fake_vllm.VllmBackend, "__init__", lambda self, *a, **k: orig(self, *a, require_cuda=False, **k))
    plan = tmp_path / "p.toml"
    plan.write_text(
        'name = "p"\n[[corpus]]\nname = "en"\nkind = "builtin"\ntext = "wiki-en"\nchunk_tokens = 64\nmax_chunks = 2\n'
        '[[row]]\nname = "build"\nrestore = []\n[[row]]\nname = "all"\nkeep = []\n'
    )
    p = pairs["fused"]
    res = run_ablate(
        "all",
        str(p["lowlatency"]),
        str(p["base"]),
        tmp_path / "out",
        str(plan),
        AblateSettings(backend="vllm", progress=False, bootstrap=50, time_decode=False),
    )
    rows = {v["name"]: v for v in res["variants"]}
    assert rows["all"]["status"] == "ok" and rows["all"]["metrics"]["en"]["top1"] == 1.0
    assert rows["all"]["metrics"]["en"]["kl"] == pytest.approx(0, abs=1e-6) and rows["all"]["metrics"]["en"]["kl_full"] is None
    assert rows["build"]["metrics"]["en"]["kl"] > 0.01 and rows["build"]["engine"]["vllm"] == "0.0.0-fake"
    assert res["backend"] == "vllm"
    assert rows["build"]["engine"]["pid"] == rows["all"]["engine"]["pid"] and res["backend_info"]["worker_starts"] == 1
    assert res["time_breakdown"]["waiting for engines"] > 0 and res["time_breakdown"]["scoring"] > 0
    assert "Speed per variant" in (tmp_path / "out" / "table.md").read_text()


def test_kernel_probe_keeps_layers_that_differ():
    """A splice of some layers: layers of one name pattern load with different methods, and both must show."""
    from splicer.backends.vllm_child import _kernel_probe
    from splicer.backends.vllm_logs import kernels_by_class

    class Method:
        pass

    class Unquantized:
        pass

    layers = torch.nn.ModuleDict({str(i): torch.nn.ModuleDict({"experts": torch.nn.Module()}) for i in range(3)})
    for i in range(3):
        layers[str(i)]["experts"].quant_method = Unquantized() if i in (0, 2) else Method()
    model = torch.nn.Module()
    model.layers = layers
    probe = _kernel_probe(model)
    assert probe == {"layers.*.experts": "Method | Unquantized"}
    from splicer.arch.qwen3_5_moe import QWEN3_5_MOE

    assert kernels_by_class({"model.layers.*.mlp.experts": probe["layers.*.experts"]}, QWEN3_5_MOE) == {
        "experts": ["Method", "Unquantized"]
    }


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

    orig = fake_vllm.VllmBackend.__init__
    monkeypatch.setattr(fake_vllm.VllmBackend, "__init__", lambda self, *a, **k: orig(self, *a, require_cuda=False, **k))
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


def _ablate_overlapped(pairs, fake_vllm, tmp_path, monkeypatch, modes):
    from splicer.ablate import AblateSettings, run_ablate

    orig = fake_vllm.VllmBackend.__init__
    monkeypatch.setattr(fake_vllm.VllmBackend, "__init__", lambda self, *a, **k: orig(self, *a, require_cuda=False, **k))
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


def test_engine_caches_stay_in_the_per_user_folders_unless_moved(fake_vllm, tmp_path, monkeypatch):
    for var in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    default = fake_vllm.VllmBackend(log_dir=tmp_path, require_cuda=False)
    assert not {"VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"} & set(default.env)
    assert default.describe()["engine_cache_dir"] == "per-user defaults"
    moved = fake_vllm.VllmBackend(log_dir=tmp_path, require_cuda=False, cache_dir=tmp_path / "c")
    assert moved.env["TRITON_CACHE_DIR"] == str((tmp_path / "c" / "triton").resolve())
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))  # the user's own setting wins
    assert "TRITON_CACHE_DIR" not in fake_vllm.VllmBackend(log_dir=tmp_path, require_cuda=False, cache_dir=tmp_path / "c").env


def test_decode_falls_back_to_the_wall_clock_without_request_stats(pairs, fake_vllm, tmp_path):
    from splicer.backends.vllm_outputs import engine_step_s

    b = fake_vllm.VllmBackend(log_dir=tmp_path, require_cuda=False, engine_args={"disable_log_stats": True})
    # The stand-in pays a real sleep per decode step, so the wall-clock estimate has something to measure. Its torch
    # reference runs on one thread here: with two OpenMP threads on a CPU shared with other work, one call took up to
    # 2.5 s longer than the next (threads waiting on each other's time slices), which swamps any step. A warm-up run
    # keeps the first call's one-time costs out, as on the GPU.
    b.env["OMP_NUM_THREADS"] = "1"
    b.load(pairs["fused"]["lowlatency"])
    timing = b.time_decode(list(range(20, 60)), 4, 1, 3)
    b.close()
    assert timing["method"].startswith("wall") and "wall_diff" not in timing and timing["decode_ms_per_token"] > 0
    assert len(timing["per_run_ms"]) == 3 and timing["decode_ms_per_token"] == sorted(timing["per_run_ms"])[1]

    class Stats:
        first_token_ts, last_token_ts, num_generation_tokens = 10.0, 10.3, 4

    assert engine_step_s(Stats()) == pytest.approx(0.1)
    Stats.num_generation_tokens = 1  # one token: no decode step to time
    assert engine_step_s(Stats()) is None and engine_step_s(None) is None


def test_a_decode_estimate_that_is_not_positive_is_not_reported_as_a_time():
    """Steps shorter than the clock's jitter: t(n) - t(1) <= 0. No ms/token then, and the runs stay on record."""
    from splicer.backends.vllm_outputs import summarise_decode_runs

    kw = dict(new_tokens=5, warmup=0, prompt_tokens=40)
    # Wall clock only (stats off): two runs where the n-token request was faster than the 1-token one, one where not.
    t = summarise_decode_runs([0.100, 0.100, 0.100], [0.096, 0.099, 0.104], [None, None, None], **kw)
    assert t["decode_ms_per_token"] is None and t["decode_iqr"] is None and t["decode_min_max"] is None
    assert t["method"].startswith("not resolved: wall") and "per_run_ms" in t["method"]
    assert t["per_run_ms"] == pytest.approx([-1.0, -0.25, 1.0])  # (tn - t1) * 1000 / (n - 1), as measured
    assert t["ttft_ms"] == pytest.approx(100.0) and t["runs"] == 3
    # A median of exactly zero is no measurement either.
    assert summarise_decode_runs([0.1, 0.1], [0.1, 0.1], [None, None], **kw)["decode_ms_per_token"] is None
    # The same runs with a positive median are a measurement, with the spread and the runs.
    ok = summarise_decode_runs([0.100, 0.100, 0.100], [0.108, 0.099, 0.112], [None, None, None], **kw)
    assert ok["decode_ms_per_token"] == pytest.approx(2.0) and ok["method"].startswith("wall")
    assert ok["decode_min_max"] == pytest.approx([-0.25, 3.0]) and len(ok["per_run_ms"]) == 3
    # Engine times in every run: they are the figure; a negative wall-clock difference beside them is kept unresolved.
    e = summarise_decode_runs([0.100, 0.100], [0.096, 0.099], [0.004, 0.0042], **kw)
    assert e["method"].startswith("engine") and e["decode_ms_per_token"] == pytest.approx(4.1)
    assert e["wall_diff"]["decode_ms_per_token"] is None and e["wall_diff"]["per_run_ms"] == pytest.approx([-1.0, -0.25])
    # Engine times of zero (first and last token stamped together) are not a time either.
    z = summarise_decode_runs([0.1, 0.1], [0.2, 0.2], [0.0, 0.0], **kw)
    assert z["decode_ms_per_token"] is None and z["method"].startswith("not resolved: engine")
    # One new token: no decode step, nothing to divide by.
    one = summarise_decode_runs([0.1], [0.1], [None], new_tokens=1, warmup=0, prompt_tokens=40)
    assert one["decode_ms_per_token"] is None and one["per_run_ms"] == [] and one["method"].startswith("not resolved")


def test_both_backends_offer_everything_the_backend_protocol_declares(fake_vllm, tmp_path):
    """ablate calls these without probing (no hasattr/getattr): each implementation must have every one."""
    from splicer.backends.base import Backend
    from splicer.backends.torch_ref import TorchBackend

    declared = set(Backend.__annotations__) | {n for n, v in vars(Backend).items() if callable(v) and not n.startswith("_")}
    assert {"load", "score", "generate", "time_decode", "load_info", "prefetch", "close", "overlap_starts"} <= declared
    vllm = fake_vllm.VllmBackend(log_dir=tmp_path, require_cuda=False)
    for backend in (TorchBackend(device="cpu"), vllm):
        missing = sorted(n for n in declared if not hasattr(backend, n))
        assert not missing, f"{type(backend).__name__} lacks {missing}"
    vllm.close()


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

    orig = fake_vllm.VllmBackend.__init__
    monkeypatch.setattr(fake_vllm.VllmBackend, "__init__", lambda self, *a, **k: orig(self, *a, require_cuda=False, **k))
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


def test_a_base_the_engine_refuses_ends_ablate_in_one_line(pairs, fake_vllm, tmp_path, monkeypatch, capsys):
    """vLLM refuses the base (as an H200 refused a DeepSeek-V3-layout base whose MLA head size no prefill backend
    supports): `ablate` ends in the base pass with one line giving the engine's reason and the way out, exit 2, no
    traceback (the engine's own output stays in its log), no results and no folder it created; inputs unchanged."""
    from splicer.cli import main

    from .conftest import tree_digest

    orig = fake_vllm.VllmBackend.__init__
    monkeypatch.setattr(fake_vllm.VllmBackend, "__init__", lambda self, *a, **k: orig(self, *a, **dict(k, require_cuda=False)))
    p = pairs["fused"]
    plan = tmp_path / "p.toml"
    plan.write_text(
        'name = "p"\n[[corpus]]\nname = "en"\nkind = "builtin"\ntext = "wiki-en"\nchunk_tokens = 32\nmax_chunks = 2\n'
        '[[row]]\nname = "build"\nrestore = []\n[[row]]\nname = "gdn"\nrestore = ["gdn"]\n'
    )
    before = {k: tree_digest(p[k]) for k in ("lowlatency", "base")}
    why = "No valid attention backend found for cuda with head_size: 192 (fake)"
    monkeypatch.setenv("FAKE_VLLM_FAIL_ON", str(p["base"]))
    monkeypatch.setenv("FAKE_VLLM_FAIL_MESSAGE", why)
    out = tmp_path / "out"
    assert (
        main(
            [
                "ablate",
                "all",
                str(p["lowlatency"]),
                str(p["base"]),
                "-o",
                str(out),
                "--plan",
                str(plan),
                "--backend",
                "vllm",
                "--no-time",
                "-q",
            ]
        )
        == 2
    )
    got = capsys.readouterr()
    assert "Traceback" not in got.err + got.out and got.out == ""
    lines = got.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("splicer: error: the base pass could not start: vLLM could not load "), lines
    assert f"ValueError: {why}" in lines[0] and "--backend torch" in lines[0]
    assert not out.exists()  # the folder this run created is gone again, with no half-made base pass in it
    assert {k: tree_digest(p[k]) for k in ("lowlatency", "base")} == before
