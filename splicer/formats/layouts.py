"""Storage layouts of quantized modules: which tensors a quantized Linear is stored as, in each format splicer reads
(the formats themselves, one module per quantization_config dialect, are this package's other modules).

One table, as the architecture tables are for names: everything else asks it which tensors belong to a quantized
module (and are dropped when it is restored), which tensor marks a module as quantized, and how to read a module's
shape and scheme from the tensor headers alone. Sources: compressed-tensors 0.17 `compressors/*/base.py`
(`compression_param_names`), AutoGPTQ / GPTQModel v1, vLLM 0.26 `layers/quantization/fp8.py` and `auto_awq.py`, and
the shared formats fact sheet (its section numbers are cited below).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import SplicerError
from .module import Module

# Stored dtypes of a quantized module's `weight` in the formats that keep that name (FP8, INT8): a BF16 `weight` beside
# them would be a corrupt module.
QUANTIZED_WEIGHT_DTYPES = ("F8_E4M3", "F8_E5M2", "I8")


@dataclass(frozen=True)
class Layout:
    """How one quantized module is stored in one format."""

    name: str
    quant_method: str  # config.json quantization_config.quant_method of checkpoints that use it
    anchor: str  # the tensor every quantized module of this layout has; the restored weight goes into its shard
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    formats: tuple[str, ...] = ()  # compressed-tensors `format` values stored this way
    # what a module's tensors show it is stored as, in the words of the message for a config that says otherwise
    stored_as: str = field(kw_only=True)
    # its Module, shape, bits, group size and scheme read from the tensors' headers (and, for compressed-tensors'
    # weight_shape, a few bytes), refused in one line when they do not fit together
    read: Callable[[StoredModule, Layout], Module] = field(kw_only=True)

    @property
    def suffixes(self) -> tuple[str, ...]:
        return self.required + self.optional


@dataclass(frozen=True)
class StoredModule:
    """One quantized module's tensors as a checkpoint stores them, with what reading its shape needs."""

    label: str  # the checkpoint, for messages
    name: str
    cls: str  # its module class (the architecture table's)
    packed: dict  # suffix -> TensorInfo: the quantized module's tensors (an FP8/INT8 `weight` among them)
    plain: dict  # suffix -> TensorInfo: weight, bias
    read_bytes: Callable  # TensorInfo -> its bytes: the integer pair compressed-tensors stores a shape in
    config_block: Callable[[], tuple[int, int] | None]  # the one FP8 block size the config states (registry.config_block)

    def module(self, **fields) -> Module:
        return Module(self.name, self.cls, packed=self.packed, plain=self.plain, **fields)


def _gptq_module(s: StoredModule, layout: Layout) -> Module:
    """Shape, bits and group size of a GPTQ module from its tensors' shapes alone (its tensors checked by the caller)."""
    qw, qz, sc = s.packed["qweight"], s.packed["qzeros"], s.packed["scales"]
    if (
        any(len(t.shape) != 2 for t in (qw, qz, sc))
        or qw.shape[1] != sc.shape[1]
        or qz.shape[0] != sc.shape[0]
        or sc.shape[1] == 0
    ):
        raise SplicerError(f"{s.label}: {s.name} has GPTQ tensors of inconsistent shapes; the build is corrupt")
    out_f = sc.shape[1]
    bits = qz.shape[1] * 32 // out_f if qz.shape[1] * 32 % out_f == 0 else None
    in_f = qw.shape[0] * 32 // bits if bits else None
    group = in_f // sc.shape[0] if in_f and in_f % sc.shape[0] == 0 else None
    if not bits or not in_f:
        raise SplicerError(f"{s.label}: {s.name}: cannot infer the bit width from qzeros {list(qz.shape)}; the build is corrupt")
    return s.module(shape=(out_f, in_f), bits=bits, group_size=group)


def _awq_module(s: StoredModule, layout: Layout) -> Module:
    """AutoAWQ GEMM: qweight [K, N/8], qzeros [K/g, N/8], scales [K/g, N] (4-bit only)."""
    qw, qz, sc = s.packed["qweight"], s.packed["qzeros"], s.packed["scales"]
    if (
        any(len(t.shape) != 2 for t in (qw, qz, sc))
        or sc.shape[1] != qw.shape[1] * 8
        or qz.shape != (sc.shape[0], qw.shape[1])
        or sc.shape[0] == 0
        or qw.shape[0] % sc.shape[0]
    ):
        raise SplicerError(f"{s.label}: {s.name} has AWQ tensors of inconsistent shapes; the build is corrupt")
    out_f, in_f = sc.shape[1], qw.shape[0]
    return s.module(shape=(out_f, in_f), bits=4, group_size=in_f // sc.shape[0])


def _ct_pack_module(s: StoredModule, layout: Layout) -> Module:
    ws = s.packed["weight_shape"]
    if ws.dtype not in ("I64", "I32") or ws.shape != (2,):
        raise SplicerError(
            f"{s.label}: {s.name}.weight_shape is {ws.dtype}{list(ws.shape)}, not an integer pair; the build is corrupt"
        )
    fmt = "<2q" if ws.dtype == "I64" else "<2i"
    out_f, in_f = struct.unpack(fmt, s.read_bytes(ws))
    pk, sc = s.packed["weight_packed"], s.packed["weight_scale"]
    if len(pk.shape) != 2 or len(sc.shape) != 2 or pk.shape[0] != out_f or in_f <= 0 or sc.shape[1] == 0:
        raise SplicerError(
            f"{s.label}: {s.name} has packed tensors that do not fit weight_shape {[out_f, in_f]}; the build is corrupt"
        )
    bits = pk.shape[1] * 32 // in_f if pk.shape[1] * 32 % in_f == 0 else None
    group = in_f // sc.shape[1] if in_f % sc.shape[1] == 0 else None
    return s.module(shape=(out_f, in_f), bits=bits, group_size=group)


def _nvfp4_module(s: StoredModule, layout: Layout) -> Module:
    """NVFP4: weight_packed uint8 [N, K/2] (two e2m1 values a byte), weight_scale fp8 [N, K/16], weight_global_scale [1]."""
    pk, sc = s.packed["weight_packed"], s.packed["weight_scale"]
    if pk.dtype != "U8" or len(pk.shape) != 2 or len(sc.shape) != 2 or sc.shape[0] != pk.shape[0] or sc.shape[1] == 0:
        raise SplicerError(f"{s.label}: {s.name} has NVFP4 tensors of inconsistent shapes or dtypes; the build is corrupt")
    out_f, in_f = pk.shape[0], pk.shape[1] * 2
    group = in_f // sc.shape[1] if in_f % sc.shape[1] == 0 else None
    return s.module(shape=(out_f, in_f), bits=4, group_size=group, scheme=f"nvfp4 g{group}")


def _weight_scale_module(s: StoredModule, layout: Layout) -> Module:
    """FP8 or INT8 values under `weight` [N, K] with a per-tensor, per-channel or block scale."""
    w = s.packed["weight"]
    scale = s.packed.get("weight_scale_inv") or s.packed.get("weight_scale")
    if len(w.shape) != 2 or scale is None:
        names = " or ".join(n for n in ("weight_scale_inv", "weight_scale") if n in layout.suffixes)
        raise SplicerError(f"{s.label}: {s.name} has an {w.dtype} weight {list(w.shape)} without a {names}; the build is corrupt")
    strategy = weight_scale_strategy(tuple(w.shape), tuple(scale.shape), s.config_block())
    if strategy == "unknown":
        raise SplicerError(
            f"{s.label}: {s.name}'s scale {list(scale.shape)} fits no tensor, channel or block layout of its "
            f"weight {list(w.shape)}; the build is corrupt"
        )
    kind = "int8" if w.dtype == "I8" else "fp8"
    return s.module(shape=tuple(w.shape), bits=8, group_size=None, scheme=f"{kind} {strategy}")


LAYOUTS = (
    # compressed-tensors pack-quantized (W4A16, W8A16): int32 words packed along K, weight_shape [2] (fact sheet §4).
    Layout(
        "ct-pack",
        "compressed-tensors",
        "weight_packed",
        ("weight_packed", "weight_scale", "weight_shape"),
        ("weight_zero_point", "weight_g_idx"),
        ("pack-quantized",),
        stored_as="compressed-tensors pack-quantized",
        read=_ct_pack_module,
    ),
    # compressed-tensors NVFP4: uint8 [N, K/2] e2m1 pairs, fp8 group scales [N, K/16], fp32 global scale (§3).
    Layout(
        "ct-nvfp4",
        "compressed-tensors",
        "weight_packed",
        ("weight_packed", "weight_scale", "weight_global_scale"),
        ("weight_zero_point", "input_global_scale"),
        ("nvfp4-pack-quantized",),
        stored_as="NVFP4",
        read=_nvfp4_module,
    ),
    # compressed-tensors float-quantized (FP8 W8A8) and int-quantized (INT8 W8A8): the quantized values keep the name
    # `weight` (fp8 or int8), scales per tensor [1], channel [N, 1] or 128x128 block (§1, §4).
    Layout(
        "ct-float",
        "compressed-tensors",
        "weight",
        ("weight", "weight_scale"),
        ("weight_zero_point", "input_scale", "input_zero_point"),
        ("float-quantized", "naive-quantized"),
        stored_as="FP8",
        read=_weight_scale_module,
    ),
    Layout(
        "ct-int",
        "compressed-tensors",
        "weight",
        ("weight", "weight_scale"),
        ("weight_zero_point", "input_scale", "input_zero_point"),
        ("int-quantized", "naive-quantized"),
        stored_as="INT8",
        read=_weight_scale_module,
    ),
    # GPTQ v1: qweight [K*b/32, N] packed along K, qzeros [K/g, N*b/32], scales [K/g, N], g_idx [K].
    Layout("gptq", "gptq", "qweight", ("qweight", "qzeros", "scales"), ("g_idx",), stored_as="GPTQ or AWQ", read=_gptq_module),
    # AutoAWQ GEMM: qweight [K, N/8] packed along N in AWQ's interleaved order, qzeros [K/g, N/8], scales [K/g, N] (§5).
    Layout("awq", "awq", "qweight", ("qweight", "qzeros", "scales"), stored_as="GPTQ or AWQ", read=_awq_module),
    # Native FP8 (DeepSeek-V3, Qwen *-FP8: quant_method fp8): fp8 weight with a 128x128 block `weight_scale_inv`
    # (a multiplier despite its name), or per-tensor `weight_scale` plus `input_scale` when activations are static (§2).
    Layout(
        "fp8",
        "fp8",
        "weight",
        ("weight",),
        ("weight_scale_inv", "weight_scale", "input_scale"),
        stored_as="FP8",
        read=_weight_scale_module,
    ),
    # FBGEMM FP8 (Meta's Llama 3.1 405B FP8: quant_method fbgemm_fp8): fp8 weight with a float32 per-channel
    # `weight_scale` [N, 1]; activations are scaled dynamically under the config's activation_scale_ub.
    Layout("fbgemm-fp8", "fbgemm_fp8", "weight", ("weight", "weight_scale"), stored_as="FP8", read=_weight_scale_module),
)
LAYOUT = {layout.name: layout for layout in LAYOUTS}
# The layout of a quantized `weight` under each quant_method other than compressed-tensors (whose dtype says int or fp).
WEIGHT_LAYOUT = {
    layout.quant_method: layout for layout in LAYOUTS if layout.anchor == "weight" and layout.quant_method != "compressed-tensors"
}
# quant_method values whose layouts this table holds (a checkpoint of another method is read best effort, or refused
# where reading matters: see registry.unreadable)
READ_QUANT_METHODS = tuple(dict.fromkeys(layout.quant_method for layout in LAYOUTS))

# compressed-tensors formats splicer reads (a config group's own `format`, else the top-level one).
CT_FORMATS = tuple(dict.fromkeys(f for layout in LAYOUTS if layout.quant_method == "compressed-tensors" for f in layout.formats))

# Every tensor name ending that belongs to a quantized module (besides `weight`, which FP8/INT8 formats keep).
QUANT_SUFFIXES = tuple(sorted({s for layout in LAYOUTS for s in layout.suffixes} - {"weight"}))
PLAIN_SUFFIXES = ("weight", "bias")


def is_packed_tensor(name: str) -> bool:
    """A tensor only a quantized module stores (qweight, weight_packed, scales...), by its name's last part."""
    return name.rsplit(".", 1)[-1] in QUANT_SUFFIXES


def layout_method(quant_method: str | None) -> str:
    """A config's quant_method as the layouts name it: vLLM maps awq, awq_marlin and auto_awq to one AWQ loader
    (auto_awq.py)."""
    method = str(quant_method or "")
    return "awq" if method.startswith(("awq", "auto_awq")) else method


def layout_for(quant_method: str | None, tensors: dict) -> Layout | None:
    """The layout of one module from its tensors (suffix -> TensorInfo) and the checkpoint's quant_method."""
    if "qweight" in tensors:
        return LAYOUT["awq" if layout_method(quant_method) == "awq" else "gptq"]
    if "weight_packed" in tensors:
        return LAYOUT["ct-nvfp4" if "weight_global_scale" in tensors else "ct-pack"]
    w = tensors.get("weight")
    if w is not None and w.dtype in QUANTIZED_WEIGHT_DTYPES:
        if quant_method in WEIGHT_LAYOUT:
            return WEIGHT_LAYOUT[quant_method]
        return LAYOUT["ct-int" if w.dtype == "I8" else "ct-float"]
    return None


def _block_side(dim: int, blocks: int) -> int | None:
    """The block length that splits `dim` into `blocks` blocks, the last one possibly short (a power of two, as every
    shipped block size is: 128 for DeepSeek-V3 and Qwen FP8)."""
    b = 1
    while b <= max(dim, 1) * 2:
        if math.ceil(dim / b) == blocks:
            return b
        b *= 2
    return None


def weight_scale_strategy(shape: tuple[int, int], scale_shape: tuple[int, ...], block: tuple[int, int] | None = None) -> str:
    """fp8/int8 `weight` scale layout from shapes: tensor, channel, or blockBHxBW (fact sheet §1). block: the block size
    the checkpoint's config states, taken when the scale has ceil(N/BH) x ceil(K/BW) entries; a dimension of one block
    (N or K up to the block size, e.g. a GDN in_proj_b of a few heads) says nothing about the block size by itself."""
    n, k = shape
    if block and len(scale_shape) == 2 and tuple(scale_shape) == (math.ceil(n / block[0]), math.ceil(k / block[1])):
        return f"block{block[0]}x{block[1]}"
    if math.prod(scale_shape) == 1:
        return "tensor"
    if tuple(scale_shape) == (n, 1):
        return "channel"
    if len(scale_shape) == 2:
        bh, bw = _block_side(n, scale_shape[0]), _block_side(k, scale_shape[1])
        if bh and bw:
            return f"block{bh}x{bw}"
    return "unknown"


def scheme_label_from_args(fmt: str | None, weights: dict, in_features: int | None = None) -> str:
    """What a compressed-tensors group's weight args say a module is stored as, in the words of `Module.scheme`
    (in_features: the module's K, which a packed per-channel scale cannot be told apart from one group of)."""
    t, bits = weights.get("type") or "int", weights.get("num_bits")
    strategy = str(weights.get("strategy") or ("group" if weights.get("group_size") else "channel"))
    if fmt == "pack-quantized" and strategy == "channel" and in_features:
        return f"int{bits} g{in_features}"
    if strategy in ("group", "tensor_group"):
        kind = "nvfp" if t == "float" else "int"
        return f"{kind}{bits} g{weights.get('group_size')}"
    if strategy == "block":
        bh, bw = weights.get("block_structure") or (None, None)
        return f"{'fp' if t == 'float' else 'int'}{bits} block{bh}x{bw}"
    return f"{'fp' if t == 'float' else 'int'}{bits} {strategy}"


def group_format(qc: dict, group: dict) -> str | None:
    """A compressed-tensors config group's format: its own, else the config's (vLLM reads them so, fact sheet R3)."""
    return group.get("format") or qc.get("format")


def group_scheme(qc: dict, group_name: str, in_features: int | None = None) -> str:
    """What config group `group_name` says its modules are stored as, in the words of `Module.scheme`."""
    group = qc["config_groups"][group_name]
    return scheme_label_from_args(group_format(qc, group), group.get("weights") or {}, in_features)
