"""DeepSeek-V3 / R1 (`deepseek_v3`, `DeepseekV3ForCausalLM`): MLA attention, first layers dense, routed and shared experts.

Sources: transformers 5.24 `models/deepseek_v3` (names and shapes: the fixture builds the model on the meta device);
vLLM 0.26.0 `model_executor/models/deepseek_v2.py`, `deepseek_mtp.py` (read, and loaded on the H200:
results/gpu-families/ calls 3 and 4; shared design notes, families §4): packed_modules_mapping {"gate_up_proj": [gate,
up]} plus "fused_qkv_a_proj": [q_a_proj, kv_a_proj_with_mqa] when q_lora_rank is set (V3, R1, Kimi-K2); no mapper (no
renames); the router `mlp.gate` (GateLinear, with e_score_correction_bias) never quantized; `kv_b_proj` built with
quant_config (MLA dequantizes it after load); the loader takes per-expert expert tensors only.

On disk: model.layers.{i}.self_attn.{q_a_proj,q_a_layernorm,q_b_proj,kv_a_proj_with_mqa,kv_a_layernorm,kv_b_proj,o_proj},
model.layers.{i}.mlp.{gate,up,down}_proj for i < first_k_dense_replace (class mlp), then mlp.experts.{e}.*,
mlp.shared_experts.{gate,up,down}_proj (class shared_expert), mlp.gate; model.embed_tokens, model.norm, lm_head.

The MTP layer, stored as one more decoder layer (model.layers.{num_hidden_layers}.*: a copy of a MoE decoder layer
plus embed_tokens, enorm, hnorm, eh_proj and shared_head.{norm,head}), is class mtp: get_architecture binds the table
to the checkpoint's num_hidden_layers (mtp_layer_key). vLLM's drafter (deepseek_mtp.py) shares the target's
quant_config and packed mapping, keeps the checkpoint's names for the layer's modules and never quantizes eh_proj (seen
at load with speculative decoding, results/gpu-families/ call 4). Its head is the target's lm_head: vLLM 0.26
replaces shared_head.head with it (v1/spec_decode/llm_base_proposer.py, _maybe_share_lm_head), so the checkpoint's
model.layers.{N}.shared_head.head is not used and the drafter's logits follow the lm_head class. Kimi-K2
(`kimi_k2`) shares the layout and loads with this table (results/gpu-families/ call 5).
"""

from .table import MLP_GATE_UP, Architecture, fused_group, model_layers_layout

_DEC = r"model\.layers\.\d+\."
MAIN_PACKED = {"gate_up_proj": ("gate_proj", "up_proj"), "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")}

DEEPSEEK_V3 = Architecture(
    name="deepseek_v3",
    model_types=("deepseek_v3", "kimi_k2"),
    # vLLM 0.26 maps kimi_k2 to its DeepseekV3Config (transformers_utils/config.py) and loads it with this model class;
    # transformers has no kimi_k2 config class, so the torch backend builds it with DeepSeek-V3's.
    transformers_model_types=(("kimi_k2", "deepseek_v3"),),
    class_patterns=(
        ("lm_head", r"lm_head"),
        ("experts", _DEC + r"mlp\.experts\.\d+\.(gate|up|down)_proj"),
        ("shared_expert", _DEC + r"mlp\.shared_experts\.(gate|up|down)_proj"),
        ("attention", _DEC + r"self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"),
        ("mlp", _DEC + r"mlp\.(gate|up|down)_proj"),
    ),
    classes=("attention", "mlp", "shared_expert", "lm_head", "experts", "mtp"),
    fused_shards={
        **fused_group("self_attn.fused_qkv_a_proj", ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")),
        **MLP_GATE_UP,
        **fused_group("shared_experts.gate_up_proj", ("shared_experts.gate_proj", "shared_experts.up_proj")),
    },
    vllm_packed_modules=MAIN_PACKED,
    vllm_mtp_packed_modules=MAIN_PACKED,  # the drafter shares the target's quant_config object (families §D)
    vllm_prefix_map=(),
    # The router, and the MTP layer's eh_proj (a plain nn.Linear in the drafter).
    vllm_never_quantized=r"model\.layers\.\d+\.(mlp\.gate|eh_proj)",
    **model_layers_layout(mtp_layer=True),
    mtp_layout="eh_proj over [enorm(embed), hnorm(hidden)], one decoder layer, shared_head",
    chat_stop_tokens=("<｜end▁of▁sentence｜>", "<|im_end|>"),  # DeepSeek's end of turn; Kimi-K2's
    vllm_kernel_classes=(
        ("lm_head", r"lm_head$"),
        ("experts", r".*\.mlp\.experts(\..*)?$"),
        ("shared_expert", r".*\.mlp\.shared_experts\.(gate_up_proj|down_proj)$"),
        ("attention", r".*\.self_attn\.(fused_qkv_a_proj|q_b_proj|kv_b_proj|o_proj)$"),
        ("mlp", r".*\.mlp\.(gate_up_proj|down_proj)$"),
    ),
    shape_keys=(
        "n_routed_experts",
        "n_shared_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "first_k_dense_replace",
        "num_attention_heads",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
    ),
    source="transformers 5.24 models/deepseek_v3; vLLM 0.26.0 models/deepseek_v2.py, deepseek_mtp.py",
)
