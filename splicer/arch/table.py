"""The architecture table: what splicer knows about one model family's tensor names (Architecture), and the parts
the family modules build theirs from (fused groups, the common model.layers layout)."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field

from ..errors import SplicerError


def fused_group(fused: str, shards: tuple[str, ...]) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Architecture.fused_shards entries for one group vLLM loads into a single layer: every shard -> (fused, shards)."""
    return {s: (fused, shards) for s in shards}


ATTENTION_QKV = fused_group("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"))
MLP_GATE_UP = fused_group("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"))


def model_layers_layout(routed_experts: bool = True, mtp_layer: bool = False) -> dict:
    """Table fields for the layout most HF decoders share: model.embed_tokens, model.layers.{i}.*, and routed
    experts under model.layers.{i}.mlp.experts (per expert on disk, gate_up_proj / down_proj fused in transformers).
    mtp_layer: the MTP head stored as decoder layer num_hidden_layers with its own embed_tokens and shared_head.head
    (DeepSeek-V3, GLM-4.5; vLLM's drafters name that head model.layers.{N}.head)."""
    none = r"(?!)"
    mtp = {"mtp_layer_key": "num_hidden_layers", "mtp_head_names": ("shared_head.head", "head")} if mtp_layer else {}
    return {
        **mtp,
        "embedding_pattern": r"model\.(layers\.\d+\.)?embed_tokens" if mtp_layer else r"model\.embed_tokens",
        "expert_pattern": r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)" if routed_experts else none,
        "fused_expert_pattern": r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)" if routed_experts else none,
        "layer_pattern": r"(model\.layers)\.(\d+)\.",
        "decoder_roots": (("model.layers", "model.layers"),),
    }


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
    # (HF root, vLLM root) of decoder-layer module names; an ignore regex written for a restore matches both, because
    # vLLM renames plain names but not regexes (facts §3).
    decoder_roots: tuple[tuple[str, str], ...] = ()
    lm_head_names: tuple[str, ...] = ("lm_head",)  # the head's HF module name, then any vLLM layer name for it
    # The MTP modules vLLM 0.27+ builds unquantized whenever a GPTQ `dynamic` key is a `-:` rule containing "mtp",
    # whatever the rule matches (qwen3_5_mtp.py; None: the family's vLLM model has no such rule).
    vllm_gptq_mtp_rule_layers: str | None = None
    mtp_prefix: str | None = None  # tensors of a separately stored MTP head ("mtp."), None when the family has none
    # Families that store their MTP head as one more decoder layer (DeepSeek-V3, GLM-4.5: model.layers.{N}.*): the text
    # config key holding N. get_architecture binds the table to a checkpoint's config, which sets mtp_prefix to that
    # layer and puts its modules in class mtp. (One MTP layer: the released models have num_nextn_predict_layers = 1.)
    mtp_layer_key: str | None = None
    # The MTP layer's head as the checkpoint names it and as vLLM does (DeepSeek's and GLM's drafters build
    # shared_head.head under the prefix ...head), relative to mtp_prefix.
    mtp_head_names: tuple[str, str] | None = None
    # Set by bind() when the checkpoint's config says it has no MTP layer (Kimi-K2): why `--restore mtp` finds none.
    no_mtp_reason: str | None = None
    # The MTP drafter the torch backend runs for teacher-forced acceptance (backends/torch_mtp.py builds it by this
    # name); None: not modeled there, and refused in one line that names the family and mtp_layout.
    mtp_drafter: str | None = None
    mtp_layout: str = ""  # the MTP head's layout in words, as that refusal says it
    non_text_prefixes: tuple[str, ...] = ()  # modules outside the text model (a vision tower): no decode reads them
    # The torch backend builds transformers' causal LM for the (text) config through its Auto classes (the text
    # config nested under `text_config_key` when the checkpoint is multimodal); these are the checkpoint tensors it
    # loads and their renames into that model's names.
    text_config_key: str | None = None
    text_tensor_pattern: str = r"model\.|lm_head\."
    hf_prefix_map: tuple[tuple[str, str], ...] = ()
    # Fused 3-D routed-expert tensors (HF's in-memory layout, and some bases on disk): name -> the per-expert
    # projections stacked in it, in row order (gate rows first in gate_up_proj).
    fused_expert_shards: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("gate_up_proj", ("gate_proj", "up_proj")),
        ("down_proj", ("down_proj",)),
    )
    chat_stop_tokens: tuple[str, ...] = ()  # tokens that end an assistant turn in the family's chat template
    # vLLM layer names as its kernel probe reports them (layer numbers folded to *) -> splicer's classes.
    vllm_kernel_classes: tuple[tuple[str, str], ...] = ()
    # config.json keys (of the text config) that must agree between a build and its base.
    shape_keys: tuple[str, ...] = ()
    # The text config's keys for the routed-expert count and the experts each token uses (transformers 5 writes
    # num_local_experts where the released Qwen3 MoE configs say num_experts; DeepSeek says n_routed_experts).
    expert_count_keys: tuple[str, ...] = ("num_experts", "num_local_experts", "n_routed_experts")
    experts_per_token_keys: tuple[str, ...] = ("num_experts_per_tok",)
    # model_type -> the model type whose transformers classes build it, for a model type transformers has no config
    # class of (Kimi-K2's kimi_k2 is DeepSeek-V3's layout, as vLLM's config registry maps it).
    transformers_model_types: tuple[tuple[str, str], ...] = ()
    source: str = ""  # where the names were read (files of transformers and vLLM)
    _compiled: dict = field(default_factory=dict, compare=False, repr=False)

    def bind(self, config: dict) -> Architecture:
        """The table for one checkpoint: with mtp_layer_key, its MTP decoder layer is the mtp class (see the field)."""
        if self.mtp_layer_key is None:
            return self
        text = config.get(self.text_config_key) or config if self.text_config_key else config
        n = text.get(self.mtp_layer_key)
        if not isinstance(n, int) or not self.decoder_roots:
            return self
        # vLLM skips layers num_hidden_layers ... + num_nextn_predict_layers - 1 in the main model (models/utils.py
        # get_spec_layer_idx_from_weight_name); 0 means no MTP layer, absent means the released 1.
        k = text.get("num_nextn_predict_layers", 1)
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise SplicerError(
                f"config.json: num_nextn_predict_layers = {json.dumps(k)}; it must be a whole number, "
                "0 for no MTP layer or 1 for one: fix config.json"
            )
        if k == 0:
            return dataclasses.replace(self, no_mtp_reason="config.json says num_nextn_predict_layers = 0")
        if k != 1:
            raise SplicerError(
                f"config.json: num_nextn_predict_layers = {k}; splicer reads one MTP layer "
                f"({self.decoder_roots[0][0]}.{n}), as DeepSeek-V3 and GLM-4.5 ship, not {k}: "
                "open an issue with the checkpoint"
            )
        prefix = f"{self.decoder_roots[0][0]}.{n}."
        return dataclasses.replace(
            self, mtp_prefix=prefix, class_patterns=(("mtp", re.escape(prefix) + ".+"),) + self.class_patterns
        )

    def transformers_model_type(self, model_type: str) -> str:
        """The model type transformers' Auto classes know this checkpoint's model type by."""
        return dict(self.transformers_model_types).get(model_type, model_type)

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

    def tensor_class(self, tensor: str) -> str:
        """The class of the module a tensor belongs to (a fused 3-D expert tensor: its experts' class)."""
        fused = self.fused_expert_parts(tensor)
        module = f"{fused[0]}.0.{dict(self.fused_expert_shards)[fused[1]][0]}" if fused else tensor.rpartition(".")[0]
        return self.module_class(module)

    def expert_parts(self, module: str) -> tuple[str, int, str] | None:
        m = self._re(self.expert_pattern).fullmatch(module)
        return (m.group(1), int(m.group(2)), m.group(3)) if m else None

    def fused_expert_parts(self, tensor: str) -> tuple[str, str] | None:
        m = self._re(self.fused_expert_pattern).fullmatch(tensor)
        return (m.group(1), m.group(2)) if m else None

    def layer_index(self, module: str) -> int | None:
        m = self._re(self.layer_pattern).match(module)
        return int(m.group(2)) if m else None

    def experts_read_per_token(self, text_config: dict) -> float:
        """Share of a layer's routed experts one token reads (top-k of E); 1 when the config states neither."""
        total = next((text_config[k] for k in self.expert_count_keys if text_config.get(k)), None)
        used = next((text_config[k] for k in self.experts_per_token_keys if text_config.get(k)), None)
        return used / total if total and used else 1.0

    def is_mtp(self, name: str) -> bool:
        """A tensor or module of the separately stored MTP head."""
        return self.mtp_prefix is not None and name.startswith(self.mtp_prefix)

    def is_text(self, module: str) -> bool:
        """Part of the text model a batch-1 decode runs (not a vision tower, not the MTP head)."""
        return not self.is_mtp(module) and not module.startswith(self.non_text_prefixes)

    @property
    def mtp_layer_index(self) -> int | None:
        """The decoder-layer index of an MTP head stored as one more decoder layer (None: stored apart, or none)."""
        return self.layer_index(self.mtp_prefix + "x") if self.mtp_prefix else None

    @property
    def mtp_ignore(self) -> str:
        """The ignore entry that keeps a BF16 MTP head unquantized."""
        return f"re:{re.escape(self.mtp_prefix)}.+$"

    def split_fused_experts(self, name: str, t):
        """A fused 3-D expert tensor [E, k*I, H] as per-expert weights [(experts.e.proj.weight, [I, H]), ...], expert by
        expert in the table's projection order (views, no copies); None for any other tensor. Works on meta tensors."""
        parts = self.fused_expert_parts(name)
        if not parts:
            return None
        prefix, which = parts
        projs = dict(self.fused_expert_shards)[which]
        rows = t.shape[1] // len(projs)
        return [
            (f"{prefix}.{e}.{p}.weight", t[e, i * rows : (i + 1) * rows]) for e in range(t.shape[0]) for i, p in enumerate(projs)
        ]

    def per_expert_shapes(self, tensor: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]] | None:
        """split_fused_experts on shapes alone."""
        import torch

        split = self.split_fused_experts(tensor, torch.empty(shape, device="meta"))
        return {n: tuple(t.shape) for n, t in split} if split is not None else None

    def fused_expert_name(self, prefix: str, proj: str) -> str:
        """The fused 3-D tensor that holds expert projection proj under prefix (…mlp.experts)."""
        return f"{prefix}." + next(f for f, projs in self.fused_expert_shards if proj in projs)

    def kernel_class(self, vllm_layer: str) -> str | None:
        return next((c for c, p in self.vllm_kernel_classes if self._re(p).match(vllm_layer)), None)

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
                return vl + name[len(hf) :]
        return name

    def vllm_rename_entry(self, entry: str) -> str:
        """How vLLM rewrites an ignore/target entry (configure_quant_config -> apply_vllm_mapper).

        Only plain dotted names are renamed; regexes and dot-free names are kept as they are.
        """
        if entry.startswith("re:") or "." not in entry:
            return entry
        return self.to_vllm_name(entry)

    def vllm_layer(self, module: str) -> VllmLayer:
        drafter = self.is_mtp(module)
        packed = self.vllm_mtp_packed_modules if drafter else self.vllm_packed_modules
        vname = module if drafter else self.to_vllm_name(module)
        if self._re(self.vllm_never_quantized).fullmatch(module):
            return VllmLayer(vname, "unquantized", vname, (), drafter)
        if self.is_embedding(module):
            return VllmLayer(vname, "embedding", vname, ("VocabParallelEmbedding",), drafter)
        if module == self.lm_head_names[0]:
            return VllmLayer(vname, "lm_head", vname, ("ParallelLMHead",), drafter)
        if drafter and self.mtp_head_names and module == self.mtp_prefix + self.mtp_head_names[0]:
            vhead = self.mtp_prefix + self.mtp_head_names[1]
            return VllmLayer(vhead, "lm_head", vhead, ("ParallelLMHead",), drafter)
        parts = self.expert_parts(module)
        if parts:
            prefix, _, proj = parts
            vprefix = prefix if drafter else self.to_vllm_name(prefix)
            # vLLM's MoE layer is a RoutedExperts module: a class target must be contained in that name, and an exact
            # "Linear" target reaches it through compressed_tensors.vllm_targets.
            return VllmLayer(vprefix, "moe", f"{vprefix}.0.{proj}", ("RoutedExperts",), drafter)
        proj = vname.rsplit(".", 1)[-1]
        for fused, shards in packed.items():
            if proj in shards and fused != proj:
                return VllmLayer(vname[: -len(proj)] + fused, "linear", vname, ("MergedColumnParallelLinear",), drafter)
        return VllmLayer(vname, "linear", vname, ("RowParallelLinear", "ColumnParallelLinear"), drafter)

    def vllm_fused_shards(self, layer: VllmLayer) -> list[str] | None:
        """The shard names vLLM tests for a layer its packed_modules_mapping fuses (None for any other layer)."""
        proj = layer.name.rsplit(".", 1)[-1]
        packed = self.vllm_mtp_packed_modules if layer.drafter else self.vllm_packed_modules
        if layer.kind == "linear" and proj in packed:
            return [layer.name[: -len(proj)] + s for s in packed[proj]]
        return None

    def vllm_shards_of(self, layer: VllmLayer) -> list[str]:
        """Every shard name vLLM tests for a fused layer (should_ignore_layer)."""
        fused = self.vllm_fused_shards(layer)
        if fused is not None:
            return fused
        if layer.kind == "moe":
            return [f"{layer.name}.0.{p}" for _, projs in self.fused_expert_shards for p in projs]
        return [layer.shard]
