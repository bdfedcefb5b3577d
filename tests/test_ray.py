"""`--ray`: a plan's rows on the lanes of a Ray cluster (backends/ray_lanes.py), here a local cluster on the CPU with two
cores and two logical GPUs (Ray hands them out as it would real ones; nothing here runs on a GPU). The torch backend on
the CPU takes one lane per core; the stand-in vLLM (tests/fake_vllm, not vLLM) one lane per GPU. One file, one cluster.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from splicer.ablate import AblateSettings, run_ablate
from splicer.backends import backend_options
from splicer.errors import SplicerError

ray = pytest.importorskip("ray")  # the test extra installs it

ROOT = Path(__file__).parents[1]
FAKE = str(ROOT / "tests" / "fake_vllm")


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


PLAN = """name = "ray-test"
[[corpus]]
name = "en"
kind = "builtin"
text = "wiki-en"
chunk_tokens = 32
max_chunks = 5
[timing]
prompt_tokens = 16
new_tokens = 4
warmup = 1
runs = 3
[[row]]
name = "build"
restore = []
[[row]]
name = "build-again"
restore = []
repeat = true
[[row]]
name = "gdn"
restore = ["gdn"]
[[row]]
name = "attention"
restore = ["attention"]
"""


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> str:
    """One short corpus (five 32-token sequences) and a short timing: the scheduling is under test, not the scores."""
    path = tmp_path_factory.mktemp("ray-plan") / "plan.toml"
    path.write_text(PLAN)
    return str(path)


def _settings(ray_address="default", backend="torch", time_decode=True, **options):
    given = {"ray": ray_address, **options} if ray_address else dict(options)
    return AblateSettings(
        backend=backend,
        device="cpu" if backend == "torch" else "auto",
        time_decode=time_decode,
        progress=False,
        bootstrap=50,
        backend_options=backend_options(backend, given, "cpu" if backend == "torch" else "auto"),
    )


def _metrics(results: dict) -> dict:
    return {v["name"]: v["metrics"] for v in results["variants"] if v["status"] == "ok"}


def test_rows_on_two_lanes_score_as_a_plain_run_survive_a_killed_worker_and_resume(pairs, cluster, plan, tmp_path, monkeypatch):
    """Lane ray1's first worker is killed (SIGKILL) at its fourth call, inside a row: that row is tried again on a new
    worker, and every row ends ok, with the scores one process gives. Each lane timed the build at its start and end.
    Running it again keeps the plan's finished rows."""
    from splicer.backends import ray_lanes

    p = pairs["fused"]
    # scores only: the plain run's timing is not compared
    plain = run_ablate("gdn", str(p["lowlatency"]), str(p["base"]), tmp_path / "plain", plan, _settings(None, time_decode=False))
    monkeypatch.setattr(ray_lanes, "ACTOR_OPTIONS", {"runtime_env": {"env_vars": {"SPLICER_FAULT": "ray:lane-call:ray1:0#4"}}})
    out = tmp_path / "ray"
    spread = run_ablate("gdn", str(p["lowlatency"]), str(p["base"]), out, plan, _settings())
    got = {v["name"]: v for v in spread["variants"]}
    assert all(v["status"] == "ok" for v in got.values()), [v.get("error") for v in got.values()]
    # each lane timed the build at its start and its end; every row names its lane
    assert set(got) == {"build", "build-ray1", "gdn", "build-end-ray0", "build-end-ray1"}
    assert {v["gpu"] for v in got.values()} == {"ray0", "ray1"}
    assert got["build"]["gpu"] == "ray0" and got["build-ray1"]["gpu"] == "ray1"
    retried = [v for v in got.values() if v.get("after_lost_worker")]
    assert len(retried) == 1 and retried[0]["gpu"] == "ray1", retried  # the killed worker cost one try of one row
    assert "LaneLost: Ray lane ray1 lost its worker" in retried[0]["after_lost_worker"]
    # the same scores as one process gives, position for position
    plain_metrics, ray_metrics = _metrics(plain), _metrics(spread)
    for name in ("build", "gdn"):
        assert ray_metrics[name] == plain_metrics[name], name
    for name in ("build-ray1", "build-end-ray0", "build-end-ray1"):
        assert ray_metrics[name] == plain_metrics["build"], name
    # the row's decode is compared with the build on its own lane
    d = got["gdn"].get("decode_vs_build")
    assert d is not None and d.get("gpu") == got["gdn"]["gpu"], d
    job = json.loads((out / "job.json").read_text())
    assert job["settings"].get("ray") is True
    table = (out / "table.md").read_text()
    assert "on the row's own Ray lane" in table and "Ray lane ray1:" in table
    assert "spread over Ray lanes: the build is timed at the start and end of every lane instead" in table
    assert not (out / ray_lanes.TOKEN_FILE).exists()
    # run again, as after an interrupted driver: the plan's finished rows are kept; each lane times the build again at
    # its start and end (as --gpus does), so that rows of this run are compared with builds of this run
    monkeypatch.setattr(ray_lanes, "ACTOR_OPTIONS", {})
    again = run_ablate("gdn", str(p["lowlatency"]), str(p["base"]), out, plan, _settings())
    assert sorted(again["runs"][-1]["rows_run"]) == ["build-end-ray0", "build-end-ray1", "build-ray1"]
    assert {v["name"] for v in again["variants"] if v["status"] == "ok"} == set(got)


def test_a_lane_that_cannot_see_the_folders_fails_the_run_in_one_line(pairs, cluster, tmp_path):
    from splicer.backends import ray_lanes

    options = backend_options("torch", {"ray": "default", "ray_lanes": 1}, "cpu")
    lanes = options.make_backends("cpu", tmp_path / "logs")
    try:
        assert len(lanes) == 1
        ray_lanes.check_storage(lanes, tmp_path, [str(pairs["fused"]["base"])])  # sees it: no error
        with pytest.raises(SplicerError, match=r"lane ray0 on .*: cannot read /nowhere/build/config.json; every worker"):
            ray_lanes.check_storage(lanes, tmp_path, ["/nowhere/build"])
        (tmp_path / ray_lanes.TOKEN_FILE).write_text("another run\n")
        with pytest.raises(SplicerError, match="holds another run's token"):
            lanes[0].check_storage(tmp_path, "this run", [])
    finally:
        for lane in lanes:
            lane.close()


def test_a_lane_whose_worker_cannot_start_refuses_the_run_in_one_line(cluster, tmp_path, monkeypatch):
    from splicer.backends import ray_lanes

    monkeypatch.setattr(ray_lanes, "BACKEND_KWARGS", {"no_such_option": 1})  # the backend's constructor refuses it
    options = backend_options("torch", {"ray": "default", "ray_lanes": 1}, "cpu")
    with pytest.raises(SplicerError, match=r"^--ray: lane ray0's worker could not start: TypeError: .*no_such_option"):
        options.make_backends("cpu", tmp_path / "logs")


def test_a_run_right_after_another_waits_for_all_the_lanes_the_other_gave_back(monkeypatch):
    """Killed workers give their resources back one by one: planning waits for all that this process's closed lanes
    held, so that a run started right after another has as many lanes (and rows) as the one before; but not for more
    lanes than --ray-lanes asks for, nor for what was given back long ago (other work holds it now)."""
    from splicer.backends import ray_lanes

    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)  # plan_lanes polls every half second

    def close_lanes(per_engine, n=2):  # the lanes of the run before, closed as its end closes them
        for k in range(n):
            lane = object.__new__(ray_lanes.RayLane)
            lane.label, lane.per_engine, lane._actor, lane._closed = f"ray{k}", per_engine, object(), False
            lane.abort()

    monkeypatch.setattr(ray, "kill", lambda actor: None)
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 2}}])
    freed = iter([1, 1, 1, 2])
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": next(freed, 2)})
    close_lanes(0)
    assert ray_lanes.plan_lanes(0, None) == (2, True) and len(slept) == 3
    # nothing given back since: no wait, as many lanes as are free
    slept.clear()
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 1})
    assert ray_lanes.plan_lanes(0, None) == (1, True) and not slept
    # GPU lanes: their GPUs waited for, but no more than --ray-lanes asks for
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 16, "GPU": 4}}])
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 16, "GPU": 2})
    monkeypatch.setattr(ray_lanes, "FREE_WAIT_S", 0.05)
    close_lanes(2)
    assert ray_lanes.plan_lanes(2, 1) == (1, True) and not slept
    # given back long ago: other work holds it now, no wait
    close_lanes(2)
    ray_lanes._GIVEN_BACK["at"] -= 60
    assert ray_lanes.plan_lanes(2, None) == (1, True) and not slept


def test_lanes_follow_the_engines_size_and_the_options_it_cannot_go_with(monkeypatch):
    from splicer.backends import ray_lanes

    def nodes(*gpus):
        return lambda: [{"Alive": True, "Resources": {"GPU": g, "CPU": 8}} for g in gpus]

    monkeypatch.setattr(ray_lanes, "FREE_WAIT_S", 0)
    monkeypatch.setattr(ray, "available_resources", lambda: {"GPU": 16, "CPU": 16})
    monkeypatch.setattr(ray, "nodes", nodes(8, 8))
    assert ray_lanes.plan_lanes(2, None) == (8, True) and ray_lanes.plan_lanes(2, 3) == (3, True)
    assert ray_lanes.plan_lanes(16, None) == (1, False)  # across both nodes, vLLM's Ray executor
    monkeypatch.setattr(ray, "available_resources", lambda: {"GPU": 3, "CPU": 16})
    monkeypatch.setattr(ray, "nodes", nodes(1, 1, 1))
    assert ray_lanes.plan_lanes(2, None) == (1, False)
    monkeypatch.setattr(ray, "available_resources", lambda: {"GPU": 1, "CPU": 16})  # other work holds two
    with pytest.raises(SplicerError, match="no 2 GPU\\(s\\) free for one engine now"):
        ray_lanes.plan_lanes(2, None)
    with pytest.raises(SplicerError, match="has 3 GPU"):
        ray_lanes.plan_lanes(4, None)
    with pytest.raises(SplicerError, match="--ray and --gpus, --precompile"):
        backend_options("vllm", {"ray": "default", "gpus": ("0", "1"), "precompile": 2})
    with pytest.raises(SplicerError, match="--ray-lanes caps"):
        backend_options("torch", {"ray_lanes": 2})
    vllm = backend_options("vllm", {"ray": "default", "engine_args": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}})
    assert vllm.ray_engine("auto", True) == ("auto", 4)
    torch_options = backend_options("torch", {"ray": "default"}, "cpu")
    assert torch_options.ray_engine("cpu", True) == ("cpu", 0)
    assert torch_options.ray_engine("auto", True) == ("cuda", 1) and torch_options.ray_engine("auto", False) == ("cpu", 0)


def test_the_fake_vllm_runs_on_gpu_lanes(pairs, cluster, plan, tmp_path, monkeypatch):
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


def test_a_cluster_too_small_for_one_engine_is_refused_in_one_line(pairs, cluster, tmp_path, capsys):
    """Through the command line, in this process (its Ray cluster already joined): one line, exit 2, no DIR."""
    from splicer.cli import main

    p = pairs["fused"]
    out = tmp_path / "out"
    argv = ["ablate", "gdn", str(p["lowlatency"]), str(p["base"]), "-o", str(out), "--plan", "demo", "--backend", "vllm"]
    assert main([*argv, "--tensor-parallel-size", "4", f"--ray={cluster}", "-q"]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "the cluster has 2 GPU(s) and one engine needs 4" in lines[0], err
    assert not out.exists()
