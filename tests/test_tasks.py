"""Task accuracy through lm-evaluation-harness (`splicer tasks`, `ablate --tasks`): cloze items cut from text as an
lm-eval task YAML, run by lm-eval's own HF model over the torch backend's model of each row, on the tiny fixture."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from splicer.cli import main
from splicer.tasks.cloze import items_from_texts

from .results_edits import with_failed_row

DEMO_TEXT = Path(str(resources.files("splicer") / "data" / "demo_wiki_en.txt"))


def test_cloze_refuses_what_it_cannot_use_in_one_line(tmp_path, capsys):
    from splicer.tasks.cloze import main as cloze

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "notes.txt").write_text(DEMO_TEXT.read_text(), encoding="utf-8")
    (b / "notes.txt").write_text(" ".join(reversed(DEMO_TEXT.read_text().split())), encoding="utf-8")
    assert (
        cloze([str(a / "notes.txt"), str(b / "notes.txt"), "-o", str(tmp_path / "t"), "--items", "10", "--context-words", "20"])
        == 0
    )
    sources = {json.loads(line)["source"] for line in (tmp_path / "t" / "cloze.jsonl").read_text().splitlines()}
    assert sources == {"notes", "notes-2"}  # two files of one name stay two sources
    capsys.readouterr()
    zh = tmp_path / "zh.txt"
    zh.write_text(DEMO_TEXT.with_name("demo_wiki_zh.txt").read_text(encoding="utf-8"), encoding="utf-8")
    for argv, says in (
        ([str(a / "notes.txt"), str(a / "notes.txt"), "-o", str(tmp_path / "u")], "given twice"),
        ([str(a / "notes.txt"), "-o", str(a / "notes.txt")], "cannot make that folder"),
        ([str(zh), "-o", str(tmp_path / "u")], f"no cloze item could be cut from {zh} (no words of four letters or more"),
    ):
        assert cloze(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and says in err, err
    # a text without words separated by spaces gives no item: named, with why, and left out of the YAML's sources
    assert cloze([str(a / "notes.txt"), str(zh), "-o", str(tmp_path / "v"), "--items", "6", "--context-words", "20"]) == 0
    said = capsys.readouterr().out
    assert f"none from {zh} (no words of four letters or more separated by spaces)" in said
    header = (tmp_path / "v" / "cloze.yaml").read_text().splitlines()[:2]
    assert header[0].endswith(f"cut from {a / 'notes.txt'}.") and header[1].startswith(f"# None from {zh}: no words of four")


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
    assert build["metric"] == "acc" and build["filter"] == "none" and build["n"] == 10 and 0 <= build["value"] <= 1
    assert build["value"] == pytest.approx(sum(build["items"].values()) / 10) and build["stderr"] is not None
    lo, hi = record["summary"]["build"]["cloze"]["ci"]  # Wilson, from the items
    assert 0 <= lo <= build["value"] <= hi <= 1
    vs = record["summary"]["all"]["cloze"]["vs_build"]
    diff = rows["all"]["tasks"]["cloze"]["value"] - build["value"]
    assert vs["diff"] == pytest.approx(diff) and vs["items"] == 10 and (vs["ci"] is None or vs["ci"][0] <= diff <= vs["ci"][1])
    assert "Task accuracy (lm-evaluation-harness)" in (out / "table.md").read_text()
    assert "Task cloze, build: acc" in (out / "report.md").read_text()
    elapsed = {r: e["elapsed_s"] for r, e in rows.items()}
    capsys.readouterr()
    assert main(["tasks", str(out), "--tasks", "cloze", "--include-path", str(tasks), "-q"]) == 0  # kept, not rerun
    assert {r: e["elapsed_s"] for r, e in json.loads((out / "tasks.json").read_text())["rows"].items()} == elapsed
    # other settings never silently replace what is there
    assert main(["tasks", str(out), "--tasks", "cloze", "--include-path", str(tasks), "--limit", "4", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "limit: None -> 4" in err and "--force" in err
    assert set(json.loads((out / "tasks.json").read_text())["rows"]) == {"build", "all"}


def test_rows_scored_before_lm_evals_log_likelihoods_took_the_fp32_products_are_run_again_not_mixed(scored, capsys):
    """A tasks.json begun when lm-eval's HF model scored with torch's BF16 GEMM (its model recorded as the torch
    backend's task_models_before) is another run: no option gives that arithmetic back, so it is not refused but its
    finished rows are run again, and the run says so on stderr and in tasks.log; none of its rows is kept beside the
    new ones. A model of another backend is still refused (test_tasks_through_lm_evals_vllm_model_...)."""
    import hashlib

    from splicer.backends.torch_ref import TorchBackend
    from splicer.tasks.run import settings_refusal, task_settings

    out, tasks = scored
    old_model = TorchBackend.task_models_before[0]
    assert old_model != TorchBackend.task_model and TorchBackend.SCORING_PRODUCTS in TorchBackend.task_model
    settings = dict(task_settings(["cloze"], tasks, None, "torch"), model=old_model)
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    then = {"status": "ok", "tasks": {"cloze": {"metric": "acc", "value": 0.0, "items": {}, "n": 0}}, "elapsed_s": -1.0}
    record = {"schema": 1, "settings": settings, "settings_digest": digest, "rows": {"build": then, "all": then}}
    (out / "tasks.json").write_text(json.dumps(record))
    now = task_settings(["cloze"], tasks, None, "torch")
    assert "model:" in settings_refusal(out, now)  # what the check said before the earlier models were named
    assert settings_refusal(out, now, earlier_models=TorchBackend.task_models_before) is None
    # every arithmetic the backend recorded before, the one before its convolutions were FP32 too among them
    for earlier in TorchBackend.task_models_before[1:]:
        assert earlier != TorchBackend.task_model
        (out / "tasks.json").write_text(json.dumps(dict(record, settings=dict(settings, model=earlier))))
        assert settings_refusal(out, now, earlier_models=TorchBackend.task_models_before) is None, earlier
    (out / "tasks.json").write_text(json.dumps(record))
    capsys.readouterr()
    assert main(["tasks", str(out), "--tasks", "cloze", "--include-path", str(tasks), "--rows", "build", "-q"]) == 0
    err = capsys.readouterr().err
    assert "an earlier arithmetic of the same backend" in err and "finished rows build are run again" in err, err
    assert "all not kept (ask for them with --rows to run them again)" in err, err  # not asked for this time
    assert "are run again" in (out / "tasks.log").read_text()
    after = json.loads((out / "tasks.json").read_text())
    assert after["settings"]["model"] == TorchBackend.task_model and set(after["rows"]) == {"build"}
    assert after["rows"]["build"]["elapsed_s"] > 0 and after["rows"]["build"]["tasks"]["cloze"]["n"] == 10


def test_a_group_of_tasks_is_scored_over_its_subtasks_items(scored, tmp_path, capsys):
    out, tasks = scored
    import shutil

    from splicer.tasks.cloze import main as cloze

    group = tmp_path / "group"
    shutil.copytree(tasks, group)
    assert cloze([str(DEMO_TEXT), "-o", str(group), "--name", "cloze2", "--items", "6", "--context-words", "12"]) == 0
    (group / "both.yaml").write_text(
        "group: both\ntask:\n  - cloze\n  - cloze2\naggregate_metric_list:\n  - metric: acc\n    aggregation: mean\n"
        "    weight_by_size: true\nmetadata:\n  version: 1.0\n"
    )
    assert main(["tasks", str(out), "--tasks", "both", "--include-path", str(group), "--rows", "build", "--force", "-q"]) == 0
    fig = json.loads((out / "tasks.json").read_text())["rows"]["build"]["tasks"]["both"]
    assert fig["n"] == 16 and all(k.startswith(("cloze/", "cloze2/")) for k in fig["items"])
    assert fig["value"] == pytest.approx(sum(fig["items"].values()) / 16)  # the size-weighted mean of the subtasks


def test_bad_task_inputs_are_one_line_before_anything_runs(scored, pairs, tmp_path, capsys):
    out, tasks = scored
    capsys.readouterr()
    with with_failed_row(out):  # lm_head: a row whose ablate run failed
        for argv, says in (
            (["--tasks", "clozee", "--include-path", str(tasks)], "close: cloze"),
            (["--tasks", "cloze", "--include-path", str(tmp_path / "nope")], "not a folder"),
            (["--tasks", "cloze", "--include-path", str(tasks), "--rows", "gdn"], "no finished row"),
            (
                ["--tasks", "cloze", "--include-path", str(tasks), "--rows", "lm_head"],
                f"lm_head failed in {out} (its error: RuntimeError: out of memory); rerun ablate to finish it",
            ),
            (["--tasks", ","], "name one task"),
        ):
            assert main(["tasks", str(out), *argv]) == 2
            err = capsys.readouterr().err.strip()
            assert err.count("\n") == 0 and says in err, err
    p = pairs["fused"]
    fresh = tmp_path / "fresh"
    argv = ["ablate", "build", str(p["lowlatency"]), str(p["base"]), "-o", str(fresh), "--plan", "demo", "--tasks", "clozee"]
    assert main([*argv, "--include-path", str(tasks)]) == 2 and not fresh.exists()
    assert "no such task in lm-eval" in capsys.readouterr().err
    assert main(["ablate", "build", str(p["lowlatency"]), str(p["base"]), "-o", str(fresh), "--include-path", str(tasks)]) == 2
    assert "add --tasks" in capsys.readouterr().err and not fresh.exists()


FAKE = Path(__file__).parent / "fake_vllm"
FAKE_META = Path(__file__).parent / "fake_vllm_meta"  # its package metadata: lm-eval's VLLM model reads vLLM's version


@pytest.fixture
def fake_vllm(monkeypatch):
    """The stand-in vLLM (tests/fake_vllm: the torch reference behind vLLM's entry points, not vLLM) for the worker
    processes, on a machine without CUDA."""
    import importlib
    import os

    monkeypatch.syspath_prepend(str(FAKE_META))  # spawned workers start from this process's sys.path
    monkeypatch.syspath_prepend(str(FAKE))
    path = [str(FAKE), str(FAKE_META), str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    import splicer.backends.vllm_backend as vb

    importlib.reload(vb)
    orig = vb.VllmBackend.__init__
    monkeypatch.setattr(vb.VllmBackend, "__init__", lambda self, *a, **k: orig(self, *a, **dict(k, require_cuda=False)))
    return vb


def test_tasks_through_lm_evals_vllm_model_answer_as_the_torch_model_does(scored, pairs, fake_vllm, monkeypatch, capsys):
    """--backend vllm: lm-eval's own VLLM model, built in the vLLM backend's worker process from DIR's engine
    arguments, scores every item as lm-eval's HF model over the torch reference does (the stand-in computes its
    log-probs with that reference, so any difference is in splicer's plumbing); a different model is another run."""
    out, tasks = scored
    argv = ["tasks", str(out), "--tasks", "cloze", "--include-path", str(tasks), "--rows", "build", "-q"]
    monkeypatch.setenv("FAKE_VLLM_ECHO", "tasks-engine")
    assert main([*argv, "--backend", "vllm", "--force"]) == 0
    record = json.loads((out / "tasks.json").read_text())
    assert record["settings"]["model"] == "vLLM engine with DIR's engine arguments through lm-eval's VLLM model"
    through_vllm = record["rows"]["build"]["tasks"]["cloze"]
    assert through_vllm["n"] == 10 and through_vllm["metric"] == "acc"
    assert record["rows"]["build"]["engine_dtype"] == "bfloat16"  # what lm-eval's engine computed in
    logs = list((out / "task-logs").glob("*-tasks*.log"))
    assert logs and "FAKE_VLLM_ECHO=tasks-engine" in "".join(p.read_text() for p in logs)  # the engine ran in the worker
    # each row's log is named after the row, the build's too (its folder is named after the checkpoint)
    assert {p.name.split("-tasks")[0] for p in logs} == {"build"}
    capsys.readouterr()
    assert main([*argv, "--backend", "torch"]) == 2  # another model: refused in one line, not mixed in
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "model:" in err and "--force" in err and "the same --backend" in err, err
    p = pairs["fused"]
    ablate = ["ablate", "build", str(p["lowlatency"]), str(p["base"]), "-o", str(out), "--plan", "demo", "--no-time", "-q"]
    assert main([*ablate, "--tasks", "cloze", "--include-path", str(tasks)]) == 2  # ablate checks before it runs
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "model:" in err and "splicer tasks DIR ... --force" in err and "--backend" in err, err
    assert main([*argv, "--backend", "torch", "--force"]) == 0
    torch_row = json.loads((out / "tasks.json").read_text())["rows"]["build"]
    assert torch_row["engine_dtype"] == "bfloat16"
    through_torch = torch_row["tasks"]["cloze"]
    assert through_vllm["items"] == through_torch["items"] and through_vllm["value"] == pytest.approx(through_torch["value"])


def test_a_row_whose_engine_fails_under_lm_eval_is_recorded_and_the_run_says_so(scored, fake_vllm, monkeypatch, capsys):
    out, tasks = scored
    monkeypatch.setenv("FAKE_VLLM_FAIL_ON", "all")  # the stand-in refuses to build the engine of row `all`
    argv = ["tasks", str(out), "--tasks", "cloze", "--include-path", str(tasks), "--backend", "vllm", "--force", "-q"]
    capsys.readouterr()
    assert main(argv) == 1
    rows = json.loads((out / "tasks.json").read_text())["rows"]
    assert rows["build"]["status"] == "ok" and rows["all"]["status"] == "error"
    assert "quantization schemes" in rows["all"]["error"]
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "all" in err


def test_a_row_whose_engine_computed_in_another_dtype_than_the_builds_is_said():
    """vLLM's dtype="auto" follows each checkpoint's config: a row computed in float16 beside a bfloat16 build has a
    difference from the build that holds the dtypes' as well. The table's note and the report say so with the engine
    argument that puts every engine in one dtype; rows recorded before engines said their dtype are not compared."""
    from splicer.analysis import task_scores

    items = {str(i): float(i % 2) for i in range(12)}
    task = {"cloze": {"metric": "acc", "value": 0.5, "stderr": 0.1, "items": items}}
    record = {
        "build_row": "build",
        "settings": {"tasks": ["cloze"], "model": "m"},
        "rows": {
            "build": {"status": "ok", "tasks": task, "engine_dtype": "bfloat16"},
            "gdn": {"status": "ok", "tasks": task, "engine_dtype": "float16"},
            "attention": {"status": "ok", "tasks": task, "engine_dtype": "bfloat16"},
            "older": {"status": "ok", "tasks": task},
        },
    }
    spec = {"record": record, "summary": task_scores.summarize(record, reps=50)}
    said = "Computed in another dtype than the build's engine (bfloat16): gdn (float16);"
    assert said in task_scores.note(spec) and "--engine-arg dtype=bfloat16" in task_scores.note(spec)
    assert [s for s in task_scores.sentences(spec) if s.startswith(said)]
    record["rows"]["gdn"]["engine_dtype"] = "bfloat16"
    assert "another dtype" not in task_scores.note(spec) + " ".join(task_scores.sentences(spec))


def test_no_item_differs_from_the_build_so_no_interval_nor_verdict():
    """A bootstrap over items none of which differs has standard error 0: its [0, 0] would say nothing about a
    difference. The difference is 0 with why, in the JSON, the table and the report; with one item that differs the
    interval is the bootstrap's, as before."""
    from splicer.analysis import task_scores
    from splicer.analysis.formatting import fmt_paired_pp

    items = {str(i): float(i % 3 == 0) for i in range(11)}

    def spec(other):
        task = {"metric": "acc", "value": sum(other.values()) / 11, "stderr": 0.1}
        record = {
            "build_row": "build",
            "rows": {
                "build": {"status": "ok", "tasks": {"cloze": dict(task, value=sum(items.values()) / 11, items=items)}},
                "gdn": {"status": "ok", "tasks": {"cloze": dict(task, items=other)}},
            },
        }
        return {"record": record, "summary": task_scores.summarize(record, reps=200)}

    same = spec(dict(items))
    vs = same["summary"]["gdn"]["cloze"]["vs_build"]
    assert vs["diff"] == 0 and vs["ci"] is None and vs["significant"] is None and vs["items"] == 11
    assert vs["why"] == "no item differs from the build's: no interval"
    assert task_scores.table_rows(same, ["build", "gdn"])[1][5] == "+0.0 (no item differs from the build's: no interval)"
    text = " ".join(task_scores.sentences(same))
    assert "+0.0 pp against the build (no item differs from the build's: no interval)." in text and "significant" not in text
    one = spec(dict(items, **{"1": 1.0}))["summary"]["gdn"]["cloze"]["vs_build"]
    assert one["diff"] == pytest.approx(1 / 11) and one["ci"] is not None and one["ci"][0] < one["ci"][1]
    # a difference that rounds to zero prints unsigned; an interval's end that would print as 0 gets the decimals that
    # keep its sign, so a "not significant" interval never reads [+0.0, +0.1]
    assert fmt_paired_pp({"diff": -0.0001, "ci": [-0.004, 0.003], "significant": False}) == "+0.0 [-0.4, +0.3] n.s."
    assert fmt_paired_pp({"diff": -0.0, "ci": [-0.0002, 0.0001], "significant": False}) == "+0.00 [-0.02, +0.01] n.s."
    assert fmt_paired_pp({"diff": 0.0009, "ci": [-0.0001, 0.0021], "significant": False}) == "+0.09 [-0.01, +0.21] n.s."


def test_lm_evals_warning_on_the_model_splicer_hands_it_stays_out_of_the_output(scored, pairs, monkeypatch):
    """lm-eval's HF model warns that `pretrained` is no string (how splicer hands it the torch backend's model) unless
    its logger is set before the model is made: as in a fresh process, lm_eval's logger at WARNING."""
    import logging

    from splicer.backends import task_backend

    monkeypatch.delenv("LMEVAL_LOG_LEVEL", raising=False)
    logger, seen = logging.getLogger("lm_eval"), []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep()
    old = logger.level
    logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    engine = task_backend("torch", {}, "cpu", scored[0] / "task-logs")
    try:
        engine.load(pairs["fused"]["lowlatency"])
        engine.lm_eval_model(pairs["fused"]["base"])
    finally:
        engine.unload()
        engine.close()
        logger.removeHandler(handler)
        logger.setLevel(old)
    assert not [m for m in seen if "pretrained" in m], seen
