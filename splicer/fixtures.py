"""A tiny, deterministic `qwen3_5_moe` pair with the real on-disk names and layouts.

The BF16 base is laid out like Qwen's release (`Qwen3_5MoeForConditionalGeneration`:
`model.language_model.*`, `model.visual.*`, `lm_head`, `mtp.*`), with routed experts
either fused 3-D (`mlp.experts.gate_up_proj` / `down_proj`) or per expert. Tensor names
and shapes come from transformers' own model class built on the meta device, so they
stay right when transformers changes. The INT4 builds are made tensor by tensor with
compressed-tensors' quantize/pack (round to nearest):

* ``lowlatency`` (like seed 000): INT4 g128 sym on every decoder Linear, INT8 g128 on
  ``re:.*lm_head$``; visual, in_proj_a/b, mlp.gate, shared_expert_gate and mtp ignored.
* ``experts-g32`` (like seed 004): INT4 g32 on routed experts only, MTP experts included.

Every grouped input dim is a multiple of 128, so vLLM's Marlin/Machete kernels accept
the same files on a GPU.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from .arch.qwen3_5_moe import QWEN3_5_MOE
from .awq import quantize_awq
from .checkpoint import INDEX_NAME
from .formats.skip_list import skip_list_entries
from .gptq import quantize_gptq
from .quantize import config_group, make_scheme, preset_scheme, quantize_native_fp8, quantize_weight

TEXT_PRESETS = {
    # Used by the tests and the demo: ~30 MB BF16, every K a multiple of 128.
    "tiny": dict(
        vocab_size=2048,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=256,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
    ),
    # The dims an earlier vLLM 0.26 run on the H200 loaded (shared device notes): a fallback for GPU checks.
    "gpu": dict(
        vocab_size=4096,
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=256,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        num_experts=16,
        num_experts_per_tok=4,
        max_position_embeddings=4096,
    ),
    # Qwen3.6-35B-A3B's text dimensions (its config.json; transformers' Qwen3_5MoeTextConfig defaults agree):
    # for the full-size stand-in (splicer.standin), generated on a GPU.
    "full": dict(
        vocab_size=248320,
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_conv_kernel_dim=4,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        num_experts=256,
        num_experts_per_tok=8,
        max_position_embeddings=262144,
    ),
    # For the splice benchmark: ~2.2 GB BF16.
    "bench": dict(
        vocab_size=16384,
        hidden_size=1024,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        num_experts=64,
        num_experts_per_tok=4,
        max_position_embeddings=4096,
    ),
}
VISION_TINY = dict(depth=1, hidden_size=128, intermediate_size=256, num_heads=2, num_position_embeddings=64)

# lowlatency-nomtp: seed 000's raw export, before its fix-ups (llm-compressor's oneshot drops mtp.* on load).
# gptq-experts-g32: seed 003's layout (GPTQModel, quant_method gptq v1, 4-bit g32 sym, routed experts only,
# the rest excluded through `dynamic` negative rules), values by round to nearest.
# The format builds: seed 000's module selection (every decoder Linear vLLM quantizes, MTP and vision BF16) in one of
# compressed-tensors' presets, as llm-compressor's model_free_ptq writes them without calibration data; the head stays
# BF16 (`ignore: lm_head`, as model_free_ptq's examples do). `mixed`: one group per scheme in one config, as
# seed 000's INT8 head is: NVFP4A16 routed experts, FP8_DYNAMIC for the other Linears, a W8A16 g128 head.
FORMAT_BUILDS = {
    "w4a16": "W4A16",
    "w8a16": "W8A16",
    "w8a8": "W8A8",
    "fp8-dynamic": "FP8_DYNAMIC",
    "fp8-block": "FP8_BLOCK",
    "nvfp4a16": "NVFP4A16",
}
# Builds in the two formats that list what stays unquantized, with seed 000's module selection too:
# fp8-native: `quant_method: fp8` with 128x128 `weight_scale_inv` blocks (float32, as DeepSeek-V3's README says), the
#   skip list as full module names in `modules_to_not_convert` (vLLM's FP8 loader matches names exactly);
# awq: AutoAWQ GEMM, 4-bit g128 with zero points, fp16 scales, the skip list as the substrings AWQ exports write.
SKIP_LIST_BUILDS = ("fp8-native", "awq")
AWQ_NOT_CONVERT = [
    "model.visual",
    "visual",
    "mtp",
    "linear_attn.in_proj_a",
    "linear_attn.in_proj_b",
    "mlp.gate",
    "shared_expert_gate",
]
BUILD_KINDS = ("lowlatency", "lowlatency-nomtp", "experts-g32", "gptq-experts-g32", *FORMAT_BUILDS, "mixed", *SKIP_LIST_BUILDS)


@dataclass
class FixtureSpec:
    preset: str = "tiny"
    experts_layout: str = "fused"  # fused | per_expert (base only; builds are always per expert)
    seed: int = 0
    text_overrides: dict = field(default_factory=dict)
    # Extra factor on the projections that write into the residual stream. 1.0 keeps the tiny fixture as it was;
    # a 40-layer random stack needs much smaller updates or it is chaotic (see splicer.standin).
    residual_scale: float = 1.0

    def text_config(self) -> dict:
        cfg = dict(TEXT_PRESETS[self.preset])
        cfg.update(self.text_overrides)
        # Qwen3.6's rope: theta 1e7, partial rotary 0.25, interleaved mrope [11, 11, 10].
        cfg["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        }
        cfg["mtp_num_hidden_layers"] = 1
        return cfg


def hf_config(spec: FixtureSpec):
    from transformers import Qwen3_5MoeConfig

    vision = dict(VISION_TINY, out_hidden_size=spec.text_config()["hidden_size"])
    cfg = Qwen3_5MoeConfig(text_config=spec.text_config(), vision_config=vision, tie_word_embeddings=False)
    cfg.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    return cfg


def _model_shapes(cfg) -> dict[str, tuple[int, ...]]:
    from transformers import Qwen3_5MoeForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3_5MoeForConditionalGeneration(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def base_shapes(spec: FixtureSpec, cfg) -> dict[str, tuple[int, ...]]:
    """Every tensor of the BF16 base: transformers' names plus the MTP head vLLM loads."""
    shapes = _model_shapes(cfg)
    tc = cfg.text_config
    h = tc.hidden_size
    full = [i for i, t in enumerate(tc.layer_types) if t == "full_attention"][0]
    src = f"model.language_model.layers.{full}."
    for name, shape in list(shapes.items()):
        if name.startswith(src):
            shapes["mtp.layers.0." + name[len(src) :]] = shape
    shapes.update(
        {
            "mtp.fc.weight": (h, 2 * h),
            "mtp.pre_fc_norm_hidden.weight": (h,),
            "mtp.pre_fc_norm_embedding.weight": (h,),
            "mtp.norm.weight": (h,),
        }
    )
    if spec.experts_layout == "per_expert":
        for name, shape in list(shapes.items()):
            split = QWEN3_5_MOE.per_expert_shapes(name, shape)
            if split:
                del shapes[name]
                shapes.update(split)
    return dict(sorted(shapes.items()))


def init_tensor(name: str, shape, gen: torch.Generator, residual_scale: float = 1.0) -> torch.Tensor:
    """Deterministic values of a plausible scale (norms near their zero-centred identity), on the generator's device."""
    leaf = name.rsplit(".", 1)[-1]
    dev = gen.device
    if "norm" in name or leaf == "bias":
        t = torch.randn(shape, generator=gen, device=dev) * 0.02
    elif leaf == "A_log":
        t = torch.log(torch.rand(shape, generator=gen, device=dev) * 15 + 1)
    elif leaf == "dt_bias":
        t = torch.ones(shape, device=dev)
    else:
        fan_in = shape[-1] if len(shape) >= 2 else 1
        if len(shape) > 2 and not QWEN3_5_MOE.fused_expert_parts(name):
            fan_in = math.prod(shape[1:])
        t = torch.randn(shape, generator=gen, device=dev) / math.sqrt(fan_in)
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")):
            # Blocks that write into the residual stream write small updates, as in a trained
            # model; with full-size random updates the net is chaotic and any rounding flips it.
            t = t * (0.25 * residual_scale)
        if name.endswith("mlp.gate.weight"):
            t = t * 4  # decisive routing: near-ties between experts would flip on any rounding
        if name == "lm_head.weight":
            # Logits of std ~4 instead of ~1: next-token distributions peaked like a trained model's
            # (most mass in the top 20), so top-20 KL and dNLL mean what they mean on real models.
            t = t * 4
    return t.to(torch.bfloat16)


def _shard_key(name: str, n_layers: int) -> str:
    """Which base shard a tensor goes to: one per decoder layer, plus head and tail shards."""
    li = QWEN3_5_MOE.layer_index(name)
    if name.startswith("mtp.") or name in ("lm_head.weight", "model.language_model.norm.weight"):
        return "tail"
    if li is not None:
        return f"layer{li:03d}"
    return "head"


def write_sharded(out: Path, tensors_by_shard: dict[str, dict[str, torch.Tensor]], config: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    keys = sorted(tensors_by_shard, key=lambda k: (k != "head", k == "tail", k))
    n = len(keys)
    weight_map, total = {}, 0
    for i, key in enumerate(keys, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        tensors = tensors_by_shard[key]
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def write_side_files(out: Path, vocab_size: int) -> None:
    """Files a splice must copy verbatim: tokenizer, chat template, generation config, model card."""
    from .demo_tokenizer import SPECIAL, write_tokenizer

    write_tokenizer(out, vocab_size, CHAT_TEMPLATE)
    eos = [SPECIAL.index("<|im_end|>"), SPECIAL.index("<|endoftext|>")]
    (out / "generation_config.json").write_text(
        json.dumps({"do_sample": False, "eos_token_id": eos, "transformers_version": "5.17.0"}, indent=2) + "\n"
    )
    (out / "README.md").write_text("Synthetic qwen3_5_moe checkpoint made by splicer.fixtures; random weights.\n")


def base_config(cfg) -> dict:
    """config.json of a fixture base: the HF config in BF16, ending generation at the demo tokenizer's <|im_end|>."""
    config = cfg.to_dict()
    config["dtype"] = "bfloat16"
    config["text_config"]["eos_token_id"] = 2  # <|im_end|> of the demo tokenizer
    return config


def _per_expert_values(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused 3-D expert tensors split per expert (the release's layout); every other tensor as it is."""
    out = {}
    for name, t in tensors.items():
        split = QWEN3_5_MOE.split_fused_experts(name, t)
        out.update({n: v.contiguous() for n, v in split} if split is not None else {name: t})
    return out


def write_base(out: Path, spec: FixtureSpec | None = None, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """The BF16 base. `tensors` (name -> BF16 tensor, experts fused or per expert) replaces the random values of the
    tensors it names (a trained model's text and MTP weights); their shapes must match the spec's."""
    spec = spec or FixtureSpec()
    cfg = hf_config(spec)
    shapes = base_shapes(spec, cfg)
    given = {}
    if tensors is not None:
        given = tensors if spec.experts_layout == "fused" else _per_expert_values(tensors)
        unknown = sorted(n for n in given if n not in shapes or tuple(given[n].shape) != shapes[n])
        if unknown:
            raise ValueError(f"tensors not in the base or of another shape: {unknown[:5]}")
    gen = torch.Generator().manual_seed(spec.seed)
    n_layers = cfg.text_config.num_hidden_layers
    by_shard: dict[str, dict[str, torch.Tensor]] = {}
    for name, shape in shapes.items():
        value = given[name] if name in given else init_tensor(name, shape, gen, spec.residual_scale)
        by_shard.setdefault(_shard_key(name, n_layers), {})[name] = value
    config = base_config(cfg)
    write_sharded(Path(out), by_shard, config)
    write_side_files(Path(out), cfg.text_config.vocab_size)
    (Path(out) / "fixture.json").write_text(json.dumps(asdict(spec), indent=2) + "\n")
    return Path(out)


def ct_group(targets: list[str], bits: int, group_size: int) -> dict:
    """A config group exactly as compressed-tensors 0.17 dumps it (vLLM 0.26/0.33 pin 0.17)."""
    return {
        "format": "pack-quantized",
        "input_activations": None,
        "output_activations": None,
        "targets": targets,
        "weights": {
            "actorder": None,
            "block_structure": None,
            "dynamic": False,
            "group_size": group_size,
            "num_bits": bits,
            "observer": "memoryless_minmax",
            "observer_kwargs": {},
            "scale_dtype": None,
            "strategy": "group",
            "symmetric": True,
            "type": "int",
            "zp_dtype": None,
        },
    }


def ct_quant_config(groups: dict, ignore: list[str]) -> dict:
    return {
        "config_groups": groups,
        "format": "pack-quantized",
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.17.0",
    }


LOWLATENCY_IGNORE = [
    "re:.*visual.*",
    r"re:.*linear_attn\.in_proj_a$",
    r"re:.*linear_attn\.in_proj_b$",
    r"re:.*mlp\.gate$",
    r"re:.*shared_expert_gate$",
    "re:.*mtp.*",
]


def _lowlatency_body(module: str) -> bool:
    """seed 000's quantized decoder Linears: GDN (but in_proj_a/b), attention, shared and routed experts."""
    cls = QWEN3_5_MOE.module_class(module)
    return cls in ("experts", "shared_expert", "attention") or (cls == "gdn" and not module.endswith(("in_proj_a", "in_proj_b")))


def _format_plan(kind: str) -> tuple[dict, callable]:
    expert_target = r"re:.*mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)$"
    if kind == "mixed":
        experts, body = preset_scheme("NVFP4A16", [expert_target]), preset_scheme("FP8_DYNAMIC", ["Linear"])
        head = make_scheme(8, 128, targets=[r"re:.*lm_head$"])
        groups = {"group_0": config_group(head), "group_1": config_group(experts), "group_2": config_group(body)}
        qc = ct_quant_config(groups, LOWLATENCY_IGNORE)
        qc["format"] = "mixed-precision"

        def pick(module: str):
            if QWEN3_5_MOE.module_class(module) == "lm_head":
                return head
            return (experts if QWEN3_5_MOE.expert_parts(module) else body) if _lowlatency_body(module) else None

        return qc, pick
    scheme = preset_scheme(FORMAT_BUILDS[kind], ["Linear"])
    qc = ct_quant_config({"group_0": config_group(scheme)}, ["lm_head", *LOWLATENCY_IGNORE])
    qc["format"] = scheme.format
    return qc, lambda module: scheme if _lowlatency_body(module) else None


def _global_scale_key(module: str) -> str:
    """NVFP4 shares one global scale across the shards vLLM fuses (q/k/v, a GDN projection group, an expert's gate and
    up), as llm-compressor's model_free_ptq does: vLLM keeps one per fused layer (the largest) and warns otherwise."""
    parts = QWEN3_5_MOE.expert_parts(module)
    if parts:
        return f"{parts[0]}.{parts[1]}.{'w2' if parts[2] == 'down_proj' else 'w13'}"
    return QWEN3_5_MOE.atomic_unit(module)


def build_plan(kind: str) -> tuple[dict, callable]:
    """(quantization_config, module -> (bits, group), a compressed-tensors scheme, or None) for a build kind."""
    if kind in FORMAT_BUILDS or kind == "mixed":
        return _format_plan(kind)
    if kind == "fp8-native":
        # The skip list is filled in by write_build from what it left unquantized.
        qc = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": [],
        }
        return qc, lambda module: "fp8" if _lowlatency_body(module) else None
    if kind == "awq":
        qc = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": 128,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": list(AWQ_NOT_CONVERT),
        }
        return qc, lambda module: "awq" if _lowlatency_body(module) else None
    if kind in ("lowlatency", "lowlatency-nomtp"):
        qc = ct_quant_config(
            {"group_0": ct_group(["Linear"], 4, 128), "group_1": ct_group([r"re:.*lm_head$"], 8, 128)}, LOWLATENCY_IGNORE
        )

        def pick(module: str):
            if QWEN3_5_MOE.module_class(module) == "lm_head":
                return (8, 128)
            return (4, 128) if _lowlatency_body(module) else None

        return qc, pick
    if kind == "gptq-experts-g32":
        qc = {
            "bits": 4,
            "group_size": 32,
            "sym": True,
            "desc_act": False,
            "quant_method": "gptq",
            "checkpoint_format": "gptq",
            "pack_dtype": "int32",
            "lm_head": False,
            "true_sequential": True,
            "damp_percent": 0.01,
            "static_groups": False,
            "dynamic": {
                r"-:.*visual.*": {},
                r"-:.*mtp.*": {},
                r"-:.*linear_attn.*": {},
                r"-:.*self_attn.*": {},
                r"-:.*shared_expert.*": {},
            },
            "quantizer": ["gptqmodel:5.7.1"],
        }

        def pick(module: str):
            return (4, 32) if QWEN3_5_MOE.expert_parts(module) and not module.startswith("mtp.") else None

        return qc, pick
    if kind == "experts-g32":
        qc = ct_quant_config({"group_0": ct_group([r"re:.*mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)$"], 4, 32)}, [])

        def pick(module: str):
            return (4, 32) if QWEN3_5_MOE.expert_parts(module) else None

        return qc, pick
    raise ValueError(f"unknown build kind {kind!r}; one of {BUILD_KINDS}")


def _nvfp4_global_scales(items) -> dict:
    """One NVFP4 global scale per fused group of a shard's tensors (name, tensor, its build plan choice), from the
    group's common min and max."""
    from compressed_tensors.quantization.utils import generate_gparam

    lo, hi = {}, {}
    for tname, tensor, choice in items:
        module = tname.rpartition(".")[0]
        if (
            choice is None
            or isinstance(choice, (tuple, str))
            or str(getattr(choice.weights.strategy, "value", "")) != "tensor_group"
        ):
            continue
        key = _global_scale_key(module)
        t = tensor.float()
        lo[key] = torch.minimum(lo.get(key, t.amin()), t.amin())
        hi[key] = torch.maximum(hi.get(key, t.amax()), t.amax())
    return {k: generate_gparam(lo[k], hi[k]) for k in lo}


def write_build(base: Path, out: Path, kind: str = "lowlatency") -> Path:
    """Quantize a fixture base into a compressed-tensors build (experts per expert, own shards)."""
    from safetensors import safe_open

    base, out = Path(base), Path(out)
    qc, pick = build_plan(kind)
    index = json.loads((base / INDEX_NAME).read_text())
    by_shard: dict[str, dict[str, torch.Tensor]] = {}
    schemes = {}
    n_layers = json.loads((base / "config.json").read_text())["text_config"]["num_hidden_layers"]
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(base / shard), "pt") as f:
            items = []
            for name in f.keys():
                if kind == "lowlatency-nomtp" and name.startswith("mtp."):
                    continue
                # Build files are per expert, as llm-compressor writes them.
                t = f.get_tensor(name)
                for tname, tensor in QWEN3_5_MOE.split_fused_experts(name, t) or [(name, t)]:
                    module, _, leaf = tname.rpartition(".")
                    items.append((tname, tensor, pick(module) if leaf == "weight" and tensor.dim() == 2 else None))
            global_scales = _nvfp4_global_scales(items)
            for tname, tensor, choice in items:
                module = tname.rpartition(".")[0]
                key = _shard_key(tname, n_layers)
                if QWEN3_5_MOE.expert_parts(module):
                    key += "-experts"  # routed experts in their own shards: most splices hard-link them
                dest = by_shard.setdefault(key, {})
                if choice is None:
                    dest[tname] = tensor.contiguous()
                    continue
                if qc.get("quant_method") == "gptq":
                    packed = quantize_gptq(tensor.contiguous(), *choice)
                elif qc.get("quant_method") == "fp8":
                    packed = quantize_native_fp8(tensor.contiguous(), qc["weight_block_size"])
                elif qc.get("quant_method") == "awq":
                    packed = quantize_awq(tensor.contiguous(), qc["group_size"])
                elif isinstance(choice, tuple):
                    packed = quantize_weight(tensor.contiguous(), schemes.setdefault(choice, make_scheme(*choice)))
                else:
                    packed = quantize_weight(tensor.contiguous(), choice, global_scales.get(_global_scale_key(module)))
                for k, v in packed.items():
                    dest[f"{module}.{k}"] = v
    if qc.get("quant_method") == "fp8":
        # Every module left BF16, by its full name: vLLM's FP8 loader matches exactly (fact sheet §2).
        plain = [
            n.rpartition(".")[0]
            for d in by_shard.values()
            for n, t in d.items()
            if n.endswith(".weight") and t.dim() == 2 and t.dtype == torch.bfloat16
        ]
        qc["modules_to_not_convert"] = skip_list_entries(
            dict.fromkeys(sorted(n for n in plain if not QWEN3_5_MOE.is_embedding(n))), QWEN3_5_MOE
        )
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = qc
    write_sharded(out, by_shard, config)
    for p in base.iterdir():
        if p.is_file() and p.name not in ("config.json", INDEX_NAME, "fixture.json") and not p.name.endswith(".safetensors"):
            shutil.copy2(p, out / p.name)
    return out


def write_pair(root: Path, spec: FixtureSpec | None = None, kinds=("lowlatency",)) -> dict[str, Path]:
    """base/ plus one build folder per kind under root; returns their paths."""
    root = Path(root)
    paths = {"base": write_base(root / "base", spec)}
    for kind in kinds:
        paths[kind] = write_build(paths["base"], root / kind, kind)
    return paths


def write_fixture_folder(out: Path, writer, force: bool = False, what: dict | None = None):
    """Run writer(folder) into OUT's partial sibling and rename the result into place, under OUT's lock.

    So a fixture is either whole or absent (a killed or failed run leaves only the hidden partial folder, dropped by
    the next run), an existing folder is replaced only with --force and only when a fixture command wrote it, and
    the record it leaves (`splicer-fixture.json`) is what lets `--force` and `ablate --demo` recognise it.
    Returns writer's result with its paths moved from the partial folder to OUT.
    """
    from . import __version__
    from .outputs import FIXTURE, PARTIAL_SUFFIX, check_output, lock_output, os_error_of, replace_dir, sibling, write_error

    out = check_output(out, [], FIXTURE, force)
    with lock_output(out, FIXTURE):
        out = check_output(out, [], FIXTURE, force, recover=True)
        tmp = sibling(out, PARTIAL_SUFFIX)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            result = writer(tmp)
            (tmp / FIXTURE.record).write_text(json.dumps({"tool": f"splicer {__version__}", **(what or {})}, indent=2) + "\n")
            replace_dir(tmp, out)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error = os_error_of(e)
            message = write_error(error, out.parent) if error is not None else None
            if message is not None:
                raise message from None
            raise

    def moved(v):
        return out / Path(v).relative_to(tmp) if isinstance(v, Path) and Path(v).is_relative_to(tmp) else v

    return {k: moved(v) for k, v in result.items()}


__all__ = ["FixtureSpec", "write_base", "write_build", "write_pair", "write_fixture_folder", "BUILD_KINDS"]
