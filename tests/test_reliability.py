"""Faults: killed splices and ablates, a full disk, a read-only or foreign output filesystem, changed inputs, untrusted files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from splicer.ablate import AblateSettings, run_ablate
from splicer.backends.torch_ref import TorchBackend
from splicer.errors import SplicerError

from .test_ablate import PLAN
from .test_splice import bit_equal, load_all

ROOT = Path(__file__).parents[1]


def _cli(*args, env=None):
    e = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "splicer", *map(str, args)], capture_output=True, text=True, env=e)


@pytest.fixture(scope="module")
def reference(pairs, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "gdn"
    r = _cli("splice", "-q", "--restore", "gdn,lm_head", pairs["fused"]["lowlatency"], pairs["fused"]["base"], "-o", out)
    assert r.returncode == 0, r.stderr
    return load_all(out)


def _same(out: Path, reference) -> bool:
    got = load_all(out)
    return set(got) == set(reference) and all(bit_equal(got[k], reference[k]) for k in reference)


@pytest.mark.parametrize("fault", ["splice:shard-written#1", "splice:shard-written#2", "splice:before-rename"])
def test_killed_splice_leaves_no_out_and_the_rerun_succeeds(pairs, tmp_path, reference, fault):
    p = pairs["fused"]
    out = tmp_path / "out"
    args = ("splice", "-q", "--restore", "gdn,lm_head", p["lowlatency"], p["base"], "-o", out)
    killed = _cli(*args, env={"SPLICER_FAULT": fault})
    assert killed.returncode == -9
    assert not out.exists() and (tmp_path / ".out.splicer-partial").exists()
    again = _cli(*args)
    assert again.returncode == 0, again.stderr
    assert not (tmp_path / ".out.splicer-partial").exists()
    assert _same(out, reference)


def test_killed_between_the_renames_of_force_recovers(pairs, tmp_path, reference):
    p = pairs["fused"]
    out = tmp_path / "out"
    assert _cli("splice", "-q", "--restore", "attention", p["lowlatency"], p["base"], "-o", out).returncode == 0
    args = ("splice", "-q", "--force", "--restore", "gdn,lm_head", p["lowlatency"], p["base"], "-o", out)
    assert _cli(*args, env={"SPLICER_FAULT": "splice:between-renames"}).returncode == -9
    assert not out.exists()  # the old OUT is parked beside it
    assert _cli(*args).returncode == 0
    assert _same(out, reference) and not (tmp_path / ".out.splicer-old").exists()


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs (root only); skipped where mounting is not allowed."""
    mnt = tmp_path / "small"
    mnt.mkdir()

    def mount(options):
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True)
        if r.returncode:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        return mnt

    yield mount
    subprocess.run(["umount", str(mnt)], capture_output=True)


def test_disk_full_is_one_line_and_leaves_nothing(pairs, small_fs):
    mnt = small_fs("size=1m")
    p = pairs["fused"]
    r = _cli("splice", "-q", "--restore", "all", p["lowlatency"], p["base"], "-o", mnt / "out")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "no space left" in r.stderr and "Traceback" not in r.stderr
    assert list(mnt.iterdir()) == []


def test_read_only_parent(pairs, small_fs):
    mnt = small_fs("ro,size=1m")
    p = pairs["fused"]
    r = _cli("splice", "-q", "--restore", "gdn", p["lowlatency"], p["base"], "-o", mnt / "out")
    assert r.returncode == 2 and "cannot write under" in r.stderr and r.stderr.strip().count("\n") == 0


@pytest.mark.parametrize("command", [["fixture"], ["ablate", "all", "--demo", "-q", "-o"]])
def test_a_fixture_or_demo_pair_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys, command):
    """safetensors reports a full disk as its own SafetensorError, not an OSError: the fixture (and the demo, which
    writes its pair first) still end in one line naming the folder and the fix, with nothing left."""
    from safetensors import SafetensorError

    import splicer.fixtures.core
    from splicer.cli import main

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(splicer.fixtures.core, "save_file", full)
    assert main([*command, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no space left on the device holding" in err, err
    assert list(tmp_path.iterdir()) == []


def test_out_on_another_filesystem_is_copied(pairs, reference):
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == pairs["fused"]["lowlatency"].stat().st_dev:
        pytest.skip("no second filesystem at /dev/shm")
    out = shm / f"splicer-test-{os.getpid()}"
    try:
        r = _cli("splice", "-q", "--restore", "gdn,lm_head", pairs["fused"]["lowlatency"], pairs["fused"]["base"], "-o", out)
        assert r.returncode == 0, r.stderr
        record = json.loads((out / "splice.json").read_text())
        assert record["shards"]["linked"] == 0 and record["shards"]["copied"] > 0
        assert _same(out, reference)
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture
def plan_file(tmp_path):
    p = tmp_path / "tiny.toml"
    p.write_text(PLAN)
    return p


def _count_loads(monkeypatch):
    loads = []
    orig = TorchBackend.load
    monkeypatch.setattr(TorchBackend, "load", lambda self, folder: loads.append(Path(folder).name) or orig(self, folder))
    return loads


def test_killed_ablate_reruns_only_unfinished_rows(pairs, plan_file, tmp_path, monkeypatch):
    p = pairs["fused"]
    out = tmp_path / "run"
    r = _cli(
        "ablate",
        "all",
        p["lowlatency"],
        p["base"],
        "-o",
        out,
        "--plan",
        plan_file,
        "--no-time",
        "-q",
        "--device",
        "cpu",
        env={"SPLICER_FAULT": "ablate:row-done#2"},
    )
    assert r.returncode == -9
    assert [v["name"] for v in json.loads((out / "results.json").read_text())["variants"]] == ["build", "gdn"]
    loads = _count_loads(monkeypatch)
    res = run_ablate(
        "all",
        str(p["lowlatency"]),
        str(p["base"]),
        out,
        str(plan_file),
        AblateSettings(device="cpu", progress=False, bootstrap=50, time_decode=False),
    )
    assert loads == ["lm_head", "all", "base"]  # neither the base pass nor the two finished rows again
    assert [v["name"] for v in res["variants"]] == ["build", "gdn", "lm_head", "all", "base"]
    # each invocation says what it did and on which CPU (a resumed run may land on another machine)
    assert [r["rows_run"] for r in res["runs"]] == [["build", "gdn"], ["lm_head", "all", "base"]]
    assert all(r["host"]["logical_cores"] == os.cpu_count() and r["host"]["cpu"] for r in res["runs"])


def test_changed_inputs_invalidate_caches(pairs, plan_file, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    build = tmp_path / "build"
    base = tmp_path / "base"
    shutil.copytree(pairs["fused"]["lowlatency"], build)
    shutil.copytree(pairs["fused"]["base"], base)
    out = tmp_path / "run"
    settings = AblateSettings(device="cpu", progress=False, bootstrap=50, time_decode=False)
    run_ablate("gdn", str(build), str(base), out, str(plan_file), settings)
    # the same inputs again: nothing recomputed
    loads = _count_loads(monkeypatch)
    run_ablate("gdn", str(build), str(base), out, str(plan_file), settings)
    assert loads == []
    # a rewritten build shard (other header) -> every row again, stale splices dropped; the base pass is kept
    shard = sorted(build.glob("model-0000[2-9]*.safetensors"))[0]
    save_file(load_file(str(shard)), str(shard), metadata={"format": "pt", "changed": "yes"})
    run_ablate("gdn", str(build), str(base), out, str(plan_file), settings)
    assert loads == ["build", "gdn"]
    # a rewritten base shard -> a new base pass too
    loads.clear()
    shard = sorted(base.glob("*.safetensors"))[0]
    save_file(load_file(str(shard)), str(shard), metadata={"format": "pt", "changed": "yes"})
    run_ablate("gdn", str(build), str(base), out, str(plan_file), settings)
    assert loads == ["base", "build", "gdn"]
    assert len(list((out / "cache").iterdir())) == 2


def test_failed_splice_is_recorded_and_the_plan_goes_on(pairs, plan_file, tmp_path, monkeypatch):
    import splicer.splice.core as sp

    orig = sp.splice

    def refuse(build, base, out, restore, **kw):
        if restore == "lm_head":
            raise SplicerError("refused for the test")
        return orig(build, base, out, restore, **kw)

    monkeypatch.setattr(sp, "splice", refuse)
    p = pairs["fused"]
    res = run_ablate(
        "gdn,lm_head",
        str(p["lowlatency"]),
        str(p["base"]),
        tmp_path / "r",
        str(plan_file),
        AblateSettings(device="cpu", progress=False, bootstrap=50, time_decode=False),
    )
    rows = {v["name"]: v for v in res["variants"]}
    assert rows["lm_head"]["status"] == "error" and rows["lm_head"]["error"] == "refused for the test"
    assert rows["gdn"]["status"] == "ok"


def test_untrusted_files_are_never_executed(pairs, tmp_path, plan_file):
    """A pickle and a remote-code module beside the weights: splicer reads safetensors and JSON only."""
    import pickle

    marker = tmp_path / "pwned"

    class Boom:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    build = tmp_path / "build"
    shutil.copytree(pairs["fused"]["lowlatency"], build)
    (build / "pytorch_model.bin").write_bytes(pickle.dumps(Boom()))
    (build / "evil.py").write_text(f"open({str(marker)!r}, 'w')\n")
    cfg = json.loads((build / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "evil.Config", "AutoModelForCausalLM": "evil.Model", "AutoTokenizer": ["evil.Tok", None]}
    (build / "config.json").write_text(json.dumps(cfg))
    for args in (
        ("inspect", build),
        ("splice", "-q", "--restore", "gdn", build, pairs["fused"]["base"], "-o", tmp_path / "o"),
        (
            "ablate",
            "gdn",
            build,
            pairs["fused"]["base"],
            "-o",
            tmp_path / "a",
            "--plan",
            plan_file,
            "--no-time",
            "-q",
            "--device",
            "cpu",
        ),
    ):
        r = _cli(*args)
        assert r.returncode == 0, r.stderr
        assert not marker.exists(), args


def test_rerun_after_a_kill_resumes_from_finished_shards(pairs, tmp_path, reference, monkeypatch):
    import splicer.splice.core as sp
    from splicer.splice.core import splice

    p = pairs["fused"]
    out = tmp_path / "out"
    killed = _cli(
        "splice",
        "-q",
        "--restore",
        "gdn,lm_head",
        p["lowlatency"],
        p["base"],
        "-o",
        out,
        env={"SPLICER_FAULT": "splice:shard-written#2"},
    )
    assert killed.returncode == -9
    written = []
    orig = sp.write_shard
    monkeypatch.setattr(sp, "write_shard", lambda path, *a, **k: written.append(path.name) or orig(path, *a, **k))
    record = splice(str(p["lowlatency"]), str(p["base"]), out, "gdn,lm_head", progress=False)
    assert record["shards"]["resumed"] == 2 and len(written) == record["shards"]["rewritten"] - 2
    assert _same(out, reference) and not (out / ".splice-progress.json").exists()
    # a partial folder from another plan is not reused
    killed = _cli(
        "splice",
        "-q",
        "--restore",
        "attention",
        p["lowlatency"],
        p["base"],
        "-o",
        tmp_path / "o2",
        env={"SPLICER_FAULT": "splice:before-rename"},
    )
    written.clear()
    record = splice(str(p["lowlatency"]), str(p["base"]), tmp_path / "o2", "gdn,lm_head", progress=False)
    assert record["shards"]["resumed"] == 0 and _same(tmp_path / "o2", reference)


def test_a_run_record_starts_when_the_invocation_began_not_when_its_base_pass_ended(pairs, plan_file, tmp_path, monkeypatch):
    import time
    from datetime import datetime

    import splicer.ablate.rows

    orig = splicer.ablate.rows.base_pass

    def slow_base_pass(*a, **k):
        time.sleep(3)  # a base pass that takes a while, as on a GPU from cold (run 9's: 237 s)
        return orig(*a, **k)

    monkeypatch.setattr(splicer.ablate.rows, "base_pass", slow_base_pass)  # where the rows stage calls it
    p = pairs["fused"]
    out = tmp_path / "run"
    t0 = time.time()
    res = run_ablate(
        "build",
        str(p["lowlatency"]),
        str(p["base"]),
        out,
        str(plan_file),
        AblateSettings(device="cpu", progress=False, bootstrap=20, time_decode=False),
    )
    started = datetime.strptime(res["runs"][-1]["started"] + "+0000", "%Y-%m-%dT%H:%M:%SZ%z").timestamp()
    assert started <= t0 + 1.5  # at the start (whole seconds), not 3 s later after the base pass


SMALL_PLAN = """
name = "small"
top_k = 5
[[corpus]]
name = "en"
kind = "builtin"
text = "wiki-en"
chunk_tokens = 32
max_chunks = 2
[[row]]
name = "build"
restore = []
[[row]]
name = "gdn"
restore = ["gdn"]
"""


def test_resume_does_not_depend_on_how_the_inputs_are_spelled(pairs, tmp_path, monkeypatch, capsys):
    """The same build, base and plan named relatively, then absolutely from another folder (and through a link): no
    row runs again. Another setting: the rows run again and one line names the field, old -> new."""
    from splicer.cli import main

    from .conftest import tree_digest

    work = tmp_path / "work"
    shutil.copytree(pairs["fused"]["lowlatency"], work / "build")
    shutil.copytree(pairs["fused"]["base"], work / "base")
    (work / "small.toml").write_text(SMALL_PLAN)
    before = tree_digest(work)
    out = tmp_path / "run"
    monkeypatch.chdir(work)
    assert (
        main(["ablate", "all", "build", "base", "-o", str(out), "--plan", "small.toml", "--no-time", "-q", "--device", "cpu"])
        == 0
    )
    first = json.loads((out / "results.json").read_text())
    assert first["job"]["build"]["source"] == str((work / "build").resolve())  # recorded by what it is
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "link").symlink_to(work)
    monkeypatch.chdir(elsewhere)
    loads = _count_loads(monkeypatch)
    capsys.readouterr()
    for build, base in ((work / "build", work / "base"), (Path("link/build"), Path("link/base"))):
        assert (
            main(
                [
                    "ablate",
                    "all",
                    str(build),
                    str(base),
                    "-o",
                    str(out),
                    "--plan",
                    str(work / "small.toml"),
                    "--no-time",
                    "-q",
                    "--device",
                    "cpu",
                ]
            )
            == 0
        )
    assert loads == []  # neither the base pass nor a finished row again
    assert "differs" not in capsys.readouterr().err
    again = json.loads((out / "results.json").read_text())
    assert [v["metrics"] for v in again["variants"]] == [v["metrics"] for v in first["variants"]]
    # one setting changed: every row again, and the line says which field and how
    assert (
        main(
            [
                "ablate",
                "all",
                str(work / "build"),
                str(work / "base"),
                "-o",
                str(out),
                "--plan",
                str(work / "small.toml"),
                "--no-time",
                "-q",
                "--device",
                "cpu",
                "--batch-size",
                "2",
            ]
        )
        == 0
    )
    err = [line for line in capsys.readouterr().err.splitlines() if "differs" in line]
    assert len(err) == 1 and "settings.batch_size: null -> 2" in err[0] and "build" not in err[0].split("(")[1], err
    assert loads == ["base", "build", "gdn"]
    assert tree_digest(work) == before  # inputs untouched


def test_a_run_with_failed_rows_exits_non_zero_and_says_so_last(pairs, tmp_path, monkeypatch, capsys):
    """The disk fills up while splicing: every spliced row fails with the one-line reason, the rows that need no
    splice are written, and the run ends with exit 1 and, last, how many rows failed and where to read why."""
    import errno

    import splicer.splice.core as sp
    from splicer.cli import main

    from .conftest import tree_digest

    def full(path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(sp, "write_shard", full)
    p = pairs["fused"]
    plan = tmp_path / "small.toml"
    plan.write_text(SMALL_PLAN + '[[row]]\nname = "lm_head"\nrestore = ["lm_head"]\n[[row]]\nname = "base"\nbase = true\n')
    before = {k: tree_digest(p[k]) for k in ("lowlatency", "base")}
    out = tmp_path / "run"
    code = main(
        [
            "ablate",
            "all",
            str(p["lowlatency"]),
            str(p["base"]),
            "-o",
            str(out),
            "--plan",
            str(plan),
            "--no-time",
            "-q",
            "--device",
            "cpu",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith("splicer: error: 2 of 4 rows failed: gdn, lm_head; see each row's error in "), err[-1]
    rows = {v["name"]: v for v in json.loads((out / "results.json").read_text())["variants"]}
    assert rows["build"]["status"] == rows["base"]["status"] == "ok" and rows["build"]["metrics"]["en"]["kl"] > 0
    assert all(
        rows[n]["status"] == "error" and rows[n]["error"].startswith("no space left on the device holding")
        for n in ("gdn", "lm_head")
    )
    assert "failed" in (out / "table.md").read_text() and not list(out.rglob("*.tmp"))
    assert not list((out / "variants").glob(".*partial*"))  # no half-written splice left behind
    assert {k: tree_digest(p[k]) for k in ("lowlatency", "base")} == before


def test_a_base_pass_on_a_full_disk_is_one_line_and_leaves_no_dir(pairs, tmp_path, monkeypatch, capsys):
    """The base pass's score cache is written with safetensors, whose full-disk error is its own SafetensorError: one
    line naming the file and the fix, exit 2, the new DIR removed, the inputs as they were."""
    import safetensors.torch
    from safetensors import SafetensorError

    from splicer.cli import main

    from .conftest import tree_digest

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    p = pairs["fused"]
    plan = tmp_path / "small.toml"
    plan.write_text(SMALL_PLAN)
    before = {k: tree_digest(p[k]) for k in ("lowlatency", "base")}
    out = tmp_path / "run"
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
                "--no-time",
                "-q",
                "--device",
                "cpu",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no space left on its device; free space there and run again" in err[0], err
    assert not out.exists() and {k: tree_digest(p[k]) for k in ("lowlatency", "base")} == before
