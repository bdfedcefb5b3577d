"""scripts/gpu/start_profile.py: the timers' accounting (nesting, exclusive times, the split by category, the remainder),
the wrapping of functions by name, and the comparison of starts, on a fake clock; and one start end to end against the
stand-in vLLM of tests/fake_vllm (the script's --cpu-smoke-test)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

from .scripts_import import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu" / "start_profile.py"


sp = load_script("scripts/gpu/start_profile.py")


class FakeClock:
    """Time that moves only when a fake function spends it."""

    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t

    def spend(self, s):
        self.t += s


def _row(clock, path):
    return next(r for r in clock.rows() if r["path"] == path)


def test_nested_calls_inclusive_exclusive_and_the_split():
    fake = FakeClock()
    clock = sp.PhaseClock(clock=fake)
    clock.meta.update({"load": {"category": "read"}, "leaf": {"category": "weight_loader"}, "mid": {}})

    def leaf():
        fake.spend(1.0)

    def mid():  # no category: its own time goes to the enclosing "load"
        fake.spend(0.5)
        leaf()
        leaf()

    def load():
        fake.spend(0.25)
        mid()

    leaf, mid, load = (clock.wrap_call(f, f.__name__) for f in (leaf, mid, load))
    with clock.phase("LLM()"):
        fake.spend(2.0)  # outside every wrapped phase
        load()
        leaf()  # the same function at another nesting: its own path
    assert _row(clock, "LLM()") == {**_row(clock, "LLM()"), "calls": 1, "inclusive_s": 5.75, "exclusive_s": 2.0}
    assert _row(clock, "LLM() > load")["inclusive_s"] == 2.75
    assert _row(clock, "LLM() > load")["exclusive_s"] == 0.25
    assert _row(clock, "LLM() > load > mid")["exclusive_s"] == 0.5
    assert _row(clock, "LLM() > load > mid > leaf")["calls"] == 2
    assert _row(clock, "LLM() > load > mid > leaf")["inclusive_s"] == 2.0
    assert _row(clock, "LLM() > leaf")["calls"] == 1
    # rows in the order the phases began: a parent before its children
    assert [r["path"] for r in clock.rows()] == [
        "LLM()",
        "LLM() > load",
        "LLM() > load > mid",
        "LLM() > load > mid > leaf",
        "LLM() > leaf",
    ]
    assert clock.by_label()["leaf"]["calls"] == 3 and clock.by_label()["leaf"]["inclusive_s"] == 3.0
    split = clock.split("LLM()")
    assert split == {"outside": 2.0, "read": 0.75, "weight_loader": 3.0}
    assert sum(split.values()) == pytest.approx(5.75)


def test_recursion_is_not_counted_twice_and_groups_count_outermost_calls():
    fake = FakeClock()
    clock = sp.PhaseClock(clock=fake)

    def default_loader():
        fake.spend(1.0)

    inner = clock.wrap_call(default_loader, "default")

    def param_loader():  # a parameter's loader that calls the default one: one tensor load, not two
        fake.spend(0.5)
        inner()

    outer = clock.wrap_call(param_loader, "param")

    def rec(n):
        fake.spend(1.0)
        if n:
            rec_w(n - 1)

    rec_w = clock.wrap_call(rec, "rec")
    with clock.phase("LLM()"):
        outer()
        inner()
        rec_w(2)
    assert clock.group(["param", "default"]) == (2, 2.5)  # one param load (1.5 s) and one default load (1 s)
    labels = clock.by_label()
    assert labels["rec"]["calls"] == 3
    assert labels["rec"]["inclusive_s"] == 3.0  # the outermost call only
    assert labels["rec"]["exclusive_s"] == 3.0


def test_generator_resumes_are_timed_where_they_are_consumed():
    fake = FakeClock()
    clock = sp.PhaseClock(clock=fake)
    clock.meta.update({"reader": {"category": "read"}, "consume": {"category": "load_python"}})

    def reader(n):
        for i in range(n):
            fake.spend(0.5)  # reading one tensor
            yield i
        fake.spend(0.25)  # closing the file, at the last resume

    reader = clock.wrap_gen(reader, "reader")

    def consume():
        total = 0
        for item in reader(4):
            fake.spend(1.0)  # the loader's Python per tensor
            total += item
        return total

    consume = clock.wrap_call(consume, "consume")
    with clock.phase("LLM()"):
        assert consume() == 6
    row = _row(clock, "LLM() > consume > reader")
    assert row["calls"] == 5  # four items and the end
    assert row["inclusive_s"] == 2.25
    assert _row(clock, "LLM() > consume")["exclusive_s"] == 4.0
    assert clock.split("LLM()") == {"read": 2.25, "load_python": 4.0, "outside": 0.0}


def test_context_managers_errors_and_threads_keep_the_stack_balanced():
    fake = FakeClock()
    clock = sp.PhaseClock(clock=fake)

    class Compiling:
        def __enter__(self):
            fake.spend(0.5)

        def __exit__(self, *exc):
            fake.spend(0.5)
            return False

    monitor = clock.wrap_cm(Compiling, "compile")

    def boom():
        fake.spend(1.0)
        raise ValueError("vLLM refused")

    boom = clock.wrap_call(boom, "boom")
    with clock.phase("LLM()"):
        with monitor():
            fake.spend(2.0)
        with pytest.raises(ValueError):
            boom()
        worker = threading.Thread(target=lambda: clock.wrap_call(lambda: fake.spend(0.0), "in a thread")(), name="t1")
        worker.start()
        worker.join()
    assert _row(clock, "LLM() > compile")["inclusive_s"] == 3.0
    assert _row(clock, "LLM() > boom")["calls"] == 1 and _row(clock, "LLM() > boom")["inclusive_s"] == 1.0
    assert _row(clock, "[thread t1] > in a thread")["calls"] == 1  # its own root, not under LLM()
    assert _row(clock, "LLM()")["exclusive_s"] == 0.0
    with clock.phase("after"):  # the stack is empty again: a new root
        pass
    assert _row(clock, "after")["depth"] == 0


def test_install_wraps_by_name_rebinds_imports_and_notes_what_is_missing(monkeypatch):
    lib = types.ModuleType("spfake_lib")
    user = types.ModuleType("spfake_user")
    exec(
        "def load(x):\n    return x + 1\n"
        "def reader():\n    yield from (1, 2)\n"
        "class Runner:\n"
        "    def run(self):\n        return 'ran'\n"
        "    @staticmethod\n    def helper():\n        return 'helped'\n"
        "    @classmethod\n    def make(cls):\n        return cls.__name__\n",
        lib.__dict__,
    )
    monkeypatch.setitem(sys.modules, "spfake_lib", lib)
    user.load = lib.load  # as `from spfake_lib import load` leaves it
    exec("def go():\n    return load(1)\n", user.__dict__)
    monkeypatch.setitem(sys.modules, "spfake_user", user)
    clock = sp.PhaseClock()
    targets = (
        sp.T("read", "spfake_lib:load", "lib.py:1"),
        sp.T("read", "spfake_lib:reader", "lib.py:3", kind="gen"),
        sp.T(None, "spfake_lib:Runner.run", "lib.py:5"),
        sp.T(None, "spfake_lib:Runner.helper", "lib.py:8"),
        sp.T(None, "spfake_lib:Runner.make", "lib.py:11"),
        sp.T(None, "spfake_lib:Runner.missing", "lib.py:99"),
        sp.T(None, "spfake_absent.module:f", "absent.py:1"),
        sp.T(None, "spfake_lib:load", "lib.py:1", "per tensor only", fine=True),
    )
    wrapped, notes = sp.install(clock, targets, fine=False)
    assert [w["label"] for w in wrapped] == ["load", "reader", "Runner.run", "Runner.helper", "Runner.make"]
    assert wrapped[0]["rebound_in"] == ["spfake_user"]
    assert len(notes) == 2 and "does not exist" in notes[0] and "not importable" in notes[1]
    assert user.go() == 2  # through the rebound name
    assert list(lib.reader()) == [1, 2]
    assert lib.Runner().run() == "ran" and lib.Runner.helper() == "helped" and lib.Runner.make() == "Runner"
    labels = clock.by_label()
    assert labels["load"]["calls"] == 1 and labels["reader"]["calls"] == 3
    assert labels["Runner.run"]["calls"] == labels["Runner.helper"]["calls"] == labels["Runner.make"]["calls"] == 1
    assert "per tensor only" not in clock.meta  # fine targets skipped with --detail coarse
    _, again = sp.install(clock, targets[:1])
    assert again == ["load: already wrapped"]


def test_parameters_weight_loaders_are_named_by_their_layer():
    torch = pytest.importorskip("torch")
    clock = sp.PhaseClock()

    class RoutedExperts:
        def weight_loader(self, param, loaded):
            param.data.copy_(loaded)

    class Linear:
        def weight_loader(self, param, loaded):
            param.data.copy_(loaded)

    model = torch.nn.Module()
    model.w13 = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    model.qkv = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    model.norm = torch.nn.Parameter(torch.zeros(2), requires_grad=False)  # no loader of its own
    model.w13.weight_loader = RoutedExperts().weight_loader
    model.qkv.weight_loader = Linear().weight_loader
    counts = sp.instrument_param_loaders(clock, model)
    assert counts == {sp.EXPERT_LOADER: 1, sp.OTHER_LOADER: 1, "not wrappable": 0}
    model.w13.weight_loader(model.w13, torch.ones(2))
    model.w13.weight_loader(model.w13, torch.ones(2))
    model.qkv.weight_loader(model.qkv, torch.ones(2))
    assert clock.group(sp.PER_TENSOR_LOADERS)[0] == 3
    assert clock.by_label()[sp.EXPERT_LOADER]["calls"] == 2
    assert float(model.w13.sum()) == 2.0
    assert sp.instrument_param_loaders(clock, model)[sp.EXPERT_LOADER] == 0  # never wrapped twice


def _record(name, llm, split, tokens, role="cut", **kw):
    return {
        "name": name,
        "role": role,
        "cut": name,
        "ok": True,
        "times": {"import_s": 10.0, "llm_init_s": llm},
        "split": split,
        "tokens": tokens,
        "weight_loader_calls": kw.pop("calls", 0),
        "weight_loader_s": kw.pop("wl_s", 0.0),
        "instrumentation": {"timer_cost_us": 1.0},
        "wrapped_calls_in_llm": 200000,
        **kw,
    }


def test_summary_compares_against_the_calls_auto_start():
    auto = _record(
        "auto",
        46.0,
        {"read": 4.0, "weight_loader": 10.0, "load_python": 16.0, "compile": 6.0, "outside": 10.0},
        [1, 2],
        role="reference",
        calls=92160,
        wl_s=10.0,
    )
    sharded = _record(
        "sharded_state_unprocessed", 20.0, {"read": 2.0, "weight_loader": 2.0, "compile": 6.0, "outside": 10.0}, [1, 2]
    )
    different = _record("enforce_eager", 30.0, {"outside": 30.0}, [1, 3])
    skipped = {
        "name": "fastsafetensors",
        "role": "cut",
        "cut": "fastsafetensors",
        "ok": False,
        "skipped": "not installed: fastsafetensors",
    }
    failed = {"name": "sharded_state", "role": "cut", "cut": "sharded_state", "ok": False, "error": "KeyError: 'w13_weight'"}
    warm = _record("warmup", 180.0, {"outside": 180.0}, [1, 2], role="warmup")
    records = [warm, auto, sharded, different, skipped, failed]
    summary = sp.summarize(records)
    rows = {r["name"]: r for r in summary["rows"]}
    assert summary["reference"] == "auto"
    assert rows["sharded_state_unprocessed"]["llm_init_s_ratio"] == pytest.approx(20 / 46, abs=1e-3)
    assert rows["sharded_state_unprocessed"]["start_s_ratio"] == pytest.approx(30 / 56, abs=1e-3)
    assert rows["sharded_state_unprocessed"]["model_loading_s"] == 4.0
    assert rows["sharded_state_unprocessed"]["model_loading_s_ratio"] == pytest.approx(4 / 30, abs=1e-3)
    assert rows["sharded_state_unprocessed"]["same_tokens_as_auto"] is True
    assert rows["enforce_eager"]["same_tokens_as_auto"] is False
    assert rows["auto"]["timer_cost_estimate_s"] == 0.2
    assert (
        rows["fastsafetensors"]["why_not"] == "not installed: fastsafetensors"
        and "llm_init_s_ratio" not in rows["fastsafetensors"]
    )
    md = sp.markdown(summary, records)
    header = md.splitlines()[0]
    assert header.split(" | ")[1:] == [
        "warmup",
        "auto",
        "sharded_state_unprocessed",
        "enforce_eager",
        "fastsafetensors",
        "sharded_state |",
    ]
    assert "| LLM() | 180.00 (3.91x) | 46.00 (1.00x) | 20.00 (0.43x) |" in md
    assert "| per-tensor weight_loader calls | 0 | 92160 | 0 | 0 |  |  |" in md
    assert "not installed: fastsafetensors" in md and "KeyError: 'w13_weight'" in md and "| NO |" in md


def test_cuts_start_with_auto_and_refuse_unknown_names():
    assert [c.name for c in sp.parse_cuts("mtload,auto,mtload")] == ["auto", "mtload"]
    with pytest.raises(SystemExit):
        sp.parse_cuts("auto,quick")
    assert all(c.requires is None or c.args.get("load_format") for c in sp.CUTS.values())


@pytest.fixture(scope="module")
def smoke_model(tmp_path_factory):
    """The --cpu-smoke-test checkpoint, written once for the tests that start the stand-in (a few seconds)."""
    return sp._smoke_model(tmp_path_factory.mktemp("smoke"))


@pytest.mark.slow
def test_one_start_against_the_stand_in_vllm(tmp_path, smoke_model):
    """The protocol end to end on the CPU: a fresh process per start, the vLLM functions missing and noted, the stand-in's
    own functions wrapped and split; a reader that is not installed is reported, not started (about 10 s)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "fake_vllm"), str(ROOT)])}
    env.pop("VLLM_CACHE_ROOT", None)
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), str(tmp_path / "work"), str(out), "--cpu-smoke-test", "--no-warmup"]
    cmd += ["--model", str(smoke_model)]
    done = subprocess.run([*cmd, "--cuts", "auto,fastsafetensors"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((out / "start-profile.json").read_text())
    starts = {s["name"]: s for s in result["starts"]}
    auto = starts["auto"]
    assert auto["ok"], auto.get("error")
    assert auto["model"].endswith("start-profile/model") and auto["model_target"].endswith("lowlatency")
    assert sum(auto["split"].values()) == pytest.approx(auto["times"]["llm_init_s"], abs=2e-3)
    paths = [p["path"] for p in auto["phases"]]
    assert (
        paths.index("LLM()")
        < paths.index("LLM() > fake vLLM: TorchBackend.load")
        < paths.index("LLM() > fake vLLM: TorchBackend.load > fake vLLM: _read_tensors")
    )
    assert auto["split"]["read"] > 0 and auto["split"]["process_weights"] > 0
    assert any("process_weights_after_loading: not wrapped" in n for n in auto["notes"])
    assert len(auto["tokens"]) == sp.NEW_TOKENS
    assert len(auto["prompt_logprobs"]) == sp.PROMPT_LEN - 1  # every position but the first, compared across starts
    if importlib.util.find_spec("fastsafetensors") is None:
        assert starts["fastsafetensors"]["skipped"].startswith("not installed: fastsafetensors")
    assert (out / "start-profile.md").exists() and (out / "start-profile-starts.tgz").exists()


@pytest.mark.slow
def test_a_start_stopped_at_the_budget_keeps_what_it_timed(tmp_path, monkeypatch, smoke_model):
    """The call's budget ends inside LLM(): the start is asked to stop (SIGTERM) and its record keeps the phases timed
    until then, marked as stopped at the budget, instead of 'the start left no record' (about 6 s)."""
    monkeypatch.setattr(sp, "RESERVE_S", 0)
    monkeypatch.setattr(sp, "STOP_GRACE_S", 8)
    monkeypatch.setattr(sp, "MIN_START_S", 1)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests" / "fake_vllm"), str(ROOT)]))
    monkeypatch.setenv("FAKE_VLLM_INIT_S", "120")
    root = tmp_path / "start-profile"
    root.mkdir()
    model = smoke_model
    args, env = sp.stand_in_engine()
    # 12 s of budget: 4 s for the start after the grace, then SIGTERM (most likely while LLM() sleeps in the stand-in;
    # on a busy machine perhaps still in an import, which is as good: the record keeps whatever was timed)
    call = sp.Call(root, model.resolve(), root / "model", args, env, "fine", True, 12.0, None)
    rec = call.start("auto", "compared", sp.CUTS["auto"])
    assert rec["timed_out"] and rec["stopped_at_budget"], rec.get("error")
    assert "stopped at the call's budget" in rec["error"]
    assert "import vllm" in {p["path"] for p in rec["phases"]}  # what ran before the stop is in the record
    assert rec["process_wall_s"] < 12


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (["--engine-env", "A B=1"], "should be NAME=VALUE"),
        (["--engine-env", "VLLM_ENABLE_V1_MULTIPROCESSING=1"], "splicer sets VLLM_ENABLE_V1_MULTIPROCESSING itself"),
        (
            ["--cuts", "auto,no_autotune", "--engine-env", "VLLM_TRITON_FORCE_FIRST_CONFIG=1"],
            "a cut of --cuts sets it",
        ),
    ],
)
def test_engine_env_is_checked_as_ablates_before_anything_starts(tmp_path, capsys, given, said):
    """--engine-env takes what ablate's --engine-env takes, and no variable a chosen cut sets (the cut would be
    compared with itself); refused in one line (argparse's exit 2) before any folder is made."""
    with pytest.raises(SystemExit) as e:
        sp.main([str(tmp_path / "work"), str(tmp_path / "out"), *given])
    assert e.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()
