"""Dense decoders sharing one layout: Llama (`llama`), Qwen3 (`qwen3`), Mistral (`mistral`).

Sources: transformers 5.24 `models/{llama,qwen3,mistral}` (names and shapes; Qwen3 adds self_attn.{q,k}_norm); vLLM
0.26.0 `model_executor/models/llama.py`, `qwen3.py`, `mistral.py` (read, and loaded on the H200: results/gpu-families/
calls 1-2; shared design notes, families §3): packed_modules_mapping {"qkv_proj": [q, k, v], "gate_up_proj": [gate,
up]}, stacked-only mappers (no renames of `ignore`), MistralForCausalLM a subclass of LlamaForCausalLM. Mistral's
consolidated format (`--load-format mistral`, wq/wk/w1 names) is not covered.

On disk: model.layers.{i}.self_attn.{q,k,v,o}_proj, model.layers.{i}.mlp.{gate,up,down}_proj, model.embed_tokens,
model.norm, lm_head (absent when tied to the embedding).
"""

from .table import ATTENTION_QKV, MLP_GATE_UP, Architecture, model_layers_layout

_DEC = r"model\.layers\.\d+\."

DENSE = Architecture(
    name="dense",
    model_types=("llama", "qwen3", "mistral"),
    class_patterns=(
        ("lm_head", r"lm_head"),
        ("attention", _DEC + r"self_attn\.(q|k|v|o)_proj"),
        ("mlp", _DEC + r"mlp\.(gate|up|down)_proj"),
    ),
    classes=("attention", "mlp", "lm_head"),
    fused_shards={**ATTENTION_QKV, **MLP_GATE_UP},
    vllm_packed_modules={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
    vllm_mtp_packed_modules={},
    vllm_prefix_map=(),
    vllm_never_quantized=r"(?!)",
    **model_layers_layout(routed_experts=False),
    chat_stop_tokens=("<|im_end|>", "<|eot_id|>", "</s>"),  # Qwen's, Llama 3's and Mistral's end of turn
    vllm_kernel_classes=(
        ("lm_head", r"lm_head$"),
        ("attention", r".*\.self_attn\.(qkv_proj|o_proj)$"),
        ("mlp", r".*\.mlp\.(gate_up_proj|down_proj)$"),
    ),
    shape_keys=("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"),
    source="transformers 5.24 models/llama, qwen3, mistral; vLLM 0.26.0 models/llama.py, qwen3.py, mistral.py",
)
