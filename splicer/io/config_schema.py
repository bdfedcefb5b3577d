"""The JSON types and ranges of every config.json field splicer reads, checked once when a checkpoint is opened.

Python reads JSON leniently: a string where a list belongs iterates as one-character entries, `null` where a number
belongs fails deep inside a stage, and transformers' strict config classes refuse wrong types only once the
ablate's base pass has begun. So every field inspect, splice and ablate read (and every field the torch backend hands
to transformers' Qwen3.5-MoE config) is checked here, from one table, before any stage runs: wrong types, numbers out
of range, and a few cross-field rules, each refused with one line naming the field, what it holds and the fix.

Fields that are absent are fine unless marked required: transformers fills in its defaults, and every reader in
splicer treats them as absent. `null` is accepted only where the table says so.

The fields of each quantization format are its module's `config_fields` (the tables below); checkpoint.check_config
looks the format up and checks them after the rest.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from ..errors import SplicerError

# JSON kinds, by the name messages use. bool is not an int here (Python's bool is), nor is 4.0.
KINDS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    # transformers' strict config types some fields `float` and refuses a JSON whole number there
    "float": lambda v: isinstance(v, float),
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
    # id2label: transformers turns every key into an int
    "labels": lambda v: (
        isinstance(v, dict) and all(re.fullmatch(r"-?[0-9]+", k) for k in v) and all(isinstance(x, str) for x in v.values())
    ),
}
_ITEM_WORDS = {
    "int": "whole numbers",
    "number": "numbers",
    "str": "strings",
    "bool": "booleans",
    "object": "tables",
}  # lists of objects are the plan's [[row]] and [[corpus]] arrays
_KIND_WORDS = {
    "int": "a whole number",
    "number": "a number",
    "float": "a number with a decimal point (e.g. 0.02)",
    "str": "a string",
    "bool": "true or false",
    "object": "an object",
    "list": "a list",
    "null": "null",
    "labels": 'an object of label names by whole-number id ({"0": "LABEL_0"})',
}

# Upper bounds: far above any released model, low enough that a typo cannot make the torch backend try to allocate
# petabytes (it builds the model from these dims before it compares them with the tensors).
DIM = 1 << 20
HEADS = 1 << 12
LAYERS = 1 << 12
EXPERTS = 1 << 14
VOCAB = 1 << 24
TOKEN = 1 << 31
DTYPE_NAMES = ("bfloat16", "float16", "float32", "float64", "half", "float", "double", "auto")
# transformers' ACT2FN and ROPE_INIT_FUNCTIONS (5.x): the names its Qwen3.5-MoE text model looks up when it is built.
ACTIVATIONS = (
    "gelu",
    "gelu_10",
    "gelu_accurate",
    "gelu_fast",
    "gelu_new",
    "gelu_python",
    "gelu_python_tanh",
    "gelu_pytorch_tanh",
    "hardswish",
    "laplace",
    "leaky_relu",
    "linear",
    "mish",
    "prelu",
    "quick_gelu",
    "relu",
    "relu2",
    "relu6",
    "sigmoid",
    "silu",
    "sqrtsoftplus",
    "swish",
    "tanh",
    "xielu",
)
ROPE_TYPES = ("default", "dynamic", "linear", "llama3", "longrope", "proportional", "yarn")


@dataclass(frozen=True)
class Field:
    """One config.json field: its path (`*` = every value of an object), JSON kinds, and constraints."""

    path: str
    kinds: tuple[str, ...]
    required: bool = False
    lo: float | None = None  # inclusive
    hi: float | None = None  # inclusive
    lo_open: bool = False  # lo itself excluded (eps > 0)
    choices: tuple | None = None  # allowed values (of the field, or of each list item)
    items: str | None = None  # kind of every list item


def F(path, kinds, **kw) -> Field:
    return Field(path, tuple(kinds.split("|")), **kw)


TOP = (
    F("model_type", "str", required=True),
    F("text_config", "object"),
    F("vision_config", "object|null"),
    F("quantization_config", "object|null"),
    F("tie_word_embeddings", "bool"),
    F("id2label", "labels"),
    F("label2id", "object"),
    F("dtype", "str|null", choices=DTYPE_NAMES),
    F("torch_dtype", "str|null", choices=DTYPE_NAMES),
    # transformers calls .to_dict() on these wherever they appear in a (sub-)config, and on a text_config nested in the
    # text config even when it is an object
    *(
        F(f"{sub}.{k}", "object|null")
        for sub in ("text_config", "vision_config")
        for k in ("quantization_config", "text_config", "vision_config")
        if (sub, k) != ("text_config", "text_config")
    ),
    F("text_config.text_config", "null"),
    *(F(k, "int", lo=0, hi=TOKEN) for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")),
)

# Read from text_config (or the top level when there is none): by splicer (inspect's decode bytes, validate_base,
# --layers, ablate's context and vocabulary) and by transformers' strict Qwen3_5MoeTextConfig in the torch backend.
TEXT = (
    F("hidden_size", "int", required=True, lo=1, hi=DIM),
    F("vocab_size", "int", required=True, lo=1, hi=VOCAB),
    F("num_hidden_layers", "int", required=True, lo=1, hi=LAYERS),
    F("num_experts", "int", lo=1, hi=EXPERTS),
    F("num_experts_per_tok", "int", lo=1, hi=EXPERTS),
    F("moe_intermediate_size", "int", lo=1, hi=DIM),
    F("shared_expert_intermediate_size", "int", lo=1, hi=DIM),
    F("max_position_embeddings", "int", lo=2, hi=TOKEN),
    F("num_attention_heads", "int", lo=1, hi=HEADS),
    F("num_key_value_heads", "int", lo=1, hi=HEADS),
    F("head_dim", "int", lo=1, hi=DIM),
    F("linear_num_key_heads", "int", lo=1, hi=HEADS),
    F("linear_num_value_heads", "int", lo=1, hi=HEADS),
    F("linear_key_head_dim", "int", lo=1, hi=DIM),
    F("linear_value_head_dim", "int", lo=1, hi=DIM),
    F("linear_conv_kernel_dim", "int", lo=1, hi=1024),
    F("mtp_num_hidden_layers", "int", lo=0, hi=LAYERS),
    F("full_attention_interval", "int", lo=1, hi=LAYERS),
    F("layer_types", "list|null", items="str", choices=("linear_attention", "full_attention")),
    F("hidden_act", "str", choices=ACTIVATIONS),
    F("rms_norm_eps", "float", lo=0, lo_open=True, hi=1),
    F("initializer_range", "float", lo=0),
    F("attention_bias", "bool"),
    F("attention_dropout", "number", lo=0, hi=1),
    F("use_cache", "bool"),
    F("tie_word_embeddings", "bool"),
    F("output_router_logits", "bool"),
    F("router_aux_loss_coef", "float"),
    F("bos_token_id", "int|null", lo=0, hi=TOKEN),
    F("pad_token_id", "int|null", lo=0, hi=TOKEN),
    F("eos_token_id", "int|list|null", items="int", lo=0, hi=TOKEN),
    F("id2label", "labels"),
    F("dtype", "str|null", choices=DTYPE_NAMES),
    F("rope_parameters", "object|null"),
    F("rope_parameters.rope_type", "str", choices=ROPE_TYPES),
    F("rope_parameters.rope_theta", "number", lo=0, lo_open=True, hi=1e18),
    F("rope_parameters.partial_rotary_factor", "number", lo=0, lo_open=True, hi=1),
    F("rope_parameters.mrope_section", "list", items="int", lo=0, hi=DIM),
    F("rope_parameters.mrope_interleaved", "bool"),
)

# transformers builds the vision config too (strictly typed) whenever the torch backend reads a checkpoint.
VISION = tuple(
    F(f"vision_config.{k}", "int", lo=1, hi=DIM)
    for k in (
        "depth",
        "hidden_size",
        "intermediate_size",
        "num_heads",
        "in_channels",
        "spatial_merge_size",
        "out_hidden_size",
        "num_position_embeddings",
    )
) + (
    F("vision_config.patch_size", "int|list", items="int", lo=1, hi=DIM),
    F("vision_config.temporal_patch_size", "int|list", items="int", lo=1, hi=DIM),
    F("vision_config.hidden_act", "str"),
    F("vision_config.initializer_range", "float", lo=0),
    F("vision_config.id2label", "labels"),
    F("vision_config.dtype", "str|null", choices=DTYPE_NAMES),
    F("vision_config.rope_parameters", "object|null"),
)

QC = "quantization_config"
QUANT = (F(f"{QC}.quant_method", "str", required=True),)
# The fields each quantization format's readers read (its module in splicer/formats/ names its table as config_fields).
# compressed-tensors: what its readers, its config edit and the torch backend's dequantizer read.
COMPRESSED_TENSORS = (
    F(f"{QC}.format", "str|null"),
    F(f"{QC}.config_groups", "object", required=True),
    F(f"{QC}.config_groups.*", "object"),
    F(f"{QC}.config_groups.*.targets", "list", required=True, items="str"),
    F(f"{QC}.config_groups.*.format", "str|null"),
    F(f"{QC}.config_groups.*.weights", "object|null"),
    F(f"{QC}.config_groups.*.weights.num_bits", "int", required=True, lo=1, hi=8),
    F(f"{QC}.config_groups.*.weights.group_size", "int|null", lo=1, hi=DIM),
    F(f"{QC}.config_groups.*.weights.strategy", "str|null"),
    F(f"{QC}.config_groups.*.weights.type", "str|null"),
    F(f"{QC}.config_groups.*.weights.symmetric", "bool|null"),
    F(f"{QC}.config_groups.*.weights.dynamic", "bool|str|null"),
    F(f"{QC}.config_groups.*.weights.actorder", "bool|str|null"),
    F(f"{QC}.config_groups.*.input_activations", "object|null"),
    F(f"{QC}.config_groups.*.output_activations", "object|null"),
    F(f"{QC}.ignore", "list|null", items="str"),
    F(f"{QC}.kv_cache_scheme", "object|null"),
    F(f"{QC}.sparsity_config", "object|null"),
    F(f"{QC}.transform_config", "object|null"),
    F(f"{QC}.quantization_status", "str|null"),
    F(f"{QC}.version", "str|null"),
)

# GPTQ (GPTQModel / AutoGPTQ v1): what the GPTQ readers and its config edit read.
GPTQ = (
    F(f"{QC}.bits", "int", required=True, choices=(2, 3, 4, 8)),
    F(f"{QC}.group_size", "int", lo=-1, hi=DIM),  # -1: one group per input row (0 is refused below)
    F(f"{QC}.desc_act", "bool"),
    F(f"{QC}.sym", "bool"),
    F(f"{QC}.lm_head", "bool"),
    F(f"{QC}.dynamic", "object|null"),
    F(f"{QC}.dynamic.*", "object"),
    F(f"{QC}.modules_in_block_to_quantize", "list|null"),  # vLLM reads it instead of scanning the checkpoint
    F(f"{QC}.checkpoint_format", "str"),
    F(f"{QC}.true_sequential", "bool"),
    F(f"{QC}.static_groups", "bool"),
    F(f"{QC}.damp_percent", "number", lo=0, hi=1),
    F(f"{QC}.pack_dtype", "str"),
)

_MISSING = MISSING = object()  # a key that is absent (JSON null is None)


def describe(value) -> str:
    """What a value is, for a message: its JSON kind and, shortened, the value itself (one line)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    kind = next((k for k in ("int", "number", "str", "object", "list") if KINDS[k](value)), None)
    text = json.dumps(value, ensure_ascii=True, default=str)
    if kind is None:  # a TOML date or time
        return f"a {type(value).__name__} ({text[:40]})"
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{_KIND_WORDS[kind]} ({text})" if kind in ("str", "object", "list") else text


def _wanted(f: Field) -> str:
    """What a field should hold, in words: each kind with its range, null last."""
    rng = _range_words(f)
    if f.choices and not f.items:
        listed = ", ".join(json.dumps(c) for c in f.choices)
        return (listed if len(f.choices) == 1 else f"one of {listed}") + (" or null" if "null" in f.kinds else "")
    parts = []
    for k in f.kinds:
        if k == "list":
            parts.append(
                f"a list of {_ITEM_WORDS[f.items]}"
                + (f" {rng}" if rng and f.items in ("int", "number") else "")
                + (f" (each one of {', '.join(f.choices)})" if f.choices else "")
            )
        elif k != "null":
            parts.append(_KIND_WORDS[k] + (f" {rng}" if rng and k in ("int", "number", "float") else ""))
    return " or ".join(parts + (["null"] if "null" in f.kinds else []))


def _num(x) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _range_words(f: Field) -> str:
    if f.lo is not None and f.hi is not None:
        return f"in {'(' if f.lo_open else '['}{_num(f.lo)}, {_num(f.hi)}]"
    if f.lo is not None:
        return f"{'>' if f.lo_open else '>='} {_num(f.lo)}"
    if f.hi is not None:
        return f"<= {_num(f.hi)}"
    return ""


def _in_range(f: Field, v) -> bool:
    if f.lo is not None and (v < f.lo or (f.lo_open and v == f.lo)):
        return False
    if f.hi is not None and v > f.hi:
        return False
    return math.isfinite(v)  # JSON has no NaN or Infinity, but Python's json reads them


def path_key(k: str) -> str:
    """An object key as a dotted path names it: quoted as JSON unless it is a plain word."""
    return k if k.replace("_", "").replace("-", "").isalnum() and k.isascii() else json.dumps(k)


def _resolve(root, parts: list[str], prefix: str):
    """(dotted path, value) for every place a path with `*` reaches; a missing last key gives _MISSING."""
    if not parts:
        yield prefix, root
        return
    if not isinstance(root, dict):
        return  # the parent's own row reports its wrong type
    head, rest = parts[0], parts[1:]
    if head == "*":
        for k, v in root.items():
            yield from _resolve(v, rest, f"{prefix}.{path_key(k)}" if prefix else path_key(k))
    elif head in root:
        yield from _resolve(root[head], rest, f"{prefix}.{head}" if prefix else head)
    elif not rest:
        yield (f"{prefix}.{head}" if prefix else head), _MISSING


CONFIG_FIX = "fix config.json or restore it from the original checkpoint"


def check_value(f: Field, value, where: str, subject: str, fix: str) -> None:
    """Refuse value (of `subject`, e.g. "config.json field text_config.hidden_size") unless it is of f's kinds and in
    its range and choices; _MISSING refuses only a required field."""

    def refuse(found: str) -> None:
        raise SplicerError(f"{where}: {subject} is {found}, but it should be {_wanted(f)}; {fix}")

    if value is _MISSING:
        if f.required:
            raise SplicerError(f"{where}: {subject} is missing ({_wanted(f)}); {fix}")
        return
    kind = next((k for k in f.kinds if KINDS[k](value)), None)
    if kind is None or (kind == "list" and f.items and not all(KINDS[f.items](x) for x in value)):
        bad = next((x for x in value if not KINDS[f.items](x)), None) if kind == "list" else None
        refuse(describe(value) if kind != "list" else f"a list holding {describe(bad)}")
    values = value if kind == "list" else [value]
    if kind in ("int", "number", "float") or (kind == "list" and f.items in ("int", "number")):
        for v in values:
            if not _in_range(f, v):
                refuse(describe(v) if kind != "list" else f"a list holding {describe(v)}")
    if f.choices is not None and kind != "null":
        for v in values:
            if v not in f.choices:
                refuse(describe(v) if kind != "list" else f"a list holding {describe(v)}")


def expect(kinds: str, **kw) -> Field:
    """A Field for a value that has no config.json path (plan and corpus values)."""
    return F("", kinds, **kw)


def check_fields(config: dict, fields, where: str, prefix: str = "") -> None:
    for f in fields:
        for path, value in _resolve(config, f.path.split("."), prefix):
            check_value(f, value, where, f"config.json field {path}", CONFIG_FIX)


def check_common_fields(config: dict, label: str) -> None:
    """Refuse a config.json whose fields other than its quantization format's (checkpoint.check_config checks those,
    through the format's config_fields) have another JSON type or range than splicer and its readers expect."""
    where = label
    check_fields(config, TOP, where)
    check_fields(config, VISION, where)
    text, prefix = (config["text_config"], "text_config") if "text_config" in config else (config, "")
    check_fields(text, TEXT, where, prefix)
    _text_rules(text, where, prefix + "." if prefix else "")
    qc = config.get(QC)
    if qc is None:
        return
    check_fields(config, QUANT, where)


def _text_rules(text: dict, where: str, p: str) -> None:
    """Rules across fields: each would otherwise fail inside the model (top-k routing, grouped attention heads)."""

    def refuse(problem: str) -> None:
        raise SplicerError(f"{where}: config.json {problem}; fix config.json or restore it from the original checkpoint")

    n = text["num_hidden_layers"]
    types = text.get("layer_types")
    if isinstance(types, list) and len(types) != n:
        refuse(f"{p}layer_types lists {len(types)} layers but {p}num_hidden_layers is {n}")
    pad = text.get("pad_token_id")
    if pad is not None and pad >= text["vocab_size"]:  # the embedding's padding row must exist
        refuse(f"{p}pad_token_id is {pad}, outside the vocabulary of {text['vocab_size']}")
    k, e = text.get("num_experts_per_tok"), text.get("num_experts")
    if k is not None and e is not None and k > e:
        refuse(f"{p}num_experts_per_tok is {k}, more than {p}num_experts ({e})")
    for heads, groups in (("num_attention_heads", "num_key_value_heads"), ("linear_num_value_heads", "linear_num_key_heads")):
        a, b = text.get(heads), text.get(groups)
        if a is not None and b is not None and a % b:
            refuse(f"{p}{heads} ({a}) is not a multiple of {p}{groups} ({b})")


__all__ = [
    "check_common_fields",
    "check_fields",
    "check_value",
    "describe",
    "expect",
    "Field",
    "F",
    "KINDS",
    "MISSING",
    "path_key",
]
