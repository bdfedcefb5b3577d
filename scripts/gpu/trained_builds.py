"""Quantized builds of a trained qwen3_5_moe made by the field's own quantizer, llm-compressor (not by splicer).

    python scripts/gpu/trained_builds.py BASE CALIB_JSONL OUT [--builds LIST] [--samples N] [--seq-len L] [--device cuda|cpu]

Runs with llm-compressor 0.14 / compressed-tensors 0.19 in their own environment (never imports splicer) and writes
OUT/BUILD for each build plus OUT/builds.json (recipe, versions, wall time, and the BASE tensors each build lacks):

  gptq-w4a16-g128  oneshot GPTQ, INT4 g128 sym actorder=weight on every decoder Linear incl. routed experts (all
                   experts calibrated), INT8 g128 lm_head as a second group (RTN: oneshot never runs the head) - seed 000
  awq-experts      oneshot AWQ smoothing + INT4 g128 sym on the routed experts only
  rtn-g32-experts  model_free_ptq INT4 g32 sym on the routed experts (MTP's included) - seed 004's recipe
  fp8-block        model_free_ptq FP8_BLOCK on seed 000's module selection
  nvfp4a16         oneshot (data-free) NVFP4A16 on seed 000's module selection, with one global scale per group
                   vLLM fuses (see nvfp4_fused_groups)
  gptq-w4a16-g128-keep-CLASS  gptq-w4a16-g128 re-made with CLASS (gdn, attention, shared_expert) left in BF16; several
                              classes joined by '+' (gptq-w4a16-g128-keep-gdn+shared_expert) leave each of them in BF16

llm-compressor 0.14.0.1's oneshot copies mtp.* from BASE itself (save_mtp_tensors_to_checkpoint; transformers does
not load it); a build without it would get it back with `splicer splice --restore mtp` (trained.sh's restore_mtp).
Each build keeps BASE's tokenizer, chat template and generation config byte for byte.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

# The GPTQ build re-made with one class left in BF16 (in `ignore`): GPTQ fits each layer to the already-quantized
# layers before it, so this differs from splicing that class back into gptq-w4a16-g128 (the splice measures the build
# without the class's own error; the re-made build also re-fits everything after it).
KEEP_CLASS = {
    "gdn": r"re:.*linear_attn\.(in_proj_qkv|in_proj_z|out_proj)$",
    "attention": r"re:.*self_attn\.(q_proj|k_proj|v_proj|o_proj)$",
    "shared_expert": r"re:.*mlp\.shared_expert\.(gate_proj|up_proj|down_proj)$",
}
KEEP_PREFIX = "gptq-w4a16-g128-keep-"
REQUANT = tuple(f"{KEEP_PREFIX}{c}" for c in KEEP_CLASS)
BUILDS = ("gptq-w4a16-g128", "awq-experts", "rtn-g32-experts", "fp8-block", "nvfp4a16", *REQUANT)


def kept_classes(kind: str) -> list[str] | None:
    """The classes a re-made GPTQ build leaves in BF16 (KEEP_PREFIX + CLASS[+CLASS...]); None for any other build name.
    Several classes make a re-made build whose KL budget's model predicts from the single-class splices."""
    if not kind.startswith(KEEP_PREFIX):
        return None
    classes = kind[len(KEEP_PREFIX) :].split("+")
    return classes if classes and all(c in KEEP_CLASS for c in classes) and len(set(classes)) == len(classes) else None


# Seed 000's ignore list (splicer.fixtures.core.LOWLATENCY_IGNORE): the vision tower, GDN's tiny a/b projections, the
# router, the shared expert's gate and the MTP head stay BF16.
LOWLATENCY_IGNORE = [
    "re:.*visual.*",
    r"re:.*linear_attn\.in_proj_a$",
    r"re:.*linear_attn\.in_proj_b$",
    r"re:.*mlp\.gate$",
    r"re:.*shared_expert_gate$",
    "re:.*mtp.*",
]
EXPERTS = r"re:.*mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)$"
# Seed 000's quantized decoder Linears by name, for model_free_ptq: its "Linear" target matches every 2-D weight
# by name alone (embeddings, conv1d, router included), so the selection is spelled out. No layer prefix: vLLM
# matches these against its own names (language_model.model.layers.N..., shards of fused qkv/gate_up/in_proj_qkvz),
# so a "model.language_model.layers" anchor would leave every module unquantized to vLLM. MTP is in the ignore list.
LOWLATENCY_BODY = [
    r"re:.*self_attn\.(q_proj|k_proj|v_proj|o_proj)$",
    r"re:.*linear_attn\.(in_proj_qkv|in_proj_z|out_proj)$",
    r"re:.*mlp\.shared_expert\.(gate_proj|up_proj|down_proj)$",
    EXPERTS,
]
# Files a build must carry verbatim from BASE (transformers re-serialises tokenizer.json on save).
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
)
QPARAM_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "weight_global_scale")


def fail(msg: str) -> None:
    print(f"trained_builds: {msg}", file=sys.stderr)
    sys.exit(2)


# ---------------------------------------------------------------------------------------------------- schemes


def w4_group(group_size: int, targets: list[str], actorder: str | None = None):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size, actorder=actorder)
    return QuantizationScheme(targets=targets, weights=args, format="pack-quantized")


def int8_head():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="group", group_size=128)
    return QuantizationScheme(targets=[r"re:.*lm_head$"], weights=args, format="pack-quantized")


def awq_expert_mappings():
    """llm-compressor 0.14's Qwen3.5 MoE AWQ mappings (build_hybrid_attention_mappings) with the router added.

    The library's post_attention_layernorm mapping omits mlp.gate ("TODO ... is a Parameter"): smoothing would divide
    the norm by s while the router keeps reading the unscaled weights, so every token's routing logits would change.
    The router (Qwen3_5MoeTopKRouter) has a 2-D `weight` like a Linear, so as a balance layer AWQ multiplies it by s
    exactly as for Qwen3-MoE's _moe_default_mappings. Attention/GDN mappings are left out: nothing there is quantized.
    """
    from llmcompressor.modifiers.transform.awq.mappings import AWQMapping

    return [
        AWQMapping(
            "re:.*post_attention_layernorm$",
            [
                "re:.*mlp.gate$",
                "re:.*mlp.experts.*.gate_proj$",
                "re:.*mlp.experts.*.up_proj$",
                "re:.*mlp.shared_expert_gate$",
                "re:.*mlp.shared_expert.gate_proj$",
                "re:.*mlp.shared_expert.up_proj$",
            ],
        ),
        AWQMapping(r"re:.*mlp\.experts\.\d+\.up_proj$", [r"re:.*mlp\.experts\.\d+\.down_proj$"]),
    ]


# ---------------------------------------------------------------------------------------------------- oneshot


def calibration_dataset(tokenizer, calib: Path, samples: int, seq_len: int):
    from datasets import Dataset

    texts = []
    for n, line in enumerate(calib.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                texts.append(json.loads(line)["text"])
            except (ValueError, KeyError, TypeError):
                fail(f'{calib}:{n} is not a {{"text": ...}} line; write one JSON object with a text field per line')
        if len(texts) == samples:
            break
    if not texts:
        fail(f'{calib} has no {{"text": ...}} lines')
    enc = tokenizer(texts, truncation=True, max_length=seq_len, add_special_tokens=False)
    return Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}), len(texts)


def model_class(base: Path):
    import transformers

    arch = json.loads((base / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch)


def run_oneshot(base: Path, out: Path, recipe, args, dataset, n_samples: int) -> None:
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import load_quantizable_moe
    from transformers import AutoTokenizer

    cls = model_class(base)
    if args.device == "cpu":
        # AWQ pins its cached activations for faster host-to-GPU copies; torch refuses pin_memory without an
        # accelerator. Pinning changes no value, so a CPU run skips it.
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *a, **k: None
    # Fused 3-D experts become per-expert nn.Linear modules, so GPTQ/AWQ see (and export) every expert.
    with load_quantizable_moe(cls):
        model = cls.from_pretrained(base, dtype=torch.bfloat16, device_map=None)
    tok = AutoTokenizer.from_pretrained(base)
    calib = (
        {}
        if dataset is None
        else dict(
            dataset=dataset, max_seq_length=args.seq_len, num_calibration_samples=n_samples, shuffle_calibration_samples=False
        )
    )
    oneshot(model=model, processor=tok, recipe=recipe, moe_calibrate_all_experts=True, sequential_offload_device="cpu", **calib)
    model.save_pretrained(out, save_compressed=True, max_shard_size="4GB")


def recipe_gptq(keep: list[str] | None = None):
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier

    body = GPTQModifier(
        config_groups={"group_0": w4_group(128, ["Linear"], actorder="weight")},
        ignore=["lm_head", *LOWLATENCY_IGNORE, *(KEEP_CLASS[c] for c in keep or ())],
        dampening_frac=0.01,
        actorder="weight",
    )
    # oneshot replaces lm_head's forward during calibration (disable_lm_head), so GPTQ would get no Hessian for it:
    # the INT8 head is round-to-nearest, as seed 000 applied it.
    head = QuantizationModifier(config_groups={"group_1": int8_head()}, ignore=LOWLATENCY_IGNORE)
    return [body, head]


def recipe_awq():
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    return [
        AWQModifier(mappings=awq_expert_mappings(), duo_scaling=True),
        QuantizationModifier(config_groups={"group_0": w4_group(128, [EXPERTS])}, ignore=["lm_head", *LOWLATENCY_IGNORE]),
    ]


def nvfp4_fused_groups() -> list[str]:
    """Give Gated-DeltaNet's in_proj_qkv and in_proj_z one NVFP4 global scale, as q/k/v and gate/up already get.

    vLLM loads them as one layer (in_proj_qkvz) and keeps a single weight global scale for it ("In NVFP4 linear, the
    global scale ... different for parallel layers" warning), so a shard quantized against its own global scale is
    dequantized with the wrong one. llm-compressor 0.14's oneshot shares the scale across the name groups in
    llmcompressor.observers.helpers.FUSED_LAYER_NAMES (gate/up of every expert and the shared expert, q/k/v), which
    lacks this Qwen3.5 pair; it is added there. model_free_ptq 0.14 pairs neither the experts' gate/up nor this
    group (its DEFAULT_FUSED_MAPPINGS only match `mlp.gate_proj`), which is why nvfp4a16 runs through oneshot.
    """
    from llmcompressor.observers import helpers

    pair = ("in_proj_qkv", "in_proj_z")
    if pair not in helpers.FUSED_LAYER_NAMES:
        helpers.FUSED_LAYER_NAMES.append(pair)
        print(f"  llm-compressor FUSED_LAYER_NAMES += {pair} (vLLM fuses them as linear_attn.in_proj_qkvz)")
    return ["+".join(g) for g in helpers.FUSED_LAYER_NAMES]


def recipe_nvfp4a16():
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return [
        QuantizationModifier(config_groups={"group_0": preset("NVFP4A16", ["Linear"])}, ignore=["lm_head", *LOWLATENCY_IGNORE])
    ]


# ---------------------------------------------------------------------------------------------------- model_free


def run_model_free(base: Path, out: Path, scheme, ignore: list[str], device: str) -> None:
    from llmcompressor.entrypoints.model_free import model_free_ptq

    model_free_ptq(model_stub=str(base), save_directory=str(out), scheme=scheme, ignore=ignore, max_workers=1, device=device)


def preset(name: str, targets: list[str]):
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme(name, targets)


# ---------------------------------------------------------------------------------------------------- checks


def tensor_names(folder: Path) -> set[str]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    names = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            names.update(fh.keys())
    return names


def missing_from(base_names: set[str], build_names: set[str]) -> list[str]:
    """BASE tensors with no counterpart in the build (a quantized X.weight counts as present as X.weight_packed...)."""
    missing = []
    for name in sorted(base_names):
        if name in build_names:
            continue
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and any(f"{module}.{s}" in build_names for s in QPARAM_SUFFIXES):
            continue
        missing.append(name)
    return missing


def summarize_missing(names: list[str]) -> dict:
    prefixes: dict[str, int] = {}
    for n in names:
        key = n.split(".")[0] if not n.startswith("model.") else ".".join(n.split(".")[:3])
        prefixes[key] = prefixes.get(key, 0) + 1
    return {"count": len(names), "by_prefix": prefixes, "names": names}


# compressed-tensors 0.19 -> 0.17 (vLLM 0.26's reader): QuantizationArgs / Scheme / Config have the same fields in
# both, and every value these five builds write (observer "static_minmax"/"memoryless_minmax", scale_dtype
# "torch.float8_e4m3fn", strategy "tensor_group", actorder "weight", format names) validates under 0.17; the extra
# top-level keys 0.19 adds ("version", "transform_config": {}, "sparsity_config": {}) are ignored by 0.17's
# QuantizationConfig (extra="ignore"). So config.json is left as llm-compressor wrote it (checked with 0.17's
# QuantizationConfig.model_validate on all five builds; loading in vLLM 0.26 itself is still to be run).


def finish_build(base: Path, out: Path) -> None:
    for name in SIDE_FILES:
        if (base / name).exists():
            shutil.copyfile(base / name, out / name)
    qc = json.loads((out / "config.json").read_text()).get("quantization_config")
    if not qc:
        fail(f"{out}/config.json has no quantization_config; llm-compressor did not write a compressed checkpoint")


def versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("llmcompressor", "compressed-tensors", "transformers", "torch")}


# ---------------------------------------------------------------------------------------------------- main


def build_one(kind: str, base: Path, out: Path, args, calib_cache: dict) -> dict:
    if kind in ("gptq-w4a16-g128", "awq-experts") or kept_classes(kind):
        if "ds" not in calib_cache:
            from transformers import AutoTokenizer

            calib_cache["ds"] = calibration_dataset(AutoTokenizer.from_pretrained(base), args.calib, args.samples, args.seq_len)
        ds, n = calib_cache["ds"]
        if kind == "awq-experts":
            recipe = recipe_awq()
        else:
            recipe = recipe_gptq(kept_classes(kind))
        run_oneshot(base, out, recipe, args, ds, n)
        return {
            "entrypoint": "oneshot",
            "recipe": [r.model_dump(mode="json", exclude_none=True) if hasattr(r, "model_dump") else repr(r) for r in recipe],
            "calibration": {"samples": n, "max_seq_length": args.seq_len, "moe_calibrate_all_experts": True},
        }
    if kind == "nvfp4a16":
        groups = nvfp4_fused_groups()
        recipe = recipe_nvfp4a16()
        run_oneshot(base, out, recipe, args, None, 0)
        return {
            "entrypoint": "oneshot (data-free)",
            "recipe": [r.model_dump(mode="json", exclude_none=True) for r in recipe],
            "shared_global_scale_groups": groups,
        }
    if kind == "rtn-g32-experts":
        scheme, ignore = w4_group(32, [EXPERTS]), []
        scheme.weights.observer = "minmax"  # seed 004's card; model_free_ptq turns it into static_minmax
    elif kind == "fp8-block":
        scheme, ignore = preset("FP8_BLOCK", list(LOWLATENCY_BODY)), ["lm_head", *LOWLATENCY_IGNORE]
    else:
        raise AssertionError(kind)
    recipe = {"scheme": scheme.model_dump(mode="json", exclude_none=True), "ignore": ignore}
    run_model_free(base, out, scheme, ignore, args.device)
    return {"entrypoint": "model_free_ptq", "recipe": recipe}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base", type=Path)
    p.add_argument("calib", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--builds", default=",".join(BUILDS), help=f"comma list of {', '.join(BUILDS)}")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = p.parse_args(argv)

    kinds = [k.strip() for k in args.builds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in BUILDS and not kept_classes(k)]
    if unknown:
        fail(f"unknown build(s) {', '.join(unknown)}; choose from {', '.join(BUILDS)}")
    if not (args.base / "config.json").exists():
        fail(f"{args.base} has no config.json; BASE must be a BF16 checkpoint folder")
    if any(k in ("gptq-w4a16-g128", "awq-experts") or kept_classes(k) for k in kinds) and not args.calib.is_file():
        fail(f'{args.calib} is not a file; CALIB_JSONL holds one {{"text": ...}} object per line')
    taken = [k for k in kinds if (args.out / k).exists()]
    if taken:
        fail(f"{', '.join(str(args.out / k) for k in taken)} already exist(s); remove or choose another OUT")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            fail("--device cuda but torch sees no GPU; pass --device cpu")

    args.out.mkdir(parents=True, exist_ok=True)
    record_path = args.out / "builds.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {"builds": {}}
    record.update({"base": str(args.base), "versions": versions()})
    base_names = tensor_names(args.base)
    calib_cache: dict = {}
    for kind in kinds:
        final, tmp = args.out / kind, args.out / f".{kind}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"== {kind}", flush=True)
        t0 = time.time()
        entry = build_one(kind, args.base, tmp, args, calib_cache)
        finish_build(args.base, tmp)
        entry["wall_s"] = round(time.time() - t0, 1)
        entry["missing_base_tensors"] = summarize_missing(missing_from(base_names, tensor_names(tmp)))
        tmp.rename(final)
        record["builds"][kind] = entry
        record_path.write_text(json.dumps(record, indent=2) + "\n")
        miss = entry["missing_base_tensors"]
        print(f"== {kind}: {final} in {entry['wall_s']} s; {miss['count']} BASE tensors missing {miss['by_prefix']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
