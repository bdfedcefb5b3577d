"""`splicer budget DIR --verify N` on a real (tiny) results folder: the chosen front points are added to DIR's job as
plan rows and run with DIR's own inputs and settings (finished rows kept), budget.json records each prediction against
its measurement, an interrupted verification is resumed as it was chosen, refusals change nothing; and plain
`splicer ablate` reruns only a plan's new or changed rows.

The tiny plan is ablated once per module (cpu, torch backend); tests that change the folder work on a copy."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest

from splicer.cli import main

from .conftest import tree_digest

PLAN_HEAD = """name = "budget-verify"
description = "single-entry rows, a whole-class row and a build repeat, for splicer budget --verify"
top_k = 20
[[corpus]]
name = "wiki-en"
kind = "builtin"
text = "wiki-en"
chunk_tokens = 16
max_chunks = 5
[timing]
prompt_tokens = 8
new_tokens = 3
warmup = 0
runs = RUNS
"""
ROWS = [
    ("build", []),
    ("gdn-1", ["gdn@0"]),
    ("gdn-2", ["gdn@1-2"]),
    ("gdn", ["gdn"]),
    ("attention", ["attention"]),
    ("build-again", [], True),
]


def _plan_text(rows=ROWS, runs=2) -> str:
    text = PLAN_HEAD.replace("RUNS", str(runs))
    for name, restore, *repeat in rows:
        text += f'[[row]]\nname = "{name}"\nrestore = {json.dumps(restore)}\n' + ("repeat = true\n" if repeat else "")
    return text


@pytest.fixture(scope="module")
def measured(pairs, tmp_path_factory):
    """The plan ablated once: {'dir', 'plan', 'build', 'base'}; never changed by a test (copy it with _copy)."""
    root = tmp_path_factory.mktemp("budget-verify")
    plan = root / "plan.toml"
    plan.write_text(_plan_text())
    build, base = Path(pairs["fused"]["lowlatency"]).resolve(), Path(pairs["fused"]["base"]).resolve()
    out = root / "run"
    assert main(["ablate", "all", str(build), str(base), "-o", str(out), "--plan", str(plan), "--device", "cpu", "-q"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [(v["name"], v["status"]) for v in results["variants"]] == [(n, "ok") for n, *_ in ROWS]
    return {"dir": out, "plan": plan, "build": build, "base": base}


def _copy(measured, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(measured["dir"], dst)
    return dst


def _results(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


def _budget(folder: Path) -> dict:
    return json.loads((folder / "budget.json").read_text())


def _variants(results: dict) -> dict:
    return {v["name"]: v for v in results["variants"]}


def _lowest_unmeasured(front: list[dict]) -> dict:
    """The point `--verify 1` must choose: the front's lowest predicted KL that no row measured."""
    todo = [e for e in front if e["measured_row"] is None and e["atoms"]]
    assert todo, "the tiny plan's front holds no unmeasured point"
    return min(todo, key=lambda e: e["kl"])


def _by_hand(results: dict, atoms: list[str], additivity: dict) -> float:
    """A prediction computed independently of splicer.analysis.budget: the build's KL less its atoms' reductions (each measured
    by the row restoring that entry alone), summed per class times that class's slope when the class has several atoms,
    then summed across classes times the across slope when there are several classes."""
    v = _variants(results)
    single = {tuple(x["restored"]): x for x in v.values() if x["status"] == "ok" and not x.get("repeat_of")}
    b = v["build"]["metrics"]["wiki-en"]["kl"]
    per_class: dict[str, list[float]] = {}
    for a in atoms:
        per_class.setdefault(a.partition("@")[0], []).append(b - single[(a,)]["metrics"]["wiki-en"]["kl"])
    sums = [(additivity["within"].get(c, 1.0) if len(ds) > 1 else 1.0) * sum(ds) for c, ds in per_class.items()]
    across = additivity["across"] if additivity["across"] is not None else 1.0
    return b - (across * sum(sums) if len(sums) > 1 else sum(sums))


def test_verify_runs_the_chosen_point_keeps_the_rest_and_records_prediction_against_measurement(measured, tmp_path, capsys):
    folder = _copy(measured, tmp_path)
    before = _results(folder)
    assert main(["budget", str(folder)]) == 0  # the front as predicted before anything is verified
    front = _budget(folder)["front"]
    want = _lowest_unmeasured(front)
    capsys.readouterr()

    assert main(["budget", str(folder), "--verify", "1", "-q"]) == 0
    out = capsys.readouterr().out
    results = _results(folder)
    row = want["row"]
    assert results["runs"][-1]["rows_run"] == [row, "build-verify-1"] and results["runs"][-1]["finished"]
    assert len(results["runs"]) == len(before["runs"]) + 1
    old, new = _variants(before), _variants(results)
    assert set(new) == set(old) | {row, "build-verify-1"}
    for name, v in old.items():  # kept, not rerun
        assert json.dumps(new[name]["metrics"], sort_keys=True) == json.dumps(v["metrics"], sort_keys=True), name
        assert new[name]["timing"] == v["timing"], name
    assert new[row]["status"] == "ok" and new[row]["restored"] == want["entries"]
    assert new["build-verify-1"]["status"] == "ok" and new["build-verify-1"]["repeat_of"] == "build"
    job_rows = json.loads((folder / "job.json").read_text())["rows"]
    assert job_rows[row] == {"restore": want["entries"]} and job_rows["build-verify-1"] == {"restore": [], "repeat": True}
    assert (folder / "budget-plan.toml").exists()

    [entry] = _budget(folder)["verified"]
    assert entry["row"] == row and entry["restore"] == want["restore"] and entry["atoms"] == want["atoms"]
    assert entry["kl"] == pytest.approx(want["kl"], abs=1e-12)  # the prediction made before the row ran
    # The additivity stored with it is the pre-verify fit: within gdn from the `gdn` row alone (the only multi-atom
    # row, of one class) when one of its atoms changed KL significantly, else not fitted (1.00); no row across classes.
    kl = {n: v["metrics"]["wiki-en"]["kl"] for n, v in old.items()}
    b = kl["build"]
    if any(old[n]["vs_build"]["kl"]["pooled"]["significant"] is not False for n in ("gdn-1", "gdn-2")):
        within_gdn = (b - kl["gdn"]) / ((b - kl["gdn-1"]) + (b - kl["gdn-2"]))
        assert entry["additivity"]["within"]["gdn"] == pytest.approx(within_gdn, abs=1e-12)
    else:
        assert "gdn" not in entry["additivity"]["within"] and entry["additivity"]["unmeasurable"] == ["gdn"]
    assert entry["additivity"]["across"] is None
    assert entry["kl"] == pytest.approx(_by_hand(before, entry["atoms"], entry["additivity"]), abs=1e-12)
    measured_kl = new[row]["metrics"]["wiki-en"]["kl"]
    assert entry["measured"]["kl"] == pytest.approx(measured_kl, abs=1e-12)
    assert entry["measured"]["size_gb"] == pytest.approx(new[row]["size_bytes"] / 1e9)
    diff, (lo, hi) = entry["error_kl"]["diff"], entry["error_kl"]["ci"]
    assert diff == pytest.approx(measured_kl - entry["kl"], abs=1e-9) and abs(diff) > 1e-6
    assert lo < diff < hi
    # Decode is compared when the build, the point and each of its atoms have a decode figure; on a loaded CPU the
    # wall-clock estimate of 3 tokens can come out unusable for a row, and then there is nothing to compare.
    single = {tuple(x["restored"]): x for x in new.values() if x["status"] == "ok" and not x.get("repeat_of")}
    timed = [new["build"], new[row], *(single[(a,)] for a in entry["atoms"])]
    if all(x.get("decode_ms_per_token") is not None for x in timed):
        assert entry["error_decode"]["diff_ms"] is not None and "ci_ms" in entry["error_decode"]
    else:
        assert "error_decode" not in entry
    assert "Verified" in out and row in out and f"{measured_kl:.4f}" in out and f"{diff:+.4f}" in out


def test_plain_budget_still_shows_the_verification_and_plot_draws_it(measured, tmp_path, capsys):
    folder = _copy(measured, tmp_path)
    assert main(["budget", str(folder), "--verify", "1", "-q"]) == 0
    [entry] = _budget(folder)["verified"]
    capsys.readouterr()
    results = _results(folder)
    assert main(["budget", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "Verified" in out and entry["row"] in out and f"{entry['measured']['kl']:.4f}" in out
    assert _results(folder) == results  # a plain budget runs nothing
    [again] = _budget(folder)["verified"]
    assert again["measured"] == entry["measured"] and again["kl"] == entry["kl"]
    assert again["error_kl"]["diff"] == pytest.approx(entry["error_kl"]["diff"], abs=1e-12)
    assert main(["plot", str(folder)]) == 0
    png = folder / "plot-kl.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_interrupted_verification_is_resumed_with_the_same_row(measured, tmp_path, capsys, monkeypatch):
    from splicer.backends.torch_ref import TorchBackend

    folder = _copy(measured, tmp_path)
    assert main(["budget", str(folder)]) == 0
    row = _lowest_unmeasured(_budget(folder)["front"])["row"]
    real_load = TorchBackend.load

    def failing_load(self, path):
        if Path(path).name == row:
            raise RuntimeError("engine died")
        return real_load(self, path)

    monkeypatch.setattr(TorchBackend, "load", failing_load)
    capsys.readouterr()
    assert main(["budget", str(folder), "--verify", "1", "-q"]) == 1  # said, and not a success
    said = capsys.readouterr().out
    assert f"Not measured: row {row} (" in said and "engine died" in said and "run the same --verify again" in said
    results = _results(folder)
    assert results["runs"][-1]["rows_run"] == [row, "build-verify-1"]
    assert _variants(results)[row]["status"] == "error" and "engine died" in _variants(results)[row]["error"]
    [pending] = _budget(folder)["verified"]
    assert pending["row"] == row and "measured" not in pending
    monkeypatch.setattr(TorchBackend, "load", real_load)
    loaded = []

    def counting_load(self, path):
        loaded.append(Path(path).name)
        return real_load(self, path)

    monkeypatch.setattr(TorchBackend, "load", counting_load)
    capsys.readouterr()
    assert main(["budget", str(folder), "--verify", "1"]) == 0
    captured = capsys.readouterr()
    assert f"resuming the verification an earlier --verify began: {row}" in captured.err
    results = _results(folder)
    assert results["runs"][-1]["rows_run"] == [row] and loaded == [row]  # the same row; the build's engine was kept
    assert _variants(results)[row]["status"] == "ok"
    assert not any(n.startswith("build-verify-2") for n in _variants(results))
    [entry] = _budget(folder)["verified"]
    assert entry["row"] == row
    # The prediction is the one stored before the first attempt, not made again from the model refitted since (the
    # build's extra engine moved its decode figure, so a new prediction's decode would differ).
    for key in ("kl", "kl_ci", "decode", "decode_ci", "decode_ratio", "additivity", "size_gb"):
        assert entry[key] == pending[key], key
    assert entry["measured"]["kl"] == pytest.approx(_variants(results)[row]["metrics"]["wiki-en"]["kl"], abs=1e-12)
    assert "Verified" in captured.out and row in captured.out


def _refused(folder: Path, capsys, args, message) -> None:
    digest = tree_digest(folder)
    capsys.readouterr()
    assert main(["budget", str(folder), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert tree_digest(folder) == digest  # results.json (and everything else in DIR) unchanged


def test_verify_refuses_an_edited_plan_an_older_job_and_a_negative_count(measured, tmp_path, capsys):
    folder = _copy(measured, tmp_path)
    plan = measured["plan"]
    assert _results(folder)["plan"]["source"] == str(plan)
    original = plan.read_text()
    try:
        plan.write_text(_plan_text(runs=3))
        _refused(folder, capsys, ["--verify", "1"], "has other corpora, top_k or timing than when")
    finally:
        plan.write_text(original)
    _refused(folder, capsys, ["--verify", "-1"], "--verify -1")

    results = _results(folder)
    del results["job"]["rows"]
    (folder / "results.json").write_text(json.dumps(results, indent=1))
    job = json.loads((folder / "job.json").read_text())
    del job["rows"]
    (folder / "job.json").write_text(json.dumps(job, indent=1))
    _refused(folder, capsys, ["--verify", "1"], "written by an older splicer")


def test_ablate_runs_only_new_and_changed_rows_of_an_extended_plan(measured, tmp_path, monkeypatch):
    from splicer.backends.torch_ref import TorchBackend

    folder = _copy(measured, tmp_path)
    real_score = TorchBackend.score
    scored = []

    def counting_score(self, *args, **kwargs):
        scored.append(Path(self.folder).name if self.folder else None)
        return real_score(self, *args, **kwargs)

    monkeypatch.setattr(TorchBackend, "score", counting_score)

    def ablate(rows) -> dict:
        plan = tmp_path / "plan.toml"
        plan.write_text(_plan_text(rows))
        scored.clear()
        assert (
            main(
                [
                    "ablate",
                    "all",
                    str(measured["build"]),
                    str(measured["base"]),
                    "-o",
                    str(folder),
                    "--plan",
                    str(plan),
                    "--device",
                    "cpu",
                    "-q",
                ]
            )
            == 0
        )
        return _results(folder)

    before = _results(folder)
    rows = ROWS + [("gdn-1-attention", ["gdn@0", "attention"])]
    after = ablate(rows)
    assert after["runs"][-1]["rows_run"] == ["gdn-1-attention"] and scored == ["gdn-1-attention"]
    old, new = _variants(before), _variants(after)
    assert set(new) == set(old) | {"gdn-1-attention"} and new["gdn-1-attention"]["status"] == "ok"
    for name, v in old.items():
        assert json.dumps(new[name]["metrics"], sort_keys=True) == json.dumps(v["metrics"], sort_keys=True), name

    changed = [("gdn-1", ["gdn@1"]) if r[0] == "gdn-1" else r for r in rows]
    again = ablate(changed)
    assert again["runs"][-1]["rows_run"] == ["gdn-1"] and scored == ["gdn-1"]
    final = _variants(again)
    assert final["gdn-1"]["restored"] == ["gdn@1"] and final["gdn-1"]["status"] == "ok"
    assert final["gdn-1"]["metrics"]["wiki-en"]["kl"] != old["gdn-1"]["metrics"]["wiki-en"]["kl"]
    for name, v in new.items():
        if name != "gdn-1":
            assert json.dumps(final[name]["metrics"], sort_keys=True) == json.dumps(v["metrics"], sort_keys=True), name
    assert [r["rows_run"] for r in again["runs"]] == [[n for n, *_ in ROWS], ["gdn-1-attention"], ["gdn-1"]]


def test_a_same_named_row_defined_otherwise_is_not_taken_as_the_measurement(measured, tmp_path, capsys):
    """Issue 30, 1: DIR's job already has a row named like the chosen point (here a base row, as a user may name
    one): --verify adds the point under another name and measures it; the base row is not its measurement."""
    folder = _copy(measured, tmp_path)
    assert main(["budget", str(folder)]) == 0
    want = _lowest_unmeasured(_budget(folder)["front"])
    row = want["row"]
    results = _results(folder)
    build = _variants(results)["build"]
    clash = dict(
        build, name=row, restored="base", metrics={"wiki-en": dict(build["metrics"]["wiki-en"], kl=0.0, kl_ci=[0.0, 0.0])}
    )
    clash.pop("vs_build", None)
    results["variants"].append(clash)
    results["job"]["rows"][row] = {"base": True}
    (folder / "results.json").write_text(json.dumps(results, indent=1))
    job = json.loads((folder / "job.json").read_text())
    job["rows"][row] = {"base": True}
    (folder / "job.json").write_text(json.dumps(job, indent=1))
    capsys.readouterr()

    assert main(["budget", str(folder), "--verify", "1", "-q"]) == 0
    out = capsys.readouterr().out
    [entry] = _budget(folder)["verified"]
    assert entry["atoms"] == want["atoms"] and entry["row"] == f"{row}-2"
    after = _variants(_results(folder))
    assert (after[row]["restored"], after[row]["metrics"]) == ("base", clash["metrics"])  # the base row, as it was
    assert after[f"{row}-2"]["restored"] == want["entries"]
    measured_kl = after[f"{row}-2"]["metrics"]["wiki-en"]["kl"]
    assert measured_kl > 0.01 and entry["measured"]["kl"] == pytest.approx(measured_kl, abs=1e-12)
    assert json.loads((folder / "job.json").read_text())["rows"][f"{row}-2"] == {"restore": want["entries"]}
    assert f"{row}-2" in out and "KL measured" in out
    # A budget.json that took the base row as this point's measurement (as splicer 466b7d5 did) is read as no
    # measurement: the entry is listed as measured by a row that restores something else.
    record = _budget(folder)
    record["verified"].append(dict(entry, row=row))
    (folder / "budget.json").write_text(json.dumps(record))
    capsys.readouterr()
    assert main(["budget", str(folder)]) == 0
    out = capsys.readouterr().out
    assert f"the row {row} in this folder's results restores something else (base)" in out
    stale = [e for e in _budget(folder)["verified"] if e["row"] == row]
    assert stale and "measured" not in stale[0] and "error_kl" not in stale[0]


def test_a_verification_stopped_before_its_row_finished_is_resumed_under_other_limits(measured, tmp_path, capsys, monkeypatch):
    """Issue 30, 3: --verify interrupted (Ctrl-C) while its first row loads, before the row is in results.json; the
    rerun, with other limits, finishes that prediction first instead of choosing a new point."""
    from splicer.backends.torch_ref import TorchBackend

    folder = _copy(measured, tmp_path)
    assert main(["budget", str(folder)]) == 0
    want = _lowest_unmeasured(_budget(folder)["front"])
    row = want["row"]
    real_load = TorchBackend.load

    def interrupted_load(self, path):
        if Path(path).name == row:
            raise KeyboardInterrupt
        return real_load(self, path)

    monkeypatch.setattr(TorchBackend, "load", interrupted_load)
    assert main(["budget", str(folder), "--verify", "1", "-q"]) == 130
    assert row not in _variants(_results(folder)) and row not in _results(folder)["job"]["rows"]
    [pending] = _budget(folder)["verified"]
    assert pending["row"] == row and "measured" not in pending
    monkeypatch.setattr(TorchBackend, "load", real_load)
    capsys.readouterr()

    smaller = want["size_gb"] - 1e-6  # the pending point is outside these limits: a fresh --verify would pick another
    assert main(["budget", str(folder), "--verify", "1", "--max-gb", f"{smaller!r}"]) == 0
    captured = capsys.readouterr()
    assert f"resuming the verification an earlier --verify began: {row}" in captured.err
    assert "Resumed the verification an earlier --verify began" in captured.out
    results = _results(folder)
    assert _variants(results)[row]["status"] == "ok" and results["runs"][-1]["rows_run"][0] == row
    [entry] = _budget(folder)["verified"]
    assert entry["row"] == row and entry["kl"] == pending["kl"]
    assert entry["measured"]["kl"] == pytest.approx(_variants(results)[row]["metrics"]["wiki-en"]["kl"], abs=1e-12)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_verify_on_a_full_disk_or_read_only_folder_is_one_line_and_writes_nothing(measured, tmp_path, capsys, monkeypatch, code):
    """Issue 30, 5: a write that fails (simulated: the tests may run as root, which ignores permission bits) is one
    line naming the file and the fix, and leaves DIR exactly as it was (no plan, no pending entry, no partial file)."""
    import os

    folder = _copy(measured, tmp_path)
    digest = tree_digest(folder)
    real_replace = os.replace

    def failing_replace(src, dst):
        if Path(dst).parent == folder:
            raise OSError(code, os.strerror(code))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    capsys.readouterr()
    assert main(["budget", str(folder), "--verify", "1", "-q"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"cannot write {folder / 'budget-plan.toml'}" in err
    assert ("no space left" in err) if code == errno.ENOSPC else ("copy the folder somewhere writable" in err)
    assert tree_digest(folder) == digest and sorted(p.name for p in folder.iterdir()) == sorted(
        p.name for p in measured["dir"].iterdir()
    )


def test_a_verify_that_ablate_refuses_leaves_dir_as_it_was(measured, tmp_path, capsys):
    """Item 2's second half: a refusal met only once ablate compares DIR's job (here DIR was measured by another
    splicer version) puts back the plan and the predictions --verify had written, so nothing is left pending."""
    folder = _copy(measured, tmp_path)
    for name in ("results.json", "job.json"):
        data = json.loads((folder / name).read_text())
        (data["job"] if name == "results.json" else data)["tool"] = "splicer 0.0.1"
        (folder / name).write_text(json.dumps(data, indent=1))
    digest = tree_digest(folder)
    capsys.readouterr()
    assert main(["budget", str(folder), "--verify", "1", "-q"]) == 2
    err = capsys.readouterr().err
    assert "was measured under another job (tool: " in err and len(err.strip().splitlines()) == 1, err
    after = tree_digest(folder)
    # ablate's log records the attempt (a log, appended to by every run); everything else is as it was
    assert {k: v for k, v in after.items() if k != "ablate.log"} == {k: v for k, v in digest.items() if k != "ablate.log"}
    assert not (folder / "budget-plan.toml").exists() and not (folder / "budget.json").exists()


def test_verify_on_a_read_only_folder_names_the_folder_and_the_fix(measured, tmp_path, capsys, monkeypatch):
    """On a truly read-only DIR the first write --verify makes is its lock beside the plan (simulated: root ignores
    permission bits): one line naming it and the fix, not ablate's `-o` advice (no -o was given)."""
    import os

    folder = _copy(measured, tmp_path)
    digest = tree_digest(folder)
    real_open = os.open

    def read_only_open(path, flags, *args, **kwargs):
        if Path(path).parent == folder and flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_open)
    capsys.readouterr()
    assert main(["budget", str(folder), "--verify", "1", "-q"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"cannot write {folder / '.budget-lock'} (Read-only file system)" in err
    assert "copy the folder somewhere writable" in err and "writable -o" not in err
    assert tree_digest(folder) == digest
