"""Qwen3 MoE (`qwen3_moe`: Qwen3-30B-A3B, Qwen3-235B-A22B; `Qwen3MoeForCausalLM`).

Sources: transformers 5.24 `models/qwen3_moe` (names and shapes: the fixture builds the model on the meta device);
vLLM 0.26.0 `model_executor/models/qwen3_moe.py` (read, and loaded on the H200: results/gpu-families/
call 2; shared design notes, families §1):
packed_modules_mapping {"qkv_proj": [q, k, v]} (+ "gate_up_proj" for `mlp_only_layers`), a stacked-only
hf_to_vllm_mapper (so `ignore` names are not renamed), no MTP, no shared expert.

On disk (HF names, per expert in the released checkpoints; transformers fuses them in memory):
  model.layers.{i}.self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm
  model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj, mlp.gate (router)
  model.layers.{i}.mlp.{gate,up,down}_proj   (only layers listed in mlp_only_layers)
  model.embed_tokens, model.norm, lm_head

The router `mlp.gate` is a ReplicatedLinear built *with* quant_config in vLLM: a compressed-tensors `Linear` target
quantizes it unless `ignore` covers it (class targets match by substring there). It is not a restorable class here.
"""

from .table import ATTENTION_QKV, MLP_GATE_UP, Architecture, model_layers_layout

_DEC = r"model\.layers\.\d+\."

QWEN3_MOE = Architecture(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    class_patterns=(
        ("lm_head", r"lm_head"),
        ("experts", _DEC + r"mlp\.experts\.\d+\.(gate|up|down)_proj"),
        ("attention", _DEC + r"self_attn\.(q|k|v|o)_proj"),
        ("mlp", _DEC + r"mlp\.(gate|up|down)_proj"),
    ),
    classes=("attention", "mlp", "lm_head", "experts"),
    fused_shards={**ATTENTION_QKV, **MLP_GATE_UP},
    vllm_packed_modules={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
    vllm_mtp_packed_modules={},
    vllm_prefix_map=(),
    vllm_never_quantized=r"(?!)",  # every Linear is built with quant_config, the router included
    **model_layers_layout(),
    chat_stop_tokens=("<|im_end|>",),
    vllm_kernel_classes=(
        ("lm_head", r"lm_head$"),
        ("experts", r".*\.mlp\.experts(\..*)?$"),
        ("attention", r".*\.self_attn\.(qkv_proj|o_proj)$"),
        ("mlp", r".*\.mlp\.(gate_up_proj|down_proj)$"),
    ),
    shape_keys=(
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "mlp_only_layers",
        "decoder_sparse_step",
    ),
    source="transformers 5.24 models/qwen3_moe; vLLM 0.26.0 models/qwen3_moe.py",
)
