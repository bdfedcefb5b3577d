"""`--ray` with the vLLM backend's options, on the stand-in engine (tests/fake_vllm, which is not vLLM) in a local Ray
cluster of two logical GPUs (test_ray.py's): lanes of one GPU each, and a cluster too small for one engine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .test_ray import FAKE, ROOT, _settings, cluster, plan  # noqa: F401 (the module's Ray cluster and plan fixtures)

pytest.importorskip("ray")

from splicer.ablate import run_ablate  # noqa: E402


def test_the_fake_vllm_runs_on_gpu_lanes(pairs, cluster, plan, tmp_path, monkeypatch):  # noqa: F811
    """The stand-in engine (not vLLM) in lanes of one logical GPU each: rows load, score and record their lane."""
    from splicer.backends import ray_lanes

    env = {"PYTHONPATH": os.pathsep.join([FAKE, str(ROOT)])}
    monkeypatch.setattr(ray_lanes, "ACTOR_OPTIONS", {"runtime_env": {"env_vars": env}})
    monkeypatch.setattr(ray_lanes, "BACKEND_KWARGS", {"require_cuda": False})
    p = pairs["fused"]
    out = tmp_path / "out"
    results = run_ablate("gdn", str(p["lowlatency"]), str(p["base"]), out, plan, _settings(backend="vllm", time_decode=False))
    got = {v["name"]: v for v in results["variants"]}
    assert set(got) == {"build", "build-again", "gdn"} and all(v["status"] == "ok" for v in got.values()), got
    lanes = {v["engine"]["ray_lane"]["lane"] for v in got.values()}
    # the build on the first lane while the second takes the other rows; each engine on its own logical GPU
    assert lanes == {"ray0", "ray1"} and all(v["engine"]["ray_lane"]["gpus"] for v in got.values())
    assert len({v["engine"]["ray_lane"]["gpus"][0] for v in got.values()}) == 2


def test_a_cluster_too_small_for_one_engine_is_refused_in_one_line(pairs, cluster, tmp_path):  # noqa: F811
    p = pairs["fused"]
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "splicer", "ablate", "gdn", str(p["lowlatency"]), str(p["base"]), "-o", str(out)]
    cmd += ["--plan", "demo", "--backend", "vllm", "--tensor-parallel-size", "4", "--ray", cluster, "-q"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([FAKE, str(ROOT)]))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "the cluster has 2 GPU(s) and one engine needs 4" in lines[0], r.stderr
    assert not out.exists()
