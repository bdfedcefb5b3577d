"""The built-in chat set's groups, the early refusal of Hub corpora that cannot be read, and the torch thread
count chosen from the free cores."""

from __future__ import annotations

import itertools
import sys
import types

import pytest
import torch

from splicer.ablate import first_occurrence_weights
from splicer.backends.cpu_threads import choose_threads, usable_cores
from splicer.cli import main
from splicer.corpora.chat import GROUPS, MAX_CONVERSATIONS, N_GROUPS, NAMES, conversations, group
from splicer.corpora.core import Corpus, build_corpus, check_hub_corpora, validate_spec
from splicer.errors import SplicerError

from .conftest import tree_digest


def test_chat_groups_are_nested_and_share_nothing_across_groups():
    """Conversations of one group share their business and history; no business, rules text or history turn appears in
    two groups; conversation i is in group i % N_GROUPS, so 12 conversations are 12 groups of one."""
    convs = conversations(MAX_CONVERSATIONS)
    assert len(convs) == 72 and N_GROUPS >= 12  # the default plan asks for 72
    systems = [c[0]["content"] for c in convs]
    prompt = [(s.removeprefix(NAMES[i]), tuple(m["content"] for m in c[1:-1])) for i, (s, c) in enumerate(zip(systems, convs))]
    assert [group(i) for i in range(len(convs))] == [i % N_GROUPS for i in range(len(convs))]
    by_group = {}
    for i, p in enumerate(prompt):
        by_group.setdefault(group(i), set()).add(p)
    assert all(len(ps) == 1 for ps in by_group.values())  # one business and one history per group
    assert len(by_group) == N_GROUPS
    shared = [(b, h) for ((b, h),) in by_group.values()]
    assert len({b for b, _ in shared}) == N_GROUPS and all(h for _, h in shared)
    # across groups: no rules text and no history turn in common
    assert len({rules for _, rules, _ in GROUPS}) == N_GROUPS and len({role for role, _, _ in GROUPS}) == N_GROUPS
    turns = [t for _, h in shared for t in h]
    assert len(set(turns)) == len(turns)
    assert {s.removeprefix(NAMES[i]).split(".")[0] for i, s in enumerate(systems)} == {
        f" here: you are {r}" for r, _, _ in GROUPS
    }
    # every name distinct and opening its system prompt with its own character; every last user turn distinct
    assert len({s[0] for s in systems}) == len(convs)
    assert len({c[-1]["content"] for c in convs}) == len(convs)
    assert len({group(i) for i in range(12)}) == 12
    with pytest.raises(SplicerError, match="has 72 conversations"):
        validate_spec({"name": "chat", "kind": "chat", "conversations": 73}, "plan p")


def _common_prefix(a, b):
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("history_turns", [0, 4])
def test_chat_prompts_share_only_the_template_header(pairs, history_turns):
    """Token by token, two conversations share the chat template's `<|im_start|>system` header and nothing more; the
    header's positions (all but the last, whose next token differs) are what first_occurrence_weights counts once."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(pairs["fused"]["base"]))
    corpus = build_corpus(
        {"name": "chat", "kind": "chat", "conversations": MAX_CONVERSATIONS, "history_turns": history_turns}, tok, None, None
    )
    seqs = corpus.sequences
    assert corpus.groups == [i % N_GROUPS for i in range(len(seqs))]
    assert Corpus.from_json(corpus.to_json()).groups == corpus.groups  # kept in the base pass's corpora.json
    empty = tok.apply_chat_template([{"role": "system", "content": ""}], tokenize=True)
    header = _common_prefix(list(empty["input_ids"] if hasattr(empty, "keys") else empty), seqs[0])
    assert 0 < header < corpus.prompt_lens[0]
    assert max(_common_prefix(a, b) for a, b in itertools.combinations(seqs, 2)) == header
    lengths = torch.tensor([len(s) for s in seqs])
    weights = first_occurrence_weights(seqs, lengths)
    zeros = [int((w == 0).sum()) for w in weights.split(lengths.tolist())]
    assert zeros == [0] + [header - 1] * (len(seqs) - 1)


HUB_SPECS = [
    {"name": "wiki-zh", "kind": "hub", "dataset": "wikimedia/wikipedia"},
    {"name": "chat", "kind": "chat", "conversations": 4},
]


@pytest.fixture()
def without_datasets(monkeypatch):
    """Online as far as the environment says, but no `datasets` package (None in sys.modules: import and find_spec fail)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)


def test_hub_corpora_are_refused_offline_or_without_datasets(monkeypatch, without_datasets):
    with pytest.raises(
        SplicerError,
        match=r"plan p reads a corpus from the Hub, wiki-zh \(wikimedia/wikipedia\), but the "
        r"datasets package is not installed \(pip install datasets\); pass X",
    ):
        check_hub_corpora(HUB_SPECS, "plan p", "pass X")
    monkeypatch.setitem(sys.modules, "datasets", types.ModuleType("datasets"))
    check_hub_corpora(HUB_SPECS, "plan p", "pass X")  # installed and online: read when the run gets there
    check_hub_corpora(HUB_SPECS[1:], "plan p", "pass X")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SplicerError, match="but HF_HUB_OFFLINE=1 is set"):
        check_hub_corpora(HUB_SPECS, "plan p", "pass X")


@pytest.mark.parametrize("offline", ["HF_HUB_OFFLINE", "no datasets"])
def test_score_and_plan_sweep_say_before_anything_runs_that_the_default_plan_needs_the_hub(
    pairs, tmp_path, capsys, monkeypatch, without_datasets, offline
):
    if offline == "HF_HUB_OFFLINE":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setitem(sys.modules, "datasets", types.ModuleType("datasets"))
    p = pairs["fused"]
    before = {k: tree_digest(p[k]) for k in ("base", "lowlatency")}
    out = tmp_path / "out"
    assert main(["score", str(p["base"]), str(p["lowlatency"]), "-o", str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "plan where-error-comes-from reads corpora from the Hub, wiki-zh (wikimedia/wikipedia), wiki-en (Salesforce/wikitext)"
        in err[0]
        and "--corpus NAME=FILE" in err[0]
    ), err
    assert not out.exists()
    sweep = tmp_path / "sweep.toml"
    assert main(["plan", "sweep", str(p["lowlatency"]), "--class", "gdn", "--groups", "2", "-o", str(sweep)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--from where-error-comes-from reads corpora from the Hub" in err[0] and "--from demo" in err[0]
    assert not sweep.exists() and list(tmp_path.iterdir()) == []
    assert {k: tree_digest(p[k]) for k in ("base", "lowlatency")} == before


def test_torch_threads_leave_the_busy_cores_to_others(tmp_path):
    assert choose_threads(env={}, cores=2, others=2.1) == (
        1,
        "torch threads: 1 (2 cores, load 2.1; set SPLICER_THREADS to choose)",
    )
    assert choose_threads(env={}, cores=2, others=0.4)[0] == 2
    assert choose_threads(env={}, cores=16, others=3.6)[0] == 12
    assert choose_threads(env={}, cores=2, others=7.0)[0] == 1
    # A count the user gave wins: the argument, then SPLICER_THREADS, then OMP_NUM_THREADS.
    assert choose_threads(3, env={"SPLICER_THREADS": "2"}, cores=2, others=2)[0] == 3
    assert choose_threads(env={"SPLICER_THREADS": "2", "OMP_NUM_THREADS": "1"}, cores=2, others=2)[0] == 2
    assert choose_threads(env={"OMP_NUM_THREADS": "4,2"}, cores=2, others=2) == (4, "torch threads: 4 (from OMP_NUM_THREADS)")
    with pytest.raises(SplicerError, match="SPLICER_THREADS='0' is not a whole number from 1 to 1024"):
        choose_threads(env={"SPLICER_THREADS": "0"})
    # A digit int() cannot read, and counts that overflow torch's C int or make OpenMP abort the process: one line each.
    for env, message in (
        ({"SPLICER_THREADS": "\u00b2"}, "SPLICER_THREADS='\u00b2' is not a whole number from 1 to 1024"),
        ({"SPLICER_THREADS": "99999999999"}, "SPLICER_THREADS='99999999999' is not a whole number from 1"),
        ({"OMP_NUM_THREADS": "99999999999"}, "OMP_NUM_THREADS='99999999999' is more than 1024 threads"),
    ):
        with pytest.raises(SplicerError, match=message):
            choose_threads(env=env)
    with pytest.raises(SplicerError, match="--threads 2147483647 is more than 1024 threads"):
        choose_threads(2**31 - 1, env={})
    assert choose_threads(env={"OMP_NUM_THREADS": "\u00b2"}, cores=2, others=0)[0] == 2  # ignored, as OpenMP ignores it
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("150000 100000\n")  # a container allowed 1.5 cores
    assert usable_cores(cpu_max) == 1
    cpu_max.write_text("max 100000\n")
    assert usable_cores(cpu_max) == usable_cores(tmp_path / "none") >= 1
