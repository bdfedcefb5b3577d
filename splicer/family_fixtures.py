"""Tiny fixture pairs for the families other than qwen3_5_moe, made from transformers' own model class.

Each spec is data: the model type, a small config, and how its released checkpoints lay routed experts out on disk.
The base's tensor names and shapes come from transformers' causal-LM class for that config built on the meta device
(real names and layouts); values are seeded random BF16. Builds are quantized tensor by tensor with
compressed-tensors (`splicer.quantize`: round to nearest, pack-quantized):

* ``int4``: INT4 g128 on every Linear of the family's classes, INT8 g128 on the head (a group of its own, as seed
  000 does: vLLM matches the head only through a target that names it); other Linears (a MoE router) are ignored.
* ``experts-g32`` (families with routed experts): INT4 g32 on the routed experts only.

`splicer fixture DIR --family NAME` writes one. The qwen3_5_moe pair (vision tower, MTP head, seed builds) stays in
`splicer.fixtures`.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from .arch import Architecture, get_architecture
from .checkpoint import INDEX_NAME
from .fixtures import ct_group, ct_quant_config, write_sharded, write_side_files
from .quantize import make_scheme, quantize_weight


@dataclass(frozen=True)
class FamilyFixture:
    model_type: str
    config: dict
    experts_on_disk: str = "per_expert"  # per_expert (as released) | fused (transformers' in-memory 3-D layout)
    builds: tuple[str, ...] = ("int4",)
    absent_classes: tuple[str, ...] = ()  # classes of the family this fixture has no modules of
    mtp_layer: bool = False  # add an MTP layer as DeepSeek-V3 and GLM-4.5 store it (transformers' model has none)
    notes: str = ""


# Every grouped input dim is a multiple of 128 (vLLM's Marlin/Machete kernels need it on a GPU).
_TINY = dict(vocab_size=2048, hidden_size=256, max_position_embeddings=4096, tie_word_embeddings=False)
_TINY_DENSE = dict(_TINY, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=128)
FAMILY_FIXTURES = {
    "qwen3_moe": FamilyFixture(
        "qwen3_moe",
        dict(
            _TINY_DENSE, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0]
        ),
        builds=("int4", "experts-g32"),
        notes="Qwen3-30B-A3B's layout (per-expert experts, a router per layer, no shared expert, no MTP), with layer 0 "
        "a dense MLP (`mlp_only_layers`, which the released models leave empty) so the mlp class is exercised",
    ),
    "qwen3_next": FamilyFixture(
        "qwen3_next",
        dict(
            _TINY_DENSE,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
            num_hidden_layers=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
        ),
        builds=("int4", "experts-g32"),
        absent_classes=("mtp",),
        notes="Qwen3-Next-80B-A3B's layout (GDN projections fused on disk, a shared expert); no MTP head: "
        "transformers' model has none",
    ),
    "deepseek_v3": FamilyFixture(
        "deepseek_v3",
        dict(
            _TINY,
            intermediate_size=512,
            moe_intermediate_size=128,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            q_lora_rank=128,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=64,
            v_head_dim=128,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            # Not fields of transformers' DeepseekV3Config (its router always works so), but in the released
            # config.json, and vLLM 0.26 reads them: without topk_method = noaux_tc its DeepseekV2MoE has no
            # e_score_correction_bias and the checkpoint's bias fails to load (results/gpu-families, call 2).
            topk_method="noaux_tc",
            scoring_func="sigmoid",
        ),
        builds=("int4", "experts-g32"),
        mtp_layer=True,
        notes="DeepSeek-V3's layout at toy size: MLA (q_lora_rank set; kv_lora_rank 512 and a 64-dim rope part as in the released model, so vLLM's MLA kernels see its head size), layer 0 dense, then routed + shared experts; "
        "an MTP layer as model.layers.{num_hidden_layers} (added by the fixture: transformers' model has none)",
    ),
    "kimi_k2": FamilyFixture(
        "kimi_k2",
        dict(
            _TINY,
            intermediate_size=512,
            moe_intermediate_size=128,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            q_lora_rank=128,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=64,
            v_head_dim=128,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            # Kimi-K2 ships no MTP layer (its config.json says 0; splicer reads an absent key as DeepSeek's 1).
            num_nextn_predict_layers=0,
        ),
        builds=("int4", "experts-g32"),
        absent_classes=("mtp",),
        notes="Kimi-K2's checkpoint: DeepSeek-V3's layout (MLA, layer 0 dense, routed + shared experts) under model_type "
        "kimi_k2, architectures DeepseekV3ForCausalLM, no MTP layer; its released values are not checked here",
    ),
    "glm4_moe": FamilyFixture(
        "glm4_moe",
        dict(
            _TINY_DENSE,
            moe_intermediate_size=128,
            first_k_dense_replace=1,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            attention_bias=True,
            use_qk_norm=True,
            partial_rotary_factor=0.5,
        ),
        builds=("int4", "experts-g32"),
        mtp_layer=True,
        notes="GLM-4.5's layout at toy size: q/k/v biases, qk norms, layer 0 dense, routed + shared experts; an MTP layer "
        "as model.layers.{num_hidden_layers} (added by the fixture: transformers' model has none)",
    ),
    **{t: FamilyFixture(t, _TINY_DENSE) for t in ("llama", "mistral", "qwen3")},
}


def _hf_model_type(spec: FamilyFixture) -> str:
    return get_architecture({"model_type": spec.model_type}).transformers_model_type(spec.model_type)


def _hf_config(spec: FamilyFixture):
    from transformers import AutoConfig

    return AutoConfig.for_model(_hf_model_type(spec), **spec.config)


def _model_state(spec: FamilyFixture) -> dict[str, torch.Tensor]:
    """transformers' model for the config, initialised by transformers itself (tiny: built on the CPU)."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():  # its own seed, without touching the caller's random state
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(_hf_config(spec)).state_dict()


def base_shapes(spec: FamilyFixture, arch: Architecture, state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """The base's tensors and shapes: the model's own, routed experts per expert where releases store them so."""
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    if spec.experts_on_disk == "per_expert":
        for name, shape in list(shapes.items()):
            split = arch.per_expert_shapes(name, shape)
            if split:
                del shapes[name]
                shapes.update(split)
    return dict(sorted(shapes.items()))


def with_mtp_layer(shapes: dict[str, tuple[int, ...]], config: dict) -> dict[str, tuple[int, ...]]:
    """The shapes plus an MTP layer as DeepSeek-V3 and GLM-4.5 ship it: model.layers.{N} (N = num_hidden_layers) holds
    a copy of the last decoder layer's modules and the MTP block's own: embed_tokens, enorm, hnorm, eh_proj (the
    embedding and the hidden state, concatenated, projected back to the hidden size), shared_head.{norm,head}
    (families-facts §4, §5)."""
    n, h, v = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    last, mtp = f"model.layers.{n - 1}.", f"model.layers.{n}."
    out = dict(shapes)
    out.update({mtp + k[len(last) :]: s for k, s in shapes.items() if k.startswith(last)})
    out.update(
        {
            mtp + "embed_tokens.weight": (v, h),
            mtp + "enorm.weight": (h,),
            mtp + "hnorm.weight": (h,),
            mtp + "eh_proj.weight": (h, 2 * h),
            mtp + "shared_head.norm.weight": (h,),
            mtp + "shared_head.head.weight": (v, h),
        }
    )
    return dict(sorted(out.items()))


def _init(name: str, shape, gen: torch.Generator, arch: Architecture, default: torch.Tensor | None) -> torch.Tensor:
    """Seeded values of a plausible scale: norms and other vectors near transformers' own initial value (1 for a
    Llama RMSNorm, 0 for a zero-centred one, the GDN's A_log and dt_bias as it sets them), small residual writes, a
    decisive router."""
    if len(shape) < 2:
        start = default.float() if default is not None else torch.zeros(shape)
        return (start + torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    fan_in = shape[-1]
    t = torch.randn(shape, generator=gen) / math.sqrt(fan_in)
    if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
        t = t * 0.25  # blocks write small updates into the residual stream, as in a trained model
    if name.endswith("mlp.gate.weight"):  # the MoE router, as in splicer.fixtures
        t = t * 4  # decisive routing, so rounding does not flip near-ties between experts
    if name == f"{arch.lm_head_names[0]}.weight":
        t = t * 4  # peaked next-token distributions, as a trained model's
    return t.to(torch.bfloat16)


def _shard_key(name: str, arch: Architecture) -> str:
    li = arch.layer_index(name)
    if name.startswith(arch.lm_head_names[0] + ".") or li is None and "norm" in name:
        return "tail"
    return f"layer{li:03d}" if li is not None else "head"


def write_family_base(out: Path, family: str, seed: int = 0) -> Path:
    spec = FAMILY_FIXTURES[family]
    cfg = _hf_config(spec)
    config = cfg.to_dict()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    # As a released checkpoint names it: without `architectures` vLLM 0.26 resolved the qwen3 and qwen3_moe fixtures
    # to their bare Qwen3Model / Qwen3MoeModel and served them as embedding models (results/gpu-families).
    config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[_hf_model_type(spec)]]
    config["model_type"] = spec.model_type  # kimi_k2, built with DeepSeek-V3's classes, keeps its own
    config["dtype"] = "bfloat16"
    config["eos_token_id"] = 2  # <|im_end|> of the demo tokenizer
    arch = get_architecture(config)
    gen = torch.Generator().manual_seed(seed)
    state = _model_state(spec)
    by_shard: dict[str, dict[str, torch.Tensor]] = {}
    shapes = base_shapes(spec, arch, state)
    if spec.mtp_layer:
        shapes = with_mtp_layer(shapes, config)
        config["num_nextn_predict_layers"] = 1
    for name, shape in shapes.items():
        by_shard.setdefault(_shard_key(name, arch), {})[name] = _init(name, shape, gen, arch, state.get(name))
    out = Path(out)
    write_sharded(out, by_shard, config)
    write_side_files(out, cfg.vocab_size)
    (out / "README.md").write_text(f"Synthetic {family} checkpoint made by splicer.family_fixtures; random weights.\n")
    return out


def _build_plan(arch: Architecture, kind: str) -> tuple[dict, callable, list[str]]:
    head = arch.lm_head_names[0]
    if kind == "int4":
        # The head's group first: compressed-tensors' model-free dequantizer takes the first group that matches.
        # A family whose head vLLM never quantizes (qwen3_next) keeps it in BF16.
        groups = {"group_0": ct_group([f"re:.*{re.escape(head)}$"], 8, 128)} if "lm_head" in arch.classes else {}
        groups[f"group_{len(groups)}"] = ct_group(["Linear"], 4, 128)

        def pick(module: str):
            cls = arch.module_class(module)
            if cls == "lm_head":
                return (8, 128)
            if arch.is_mtp(module):
                # The MTP layer is quantized as the decoder layer it copies (its router stays BF16); the MTP block's own
                # eh_proj (never quantized in vLLM) and head stay BF16.
                li = arch.layer_index(module)
                cls = arch.module_class(module.replace(f".{li}.", f".{li - 1}.", 1))
            return (4, 128) if cls in arch.classes and cls not in ("mtp", "lm_head") else None

        return ct_quant_config(groups, []), pick, ["Linear"]
    if kind == "experts-g32":
        if arch.expert_pattern == r"(?!)":
            raise ValueError(f"{arch.name} has no routed experts; build kinds: int4")
        target = r"re:.*mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)$"
        return (
            ct_quant_config({"group_0": ct_group([target], 4, 32)}, []),
            (lambda m: (4, 32) if arch.expert_parts(m) else None),
            [],
        )
    raise ValueError(f"unknown build kind {kind!r}; one of int4, experts-g32")


def write_family_build(base: Path, out: Path, kind: str = "int4") -> Path:
    """Quantize a family fixture base into a compressed-tensors build; Linears left in BF16 that a `Linear` target
    would reach (a MoE router) go into `ignore` under their layer-free name."""
    from safetensors import safe_open

    base, out = Path(base), Path(out)
    config = json.loads((base / "config.json").read_text())
    arch = get_architecture(config)
    qc, pick, class_targets = _build_plan(arch, kind)
    index = json.loads((base / INDEX_NAME).read_text())
    by_shard: dict[str, dict[str, torch.Tensor]] = {}
    schemes, ignore = {}, set()
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(base / shard), "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                items = arch.split_fused_experts(name, t) or [(name, t)]  # builds are per expert, as llm-compressor writes them
                for tname, tensor in items:
                    module, _, leaf = tname.rpartition(".")
                    linear = leaf == "weight" and tensor.dim() == 2 and not arch.is_embedding(module)
                    choice = pick(module) if linear else None
                    key = _shard_key(tname, arch) + ("-experts" if arch.expert_parts(module) else "")
                    dest = by_shard.setdefault(key, {})
                    if choice is None:
                        if linear and class_targets and (arch.module_class(module) == "other" or arch.is_mtp(module)):
                            ignore.add("re:.*" + re.escape(re.sub(r"^.*?\.layers\.\d+\.", "", module)) + "$")
                        dest[tname] = tensor.contiguous()
                        continue
                    packed = quantize_weight(tensor.contiguous(), schemes.setdefault(choice, make_scheme(*choice)))
                    for k, v in packed.items():
                        dest[f"{module}.{k}"] = v
    qc["ignore"] = sorted(ignore)
    config["quantization_config"] = qc
    write_sharded(out, by_shard, config)
    for p in base.iterdir():
        if p.is_file() and p.name not in ("config.json", INDEX_NAME) and not p.name.endswith(".safetensors"):
            shutil.copy2(p, out / p.name)
    return out


def write_family_pair(root: Path, family: str, kinds: tuple[str, ...] | None = None, seed: int = 0) -> dict[str, Path]:
    root = Path(root)
    paths = {"base": write_family_base(root / "base", family, seed)}
    for kind in kinds or FAMILY_FIXTURES[family].builds:
        paths[kind] = write_family_build(paths["base"], root / kind, kind)
    return paths


__all__ = ["FAMILY_FIXTURES", "FamilyFixture", "write_family_base", "write_family_build", "write_family_pair"]
