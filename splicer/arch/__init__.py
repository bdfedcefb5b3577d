"""Architecture tables: everything splicer knows about one model family's tensor names.

One module per architecture, each exposing an `Architecture` instance. Nothing outside
this package hard-codes a tensor or module name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import SplicerError

# Tensors that make up one quantized module in compressed-tensors' pack-quantized format
# (compressors/pack_quantized/base.py: compression_param_names; g_idx only up to 0.18).
CT_PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
# GPTQ (AutoGPTQ / GPTQModel `checkpoint_format: gptq`): qweight [K*b/32, N] i32 packed along K, qzeros [K/g, N*b/32] i32
# packed along N (v1 stores zero - 1), scales [K/g, N] f16, g_idx [K] i32.
GPTQ_PACKED_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
PACKED_SUFFIXES = CT_PACKED_SUFFIXES + GPTQ_PACKED_SUFFIXES
PLAIN_SUFFIXES = ("weight", "bias")


@dataclass(frozen=True)
class VllmLayer:
    """The vLLM layer an HF module loads into, and how vLLM decides its quantization."""

    name: str  # vLLM layer name, e.g. language_model.model.layers.0.linear_attn.in_proj_qkvz
    kind: str  # linear | lm_head | moe | unquantized | embedding
    shard: str  # the name vLLM tests for this module (shard name, or expert-0 name for moe)
    class_names: tuple[str, ...]  # class names a compressed-tensors class target is matched against
    drafter: bool = False  # loaded only with --speculative-config (MTP)


@dataclass(frozen=True)
class Architecture:
    name: str
    model_types: tuple[str, ...]
    # (class, regex over the HF module name); first full match wins, otherwise "other".
    class_patterns: tuple[tuple[str, str], ...]
    # Classes the user may restore, in display order.
    classes: tuple[str, ...]
    # HF shard suffix -> (fused vLLM suffix, all shard suffixes), for the decoder and MTP.
    fused_shards: dict[str, tuple[str, tuple[str, ...]]]
    # vLLM's packed_modules_mapping for the main model and for the MTP drafter.
    vllm_packed_modules: dict[str, tuple[str, ...]]
    vllm_mtp_packed_modules: dict[str, tuple[str, ...]]
    # hf_to_vllm_mapper prefixes (exact ignore/target names are renamed with these).
    vllm_prefix_map: tuple[tuple[str, str], ...]
    # Modules vLLM always builds unquantized (quant_config=None), whatever config.json says.
    vllm_never_quantized: str
    # HF module names of embeddings (never class-targeted in either naming).
    embedding_pattern: str
    # Per-expert module: groups (experts prefix, expert index, proj).
    expert_pattern: str
    # Fused 3-D base expert tensors: groups (experts prefix, which).
    fused_expert_pattern: str
    layer_pattern: str  # groups (layer prefix, layer index) of a decoder module
    _compiled: dict = field(default_factory=dict, compare=False, repr=False)

    def _re(self, pattern: str) -> re.Pattern:
        c = self._compiled.get(pattern)
        if c is None:
            c = self._compiled[pattern] = re.compile(pattern)
        return c

    def module_class(self, module: str) -> str:
        for cls, pattern in self.class_patterns:
            if self._re(pattern).fullmatch(module):
                return cls
        return "other"

    def expert_parts(self, module: str) -> tuple[str, int, str] | None:
        m = self._re(self.expert_pattern).fullmatch(module)
        return (m.group(1), int(m.group(2)), m.group(3)) if m else None

    def fused_expert_parts(self, tensor: str) -> tuple[str, str] | None:
        m = self._re(self.fused_expert_pattern).fullmatch(tensor)
        return (m.group(1), m.group(2)) if m else None

    def layer_index(self, module: str) -> int | None:
        m = self._re(self.layer_pattern).match(module)
        return int(m.group(2)) if m else None

    def is_embedding(self, module: str) -> bool:
        return bool(self._re(self.embedding_pattern).fullmatch(module))

    def atomic_unit(self, module: str) -> str:
        """The set of modules that must be restored together, named by its vLLM-side name.

        vLLM loads fused shards into one layer and decides all routed experts of a layer
        from expert 0 (facts §3), so those can only change precision together.
        """
        parts = self.expert_parts(module)
        if parts:
            return parts[0]
        prefix, _, suffix = self._split_fused(module)
        if suffix:
            return prefix + self.fused_shards[suffix][0]
        return module

    def _split_fused(self, module: str) -> tuple[str, str, str | None]:
        for suffix in self.fused_shards:
            if module.endswith("." + suffix):
                return module[: -len(suffix)], suffix, suffix
        return module, "", None

    def to_vllm_name(self, name: str) -> str:
        for hf, vl in self.vllm_prefix_map:
            if name.startswith(hf):
                return vl + name[len(hf):]
        return name

    def vllm_rename_entry(self, entry: str) -> str:
        """How vLLM rewrites an ignore/target entry (configure_quant_config -> apply_vllm_mapper).

        Only plain dotted names are renamed; regexes and dot-free names are kept as they are.
        """
        if entry.startswith("re:") or "." not in entry:
            return entry
        return self.to_vllm_name(entry)

    def vllm_layer(self, module: str) -> VllmLayer:
        drafter = module.startswith("mtp.")
        packed = self.vllm_mtp_packed_modules if drafter else self.vllm_packed_modules
        vname = module if drafter else self.to_vllm_name(module)
        if self._re(self.vllm_never_quantized).fullmatch(module):
            return VllmLayer(vname, "unquantized", vname, (), drafter)
        if self.is_embedding(module):
            return VllmLayer(vname, "embedding", vname, ("VocabParallelEmbedding",), drafter)
        if module == "lm_head":
            return VllmLayer(vname, "lm_head", vname, ("ParallelLMHead",), drafter)
        parts = self.expert_parts(module)
        if parts:
            prefix, _, proj = parts
            vprefix = prefix if drafter else self.to_vllm_name(prefix)
            # get_moe_method adds the MoE layer to Linear's target map, so class targets
            # written for Linear reach the experts too.
            return VllmLayer(vprefix, "moe", f"{vprefix}.0.{proj}", ("FusedMoE", "Linear"), drafter)
        proj = vname.rsplit(".", 1)[-1]
        for fused, shards in packed.items():
            if proj in shards and fused != proj:
                return VllmLayer(vname[: -len(proj)] + fused, "linear", vname, ("MergedColumnParallelLinear",), drafter)
        return VllmLayer(vname, "linear", vname, ("RowParallelLinear", "ColumnParallelLinear"), drafter)

    def vllm_shards_of(self, layer: VllmLayer) -> list[str]:
        """Every shard name vLLM tests for a fused layer (should_ignore_layer)."""
        proj = layer.name.rsplit(".", 1)[-1]
        packed = self.vllm_mtp_packed_modules if layer.drafter else self.vllm_packed_modules
        if layer.kind == "linear" and proj in packed:
            return [layer.name[: -len(proj)] + s for s in packed[proj]]
        if layer.kind == "moe":
            return [f"{layer.name}.0.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
        return [layer.shard]


def get_architecture(config: dict) -> Architecture:
    from .qwen3_5_moe import QWEN3_5_MOE

    model_type = config.get("model_type")
    for arch in (QWEN3_5_MOE,):
        if model_type in arch.model_types:
            return arch
    raise SplicerError(
        f"model_type {model_type!r} is not supported (supported: qwen3_5_moe); "
        "add an architecture table under splicer/arch/"
    )
