"""GLM-4.5 / 4.6 (`glm4_moe`, `Glm4MoeForCausalLM`): first layers dense, routed and shared experts, q/k/v biases.

Sources: transformers 5.24 `models/glm4_moe` (names and shapes: the fixture builds the model on the meta device); vLLM
0.26.0 `model_executor/models/glm4_moe.py`, `glm4_moe_mtp.py` (read, and loaded on the H200: results/gpu-families/
calls 2-4; shared design notes, families §5): packed_modules_mapping {"qkv_proj": [q, k, v], "gate_up_proj": [gate,
up]}, a stacked-only mapper (no renames), the router `mlp.gate` a plain fp32 nn.Linear (never quantized), MoE layers
from `first_k_dense_replace` on.

On disk: model.layers.{i}.self_attn.{q,k,v}_proj (+ .bias when attention_bias), o_proj, {q,k}_norm (use_qk_norm);
model.layers.{i}.mlp.{gate,up,down}_proj for i < first_k_dense_replace (class mlp), then mlp.experts.{e}.*,
mlp.shared_experts.{gate,up,down}_proj (class shared_expert), mlp.gate (+ e_score_correction_bias).

The MTP layer (model.layers.{num_hidden_layers}.*, which transformers drops on load) is class mtp, as for
deepseek_v3: same binding, eh_proj never quantized (seen at load with speculative decoding, results/gpu-families/
call 4), and the drafter's head replaced by the target's lm_head (v1/spec_decode/llm_base_proposer.py).
"""

from .table import ATTENTION_QKV, MLP_GATE_UP, Architecture, fused_group, model_layers_layout

_DEC = r"model\.layers\.\d+\."
MAIN_PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

GLM4_MOE = Architecture(
    name="glm4_moe",
    model_types=("glm4_moe",),
    class_patterns=(
        ("lm_head", r"lm_head"),
        ("experts", _DEC + r"mlp\.experts\.\d+\.(gate|up|down)_proj"),
        ("shared_expert", _DEC + r"mlp\.shared_experts\.(gate|up|down)_proj"),
        ("attention", _DEC + r"self_attn\.(q|k|v|o)_proj"),
        ("mlp", _DEC + r"mlp\.(gate|up|down)_proj"),
    ),
    classes=("attention", "mlp", "shared_expert", "lm_head", "experts", "mtp"),
    fused_shards={
        **ATTENTION_QKV,
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
    # GLM-4.5 ends a turn with these (its generation_config lists them as eos; recalled, not checked against a download)
    chat_stop_tokens=("<|user|>", "<|observation|>", "<|endoftext|>"),
    vllm_kernel_classes=(
        ("lm_head", r"lm_head$"),
        ("experts", r".*\.mlp\.experts(\..*)?$"),
        ("shared_expert", r".*\.mlp\.shared_experts\.(gate_up_proj|down_proj)$"),
        ("attention", r".*\.self_attn\.(qkv_proj|o_proj)$"),
        ("mlp", r".*\.mlp\.(gate_up_proj|down_proj)$"),
    ),
    shape_keys=(
        "n_routed_experts",
        "n_shared_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "first_k_dense_replace",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "attention_bias",
    ),
    source="transformers 5.24 models/glm4_moe; vLLM 0.26.0 models/glm4_moe.py, glm4_moe_mtp.py",
)
