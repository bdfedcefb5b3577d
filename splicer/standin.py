"""A stand-in with Qwen3.6-35B-A3B's real text dimensions and random weights, generated on a GPU.

The real checkpoints cannot be downloaded where the tool is measured, but decode cost depends on shapes and
kernels, not on weight values, so a pair with the real shapes times like the real model. Written under ROOT:

* ``build/``: like seed 000's raw export: INT4 g128 sym on every decoder Linear, INT8 g128 on the lm_head
  (compressed-tensors pack-quantized, round to nearest), no MTP head. Routed experts sit in their own shards
  (``experts-layerNNN.safetensors``), written once, in INT4 only.
* ``reference/``: the base the variants are scored against. BF16 routed experts (~64 GB) do not fit the GPU
  machine's disk, so the reference keeps the build's INT4 experts and holds everything else in BF16. It is made
  by splicing: the BF16 non-expert tensors are drawn into a parts folder, and
  ``splice --restore gdn,attention,shared_expert,lm_head`` puts them into the build (the expert shards are
  hard-linked, the parts folder is removed). Use it with ``--allow-quantized-base``; no row can restore experts.

Random weights at 40 layers are chaotic with the tiny fixture's scales: INT4 rounding decorrelates the output completely
(benchmarks/standin_depth_check.py, 40 layers x hidden 256 on the CPU: build vs base KL 2.69, top-1 0.3 %; the first H200
run, results/h200-fulldims, had this and a noise floor of 38 % top-1). The stand-in therefore scales the projections that write into the residual stream by
RESIDUAL_SCALE more (same check: KL 0.059, top-1 78.1 %; results/h200-fulldims/standin-depth-check.json), so that its accuracy
columns and the reproduce-the-reference check mean something at full depth. Speed does not depend on it.

Every tensor is drawn on the device with the fixture's initialisation (`fixtures.init_tensor`) and quantized there
with compressed-tensors; the expert tensors of one layer are drawn stacked ([E*N, K]) and quantized in one call,
which is the same as per expert since groups never cross rows.
"""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from .arch.qwen3_5_moe import QWEN3_5_MOE
from .checkpoint import INDEX_NAME
from .fixtures import (
    FixtureSpec,
    base_config,
    base_shapes,
    build_plan,
    hf_config,
    init_tensor,
    write_side_files,
)
from .quantize import make_scheme, quantize_weight

NON_EXPERT_CLASSES = "gdn,attention,shared_expert,lm_head"
RESIDUAL_SCALE = 0.03


def _shard_of(name: str) -> str:
    li = QWEN3_5_MOE.layer_index(name)
    if li is not None:
        return f"model-layer{li:03d}.safetensors"
    if name in ("lm_head.weight", "model.language_model.norm.weight"):
        return "model-tail.safetensors"
    return "model-head.safetensors"


class _ShardWriter:
    """Collects tensors per shard file and writes each shard in a thread while the GPU draws the next."""

    def __init__(self, folder: Path, pool: ThreadPoolExecutor):
        self.folder, self.pool = folder, pool
        self.weight_map: dict[str, str] = {}
        self.total = 0
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.futures = []

    def add(self, shard: str, name: str, t: torch.Tensor) -> None:
        t = t.contiguous().cpu()
        self.pending.setdefault(shard, {})[name] = t
        self.weight_map[name] = shard
        self.total += t.numel() * t.element_size()

    def flush(self, shard: str) -> None:
        tensors = self.pending.pop(shard, None)
        if tensors:
            self.futures.append(self.pool.submit(save_file, tensors, str(self.folder / shard), {"format": "pt"}))

    def finish(self, config: dict) -> None:
        for shard in list(self.pending):
            self.flush(shard)
        for f in self.futures:
            f.result()
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        (self.folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _experts_of_layer(
    prefix: str, n_exp: int, shapes: dict, gen: torch.Generator, scheme, out: _ShardWriter, shard: str, residual_scale: float
) -> None:
    """Draw one layer's routed experts stacked per projection, quantize once, store per expert."""
    for proj in ("gate_proj", "up_proj", "down_proj"):
        n, k = shapes[f"{prefix}.0.{proj}.weight"]
        w = init_tensor(f"{prefix}.{proj}.weight", (n_exp * n, k), gen, residual_scale)  # same scale rule as one expert's weight
        packed = quantize_weight(w, scheme)
        del w
        cpu = {key: v.cpu() for key, v in packed.items() if key != "weight_shape"}
        for e in range(n_exp):
            module = f"{prefix}.{e}.{proj}"
            for key, v in cpu.items():
                out.add(shard, f"{module}.{key}", v[e * n : (e + 1) * n].clone())
            out.add(shard, f"{module}.weight_shape", torch.tensor([n, k], dtype=torch.int64))


def write_standin(root: Path, spec: FixtureSpec | None = None, device: str = "cuda", progress: bool = True) -> dict:
    """Write ROOT/build and ROOT/reference; returns their paths and the seconds each step took."""
    from tqdm.auto import tqdm

    from .splice import splice

    spec = replace(spec or FixtureSpec(preset="full", residual_scale=RESIDUAL_SCALE), experts_layout="per_expert")
    root = Path(root)
    build, parts, reference = root / "build", root / ".bf16-parts", root / "reference"
    for p in (build, parts, reference):
        shutil.rmtree(p, ignore_errors=True)
        p.mkdir(parents=True)
    t0 = time.perf_counter()
    cfg = hf_config(spec)
    shapes = {k: v for k, v in base_shapes(spec, cfg).items() if not k.startswith("mtp.")}  # seed 000's raw export: no MTP
    qc, pick = build_plan("lowlatency-nomtp")
    schemes: dict[tuple, object] = {}
    gen = torch.Generator(device=device).manual_seed(spec.seed)
    n_exp = cfg.text_config.num_experts
    names_by_shard: dict[str, list[str]] = {}
    experts_prefixes: dict[int, str] = {}
    for name in shapes:
        expert = QWEN3_5_MOE.expert_parts(name.rpartition(".")[0])
        if expert:
            experts_prefixes[QWEN3_5_MOE.layer_index(name)] = expert[0]
            continue
        names_by_shard.setdefault(_shard_of(name), []).append(name)
    with ThreadPoolExecutor(max_workers=4) as pool:
        b_out, p_out = _ShardWriter(build, pool), _ShardWriter(parts, pool)
        steps = [(shard, None) for shard in sorted(names_by_shard)]
        steps += [(f"experts-layer{li:03d}.safetensors", prefix) for li, prefix in sorted(experts_prefixes.items())]
        for shard, experts_prefix in tqdm(steps, desc="stand-in", disable=not progress or None):
            if experts_prefix is not None:
                _experts_of_layer(
                    experts_prefix,
                    n_exp,
                    shapes,
                    gen,
                    schemes.setdefault((4, 128), make_scheme(4, 128)),
                    b_out,
                    shard,
                    spec.residual_scale,
                )
                b_out.flush(shard)
                continue
            for name in names_by_shard[shard]:
                t = init_tensor(name, shapes[name], gen, spec.residual_scale)
                p_out.add(shard, name, t)
                module, _, leaf = name.rpartition(".")
                choice = pick(module) if leaf == "weight" and t.dim() == 2 else None
                if choice is None:
                    b_out.add(shard, name, t)
                else:
                    for key, v in quantize_weight(t, schemes.setdefault(choice, make_scheme(*choice))).items():
                        b_out.add(shard, f"{module}.{key}", v)
            p_out.flush(shard)
            b_out.flush(shard)
        config = base_config(cfg)
        p_out.finish(dict(config))
        b_out.finish(dict(config, quantization_config=qc))
    write_side_files(build, cfg.text_config.vocab_size)
    (build / "fixture.json").write_text(
        json.dumps(
            {
                "standin": "full-dims",
                "preset": spec.preset,
                "seed": spec.seed,
                "text_overrides": spec.text_overrides,
                "residual_scale": spec.residual_scale,
            },
            indent=2,
        )
        + "\n"
    )
    generated = time.perf_counter() - t0
    t0 = time.perf_counter()
    shutil.rmtree(reference)
    record = splice(str(build), str(parts), reference, NON_EXPERT_CLASSES, progress=False)
    shutil.rmtree(parts)
    return {
        "build": build,
        "reference": reference,
        "generate_s": generated,
        "splice_reference_s": time.perf_counter() - t0,
        "reference_shards": record["shards"],
    }


__all__ = ["NON_EXPERT_CLASSES", "write_standin"]
