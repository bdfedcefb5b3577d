"""The torch reference backend loads builds with each packed module read under its own scheme."""

from __future__ import annotations

import pytest
import torch

from splicer.backends.torch_ref import TorchBackend


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_build_weights_are_close_to_the_base(pairs):
    """INT4 g128 modules land ~11 % from the base, the INT8 head ~1 %: the head must not be read as INT4
    (compressed-tensors' model-free dequantizer would, since group_0 `Linear` comes first)."""
    p = pairs["fused"]
    base, build = TorchBackend("cpu"), TorchBackend("cpu")
    base.load(p["base"])
    build.load(p["lowlatency"])
    pb, pq = dict(base.model.named_parameters()), dict(build.model.named_parameters())
    assert _rel(pq["lm_head.weight"], pb["lm_head.weight"]) < 0.02
    for name in (
        "model.layers.0.linear_attn.in_proj_qkv.weight",
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.1.mlp.experts.gate_up_proj",
        "model.layers.2.mlp.shared_expert.down_proj.weight",
    ):
        assert 0.05 < _rel(pq[name], pb[name]) < 0.2, name
    assert torch.equal(pq["model.layers.0.linear_attn.in_proj_a.weight"], pb["model.layers.0.linear_attn.in_proj_a.weight"])


def test_score_shapes_and_consistency(pairs):
    b = TorchBackend("cpu")
    b.load(pairs["per_expert"]["base"])
    seqs = [list(range(10, 42)), list(range(50, 82)), list(range(5, 20))]
    out = list(b.score(seqs, top_k=20, want_full=True, batch_size=2))
    assert [s.topk_ids.shape for s in out] == [(31, 20), (31, 20), (14, 20)]
    for seq, s in zip(seqs, out):
        assert torch.allclose(s.full.gather(1, torch.tensor(seq[1:])[:, None])[:, 0], s.target_logprobs)
        # bf16 logits tie often, so compare the top value, not which of the tied ids came first
        assert torch.equal(s.topk_logprobs[:, 0], s.full.max(-1).values)
        assert torch.equal(s.full.gather(1, s.topk_ids.long()), s.topk_logprobs)
    gen = b.generate([seqs[0]], 5, stop_ids=[])
    assert len(gen[0]) == 5


def test_score_leaves_the_callers_autograd_alone(pairs):
    """A partly consumed score() must not leave the caller in inference mode (no autograd) between yields."""
    import torch

    b = TorchBackend("cpu")
    b.load(pairs["per_expert"]["base"])
    seqs = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [3, 4, 5]]
    it = b.score(seqs, top_k=5, batch_size=1)
    next(it)
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    x = torch.ones(2, requires_grad=True)
    (x * 2).sum().backward()
    assert x.grad is not None
    del it


def test_vllm_prompt_logprobs_conversion():
    """vLLM's prompt_logprobs -> top-k ids by rank, and the actual token's logprob even when it ranks below k."""
    from collections import namedtuple

    from splicer.backends.vllm_outputs import PAD_LOGPROB, scores_from_prompt_logprobs

    Lp = namedtuple("Lp", "logprob rank decoded_token")
    ids = [7, 3, 9]
    plp = [
        None,
        {5: Lp(-0.1, 1, None), 3: Lp(-2.5, 2, None), 8: Lp(-3.0, 3, None)},
        {9: Lp(-7.0, 40, None), 4: Lp(-0.2, 1, None), 6: Lp(-1.9, 2, None), 2: Lp(-2.2, 3, None)},
    ]
    s = scores_from_prompt_logprobs(ids, plp, top_k=3)
    assert s.topk_ids.tolist() == [[5, 3, 8], [4, 6, 2]]
    assert s.target_logprobs.tolist() == [-2.5, -7.0]
    s4 = scores_from_prompt_logprobs(ids, plp, top_k=4)
    assert s4.topk_ids[0].tolist() == [5, 3, 8, -1] and s4.topk_logprobs[0, 3].item() == PAD_LOGPROB


def test_vllm_backend_without_gpu_is_a_clear_error(pairs, tmp_path, capsys):
    from splicer.cli import main

    p = pairs["fused"]
    code = main(
        [
            "ablate",
            "all",
            str(p["lowlatency"]),
            str(p["base"]),
            "-o",
            str(tmp_path / "o"),
            "--backend",
            "vllm",
            "-q",
            "--plan",
            "demo",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "vLLM backend needs" in err[0]


def test_kernels_by_class_from_a_real_probe():
    """The per-layer probe vLLM 0.26 returned on the H200 for the INT4 build (results/gpu-fixture/results-run1.json)."""
    import json
    from pathlib import Path

    from splicer.backends.vllm_backend import kernels_by_class

    run = json.loads((Path(__file__).parents[1] / "results/gpu-fixture/results-run1.json").read_text())
    layers = run["variants"][0]["engine"]["layers"]
    from splicer.arch.qwen3_5_moe import QWEN3_5_MOE

    got = kernels_by_class(layers, QWEN3_5_MOE)
    machete = "CompressedTensorsLinearMethod / CompressedTensorsWNA16 / MacheteLinearKernel"
    assert got["gdn"] == got["attention"] == got["shared_expert"] == got["lm_head"] == [machete]
    assert got["experts"][0].startswith("CompressedTensorsWNA16MarlinMoEMethod") and "wna16_backend=MARLIN" in got["experts"][0]


def test_cuda_kernel_advice_is_dropped_on_the_cpu_only():
    """transformers advises installing CUDA kernels (causal-conv1d, flash-linear-attention) each time the CPU runs their
    fallbacks: the demo printed four such lines. The CPU backend drops that one kind of record and no other."""
    import logging

    from splicer.backends.torch_ref import TorchBackend, _cuda_kernel_advice_on_cpu

    logger = logging.getLogger("transformers.integrations.hub_kernels")
    TorchBackend("cpu")
    assert _cuda_kernel_advice_on_cpu in logger.filters
    record = lambda msg: logging.LogRecord(logger.name, logging.WARNING, __file__, 0, msg, None, None)  # noqa: E731
    assert not logger.filter(
        record(
            "`chunk_gated_delta_rule` is falling back to its reference PyTorch implementation "
            "because `flash-linear-attention` is not installed."
        )
    )
    assert logger.filter(record("any other warning"))


def test_torch_backend_takes_the_thread_count_chosen_or_given(monkeypatch):
    import torch

    from splicer.backends.torch_ref import TorchBackend

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("SPLICER_THREADS", "1")
        backend = TorchBackend("cpu")
        assert (torch.get_num_threads(), backend.threads_note) == (1, "torch threads: 1 (from SPLICER_THREADS)")
        assert backend.describe()["threads"] == 1
        from splicer.backends.cpu_threads import torch_threads_note

        assert torch_threads_note() == backend.threads_note  # the line run_ablate writes into DIR/ablate.log
        monkeypatch.delenv("SPLICER_THREADS")
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        backend = TorchBackend("cpu")
        assert (
            backend.threads_note.startswith(f"torch threads: {torch.get_num_threads()} (")
            and " cores, load " in backend.threads_note
        )
        TorchBackend("cpu", threads=2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_threads_option_reaches_the_torch_backend_and_is_refused_for_vllm(pairs, tmp_path, capsys, monkeypatch):
    from splicer.backends.torch_ref import TorchBackend
    from splicer.cli import main
    from splicer.errors import SplicerError

    p = pairs["fused"]
    asked = []

    def stop(self, device="auto", dtype="bfloat16", threads=None):
        asked.append(threads)
        raise SplicerError("stopped once the backend was asked for")

    monkeypatch.setattr(TorchBackend, "__init__", stop)
    argv = ["ablate", "all", str(p["lowlatency"]), str(p["base"]), "-o", str(tmp_path / "o"), "-q", "--plan", "demo", "--threads"]
    assert main([*argv, "3"]) == 2 and asked == [3]
    assert "stopped once the backend was asked for" in capsys.readouterr().err
    assert main([*argv, "1", "--backend", "vllm"]) == 2 and asked == [3]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--threads sets the torch backend's CPU threads" in err[0]
    assert not (tmp_path / "o").exists()


def test_bf16_matrix_products_and_convolutions_on_the_cpu_are_fp32_ones_of_the_same_values_rounded_to_bf16():
    """Each product the reference routes (linear with its bias, matmul, @, bmm, the experts' grouped product) and the
    depthwise conv1d (functional and nn.Conv1d) gives exactly the FP32 result of the BF16 values, rounded to BF16, in
    BF16; FP32 arguments pass as they are. With matmuls=False only the convolutions are routed."""
    from splicer.backends.torch_ref import _Bf16InFp32

    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g).bfloat16() for s in ((9, 16), (12, 16), (12,)))
    xs, ws = torch.randn(3, 9, 16, generator=g).bfloat16(), torch.randn(3, 16, 8, generator=g).bfloat16()
    offs = torch.tensor([3, 7, 9], dtype=torch.int32)
    seq, kernel = torch.randn(2, 24, 11, generator=g).bfloat16(), torch.randn(24, 1, 4, generator=g).bfloat16()
    conv = torch.nn.Conv1d(24, 24, 4, groups=24, padding=3, bias=True).bfloat16()
    cases = {
        "linear": (
            lambda: torch.nn.functional.linear(x, w, b),
            lambda: torch.nn.functional.linear(x.float(), w.float(), b.float()),
        ),
        "matmul": (lambda: torch.matmul(x, w.T), lambda: x.float() @ w.float().T),
        "@": (lambda: x @ w.T, lambda: x.float() @ w.float().T),
        "bmm": (lambda: torch.bmm(xs, ws), lambda: torch.bmm(xs.float(), ws.float())),
        "grouped": (
            lambda: torch._grouped_mm(x, ws[:, :, :], offs=offs),
            lambda: torch._grouped_mm(x.float(), ws.float(), offs=offs),
        ),
        "conv1d": (
            lambda: torch.nn.functional.conv1d(seq, kernel, padding=3, groups=24),
            lambda: torch.nn.functional.conv1d(seq.float(), kernel.float(), padding=3, groups=24),
        ),
        "Conv1d": (
            lambda: conv(seq),
            lambda: torch.nn.functional.conv1d(seq.float(), conv.weight.float(), conv.bias.float(), padding=3, groups=24),
        ),
    }
    with _Bf16InFp32():
        got = {k: f() for k, (f, _) in cases.items()}
        passed = torch.nn.functional.linear(x.float(), w.float())
    for k, (_, want) in cases.items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], want().bfloat16()), k
    assert passed.dtype == torch.float32 and torch.equal(passed, x.float() @ w.float().T)
    routed = []
    real = torch.Tensor.float
    with _Bf16InFp32(matmuls=False):
        torch.Tensor.float = lambda t: routed.append(tuple(t.shape)) or real(t)
        try:
            torch.nn.functional.linear(x, w, b), conv(seq)
        finally:
            torch.Tensor.float = real
    assert routed == [tuple(seq.shape), tuple(conv.weight.shape), tuple(conv.bias.shape)]


def _routed_by_the_mode(monkeypatch) -> list[str]:
    """A list that records, in order, each call _Bf16InFp32 routes through FP32 ("conv" or "matmul")."""
    import splicer.backends.torch_ref as tr

    routed = []
    real = tr._Bf16InFp32.__torch_function__

    def spy(self, func, *a, **k):
        if func in self.funcs:
            routed.append("conv" if func in self.CONVS else "matmul")
        return real(self, func, *a, **k)

    monkeypatch.setattr(tr._Bf16InFp32, "__torch_function__", spy)
    return routed


def test_on_the_cpu_scoring_runs_its_products_in_fp32_and_agrees_with_torchs_bf16_gemm(pairs, monkeypatch):
    """A BF16 model on the CPU scores through the FP32 products and convolutions; torch's own BF16 kernels give the same
    predictions but for rounding in the order of the sums, which a random 4-layer model amplifies (a hundredth of a nat
    on average, at most about 0.13, against log-probs spread over nats). Generation routes the convolutions only (one
    row at a time a GEMM weight's conversion costs more than it saves), and transformers still sees the model's own
    forward (its signature decides what generate passes). An FP32 model is left as it is; the arithmetic is part of the
    job and the engine info."""
    import contextlib
    import inspect

    import splicer.backends.torch_ref as tr

    routed = _routed_by_the_mode(monkeypatch)
    b = TorchBackend("cpu")
    b.load(pairs["per_expert"]["lowlatency"])
    assert "logits_to_keep" in inspect.signature(b.model.forward).parameters
    seqs = [list(range(10, 74)), list(range(80, 144))]
    fp32_products = list(b.score(seqs, top_k=20))
    assert {"conv", "matmul"} <= set(routed), "the FP32 products and convolutions were not used"
    routed.clear()
    b.generate([seqs[0][:8]], 3, stop_ids=[])
    assert set(routed) == {"conv"}, routed
    routed.clear()
    b.time_decode(seqs[0][:8], new_tokens=3, warmup=0, runs=1)
    assert set(routed) == {"conv"}, routed
    routed.clear()
    monkeypatch.setattr(TorchBackend, "_scoring_products", lambda self, model: contextlib.nullcontext())
    own = list(b.score(seqs, top_k=20))
    assert not routed
    for a, o in zip(fp32_products, own):
        apart = (a.target_logprobs - o.target_logprobs).abs()
        assert apart.mean() < 0.05 and apart.max() < 0.5, (apart.mean(), apart.max())
        assert (a.topk_ids[:, 0] == o.topk_ids[:, 0]).float().mean() > 0.9
    monkeypatch.undo()
    f32 = TorchBackend("cpu", dtype="float32")
    f32.load(pairs["per_expert"]["lowlatency"])
    if next(f32.model.parameters()).dtype == torch.float32:
        assert isinstance(f32._scoring_products(f32.model), contextlib.nullcontext)
        assert isinstance(f32._generation_products(f32.model), contextlib.nullcontext)
    assert b.describe()["scoring_products"] == TorchBackend.SCORING_PRODUCTS
    assert tr.TorchOptions().job_settings()["scoring_products"] == TorchBackend.SCORING_PRODUCTS


def test_a_model_without_a_convolution_generates_with_no_mode_around_it(tmp_path):
    """The convolutions-only mode would put a Python call around every op of a decode step and route nothing: a family
    with no Conv1d (qwen3_moe) generates and times decode with torch's own kernels and no mode at all."""
    import contextlib

    from splicer.fixtures.families import write_family_pair

    b = TorchBackend("cpu")
    b.load(write_family_pair(tmp_path / "pair", "qwen3_moe", kinds=())["base"])
    assert isinstance(b._generation_products(b.model), contextlib.nullcontext)
    assert not isinstance(b._scoring_products(b.model), contextlib.nullcontext)  # its products still go through FP32


def test_keyword_out_and_mixed_arguments_are_left_to_torch():
    """Tensors given by keyword are converted too; an out= tensor, or an FP32 tensor beside a BF16 one, leaves the call
    to torch as it is (an FP32 product would not fit a BF16 out=, and torch refuses mixed dtypes itself)."""
    import pytest

    from splicer.backends.torch_ref import _Bf16InFp32

    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 16, generator=g).bfloat16(), torch.randn(12, 16, generator=g).bfloat16()
    with _Bf16InFp32():
        by_keyword = torch.nn.functional.linear(x, weight=w)
        other = torch.matmul(x, other=w.T)
        out = torch.empty(9, 12, dtype=torch.bfloat16)
        torch.matmul(x, w.T, out=out)
        with pytest.raises(RuntimeError):
            torch.nn.functional.linear(x.float(), w)
    want = (x.float() @ w.float().T).bfloat16()
    assert torch.equal(by_keyword, want) and torch.equal(other, want)
    assert torch.equal(out, torch.matmul(x, w.T))


def test_lm_evals_log_likelihoods_run_through_the_fp32_products_and_its_generation_its_convolutions_only(pairs, monkeypatch):
    """lm-eval's HF model over the torch backend (`splicer tasks`): on the CPU with a BF16 model, the forward of
    loglikelihood and loglikelihood_rolling goes through the FP32 products, as score() does, and gives the log-likelihoods
    of torch's own BF16 GEMM (lm-eval's plain HFLM over the same model) but for rounding in the order of the sums;
    generate_until keeps torch's BF16 GEMM and routes the convolutions only, as generate() does. Off the CPU nothing
    changes."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    calls = _routed_by_the_mode(monkeypatch)
    p = pairs["fused"]
    b = TorchBackend("cpu")
    b.load(p["lowlatency"])
    lm = b.lm_eval_model(p["base"], batch_size=4)
    words = "the river runs past the old mill and under the stone bridge before it reaches the sea at dawn".split()
    cut = [(" ".join(words[i : i + 8]), " " + " ".join(words[i + 8 : i + 10])) for i in range(0, 8, 2)]
    likelihood = [Instance("loglikelihood", {}, args, i) for i, args in enumerate(cut)]
    rolling = [Instance("loglikelihood_rolling", {}, (" ".join(words),), 0)]
    generation = [Instance("generate_until", {}, (cut[0][0], {"until": ["\n"], "max_gen_toks": 3}), 0)]

    fp32 = lm.loglikelihood(likelihood)
    assert {"conv", "matmul"} <= set(calls), "lm-eval's log-likelihood forward did not go through the FP32 products"
    calls.clear()
    fp32_rolling = lm.loglikelihood_rolling(rolling)
    assert {"conv", "matmul"} <= set(calls), "lm-eval's rolling log-likelihood forward did not go through the FP32 products"
    calls.clear()
    lm.generate_until(generation)
    assert set(calls) == {"conv"}, "generation's products went through FP32, or its convolutions did not"
    calls.clear()

    own = HFLM(pretrained=b.model, tokenizer=lm.tokenizer, batch_size=4, device="cpu")  # torch's BF16 GEMM throughout
    gemm, gemm_rolling = own.loglikelihood(likelihood), own.loglikelihood_rolling(rolling)
    assert not calls
    # summed over the continuation's tokens, in BF16 as lm-eval sums them (one unit apart at 128 and beyond)
    for a, o in zip([ll for ll, _ in fp32] + fp32_rolling, [ll for ll, _ in gemm] + gemm_rolling):
        assert a == pytest.approx(o, rel=0.03, abs=0.5), (fp32, gemm, fp32_rolling, gemm_rolling)

    b.device = torch.device("cuda")  # what _scoring_products reads: on a GPU, lm-eval's forward is left as it is
    lm.loglikelihood(likelihood[:1])
    assert not calls


@pytest.mark.parametrize(
    ("family", "where", "key"),
    [("qwen3_moe", None, "dtype"), ("qwen3_moe", None, "torch_dtype"), ("qwen3_5_moe", "text_config", "dtype")],
)
def test_a_checkpoint_whose_config_says_float16_loads_in_the_backends_dtype(pairs, tmp_path, family, where, key):
    """A config.json naming float16 (as GPTQ exports often do) must not change what the backend computes in: the
    model is built in the dtype the backend records, so a build and its base are scored in the same arithmetic."""
    import json
    import shutil

    from splicer.fixtures.families import write_family_pair

    if family == "qwen3_5_moe":
        src = pairs["per_expert"]["base"]
    else:
        src = write_family_pair(tmp_path / "pair", family, kinds=())["base"]
    folder = tmp_path / "fp16-config"
    shutil.copytree(src, folder)
    cfg = json.loads((folder / "config.json").read_text())
    sub = cfg[where] if where else cfg
    sub.pop("dtype", None), sub.pop("torch_dtype", None)
    sub[key] = "float16"
    (folder / "config.json").write_text(json.dumps(cfg))
    as_given, reference = TorchBackend("cpu"), TorchBackend("cpu")
    as_given.load(folder)
    reference.load(src)
    assert {p.dtype for p in as_given.model.parameters()} == {torch.bfloat16}
    assert as_given.describe()["dtype"] == "bfloat16"
    # recorded, so that a job begun while the config's dtype won is another job, not resumed with these rows
    from splicer.backends import torch_ref as tr

    assert as_given.describe()["model_dtype"] == tr.TorchOptions().job_settings()["model_dtype"] == TorchBackend.MODEL_DTYPE
    assert {"model_dtype": TorchBackend.MODEL_DTYPE}.items() <= tr.TorchOptions().cache_key()[0].items()
    seq = [list(range(10, 30))]
    got, want = next(iter(as_given.score(seq, top_k=5))), next(iter(reference.score(seq, top_k=5)))
    assert torch.equal(got.target_logprobs, want.target_logprobs)
