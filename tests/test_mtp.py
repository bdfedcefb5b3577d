"""MTP acceptance (`splicer mtp DIR`): vLLM's spec-decode counters turned into per-prompt drafts, the figures and
their intervals, and the stage end to end against the stand-in engine (tests/fake_vllm, which is not vLLM: it
accepts a share of draft tokens chosen by the test, so these tests check splicer's counting and wiring only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splicer.analysis import speculative as figures
from splicer.backends.vllm_outputs import spec_decode_delta
from splicer.cli import main

DRAFTS, TOKENS, ACC, POS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
)


def test_counter_deltas_are_one_requests_drafts():
    before = {DRAFTS: 10.0, TOKENS: 20.0, ACC: 9.0, POS: [6, 3]}
    after = {DRAFTS: 14.0, TOKENS: 28.0, ACC: 14.0, POS: [9, 5]}
    assert spec_decode_delta(before, after, 2) == {"drafts": 4, "draft_tokens": 8, "accepted": 5, "accepted_per_pos": [3, 2]}
    # the first request of an engine: nothing before it; an engine without a drafter reports no counters at all
    assert spec_decode_delta({}, {DRAFTS: 3, TOKENS: 3, ACC: 1, POS: [1]}, 1)["accepted_per_pos"] == [1]
    assert spec_decode_delta({}, {}, 2) == {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": [0, 0]}
    with pytest.raises(ValueError, match="went down"):
        spec_decode_delta(after, before, 2)


def _prompt(accepted, drafts, k=2):
    per = [min(drafts, accepted)] + [max(0, accepted - drafts)] * (k - 1)
    return {"drafts": drafts, "draft_tokens": k * drafts, "accepted": accepted, "accepted_per_pos": per[:k]}


def _record(build_acc, row_acc, k=2, n=10):
    engines = []
    for row, accs in (("build", build_acc), ("gdn", row_acc)):
        engines.append({"row": row, "k": 0, "status": "ok", "tokens": [[1]] * n})
        engines.append({"row": row, "k": k, "status": "ok", "per_prompt": [_prompt(a, 20, k) for a in accs]})
    return {
        "build_row": "build",
        "prompts": [{"corpus": "a" if i % 2 else "b", "index": i} for i in range(n)],
        "engines": engines,
    }


def test_rates_are_ratios_of_sums_with_intervals_over_prompts():
    rec = _record([20, 22, 18, 20, 21, 19, 20, 20, 22, 18], [10, 12, 8, 10, 11, 9, 10, 10, 12, 8])
    s = figures.summarize(rec, reps=400)
    build, gdn = s["build"]["2"], s["gdn"]["2"]
    assert build["acceptance"]["value"] == pytest.approx(200 / 400)
    lo, hi = build["acceptance"]["ci"]
    assert lo < 0.5 < hi and hi - lo < 0.1
    assert build["mean_accepted_length"]["value"] == pytest.approx(1 + 200 / 200)
    first = sum(min(20, a) for a in [20, 22, 18, 20, 21, 19, 20, 20, 22, 18])
    assert build["per_position"][0]["value"] == pytest.approx(first / 200)  # drafts whose first token was accepted
    vs = gdn["vs_build"]
    assert vs["diff"] == pytest.approx(100 / 400 - 200 / 400) and vs["significant"] is True and vs["ci"][1] < 0
    same = figures.summarize(_record([20] * 10, [21, 19, 19, 21, 20, 22, 18, 20, 21, 18]), reps=400)["gdn"]["2"]["vs_build"]
    assert same["ci"][0] < 0 < same["ci"][1] and same["significant"] is False


def test_a_drafter_from_missing_or_random_weights_is_flagged_not_tabulated():
    zero = figures.summarize(_record([20] * 10, [0] * 10))["gdn"]["2"]
    assert "acceptance" not in zero and "did not draft from trained weights" in zero["flagged"]
    pinned = figures.summarize(_record([20] * 10, [40] * 10))["gdn"]["2"]
    assert "pinned at 1" in pinned["flagged"]
    assert "vs_build" not in figures.summarize(_record([0] * 10, [10] * 10))["gdn"]["2"]  # no build figure to pair with


def test_every_corpus_needs_five_prompts_and_intervals_stay_in_range():
    # ten prompts, but one corpus holds a single one: no interval (a stratum of one never varies when resampled)
    strata = ["a"] * 9 + ["b"]
    r = figures.ratio([5, 6, 4, 5, 7, 3, 5, 6, 4, 5], [10] * 10, strata)
    assert r["ci"] is None and "corpus b" in r["why"]
    high = figures.ratio([10, 10, 10, 9, 10, 6], [10] * 6, ["a"] * 6)
    assert high["ci"][1] <= 1.0 and high["ci"][0] < high["value"]
    d = figures.paired_ratio_difference(([10] * 6, [10] * 6), ([0, 1, 0, 2, 0, 9], [10] * 6), ["a"] * 6)
    assert -1.0 <= d["ci"][0] and d["ci"][1] <= 1.0


def test_chat_prompts_of_one_group_are_one_unit():
    prompts = [{"corpus": "chat", "index": i, "group": i % 5} for i in range(10)]
    strata, cluster = figures.prompt_clusters(prompts)
    assert cluster == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    # the same totals counted as 10 independent prompts give a narrower interval than as 5 groups of 2
    num, den = [3, 7, 2, 8, 5, 3, 7, 2, 8, 5], [10] * 10
    grouped = figures.ratio(num, den, strata, cluster=cluster)
    single = figures.ratio(num, den, strata)
    assert grouped["value"] == single["value"]
    assert grouped["ci"][1] - grouped["ci"][0] > single["ci"][1] - single["ci"][0]


def test_too_few_draft_tokens_are_not_judged():
    assert figures.flag([_prompt(0, 5, 1)] * 5) is None  # 25 draft tokens: no verdict on the drafter
    assert "did not draft" in figures.flag([_prompt(0, 50, 1)] * 5)


def test_decode_against_plain_counts_each_engine_once():
    def engine(row, k, ms, repeat=False):
        e = {"row": row, "k": k, "status": "ok", "repeat": repeat, "timing": {"decode_ms_per_token": ms, "per_run_ms": [ms] * 3}}
        if k:
            e["per_prompt"] = [_prompt(10, 20, k)] * 10
        return e

    rec = {
        "build_row": "build",
        "prompts": [{"corpus": "a", "index": i} for i in range(10)],
        "engines": [engine("build", 0, 2.0), engine("build", 1, 3.0), engine("gdn", 0, 2.1), engine("gdn", 1, 3.1)]
        + [engine("build", 0, 2.02, True), engine("build", 1, 3.03, True)],
    }
    s = figures.summarize(rec, reps=200)
    # the build's own two pairs are the variant and reference; only the other rows' repeats could add to the spread
    assert s["build"]["1"]["decode_vs_plain"]["df"] == 2 and s["gdn"]["1"]["decode_vs_plain"]["df"] == 2


def test_too_few_prompts_give_no_interval():
    s = figures.summarize(_record([20] * 3, [10] * 3, n=3))
    assert s["build"]["2"]["acceptance"]["ci"] is None and s["gdn"]["2"]["vs_build"]["ci"] is None


@pytest.fixture(scope="module")
def scored(pairs, tmp_path_factory):
    """An ablate folder scored with the vLLM backend (stand-in engine): rows build and all, five 32-token sequences."""
    import importlib

    from splicer.ablate import AblateSettings, run_ablate

    from .test_vllm_backend_protocol import FAKE

    with pytest.MonkeyPatch.context() as mp:
        _use_fake(mp, FAKE)
        plan = tmp_path_factory.mktemp("mtp-plan") / "p.toml"
        plan.write_text(
            'name = "p"\n[[corpus]]\nname = "en"\nkind = "builtin"\ntext = "wiki-en"\nchunk_tokens = 32\nmax_chunks = 5\n'
            '[[row]]\nname = "build"\nrestore = []\n[[row]]\nname = "all"\nkeep = []\n'
        )
        p = pairs["fused"]
        out = tmp_path_factory.mktemp("mtp") / "out"
        settings = AblateSettings(backend="vllm", progress=False, bootstrap=50, time_decode=False)
        run_ablate("all", str(p["lowlatency"]), str(p["base"]), out, str(plan), settings)
    import splicer.backends.vllm_backend as vb

    importlib.reload(vb)
    return out


def _use_fake(mp, fake: str) -> None:
    """The stand-in engine for this block: on the path of this process and of the engine processes it spawns."""
    import importlib
    import os

    import splicer.backends.vllm_backend as vb

    mp.syspath_prepend(fake)
    mp.setenv("PYTHONPATH", os.pathsep.join([fake, str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    importlib.reload(vb)
    orig = vb.VllmBackend.__init__
    mp.setattr(vb.VllmBackend, "__init__", lambda self, *a, **k: orig(self, *a, require_cuda=False, **k))


@pytest.fixture
def vllm_dir(scored, tmp_path, monkeypatch):
    """A copy of the scored folder for one test, the stand-in engine on the path."""
    import shutil

    from .test_vllm_backend_protocol import FAKE

    out = tmp_path / "out"
    shutil.copytree(scored, out, symlinks=True)
    _use_fake(monkeypatch, FAKE)
    return out


KW = dict(prompts_per_corpus=5, prompt_tokens=16, new_tokens=4, time_decode=False, progress=False)


def test_mtp_stage_counts_every_rows_drafts_and_writes_table_and_report(vllm_dir):
    from splicer.ablate.speculative import run_mtp

    rec = run_mtp(vllm_dir, tokens=(1,), **KW)
    order = [(e["row"], e["k"], e["repeat"]) for e in rec["engines"]]
    assert order == [
        ("build", 0, False),
        ("build", 1, False),
        ("all", 0, False),
        ("all", 1, False),
        ("build", 0, True),
        ("build", 1, True),
    ]
    assert all(e["status"] == "ok" for e in rec["engines"])
    build = rec["summary"]["build"]["1"]
    # 4 tokens per prompt: the first from the prefill, then one draft per target step until all 4 are out
    prompts = next(e for e in rec["engines"] if e["row"] == "build" and e["k"] == 1)["per_prompt"]
    assert len(prompts) == 5 and all(p["draft_tokens"] == p["drafts"] and 1 + p["drafts"] + p["accepted"] >= 4 for p in prompts)
    assert 0.1 < build["acceptance"]["value"] < 0.99 and build["acceptance"]["ci"] is not None
    assert build["repeat_agrees"] is True and build["greedy_changed_prompts"] == 0
    assert "vs_build" in rec["summary"]["all"]["1"]
    table, report = (vllm_dir / "table.md").read_text(), (vllm_dir / "report.md").read_text()
    assert "MTP acceptance (speculative decoding in vLLM)" in table and "MTP k=1, build: acceptance" in report
    assert (
        json.loads((vllm_dir / figures.FILE).read_text())["summary"]["build"]["1"]["acceptance"]["value"]
        == build["acceptance"]["value"]
    )
    # the teacher-forced estimate on the same folder (torch reference, CPU) is set beside the engine's k=1 figure,
    # paired over the 5 sequences the engine's prompts were cut from; the engine's file is left as it was
    from splicer.ablate.speculative import run_teacher_forced
    from splicer.analysis import teacher_forced

    engines = (vllm_dir / figures.FILE).read_text()
    forced = run_teacher_forced(vllm_dir, device="cpu", progress=False)
    assert (vllm_dir / figures.FILE).read_text() == engines and set(forced["rows"]) == {"build", "all"}
    spec = teacher_forced.load(vllm_dir)
    cmp = spec["engine"]["build"]
    assert cmp["engine"]["value"] == build["per_position"][0]["value"] and cmp["sequences"] == 5
    hits = forced["rows"]["build"]["hits"]
    assert cmp["estimate_shared"] == pytest.approx(sum(hits) / sum(s["positions"] for s in forced["sequences"]))
    assert cmp["vs_engine"]["diff"] == pytest.approx(cmp["estimate_shared"] - cmp["engine_shared"])
    table, report = (vllm_dir / "table.md").read_text(), (vllm_dir / "report.md").read_text()
    section = table.split("MTP acceptance, teacher-forced (torch reference)")[1]
    assert "| build " in section and "(on the 5 sequences both measured)" in section and "No vLLM figure" not in section
    assert "MTP teacher-forced, build: first-position acceptance" in report and "teacher-forced − vLLM" in report


def test_each_sequences_own_counts_from_vllm_0_33_are_the_counters_difference():
    """vLLM 0.33's per-request spec-decode metrics (RequestSpecDecodeMetrics.to_dict) give one sequence's histogram of
    accepted draft tokens per verify step; the same drafts as the engine counters' difference around the request."""
    from splicer.backends.vllm_outputs import SPEC_ACCEPTED, SPEC_DRAFT_TOKENS, SPEC_DRAFTS, SPEC_PER_POS, spec_counts

    # k=2: five verify steps accepting 0, 2, 1, 2, 2 draft tokens
    request = {"acceptance_histogram": [1, 1, 3], "num_draft_tokens": 10, "num_spec_tokens": 2}
    before = {SPEC_DRAFTS: 4.0, SPEC_DRAFT_TOKENS: 8.0, SPEC_ACCEPTED: 3.0, SPEC_PER_POS: [2.0, 1.0]}
    after = {SPEC_DRAFTS: 9.0, SPEC_DRAFT_TOKENS: 18.0, SPEC_ACCEPTED: 10.0, SPEC_PER_POS: [6.0, 4.0]}
    got = spec_counts({"before": before, "after": after, "request": request}, 2)
    assert got == {
        "drafts": 5,
        "draft_tokens": 10,
        "accepted": 7,
        "accepted_per_pos": [4, 3],
        "counted_by": "request",
        "counters_agree": True,
    }
    after[SPEC_ACCEPTED] = 11.0  # the counters say otherwise: the sequence's own counts stand, the disagreement is kept
    assert spec_counts({"before": before, "after": after, "request": request}, 2)["counters_agree"] is False
    assert "counters_agree" not in spec_counts({"before": {}, "after": {}, "request": request}, 2)  # stats off
    assert spec_counts({"before": before, "after": after, "request": None}, 2)["counted_by"] == "engine counters"
    with pytest.raises(ValueError, match="3 entries for k=1"):
        spec_counts({"before": {}, "after": {}, "request": request}, 1)


def test_mtp_stage_on_vllm_0_33_counts_each_sequence_itself_and_agrees_with_its_counters(vllm_dir, monkeypatch):
    """With the stand-in following 0.33's API the worker asks for per-request spec-decode metrics (an engine argument
    0.26 does not have, so never given there: the other MTP tests run on 0.26's API) and counts each prompt from them;
    the engine counters' difference around each prompt, 0.26's way, agrees prompt by prompt."""
    from splicer.ablate.speculative import run_mtp

    monkeypatch.setenv("FAKE_VLLM_API", "0.33")
    after = run_mtp(vllm_dir, rows=["build"], tokens=(2,), **KW)
    drafting = [e for e in after["engines"] if e["k"] == 2 and not e["repeat"]][0]
    assert drafting["counted_by"] == ["request"] and drafting["counters_agree"] is True
    assert sum(p["drafts"] for p in drafting["per_prompt"]) and sum(p["accepted"] for p in drafting["per_prompt"])
    plain = [e for e in after["engines"] if e["k"] == 0][0]
    assert "counted_by" not in plain  # an engine without a drafter counts nothing


def test_mtp_stage_resumes_and_flags_a_broken_drafter(vllm_dir, monkeypatch):
    from splicer.ablate.speculative import run_mtp

    monkeypatch.setenv("FAKE_VLLM_MTP_ACCEPT", "0")
    monkeypatch.setattr(figures, "FLAG_MIN_TOKENS", 10)  # the short prompts here draft about 15 tokens per engine
    first = run_mtp(vllm_dir, rows=["build"], tokens=(1,), **KW)
    assert "did not draft from trained weights" in first["summary"]["build"]["1"]["flagged"]
    assert "flagged: acceptance 0.0 %" in (vllm_dir / "table.md").read_text()
    logs = sorted((vllm_dir / "mtp-logs").glob("*.log"))
    again = run_mtp(vllm_dir, rows=["build"], tokens=(1,), **KW)  # same settings: every engine kept, none started
    assert sorted((vllm_dir / "mtp-logs").glob("*.log")) == logs and again["engines"] == first["engines"]


def test_mtp_refuses_a_folder_of_the_torch_backend_in_one_line(vllm_dir, capsys):
    results = json.loads((vllm_dir / "results.json").read_text())
    (vllm_dir / "results.json").write_text(json.dumps(dict(results, backend="torch")))
    assert main(["mtp", str(vllm_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "torch backend" in err and "--backend vllm" in err
    assert not (vllm_dir / figures.FILE).exists()
    # a row whose ablate run failed: named as failed, with its error, not as a row DIR never ran
    failed = {"name": "gdn", "restored": ["gdn"], "status": "error", "error": "RuntimeError: engine died\nTraceback ..."}
    (vllm_dir / "results.json").write_text(json.dumps(dict(results, variants=[*results["variants"], failed])))
    for argv, says in (
        (["--tokens", "0"], "distinct draft-token counts"),
        (["--tokens", "1,x"], "whole numbers"),
        (["--rows", "nope"], "no finished row of that name"),
        (["--rows", "gdn"], "gdn failed in " + str(vllm_dir) + " (its error: RuntimeError: engine died); rerun ablate"),
        (["--tokens", ","], "give whole numbers"),
    ):
        assert main(["mtp", str(vllm_dir), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and says in err, err
    assert not (vllm_dir / figures.FILE).exists()


def test_rows_without_a_drafter_are_skipped_with_the_reason(tmp_path):
    from splicer.ablate.speculative import _engine_plan

    assert _engine_plan(["build", "gdn"], "build", [1, 2])[-3:] == [("build", 0, True), ("build", 1, True), ("build", 2, True)]
    assert Path  # the no-MTP case runs on the GPU (seed checks); here the plan's order is what is checked
