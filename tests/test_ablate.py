"""`ablate` end to end on the torch reference backend (CPU): results, exactness, resumption, failures, lock, table."""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

import pytest

from splicer.ablate import AblateSettings, run_ablate
from splicer.backends.torch_ref import TorchBackend
from splicer.cli import main
from splicer.errors import SplicerError

# Timing: 12 tokens a run, 3 runs. With 4 tokens (3 decode steps of a few ms) a loaded CPU drowned the difference of
# two generate() calls in their jitter and the median came out <= 0, which the backend reports as no time (None).
PLAN = """
name = "tiny"
top_k = 20
[[corpus]]
name = "wiki-en"
kind = "builtin"
text = "wiki-en"
chunk_tokens = 64
max_chunks = 3
[[corpus]]
name = "chat"
kind = "chat"
conversations = 3
answer_tokens = 8
[timing]
prompt_tokens = 32
new_tokens = 12
warmup = 0
runs = 3
[[row]]
name = "build"
restore = []
[[row]]
name = "gdn"
restore = ["gdn"]
[[row]]
name = "lm_head"
restore = ["lm_head"]
[[row]]
name = "all"
keep = []
[[row]]
name = "base"
base = true
"""


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("plan") / "tiny.toml"
    p.write_text(PLAN)
    return p


def _settings(**kw):
    return AblateSettings(device="cpu", progress=False, bootstrap=100, **kw)


@pytest.fixture(scope="module")
def finished(pairs, plan_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("ablate")
    p = pairs["fused"]
    results = run_ablate("all", str(p["lowlatency"]), str(p["base"]), out, str(plan_file), _settings())
    return out, results


def test_results_file(finished):
    out, results = finished
    on_disk = json.loads((out / "results.json").read_text())
    assert [v["name"] for v in on_disk["variants"]] == ["build", "gdn", "lm_head", "all", "base"]
    assert all(v["status"] == "ok" for v in on_disk["variants"])
    for key in ("noise_floor", "backend", "engine_version", "device", "inputs", "corpora"):
        assert on_disk[key], key
    assert on_disk["top_k"] == 20  # what the table's KL note names
    assert all(m["top1_ties"] == "symmetric" for v in on_disk["variants"] for m in v["metrics"].values())
    assert on_disk["inputs"]["build"]["header_digest"] and on_disk["inputs"]["base"]["digest"]
    v = on_disk["variants"][0]
    assert set(v) >= {"name", "restored", "size_bytes", "metrics", "decode_ms_per_token"}
    assert set(v["metrics"]) == {"wiki-en", "chat"}
    assert v["metrics"]["wiki-en"]["dnll"] is None and v["metrics"]["chat"]["dnll"] is not None
    assert v["metrics"]["wiki-en"]["positions"] == 3 * 63
    # the chat corpus's conversations are units by group (3 conversations: 3 groups of one), the text corpus's by sequence
    assert v["metrics"]["chat"]["groups"] == 3 and v["metrics"]["wiki-en"]["groups"] is None
    from splicer.analysis.verdicts import load_scores

    assert load_scores(out, "build", "chat")["group"].unique().tolist() == [0, 1, 2]
    assert "group" not in load_scores(out, "build", "wiki-en")
    assert v["decode_ms_per_token"] > 0
    caption, table = (out / "table.md").read_text().split("\n\n", 2)[:2]
    assert caption.startswith("Build `") and table.startswith("| variant")


def test_restoring_everything_reproduces_the_base(finished):
    """Spliced back whole, the build scores exactly as the base: KL 0 and top-1 100 % on every corpus."""
    _, results = finished
    rows = {v["name"]: v for v in results["variants"]}
    for name in ("all", "base"):
        for corpus, m in rows[name]["metrics"].items():
            assert m["top1"] == 1.0 and m["kl"] == pytest.approx(0, abs=1e-7) and m["kl_full"] == pytest.approx(0, abs=1e-7), (
                name,
                corpus,
            )
            if m["dnll"] is not None:
                assert m["dnll"] == pytest.approx(0, abs=1e-7)
    build = rows["build"]["metrics"]["wiki-en"]
    assert build["kl"] > 0.01 and build["top1"] < 1.0
    # The paired difference from the build is the difference of the two weighted means, per corpus and pooled.
    paired = rows["gdn"]["vs_build"]["kl"]
    assert paired["per_stratum"]["wiki-en"]["diff"] == pytest.approx(
        rows["gdn"]["metrics"]["wiki-en"]["kl"] - build["kl"], abs=1e-6
    )
    positions = {c: m["positions"] for c, m in rows["build"]["metrics"].items()}
    pooled_build = sum(rows["build"]["metrics"][c]["kl"] * n for c, n in positions.items()) / sum(positions.values())
    pooled_gdn = sum(rows["gdn"]["metrics"][c]["kl"] * n for c, n in positions.items()) / sum(positions.values())
    assert paired["pooled"]["rel"] == pytest.approx(pooled_gdn / pooled_build - 1, rel=1e-5)
    # Three sequences per corpus support no interval: no verdict either, and results.json says why.
    from splicer.analysis.metrics import TOO_FEW

    assert paired["pooled"]["rel_ci"] is None and paired["pooled"]["significant"] is None
    assert paired["pooled"]["why"] == TOO_FEW and paired["per_stratum"]["wiki-en"]["clusters"] == 3
    assert rows["gdn"]["metrics"]["wiki-en"]["kl_ci"] is None and rows["gdn"]["metrics"]["wiki-en"]["sequences"] == 3


def test_rerun_skips_finished_rows(finished, pairs, plan_file, monkeypatch):
    out, results = finished
    calls = []
    orig = TorchBackend.score
    monkeypatch.setattr(TorchBackend, "score", lambda self, *a, **k: calls.append(1) or orig(self, *a, **k))
    p = pairs["fused"]
    again = run_ablate("all", str(p["lowlatency"]), str(p["base"]), out, str(plan_file), _settings())
    assert calls == []  # base pass cached, every row already finished
    assert [v["metrics"] for v in again["variants"]] == [v["metrics"] for v in results["variants"]]


def test_table_formats(finished, capsys):
    out, _ = finished
    assert main(["table", str(out), "--format", "csv"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("variant,restored,status") and len(lines) == 6
    assert main(["table", str(out), "--format", "json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 5


def test_chosen_rows_and_a_failing_variant(pairs, plan_file, tmp_path, monkeypatch):
    orig = TorchBackend.load

    def load(self, folder):
        if Path(folder).name == "lm_head":
            raise RuntimeError("CUDA out of memory (simulated)")
        return orig(self, folder)

    monkeypatch.setattr(TorchBackend, "load", load)
    p = pairs["fused"]
    results = run_ablate(
        "gdn,lm_head", str(p["lowlatency"]), str(p["base"]), tmp_path, str(plan_file), _settings(time_decode=False)
    )
    rows = {v["name"]: v for v in results["variants"]}
    assert list(rows) == ["build", "gdn", "lm_head"]
    assert rows["lm_head"]["status"] == "error" and "out of memory" in rows["lm_head"]["error"]
    assert rows["gdn"]["status"] == "ok" and rows["gdn"]["decode_ms_per_token"] is None
    assert "failed" in (tmp_path / "table.md").read_text()
    monkeypatch.setattr(TorchBackend, "load", orig)
    more = run_ablate("all", str(p["lowlatency"]), str(p["base"]), tmp_path, str(plan_file), _settings(time_decode=False))
    # the rerun keeps finished rows, retries the failed one and adds the rest, in plan order
    assert [v["name"] for v in more["variants"]] == ["build", "gdn", "lm_head", "all", "base"]
    assert more["variants"][1]["metrics"] == rows["gdn"]["metrics"] and more["variants"][2]["status"] == "ok"


def test_second_run_on_same_dir_is_refused(pairs, plan_file, tmp_path):
    tmp_path.mkdir(exist_ok=True)
    with open(tmp_path / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        p = pairs["fused"]
        with pytest.raises(SplicerError, match="another splicer ablate"):
            run_ablate("all", str(p["lowlatency"]), str(p["base"]), tmp_path, str(plan_file), _settings())


def test_bad_rows_and_plans(pairs, plan_file, tmp_path):
    p = pairs["fused"]
    with pytest.raises(SplicerError, match="not in plan tiny"):
        run_ablate("rotary", str(p["lowlatency"]), str(p["base"]), tmp_path / "a", str(plan_file), _settings())
    bad = tmp_path / "bad.toml"
    bad.write_text(PLAN.replace('name = "gdn"\nrestore = ["gdn"]', 'name = "gdn"\nrestore = ["gdm"]'))
    with pytest.raises(SplicerError, match="unknown class 'gdm'"):
        run_ablate("all", str(p["lowlatency"]), str(p["base"]), tmp_path / "b", str(bad), _settings())


def test_demo_from_the_cli(tmp_path, capsys):
    """The README's first command: the whole pipeline on the built-in pair, on CPU, no network. Decode timing is left
    out here (6 of its 22 s): .ci/run runs the demo with it, from the installed wheel."""
    assert main(["ablate", "all", "--demo", "-q", "--no-time", "-o", str(tmp_path / "demo")]) == 0
    results = json.loads((tmp_path / "demo" / "results.json").read_text())
    rows = {v["name"]: v for v in results["variants"]}
    assert all(v["status"] == "ok" for v in rows.values())
    assert set(results["corpora"]) == {"wiki-zh", "wiki-en", "chat"}
    assert rows["build"]["metrics"]["chat"]["groups"] == 12  # the demo's 12 conversations are 12 groups of one
    assert all(m["kl"] == pytest.approx(0, abs=1e-7) for m in rows["all"]["metrics"].values())
    assert "Additivity" in (tmp_path / "demo" / "table.md").read_text()
    assert "Speed per variant" not in (tmp_path / "demo" / "table.md").read_text()  # torch: no engine log to report


def test_plan_name_beside_a_folder_of_that_name(tmp_path, monkeypatch):
    from splicer.plans.plan import load_plan

    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()  # e.g. a results folder called demo
    from splicer.arch import all_classes

    assert load_plan("demo", all_classes()).name == "demo"


def test_compare_any_two_variants(finished, capsys):
    out, results = finished
    assert main(["compare", str(out), "gdn", "lm_head"]) == 0
    text = capsys.readouterr().out
    rows = {v["name"]: v for v in results["variants"]}
    expected = rows["gdn"]["metrics"]["wiki-en"]["kl"] - rows["lm_head"]["metrics"]["wiki-en"]["kl"]
    line = next(x for x in text.splitlines() if x.startswith("| wiki-en"))
    assert f"{expected:+.5f}" in line
    assert main(["compare", str(out), "gdn", "nope"]) == 2


def test_decode_floor_column(pairs, plan_file, tmp_path):
    """bytes read per decode step (from inspect) over the bandwidth, beside each decode time."""
    from splicer.checkpoint import open_checkpoint
    from splicer.splice.inspect import inspect_checkpoint

    p = pairs["fused"]
    res = run_ablate(
        "gdn", str(p["lowlatency"]), str(p["base"]), tmp_path, str(plan_file), _settings(time_decode=False, bandwidth_gbs=4800)
    )
    rows = {v["name"]: v for v in res["variants"]}
    want = inspect_checkpoint(open_checkpoint(p["lowlatency"], "b"))["total_bytes_per_decode_step"]
    assert rows["build"]["bytes_per_decode_step"] == want
    assert rows["gdn"]["bytes_per_decode_step"] > want  # BF16 GDN projections read more bytes
    table = (tmp_path / "table.md").read_text()
    assert "floor ms @ 4.8 TB/s" in table and f"{1000 * want / 4.8e12:.3f}" in table


def test_speed_table_separates_an_engine_start_from_the_wait_for_it():
    from splicer.analysis.table import speed_rows

    timing = {
        "decode_ms_per_token": 4.0,
        "decode_iqr": [3.9, 4.1],
        "decode_min_max": [3.8, 4.2],
        "ttft_ms": 100,
        "ttft_min_max": [90, 110],
        "method": "engine: token times",
    }
    results = {
        "corpora": {"en": {"positions": 1000}},
        "base_pass": {"engine": {"startup_s": 250.0}, "timings": {"load_s": 260.0}},
        "variants": [
            {
                "name": "build",
                "status": "ok",
                "timing": timing,
                "engine": {"startup_s": 240.0, "startup_breakdown": {"compile_s": 30.0}},
                "elapsed": {"load_s": 0.5, "score_en_s": 0.1},
            }
        ],
    }
    headers, rows = speed_rows(results)
    col = {h: i for i, h in enumerate(headers)}
    base, build = rows
    assert (base[col["engine start s"]], base[col["waited s"]]) == ("250", "260")
    assert (build[col["engine start s"]], build[col["waited s"]]) == ("240", "0")  # started ahead of its turn
    assert build[col["scoring positions/s (all corpora)"]] == "10,000"


def test_report_sentences_are_the_recorded_verdicts(finished, capsys):
    """splicer report: one sentence per row, its figures and verdict words taken from results.json's paired estimates."""
    from splicer.analysis.formatting import fmt_change

    out, results = finished
    assert main(["report", str(out)]) == 0
    text = capsys.readouterr().out
    assert text == (out / "report.md").read_text()  # ablate wrote the same findings beside table.md
    for v in results["variants"]:
        if v["name"] == "build" or v.get("repeat_of") or v.get("status") != "ok":
            continue
        line = next(x for x in text.splitlines() if x.startswith(f"- {v['name']} "))
        kl = v["vs_build"]["kl"]["pooled"]
        # three sequences per corpus: the estimate without an interval, and the sentence says why
        clause = "ΔKL " + fmt_change(kl["rel"], None, None, 100, " % of the build's KL") + " (too few sequences for an interval)"
        assert clause in line and "significant" not in line, (clause, line)
    table = (out / "table.md").read_text()
    assert "(too few sequences)" in table and "n.s." not in table.split("\n\n")[1]
    assert main(["report", str(out / "nope")]) == 2


def test_chosen_rows_bring_the_builds_repeats_and_report_only_their_own_skips(pairs, plan_file, tmp_path):
    """`ablate lm_head`: the build and its other engines run too (they set every decode interval); a row nobody asked
    for is neither run nor listed as skipped."""
    plan = tmp_path / "rep.toml"
    plan.write_text(
        plan_file.read_text() + '\n[[row]]\nname = "gdn-twin"\nrestore = ["gdn"]\n'
        '\n[[row]]\nname = "build-again"\nrestore = []\nrepeat = true\n'
    )
    p = pairs["fused"]
    results = run_ablate(
        "lm_head", str(p["lowlatency"]), str(p["base"]), tmp_path / "out", str(plan), _settings(time_decode=False)
    )
    assert [v["name"] for v in results["variants"]] == ["build", "lm_head", "build-again"]
    assert results["variants"][2]["repeat_of"] == "build" and results["skipped"] == []
    both = run_ablate(
        "gdn,gdn-twin", str(p["lowlatency"]), str(p["base"]), tmp_path / "out2", str(plan), _settings(time_decode=False)
    )
    assert [s["name"] for s in both["skipped"]] == ["gdn-twin"]


def test_compile_targets_fill_every_process_once_then_the_base_pass_gpu(monkeypatch):
    """--gpus with --precompile: the first compiles go one per process, the other GPUs' first; the rest to the GPU of
    the base pass, so the other GPUs' processes end after one compile and their rows start right after the base pass."""
    import itertools

    from splicer.backends.gpus import core_shares, cuda_ids
    from splicer.plans.spread import compile_targets

    assert list(itertools.islice(compile_targets([2, 3]), 7)) == [1, 1, 1, 0, 0, 0, 0]
    assert list(itertools.islice(compile_targets([0, 2]), 4)) == [1, 1, 1, 1]
    assert list(itertools.islice(compile_targets([3]), 4)) == [0, 0, 0, 0]
    shares = core_shares(2)
    assert shares[0] and not set(shares[0]) & set(shares[1])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert cuda_ids(("0", "1")) == ["4", "6"]
    with pytest.raises(SplicerError, match="CUDA_VISIBLE_DEVICES shows 2"):
        cuda_ids(("0", "2"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpus", "0"], "two or more distinct CUDA device ids"),
        (["--gpus", "0,0"], "two or more distinct CUDA device ids"),
        (["--gpus", "0,x"], "two or more distinct CUDA device ids"),
        (["--gpus", "0,1"], "apply to --backend vllm only"),
        (["--backend", "vllm", "--gpus", "0,1", "--overlap-starts", "1"], "drop --overlap-starts"),
        (["--backend", "vllm", "--gpus", "0,1", "--device", "cuda:0"], "drop --device"),
    ],
)
def test_gpus_flag_refusals_are_one_line(args, message, tmp_path, capsys):
    from splicer.cli import main

    code = main(["ablate", "all", "--demo", "-o", str(tmp_path / "o"), *args])
    err = capsys.readouterr().err
    assert code != 0 and message in err and "Traceback" not in err and not (tmp_path / "o").exists()


def test_spread_lanes_a_gpu_that_cannot_serve_the_build_takes_no_rows_and_no_time_runs_one_build():
    """A GPU whose first engine of the build fails takes nothing from the queue (each row would fail fast there); with
    decode timing off only the first GPU runs the build and the plan's repeat rows run as other rows."""
    import threading

    from splicer.plans.plan import PlannedRow, Row
    from splicer.plans.spread import gpu_build_rows, run_rows_on_gpus

    build = PlannedRow(Row("build", restore=[]), [], "build")
    rows = [PlannedRow(Row(n, restore=[n]), [n], n) for n in ("gdn", "attention", "lm_head")]
    again = PlannedRow(Row("build-again", restore=[], repeat=True), [], "build")
    firsts, lasts, queue_rows, replaced = gpu_build_rows([build, *rows, again], ("0", "1"))
    assert [f.row.name for f in firsts] == ["build", "build-gpu1"] and [x.row.name for x in lasts] == [
        "build-end-gpu0",
        "build-end-gpu1",
    ]
    assert replaced == [again] and queue_rows == rows
    ran, lock = [], threading.Lock()

    def run_one(item, backend, gpu):
        with lock:
            ran.append((gpu, item.row.name))
        return {"name": item.row.name, "status": "error" if gpu == "1" else "ok"}

    run_rows_on_gpus([("0", None), ("1", None)], firsts, lasts, queue_rows, run_one, lambda item, entry: None)
    assert [n for g, n in ran if g == "1"] == ["build-gpu1"]
    assert [n for g, n in ran if g == "0"] == ["build", "gdn", "attention", "lm_head", "build-end-gpu0"]
    untimed = gpu_build_rows([build, *rows, again], ("0", "1"), timed=False)
    assert untimed == ([build, None], [None, None], [*rows, again], [])


def test_output_survives_a_stdout_that_is_not_utf8(finished, capsys):
    """PYTHONIOENCODING=ascii (a latin-1 console, a C locale): table, report and compare print the same text with
    ASCII spellings (Δ as d, − as -, ± as +/-) instead of ending in a UnicodeEncodeError; DIR is left as it was. The
    three commands run through the CLI's main in one process (one interpreter start, not three), each exit code kept."""
    import os
    import subprocess
    import sys

    from splicer.io.console import HANDLER

    from .conftest import tree_digest

    out, _ = finished
    commands = [["table", str(out)], ["report", str(out)], ["compare", str(out), "gdn", "lm_head"]]
    before = tree_digest(out)
    utf8 = []
    for argv in commands:
        assert main(argv) == 0
        utf8.append(capsys.readouterr().out)
        assert not utf8[-1].isascii(), argv  # each output has symbols an ASCII stdout cannot hold
    marker = "----- next command -----"
    code = (
        "import sys\nfrom splicer.cli import main\ncodes = []\n"
        f"for argv in {commands!r}:\n"
        f"    codes.append(main(argv)); print({marker!r}, flush=True)\n"
        "sys.exit(max(codes))\n"
    )
    env = dict(os.environ, PYTHONIOENCODING="ascii", PYTHONPATH=str(Path(__file__).parents[1]), HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env)
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr.decode(errors="replace")
    got = r.stdout.decode("ascii").split(marker + "\n")
    assert got[:3] == [text.encode("ascii", errors=HANDLER).decode("ascii") for text in utf8] and got[3] == ""
    assert tree_digest(out) == before


def test_settings_are_fixed_for_the_run_and_the_backend_options_are_the_backends_own():
    """A run's settings cannot change while it runs; a backend's options are made, checked and recorded by the
    backend (job.json's settings read back for `budget --verify` give the same options), and options of one backend
    are refused for another."""
    import dataclasses

    from splicer.backends import backend_options, options_type

    settings = AblateSettings(device="cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.device = "cuda"
    assert settings.backend_options == options_type("torch")()
    vllm = backend_options("vllm", {"gpus": ("0", "1"), "engine_env": {"A": "1"}, "engine_args": {"max_model_len": 64}})
    assert vllm.context_length() == 64 and vllm.gpus == ("0", "1")
    assert options_type("vllm").from_job(vllm.job_settings()).job_settings() == vllm.job_settings()
    assert vllm.job_settings()["gpus"] == ["0", "1"] and "gpus" not in options_type("vllm")().job_settings()
    with pytest.raises(SplicerError, match="options of the vllm backend given for --backend torch"):
        AblateSettings(backend_options=vllm)
    with pytest.raises(SplicerError, match="unknown backend 'tpu'"):
        AblateSettings(backend="tpu")
