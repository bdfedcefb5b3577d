"""Qwen3-Next (`qwen3_next`: Qwen3-Next-80B-A3B; `Qwen3NextForCausalLM`).

Sources: transformers 5.24 `models/qwen3_next` (names and shapes: the fixture builds the model on the meta device);
vLLM 0.26.0 `model_executor/models/qwen3_next.py`, `qwen3_next_mtp.py` (read; the main model loaded on the H200,
results/gpu-families/ call 4, the fixture having no MTP head; shared design notes, families §2):
packed_modules_mapping {"qkv_proj": [q, k, v], "gate_up_proj": [gate, up], "in_proj_qkvz": ["in_proj_qkvz"],
"in_proj_ba": ["in_proj_ba"]} (the GDN input projections are fused on disk already), a stacked-only mapper (no
renames), conv1d, mlp.gate, mlp.shared_expert_gate, lm_head and embed_tokens built without quant_config (never
quantized: a quantized head would be misread, so lm_head is not a class here), MTP under `mtp.` whose quantization
prefixes equal the checkpoint names.

On disk: model.layers.{i}.linear_attn.{in_proj_qkvz,in_proj_ba,out_proj,conv1d,A_log,dt_bias,norm} (3 of every 4
layers), model.layers.{i}.self_attn.{q,k,v,o}_proj (every 4th; q includes the output gate), mlp.experts.{e}.*,
mlp.gate, mlp.shared_expert.{gate,up,down}_proj, mlp.shared_expert_gate, mtp.{fc,layers.0.*,norm,pre_fc_norm_*}.
"""

from .table import ATTENTION_QKV, Architecture, fused_group

_DEC = r"model\.layers\.\d+\."

QWEN3_NEXT = Architecture(
    name="qwen3_next",
    model_types=("qwen3_next",),
    class_patterns=(
        ("mtp", r"mtp\..+"),
        ("experts", _DEC + r"mlp\.experts\.\d+\.(gate|up|down)_proj"),
        ("shared_expert", _DEC + r"mlp\.shared_expert\.(gate|up|down)_proj"),
        ("gdn", _DEC + r"linear_attn\.(in_proj_qkvz|in_proj_ba|out_proj)"),
        ("attention", _DEC + r"self_attn\.(q|k|v|o)_proj"),
    ),
    classes=("gdn", "attention", "shared_expert", "experts", "mtp"),
    fused_shards={
        **ATTENTION_QKV,
        **fused_group("shared_expert.gate_up_proj", ("shared_expert.gate_proj", "shared_expert.up_proj")),
    },
    vllm_packed_modules={
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
        "in_proj_qkvz": ("in_proj_qkvz",),
        "in_proj_ba": ("in_proj_ba",),
    },
    vllm_mtp_packed_modules={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
    vllm_prefix_map=(),
    vllm_never_quantized=r"lm_head|(mtp\.|model\.)(layers\.\d+\.)?(mlp\.gate|mlp\.shared_expert_gate|linear_attn\.conv1d)",
    embedding_pattern=r"model\.embed_tokens|mtp\.embed_tokens",
    expert_pattern=r"((?:mtp|model)\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)",
    fused_expert_pattern=r"((?:mtp|model)\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)",
    layer_pattern=r"((?:mtp|model)\.layers)\.(\d+)\.",
    decoder_roots=(("model.layers", "model.layers"), ("mtp.layers", "mtp.layers")),
    mtp_prefix="mtp.",
    mtp_layout="qwen3_next_mtp: fc over the normed embedding and hidden state, one Qwen3-Next decoder layer, norm",
    chat_stop_tokens=("<|im_end|>",),
    vllm_kernel_classes=(
        ("experts", r".*\.mlp\.experts(\..*)?$"),
        ("shared_expert", r".*\.mlp\.shared_expert\.(gate_up_proj|down_proj)$"),
        ("gdn", r".*\.linear_attn\.(in_proj_qkvz|in_proj_ba|out_proj)$"),
        ("attention", r".*\.self_attn\.(qkv_proj|o_proj)$"),
    ),
    shape_keys=(
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
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
    ),
    source="transformers 5.24 models/qwen3_next; vLLM 0.26.0 models/qwen3_next.py, qwen3_next_mtp.py",
)
