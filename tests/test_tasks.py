"""Task accuracy through lm-evaluation-harness (`splicer tasks`, `ablate --tasks`): cloze items cut from text as an
lm-eval task YAML, run by lm-eval's own HF model over the torch backend's model of each row, on the tiny fixture."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from splicer.cli import main
from splicer.tasks.cloze import items_from_texts

DEMO_TEXT = Path(str(resources.files("splicer") / "data" / "demo_wiki_en.txt"))


def test_cloze_items_are_whole_words_with_three_other_choices_and_repeat_by_seed():
    text = DEMO_TEXT.read_text(encoding="utf-8")
    items = items_from_texts({"wiki": text}, 12, context_words=20, seed=3)
    assert len(items) == 12 and items == items_from_texts({"wiki": text}, 12, context_words=20, seed=3)
    for it in items:
        answer = it["choices"][it["label"]]
        assert len(it["choices"]) == len(set(it["choices"])) == 4 and len(answer) >= 4
        assert answer in text and (it["context"] + " " + answer) in " ".join(text.split())  # the true continuation
    # passages do not overlap: each item's context starts after the previous item's answer
    starts = [" ".join(text.split()).index(it["context"]) for it in items]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)


@pytest.fixture(scope="module")
def scored(pairs, tmp_path_factory):
    """A torch-backend ablate folder of the fixture (build and all) and a cloze task of 10 items."""
    root = tmp_path_factory.mktemp("tasks")
    out = root / "out"
    p = pairs["fused"]
    argv = ["ablate", "build,all", str(p["lowlatency"]), str(p["base"]), "-o", str(out), "--plan", "demo", "--no-time", "-q"]
    assert main(argv) == 0
    from splicer.tasks.cloze import main as cloze

    assert cloze([str(DEMO_TEXT), "-o", str(root / "tasks"), "--items", "10", "--context-words", "20"]) == 0
    return out, root / "tasks"


def test_tasks_per_row_with_the_paired_difference_and_resume(scored, capsys):
    out, tasks = scored
    assert main(["tasks", str(out), "--tasks", "cloze", "--include-path", str(tasks), "-q"]) == 0
    record = json.loads((out / "tasks.json").read_text())
    rows = record["rows"]
    assert set(rows) == {"build", "all"} and all(r["status"] == "ok" for r in rows.values())
    build = rows["build"]["tasks"]["cloze"]
    assert build["n"] == 10 and len(build["items"]) == 10 and 0 <= build["acc"] <= 1 and build["acc_stderr"] > 0
    assert build["acc"] == pytest.approx(sum(i["acc"] for i in build["items"].values()) / 10)
    vs = record["summary"]["all"]["cloze"]["vs_build"]
    diff = rows["all"]["tasks"]["cloze"]["acc"] - build["acc"]
    assert vs["diff"] == pytest.approx(diff) and vs["items"] == 10 and (vs["ci"] is None or vs["ci"][0] <= diff <= vs["ci"][1])
    assert "Task accuracy (lm-evaluation-harness)" in (out / "table.md").read_text()
    assert "Task cloze, build: acc" in (out / "report.md").read_text()
    elapsed = {r: e["elapsed_s"] for r, e in rows.items()}
    capsys.readouterr()
    assert main(["tasks", str(out), "--tasks", "cloze", "--include-path", str(tasks), "-q"]) == 0  # kept, not rerun
    assert {r: e["elapsed_s"] for r, e in json.loads((out / "tasks.json").read_text())["rows"].items()} == elapsed


def test_bad_task_inputs_are_one_line_before_anything_runs(scored, pairs, tmp_path, capsys):
    out, tasks = scored
    capsys.readouterr()
    for argv, says in (
        (["--tasks", "clozee", "--include-path", str(tasks)], "close: cloze"),
        (["--tasks", "cloze", "--include-path", str(tmp_path / "nope")], "not a folder"),
        (["--tasks", "cloze", "--include-path", str(tasks), "--rows", "gdn"], "no finished row"),
        (["--tasks", ","], "name one task"),
    ):
        assert main(["tasks", str(out), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and says in err, err
    p = pairs["fused"]
    fresh = tmp_path / "fresh"
    argv = ["ablate", "build", str(p["lowlatency"]), str(p["base"]), "-o", str(fresh), "--plan", "demo", "--tasks", "clozee"]
    assert main([*argv, "--include-path", str(tasks)]) == 2 and not fresh.exists()
    assert "lm-eval knows no such task" in capsys.readouterr().err
    assert main(["ablate", "build", str(p["lowlatency"]), str(p["base"]), "-o", str(fresh), "--include-path", str(tasks)]) == 2
    assert "add --tasks" in capsys.readouterr().err and not fresh.exists()
