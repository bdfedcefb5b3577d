"""vLLM on a GPU: spliced fixture checkpoints load, score like the base where they should, and bad splices fail.

Marker `gpu`: skipped without CUDA or vLLM (CI never has either). scripts/gpu/README.md says how to run these on
the lent H200. Engine options come from SPLICER_GPU_ENGINE_ARGS (JSON), e.g. compile off for fast starts.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None:
    pytest.skip("needs a CUDA GPU and vLLM", allow_module_level=True)

from splicer.analysis.metrics import fill_missing, kl_top_lumped  # noqa: E402
from splicer.backends.vllm_backend import VllmBackend  # noqa: E402
from splicer.errors import SplicerError  # noqa: E402
from splicer.splice.core import splice  # noqa: E402

PRESET = os.environ.get("SPLICER_GPU_PRESET", "tiny")
ENGINE_ARGS = json.loads(os.environ.get("SPLICER_GPU_ENGINE_ARGS", "{}"))
CLASSES = ["gdn", "attention", "shared_expert", "lm_head", "experts", "all"]


@pytest.fixture(scope="module")
def gpu_pair(tmp_path_factory):
    from splicer.fixtures.core import FixtureSpec, write_pair

    root = tmp_path_factory.mktemp("gpu")
    paths = write_pair(root / "pair", FixtureSpec(preset=PRESET), kinds=("lowlatency",))
    for cls in CLASSES:
        splice(str(paths["lowlatency"]), str(paths["base"]), root / cls, cls, progress=False)
        paths[cls] = root / cls
    return paths


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    b = VllmBackend(engine_args=ENGINE_ARGS, log_dir=tmp_path_factory.mktemp("logs"))
    yield b
    b.close()


def _seqs(n=6, length=96, vocab=2000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _kl_top1(base, var):
    kl = torch.cat(
        [kl_top_lumped(b.topk_logprobs, fill_missing(b.topk_ids, v.topk_ids, v.topk_logprobs)) for b, v in zip(base, var)]
    )
    top1 = torch.cat([(b.topk_ids[:, 0] == v.topk_ids[:, 0]) for b, v in zip(base, var)]).float()
    return kl.mean().item(), top1.mean().item()


@pytest.mark.parametrize("variant", ["lowlatency", *CLASSES])
def test_variant_loads_and_scores(gpu_pair, engine, variant):
    engine.load(gpu_pair[variant])
    out = list(engine.score(_seqs(2), 20))
    assert len(out) == 2 and out[0].topk_ids.shape == (95, 20)
    assert torch.isfinite(out[0].target_logprobs).all()
    layers = engine.load_info()["layers"]
    print(variant, json.dumps(layers, indent=1))  # the kernels per layer land in the log
    if "error" not in layers:  # LLM.apply_model answered: check what vLLM made of the restored layers
        expect_bf16 = {
            "attention": "self_attn.qkv_proj",
            "gdn": "linear_attn.in_proj_qkvz",
            "shared_expert": "shared_expert.gate_up_proj",
            "lm_head": "lm_head",
            "all": "linear_attn.in_proj_qkvz",
        }.get(variant)
        if expect_bf16:
            hits = {k: v for k, v in layers.items() if k.endswith(expect_bf16)}
            assert hits and all(v.startswith("Unquantized") for v in hits.values()), hits
        if variant == "lowlatency":
            assert any(k.endswith("in_proj_qkvz") and "CompressedTensors" in v for k, v in layers.items())
    engine.unload()


def test_all_restored_scores_like_the_base(gpu_pair, engine):
    seqs = _seqs(8)
    engine.load(gpu_pair["base"])
    base_batched = list(engine.score(seqs, 20, batch_size=8))
    base_single = list(engine.score(seqs, 20, batch_size=1))
    engine.unload()
    engine.load(gpu_pair["all"])
    all_batched = list(engine.score(seqs, 20, batch_size=8))
    engine.unload()
    engine.load(gpu_pair["lowlatency"])
    build = list(engine.score(seqs, 20, batch_size=8))
    engine.unload()
    noise_kl, noise_top1 = _kl_top1(base_batched, base_single)
    all_kl, all_top1 = _kl_top1(base_batched, all_batched)
    build_kl, build_top1 = _kl_top1(base_batched, build)
    print(
        f"noise KL {noise_kl:.3e} top1 {noise_top1:.4f} | all-restored KL {all_kl:.3e} top1 {all_top1:.4f} | build KL {build_kl:.3e} top1 {build_top1:.4f}"
    )
    assert all_kl <= 2 * noise_kl + 1e-4 and all_top1 >= noise_top1 - 0.01
    assert build_kl > 10 * max(all_kl, 1e-5)


def test_split_fused_group_refused_before_vllm_and_by_vllm(gpu_pair, engine, tmp_path):
    with pytest.raises(SplicerError, match="would split"):
        splice(
            str(gpu_pair["lowlatency"]),
            str(gpu_pair["base"]),
            tmp_path / "bad",
            "gdn",
            modules_regex=r"in_proj_qkv$",
            progress=False,
        )
    # What vLLM does with such a checkpoint: hand-edit the gdn splice so only in_proj_qkv is ignored.
    import shutil

    bad = tmp_path / "bad-by-hand"
    shutil.copytree(gpu_pair["gdn"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    qc = cfg["quantization_config"]
    qc["ignore"] = [e.replace("(in_proj_qkv|in_proj_z|out_proj)", "(in_proj_qkv|out_proj)") for e in qc["ignore"]]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RuntimeError, match="different quantization scheme"):
        engine.load(bad)
