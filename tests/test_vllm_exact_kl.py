"""Exact-support KL through vLLM's prompt_logprob_token_ids (vLLM 0.31 and later), against the stand-in engine on CPU.

tests/fake_vllm is NOT vLLM: with FAKE_VLLM_API=0.33 it takes SamplingParams.prompt_logprob_token_ids and answers
RequestOutput.prompt_token_id_logprobs as vLLM 0.33's source says it does (sampling_params.py, outputs.py,
v1/engine/input_processor.py), with the torch reference's numbers; with 0.26 (its default) it refuses the keyword as
0.26 does. So these tests check splicer's side (the probe, the request, the parsing, one way of scoring per run, the
record and the wording), not what a real 0.33 engine returns: none has run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from splicer.errors import SplicerError

FAKE = str(Path(__file__).parent / "fake_vllm")

PLAN = (
    'name = "p"\n[[corpus]]\nname = "en"\nkind = "builtin"\ntext = "wiki-en"\nchunk_tokens = 48\nmax_chunks = 5\n'
    '[[row]]\nname = "build"\nrestore = []\n[[row]]\nname = "gdn"\nrestore = ["gdn"]\n[[row]]\nname = "all"\nkeep = []\n'
)


@pytest.fixture
def fake_vllm(monkeypatch):
    monkeypatch.syspath_prepend(FAKE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([FAKE, str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    import importlib

    import splicer.backends.vllm_backend as vb

    importlib.reload(vb)
    orig = vb.VllmBackend.__init__
    monkeypatch.setattr(vb.VllmBackend, "__init__", lambda self, *a, **k: orig(self, *a, require_cuda=False, **k))
    return vb


@pytest.fixture
def engine(monkeypatch):
    """The stand-in's module itself, in this process under its own name (a real vllm may be importable as `vllm`)."""
    spec = importlib.util.spec_from_file_location("fake_vllm_api", Path(FAKE) / "vllm" / "__init__.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_the_stand_in_refuses_the_keyword_as_0_26_and_checks_it_as_0_33(pairs, engine, monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setenv("FAKE_VLLM_API", "0.26")
    with pytest.raises(TypeError, match="Unexpected keyword argument 'prompt_logprob_token_ids'"):
        engine.SamplingParams(max_tokens=1, prompt_logprob_token_ids=[[0]])
    monkeypatch.setenv("FAKE_VLLM_API", "0.33")
    llm = engine.LLM(str(pairs["fused"]["base"]), max_logprobs=3)
    prompt = [{"prompt_token_ids": [5, 9, 7, 2]}]

    def ask(rows, **kw):
        params = engine.SamplingParams(max_tokens=1, prompt_logprob_token_ids=rows, **kw)
        return llm.generate(prompt, params, use_tqdm=False)[0].prompt_token_id_logprobs

    # rows padded with -1 score -inf; row t scores its ids as predictions of token t+1, as the full log-softmax says
    got = ask([[9, 1], [7], [2, 3, -1]])
    full = next(llm._ref.score([[5, 9, 7, 2]], top_k=1, want_full=True)).full
    assert got.shape == (3, 3) and got.dtype == np.float32
    assert got[0, 0] == pytest.approx(float(full[0, 9])) and got[2, 1] == pytest.approx(float(full[2, 3]))
    assert np.isneginf(got[0, 2]) and np.isneginf(got[1, 1]) and np.isneginf(got[2, 2])
    from_one = ask(np.array([[7, 2], [2, 3]], dtype=np.int32), prompt_logprob_start=1)  # the rows from a start on
    assert from_one.shape == (2, 2) and from_one[0, 0] == pytest.approx(float(full[1, 7]))
    assert llm.generate(prompt, engine.SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_id_logprobs is None
    for rows, kw, refusal in (
        ([[9], [7]], {}, "has 2 rows, but the prompt has 3 scored rows"),
        ([[1, 2, 3, 4]] * 3, {}, "greater than max allowed: 3"),
        ([[9], [], [2]], {}, None),  # a ragged row is padded, not refused
        ([[]], {}, "non-empty integer array"),
        ([[-2], [0], [0]], {}, "out-of-vocab"),
        ([[9]], {"prompt_logprob_start": -1}, "must be non-negative"),
    ):
        if refusal is None:
            assert ask(rows, **kw).shape == (3, 1)
            continue
        with pytest.raises(engine.VLLMValidationError, match=refusal):
            ask(rows, **kw)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(engine.VLLMValidationError, match="requires the V2 model runner"):
        ask([[9], [7], [2]])


@contextmanager
def _closing(backend):
    """The backend's worker ended however the test ends (a worker left running keeps pytest from exiting)."""
    try:
        yield backend
    finally:
        backend.close()


def test_the_backend_gathers_exactly_where_the_engine_serves_token_ids(pairs, fake_vllm, tmp_path, monkeypatch):
    """0.33: the worker's probe finds prompt_logprob_token_ids and scores gather the torch reference's exact log-probs at
    the base's ids (padding kept out of the KL sums); 0.26, or 0.33 on the V1 model runner: no gather, and why not."""
    from splicer.backends.torch_ref import TorchBackend
    from splicer.backends.vllm_outputs import PAD_LOGPROB

    seqs = [list(range(20, 60)), list(range(100, 130)), [7]]
    ref = TorchBackend("cpu")
    ref.load(pairs["fused"]["base"])
    gather = [s.topk_ids.clone() for s in ref.score(seqs, 20, batch_size=1)]
    gather[1][3, 5] = -1  # a top-k slot the base pass left empty
    ref.load(pairs["fused"]["lowlatency"])
    want = list(ref.score(seqs, 20, gather_ids=[g.clamp_min(0) for g in gather], batch_size=1))

    monkeypatch.setenv("FAKE_VLLM_API", "0.33")
    with _closing(fake_vllm.VllmBackend(log_dir=tmp_path / "0.33")) as b:
        b.load(pairs["fused"]["lowlatency"])
        assert b.exact_gather and b.load_info()["token_id_scoring"] == {"served": True, "why_not": None}
        got = list(b.score(seqs, 20, gather_ids=gather, batch_size=2))
        bounded = list(b.score(seqs, 20, batch_size=2))  # the base pass asks for no ids
    for g, w, n in zip(got, want, bounded):
        assert torch.equal(g.topk_ids, w.topk_ids) and torch.allclose(g.target_logprobs, w.target_logprobs, atol=1e-5)
        assert g.gathered.shape == w.gathered.shape and n.gathered is None
    assert torch.allclose(got[0].gathered, want[0].gathered, atol=1e-5)
    assert got[1].gathered[3, 5] == PAD_LOGPROB and torch.allclose(got[1].gathered[4:], want[1].gathered[4:], atol=1e-5)
    assert got[2].gathered.shape == (0, 20)  # a one-token sequence has no position: no row asked of vLLM

    for api, runner, why in (("0.26", None, "has no prompt_logprob_token_ids"), ("0.33", "0", "requires the V2 model runner")):
        monkeypatch.setenv("FAKE_VLLM_API", api)
        if runner is not None:
            monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", runner)
        with _closing(fake_vllm.VllmBackend(log_dir=tmp_path / api)) as b:
            b.load(pairs["fused"]["lowlatency"])
            assert not b.exact_gather and why in b.load_info()["token_id_scoring"]["why_not"]
            assert all(s.gathered is None for s in b.score(seqs[:2], 20, gather_ids=gather[:2], batch_size=2))


def _ablate(backend, out, plan, rows="gdn", **kw):
    from splicer.ablate import AblateSettings, run_ablate

    p = kw.pop("pair")
    return run_ablate(
        rows,
        str(p["lowlatency"]),
        str(p["base"]),
        out,
        str(plan),
        AblateSettings(backend=backend, progress=False, bootstrap=50, time_decode=False),
    )


def test_ablate_through_0_33_gives_the_torch_backends_kl_and_0_26_its_bound(pairs, fake_vllm, tmp_path, monkeypatch):
    """Rows scored through the stand-in in 0.33 mode have the torch backend's KL, top-1 and dNLL on the same positions,
    per position; in 0.26 mode the KL is today's bound from the variant's own top-20, at most the exact one here. Each
    run records how it measured (for the run, each row and the backend) and the table words it so."""
    from safetensors.torch import load_file

    plan = tmp_path / "p.toml"
    plan.write_text(PLAN)
    p = pairs["fused"]
    torch_run = _ablate("torch", tmp_path / "torch", plan, pair=p)
    monkeypatch.setenv("FAKE_VLLM_API", "0.33")
    exact = _ablate("vllm", tmp_path / "exact", plan, pair=p)
    monkeypatch.setenv("FAKE_VLLM_API", "0.26")
    bound = _ablate("vllm", tmp_path / "bound", plan, pair=p)

    assert torch_run["kl_support"] == exact["kl_support"] == "exact" and bound["kl_support"] == "own_top_k"
    assert exact["backend_info"]["kl_support"] == "exact" and bound["backend_info"]["kl_support"] == "own_top_k"
    assert exact["base_pass"]["kl_support"] == "exact"
    for name in ("build", "gdn"):
        rows = {r: {v["name"]: v for v in run["variants"]}[name] for r, run in (("t", torch_run), ("e", exact), ("b", bound))}
        assert [rows[r]["kl_support"] for r in "teb"] == ["exact", "exact", "own_top_k"]
        t, e, b = (load_file(str(tmp_path / d / "scores" / name / "en.safetensors")) for d in ("torch", "exact", "bound"))
        assert torch.equal(t["target"], e["target"]) and torch.equal(t["top1"], e["top1"])
        assert torch.allclose(e["kl_top"], t["kl_top"], atol=1e-5) and torch.allclose(e["dlogp"], t["dlogp"], atol=1e-5)
        assert rows["e"]["metrics"]["en"]["kl"] == pytest.approx(rows["t"]["metrics"]["en"]["kl"], rel=1e-4, abs=1e-7)
        assert rows["b"]["metrics"]["en"]["kl"] <= rows["e"]["metrics"]["en"]["kl"] + 1e-7
        assert bool((b["kl_top"] <= e["kl_top"] + 1e-6).all())
    assert exact["noise_floor"]["en"]["kl"] == pytest.approx(0, abs=1e-7)

    worded = {d: (tmp_path / d / "table.md").read_text() for d in ("torch", "exact", "bound")}
    assert "exact log-probs at those ids (vLLM's prompt_logprob_token_ids)" in worded["exact"]
    assert "prompt_logprob_token_ids" not in worded["bound"] and "own top-20 (an id missing there" in worded["bound"]
    assert "prompt_logprob_token_ids" not in worded["torch"] and "exact log-probs at those ids:" in worded["torch"]


def test_a_run_keeps_the_way_its_base_pass_was_scored(pairs, fake_vllm, tmp_path, monkeypatch, capsys):
    """Resumed on a vLLM with prompt_logprob_token_ids, a run begun without it stays bounded; resumed on one without it,
    a run begun exact is refused in one line before anything starts; a row whose engine cannot score exactly (another
    model runner) fails with that line; a base pass cached before kl_support was recorded is read from its noise pass;
    finished rows scored the other way than the base pass (made again) are refused."""
    from splicer.cli import main

    plan = tmp_path / "p.toml"
    plan.write_text(PLAN)
    p = pairs["fused"]
    monkeypatch.setenv("FAKE_VLLM_API", "0.26")
    _ablate("vllm", tmp_path / "begun-bounded", plan, pair=p, rows="build")
    monkeypatch.setenv("FAKE_VLLM_API", "0.33")
    resumed = _ablate("vllm", tmp_path / "begun-bounded", plan, pair=p, rows="gdn")
    assert resumed["kl_support"] == "own_top_k" and {v["kl_support"] for v in resumed["variants"]} == {"own_top_k"}
    assert [v["name"] for v in resumed["variants"]] == ["build", "gdn"] and resumed["backend_info"]["kl_support"] == "own_top_k"

    _ablate("vllm", tmp_path / "begun-exact", plan, pair=p, rows="build")
    before = (tmp_path / "begun-exact" / "results.json").read_text()
    monkeypatch.setenv("FAKE_VLLM_API", "0.26")
    with pytest.raises(
        SplicerError, match=r"scored with exact log-probs .* vLLM 0\.0\.0-fake here has no prompt_logprob_token_ids"
    ):
        _ablate("vllm", tmp_path / "begun-exact", plan, pair=p, rows="gdn")
    assert (tmp_path / "begun-exact" / "results.json").read_text() == before
    assert not (tmp_path / "begun-exact" / "variants").exists()  # refused before any splice
    capsys.readouterr()
    code = main(
        [
            "ablate",
            "gdn",
            str(p["lowlatency"]),
            str(p["base"]),
            "-o",
            str(tmp_path / "begun-exact"),
            "--plan",
            str(plan),
            "--backend",
            "vllm",
            "--no-time",
            "-q",
        ]
    )
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err and len(err.strip().splitlines()) == 1 and "resume it with vLLM 0.31" in err

    monkeypatch.setenv("FAKE_VLLM_API", "0.33")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    other_runner = _ablate("vllm", tmp_path / "begun-exact", plan, pair=p, rows="gdn")
    row = {v["name"]: v for v in other_runner["variants"]}["gdn"]
    assert row["status"] == "error" and "cannot score exact log-probs" in row["error"] and "V2 model runner" in row["error"]
    assert "traceback" not in row

    # a cache of an older splicer: done.json without kl_support, the noise pass's file says it
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    cache = next((tmp_path / "begun-exact" / "cache").glob("base-*"))
    done = json.loads((cache / "done.json").read_text())
    del done["kl_support"]
    (cache / "done.json").write_text(json.dumps(done))
    old = _ablate("vllm", tmp_path / "begun-exact", plan, pair=p, rows="gdn")
    assert old["kl_support"] == "exact" and {v["name"]: v for v in old["variants"]}["gdn"]["kl_support"] == "exact"

    # a base pass made again the other way (its cache removed, then resumed elsewhere) under finished rows: refused
    (cache / "done.json").write_text(json.dumps(dict(done, kl_support="own_top_k")))
    with pytest.raises(SplicerError, match=r"finished rows build, gdn in .* were scored with exact log-probs .* variant's own"):
        _ablate("vllm", tmp_path / "begun-exact", plan, pair=p, rows="all")
    shutil.rmtree(tmp_path / "begun-bounded")


def test_token_id_logprobs_parse_into_gathered_and_bad_answers_are_refused():
    from splicer.backends.vllm_outputs import PAD_LOGPROB, gathered_logprobs

    ids = np.array([[4, 2, -1], [7, 1, 3]], dtype=np.int32)
    got = gathered_logprobs(np.array([[-0.5, -1.5, -np.inf], [-0.1, -2.0, -3.0]], dtype=np.float32), ids)
    assert got.dtype == torch.float32 and torch.equal(got, torch.tensor([[-0.5, -1.5, PAD_LOGPROB], [-0.1, -2.0, -3.0]]))
    with pytest.raises(RuntimeError, match="no prompt_token_id_logprobs"):
        gathered_logprobs(None, ids)
    with pytest.raises(RuntimeError, match=r"shape \(1, 3\), not the \(2, 3\)"):
        gathered_logprobs(np.zeros((1, 3), dtype=np.float32), ids)
