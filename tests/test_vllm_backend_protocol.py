"""The vLLM backend's child-process protocol, parsing and failure handling, against a stand-in engine on CPU.

tests/fake_vllm is NOT vLLM: it answers vLLM's calls with the torch reference, so these tests check splicer's own
plumbing (spawned worker, pipe protocol, prompt_logprobs parsing, errors, unload). vLLM itself runs in test_gpu_vllm.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

FAKE = str(Path(__file__).parent / "fake_vllm")


def _fake_step_s() -> float:
    """The stand-in's seconds per decode step, read from its file (a real vllm may already be imported as `vllm`)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("fake_vllm_engine", Path(FAKE) / "vllm" / "__init__.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module.DECODE_STEP_S


def use_fake_vllm(monkeypatch):
    """The stand-in vLLM on this process's path and its workers' (PYTHONPATH); the backend module reloaded against it.
    The fixture of this file and of the files split from it (test_vllm_overlapped_starts, test_vllm_precompile_and_gpus)."""
    monkeypatch.syspath_prepend(FAKE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([FAKE, str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    import importlib

    import splicer.backends.vllm_backend as vb

    importlib.reload(vb)
    return vb


def cuda_not_required(monkeypatch, vb):
    """The backend module vb's VllmBackend made without its CUDA check, for runs (ablate) that make their own on the
    CPU against the stand-in engine."""
    orig = vb.VllmBackend.__init__
    monkeypatch.setattr(vb.VllmBackend, "__init__", lambda self, *a, **k: orig(self, *a, **dict(k, require_cuda=False)))


@pytest.fixture
def fake_vllm(monkeypatch):
    return use_fake_vllm(monkeypatch)


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

    cuda_not_required(monkeypatch, fake_vllm)
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


def test_a_base_the_engine_refuses_ends_ablate_in_one_line(pairs, fake_vllm, tmp_path, monkeypatch, capsys):
    """vLLM refuses the base (as an H200 refused a DeepSeek-V3-layout base whose MLA head size no prefill backend
    supports): `ablate` ends in the base pass with one line giving the engine's reason and the way out, exit 2, no
    traceback (the engine's own output stays in its log), no results and no folder it created; inputs unchanged."""
    from splicer.cli import main

    from .conftest import tree_digest

    cuda_not_required(monkeypatch, fake_vllm)
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


def test_a_build_whose_engine_computes_in_another_dtype_than_the_base_is_said(pairs, fake_vllm, tmp_path, monkeypatch, capsys):
    """vLLM's dtype="auto" follows each checkpoint's config: a build whose config says float16 (as GPTQ exports often
    do) runs in float16 beside a bfloat16 base. Each engine's dtype is recorded, and a row whose engine differs from the
    base pass's is said in the log with the engine argument that puts every engine in one dtype."""
    import json
    import shutil

    from splicer.ablate import AblateSettings, run_ablate
    from splicer.backends import backend_options

    cuda_not_required(monkeypatch, fake_vllm)
    plan = tmp_path / "p.toml"
    plan.write_text(
        'name = "p"\n[[corpus]]\nname = "en"\nkind = "builtin"\ntext = "wiki-en"\nchunk_tokens = 64\nmax_chunks = 1\n'
        '[[row]]\nname = "build"\nrestore = []\n'
    )
    build = tmp_path / "fp16-build"
    shutil.copytree(pairs["fused"]["lowlatency"], build)
    cfg = json.loads((build / "config.json").read_text())
    cfg["dtype"] = "float16"  # at the root, as a GPTQ export writes it (vLLM reads the root's before the text config's)
    (build / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    res = run_ablate(
        "all", str(build), str(pairs["fused"]["base"]), out, str(plan),
        AblateSettings(backend="vllm", progress=False, bootstrap=20, time_decode=False),
    )  # fmt: skip
    rows = {v["name"]: v for v in res["variants"]}
    assert rows["build"]["status"] == "ok" and rows["build"]["engine"]["dtype"] == "float16"
    log = (out / "ablate.log").read_text()
    assert "build: its engine computes in float16 (the checkpoint's config), the base pass's in bfloat16" in log
    assert "--engine-arg dtype=bfloat16" in log
    assert "build: its engine computes in float16" in capsys.readouterr().err  # on stderr whatever the progress output
    assert "Computed in another dtype than the base pass's engine (bfloat16): build (float16)" in (out / "report.md").read_text()
    # asked for one dtype, every engine computes in it and nothing is said
    res = run_ablate(
        "all", str(build), str(pairs["fused"]["base"]), tmp_path / "one-dtype", str(plan),
        AblateSettings(backend="vllm", progress=False, bootstrap=20, time_decode=False,
                       backend_options=backend_options("vllm", {"engine_args": {"dtype": "bfloat16"}})),
    )  # fmt: skip
    assert {v["engine"]["dtype"] for v in res["variants"]} == {"bfloat16"}
    assert "computes in" not in (tmp_path / "one-dtype" / "ablate.log").read_text()
    assert "another dtype" not in (tmp_path / "one-dtype" / "report.md").read_text()
