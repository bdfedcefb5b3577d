"""Qwen3.5 / Qwen3.6 MoE (`qwen3_5_moe`, `Qwen3_5MoeForConditionalGeneration`).

Sources (see shared design notes, "qwen3_5_moe facts"): transformers 5.24
`models/qwen3_5_moe` for on-disk names; vLLM 0.26 / 0.33 `models/qwen3_5.py`,
`qwen3_next.py`, `qwen3_5_mtp.py` for layer names, packed modules and the HF->vLLM mapper.

On disk (HF names):
  model.language_model.layers.{i}.linear_attn.{in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj}   GDN, 3 of every 4 layers
  model.language_model.layers.{i}.self_attn.{q,k,v,o}_proj                                     every 4th layer; q includes the output gate
  model.language_model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj, mlp.shared_expert_gate, mlp.gate
  model.language_model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj   (INT4 builds; per expert)
  model.language_model.layers.{i}.mlp.experts.{gate_up_proj,down_proj}   (BF16 base, fused 3-D [E,2I,H] / [E,H,I])
  lm_head, model.language_model.embed_tokens, model.visual.*, mtp.* (one full-attention MoE layer + fc + norms)
"""

from .table import ATTENTION_QKV, Architecture, fused_group

_DEC = r"model\.language_model\.layers\.\d+\."

QWEN3_5_MOE = Architecture(
    name="qwen3_5_moe",
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    class_patterns=(
        ("mtp", r"mtp\..+"),
        ("lm_head", r"lm_head"),
        ("experts", _DEC + r"mlp\.experts\.\d+\.(gate|up|down)_proj"),
        ("shared_expert", _DEC + r"mlp\.shared_expert\.(gate|up|down)_proj"),
        ("gdn", _DEC + r"linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)"),
        ("attention", _DEC + r"self_attn\.(q|k|v|o)_proj"),
    ),
    classes=("gdn", "attention", "shared_expert", "lm_head", "experts", "mtp"),
    # vLLM fuses these shards into one layer; they must share one scheme (facts §3, §7).
    fused_shards={
        **ATTENTION_QKV,
        **fused_group("linear_attn.in_proj_qkvz", ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z")),
        **fused_group("linear_attn.in_proj_ba", ("linear_attn.in_proj_b", "linear_attn.in_proj_a")),
        **fused_group("shared_expert.gate_up_proj", ("shared_expert.gate_proj", "shared_expert.up_proj")),
    },
    vllm_packed_modules={
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
        "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
        "in_proj_ba": ("in_proj_b", "in_proj_a"),
        "qkv": ("qkv",),
    },
    vllm_mtp_packed_modules={
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    },
    vllm_prefix_map=(
        ("model.visual.", "visual."),
        ("lm_head.", "language_model.lm_head."),
        ("lm_head", "language_model.lm_head"),  # the module name itself, as vLLM's layer prefix
        ("model.language_model.", "language_model.model."),
    ),
    # Qwen3NextSparseMoeBlock builds mlp.gate and shared_expert_gate with quant_config=None;
    # conv1d is not a quantizable Linear either (facts §2).
    vllm_never_quantized=r"(mtp\.|model\.language_model\.)(layers\.\d+\.)?(mlp\.gate|mlp\.shared_expert_gate|linear_attn\.conv1d)",
    embedding_pattern=r"model\.language_model\.embed_tokens|mtp\.embed_tokens|model\.visual\.pos_embed",
    vllm_gptq_mtp_rule_layers=r"mtp\.layers\..+",
    expert_pattern=r"((?:mtp|model\.language_model)\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)",
    fused_expert_pattern=r"((?:mtp|model\.language_model)\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)",
    layer_pattern=r"((?:mtp|model\.language_model)\.layers)\.(\d+)\.",
    decoder_roots=(("model.language_model.layers", "language_model.model.layers"), ("mtp.layers", "mtp.layers")),
    lm_head_names=("lm_head", "language_model.lm_head"),
    mtp_prefix="mtp.",
    # vLLM's qwen3_5_mtp: fc([norm(embed(x[t+1])), norm(h[t])]), the layer under mtp.layers, a norm, the shared lm_head
    mtp_drafter="qwen3_5_mtp",
    mtp_layout="fc over [pre_fc_norm_embedding(embed), pre_fc_norm_hidden(hidden)], one full-attention MoE layer, norm",
    non_text_prefixes=("model.visual",),
    text_config_key="text_config",
    text_tensor_pattern=r"model\.language_model\.|lm_head\.",
    hf_prefix_map=(("model.language_model.", "model."),),  # Qwen3_5MoeForCausalLM, the text model alone
    chat_stop_tokens=("<|im_end|>",),
    vllm_kernel_classes=(
        ("lm_head", r"(language_model\.)?lm_head$"),
        ("experts", r".*\.mlp\.experts(\..*)?$"),
        ("shared_expert", r".*\.mlp\.shared_expert\.(gate_up_proj|down_proj)$"),
        ("gdn", r".*\.linear_attn\.(in_proj_qkvz|out_proj)$"),
        ("attention", r".*\.self_attn\.(qkv_proj|o_proj)$"),
    ),
    shape_keys=(
        "num_experts_per_tok",
        "shared_expert_intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
        "layer_types",
        "mtp_num_hidden_layers",
    ),
    source="transformers 5.24 models/qwen3_5_moe; vLLM 0.26.0 models/qwen3_5.py, qwen3_next.py, qwen3_5_mtp.py",
)
