"""From tensor names to modules: which modules a checkpoint holds, quantized or not, and their shapes."""

from __future__ import annotations

import struct
from collections import defaultdict

from ..errors import SplicerError
from ..formats.layouts import (
    PLAIN_SUFFIXES,
    QUANT_SUFFIXES,
    QUANTIZED_WEIGHT_DTYPES,
    READ_QUANT_METHODS,
    layout_for,
    layout_method,
    weight_scale_strategy,
)
from ..formats.module import Module
from ..formats.registry import config_block
from ..io.checkpoint import Checkpoint
from ..io.safetensors_io import DTYPE_SIZES, ByteSource, TensorInfo


class _SmallReader:
    """Reads many tiny tensors (weight_shape) without reopening files each time."""

    def __init__(self):
        self.files = {}

    def read(self, info: TensorInfo) -> bytes:
        f = self.files.get(info.path)
        if f is None:
            f = self.files[info.path] = open(info.path, "rb")
        f.seek(info.start)
        return f.read(info.nbytes)

    def close(self):
        for f in self.files.values():
            f.close()


def list_modules(ckpt: Checkpoint) -> dict[str, Module]:
    """Every module with a 2-D weight or packed tensors; fused base experts split per expert."""
    arch = ckpt.arch
    groups: dict[str, dict[str, TensorInfo]] = defaultdict(dict)
    fused: list[TensorInfo] = []
    for hdr in ckpt.headers.values():
        for name, info in hdr.tensors.items():
            if arch.fused_expert_parts(name):
                fused.append(info)
                continue
            module, _, suffix = name.rpartition(".")
            if suffix in QUANT_SUFFIXES or suffix in PLAIN_SUFFIXES:
                groups[module][suffix] = info
    modules: dict[str, Module] = {}
    reader = _SmallReader()
    try:
        for name, tensors in groups.items():
            packed = {k: v for k, v in tensors.items() if k in QUANT_SUFFIXES}
            plain = {k: v for k, v in tensors.items() if k in PLAIN_SUFFIXES}
            if "weight" in plain and plain["weight"].dtype in QUANTIZED_WEIGHT_DTYPES:
                packed["weight"] = plain.pop("weight")  # FP8 / INT8 formats keep the quantized values under `weight`
            if packed:
                if "weight" in plain:
                    # A restore would add a second `weight` beside this one: the output shard would name it twice.
                    raise SplicerError(
                        f"{ckpt.label}: module {name} holds both packed tensors ({sorted(packed)[0]}) and an "
                        "unquantized weight; the build is corrupt, re-export it"
                    )
                modules[name] = _packed_module(ckpt, name, packed, plain, reader)
            elif "weight" in plain and len(plain["weight"].shape) == 2:
                modules[name] = Module(name, arch.module_class(name), plain=plain, shape=tuple(plain["weight"].shape))
    finally:
        reader.close()
    for info in fused:
        for m in _split_fused_experts(ckpt, info):
            modules[m.name] = m
    return modules


def _gptq_module(ckpt: Checkpoint, name: str, packed: dict, plain: dict) -> Module:
    """Shape, bits and group size of a GPTQ module from its tensors' shapes alone (its tensors checked by the caller)."""
    qw, qz, sc = packed["qweight"], packed["qzeros"], packed["scales"]
    if (
        any(len(t.shape) != 2 for t in (qw, qz, sc))
        or qw.shape[1] != sc.shape[1]
        or qz.shape[0] != sc.shape[0]
        or sc.shape[1] == 0
    ):
        raise SplicerError(f"{ckpt.label}: {name} has GPTQ tensors of inconsistent shapes; the build is corrupt")
    out_f = sc.shape[1]
    bits = qz.shape[1] * 32 // out_f if qz.shape[1] * 32 % out_f == 0 else None
    in_f = qw.shape[0] * 32 // bits if bits else None
    group = in_f // sc.shape[0] if in_f and in_f % sc.shape[0] == 0 else None
    if not bits or not in_f:
        raise SplicerError(f"{ckpt.label}: {name}: cannot infer the bit width from qzeros {list(qz.shape)}; the build is corrupt")
    return Module(
        name, ckpt.arch.module_class(name), packed=packed, plain=plain, shape=(out_f, in_f), bits=bits, group_size=group
    )


def _packed_module(ckpt: Checkpoint, name: str, packed: dict, plain: dict, reader: _SmallReader) -> Module:
    qc = ckpt.quantization_config or {}
    layout = layout_for(qc.get("quant_method"), packed)
    if layout is None:
        raise SplicerError(
            f"{ckpt.label}: module {name} has {sorted(packed)} but no quantized weight (weight_packed, qweight, "
            "or an fp8/int8 weight); the build is incomplete, re-export it"
        )
    method = str(qc.get("quant_method") or "")
    said = layout_method(method)
    if said in READ_QUANT_METHODS and layout.quant_method != said:
        stored = {
            "gptq": "GPTQ or AWQ",
            "awq": "GPTQ or AWQ",
            "ct-pack": "compressed-tensors pack-quantized",
            "ct-nvfp4": "NVFP4",
            "ct-int": "INT8",
        }.get(layout.name, "FP8")
        raise SplicerError(
            f"{ckpt.label}: module {name} is stored as {stored} ({', '.join(sorted(packed))}) but config.json "
            f"says quant_method {method!r}; the config does not belong to these shards"
        )
    for needed in layout.required:
        if needed not in packed:
            raise SplicerError(
                f"{ckpt.label}: module {name} has {sorted(packed)} but no {needed}; the build is incomplete, re-export it"
            )
    stray = sorted(set(packed) - set(layout.suffixes))
    if stray:
        raise SplicerError(
            f"{ckpt.label}: module {name} is stored as {layout.name} but also has {stray[0]}; "
            "the build mixes formats in one module, re-export it"
        )
    if layout.name == "gptq":
        m = _gptq_module(ckpt, name, packed, plain)
    elif layout.name == "awq":
        m = _awq_module(ckpt, name, packed, plain)
    elif layout.name == "ct-pack":
        m = _ct_pack_module(ckpt, name, packed, plain, reader)
    elif layout.name == "ct-nvfp4":
        m = _nvfp4_module(ckpt, name, packed, plain)
    else:
        m = _weight_scale_module(ckpt, name, packed, plain, layout.name)
    m.layout = layout.name
    if m.scheme is None:
        m.scheme = f"int{m.bits} g{m.group_size}"
    return m


def _awq_module(ckpt: Checkpoint, name: str, packed: dict, plain: dict) -> Module:
    """AutoAWQ GEMM: qweight [K, N/8], qzeros [K/g, N/8], scales [K/g, N] (4-bit only)."""
    qw, qz, sc = packed["qweight"], packed["qzeros"], packed["scales"]
    if (
        any(len(t.shape) != 2 for t in (qw, qz, sc))
        or sc.shape[1] != qw.shape[1] * 8
        or qz.shape != (sc.shape[0], qw.shape[1])
        or sc.shape[0] == 0
        or qw.shape[0] % sc.shape[0]
    ):
        raise SplicerError(f"{ckpt.label}: {name} has AWQ tensors of inconsistent shapes; the build is corrupt")
    out_f, in_f = sc.shape[1], qw.shape[0]
    return Module(
        name,
        ckpt.arch.module_class(name),
        packed=packed,
        plain=plain,
        shape=(out_f, in_f),
        bits=4,
        group_size=in_f // sc.shape[0],
    )


def _ct_pack_module(ckpt: Checkpoint, name: str, packed: dict, plain: dict, reader: _SmallReader) -> Module:
    ws = packed["weight_shape"]
    if ws.dtype not in ("I64", "I32") or ws.shape != (2,):
        raise SplicerError(
            f"{ckpt.label}: {name}.weight_shape is {ws.dtype}{list(ws.shape)}, not an integer pair; the build is corrupt"
        )
    fmt = "<2q" if ws.dtype == "I64" else "<2i"
    out_f, in_f = struct.unpack(fmt, reader.read(ws))
    pk, sc = packed["weight_packed"], packed["weight_scale"]
    if len(pk.shape) != 2 or len(sc.shape) != 2 or pk.shape[0] != out_f or in_f <= 0 or sc.shape[1] == 0:
        raise SplicerError(
            f"{ckpt.label}: {name} has packed tensors that do not fit weight_shape {[out_f, in_f]}; the build is corrupt"
        )
    bits = pk.shape[1] * 32 // in_f if pk.shape[1] * 32 % in_f == 0 else None
    group = in_f // sc.shape[1] if in_f % sc.shape[1] == 0 else None
    return Module(
        name, ckpt.arch.module_class(name), packed=packed, plain=plain, shape=(out_f, in_f), bits=bits, group_size=group
    )


def _nvfp4_module(ckpt: Checkpoint, name: str, packed: dict, plain: dict) -> Module:
    """NVFP4: weight_packed uint8 [N, K/2] (two e2m1 values a byte), weight_scale fp8 [N, K/16], weight_global_scale [1]."""
    pk, sc = packed["weight_packed"], packed["weight_scale"]
    if pk.dtype != "U8" or len(pk.shape) != 2 or len(sc.shape) != 2 or sc.shape[0] != pk.shape[0] or sc.shape[1] == 0:
        raise SplicerError(f"{ckpt.label}: {name} has NVFP4 tensors of inconsistent shapes or dtypes; the build is corrupt")
    out_f, in_f = pk.shape[0], pk.shape[1] * 2
    group = in_f // sc.shape[1] if in_f % sc.shape[1] == 0 else None
    return Module(
        name,
        ckpt.arch.module_class(name),
        packed=packed,
        plain=plain,
        shape=(out_f, in_f),
        bits=4,
        group_size=group,
        scheme=f"nvfp4 g{group}",
    )


def _weight_scale_module(ckpt: Checkpoint, name: str, packed: dict, plain: dict, layout: str) -> Module:
    """FP8 or INT8 values under `weight` [N, K] with a per-tensor, per-channel or block scale."""
    w = packed["weight"]
    scale = packed.get("weight_scale_inv") or packed.get("weight_scale")
    if len(w.shape) != 2 or scale is None:
        names = "a weight_scale_inv or weight_scale" if layout == "fp8" else "a weight_scale"
        raise SplicerError(f"{ckpt.label}: {name} has an {w.dtype} weight {list(w.shape)} without {names}; the build is corrupt")
    strategy = weight_scale_strategy(tuple(w.shape), tuple(scale.shape), config_block(ckpt.quantization_config))
    if strategy == "unknown":
        raise SplicerError(
            f"{ckpt.label}: {name}'s scale {list(scale.shape)} fits no tensor, channel or block layout of its "
            f"weight {list(w.shape)}; the build is corrupt"
        )
    kind = "int8" if w.dtype == "I8" else "fp8"
    return Module(
        name,
        ckpt.arch.module_class(name),
        packed=packed,
        plain=plain,
        shape=tuple(w.shape),
        bits=8,
        group_size=None,
        scheme=f"{kind} {strategy}",
    )


def _split_fused_experts(ckpt: Checkpoint, info: TensorInfo) -> list[Module]:
    """A fused 3-D expert tensor [E, k*I, H] -> one module per expert and stacked projection (the arch table says
    which: gate_up_proj [E, 2I, H] -> experts.e.{gate,up}_proj, gate rows first; down_proj [E, H, I] -> experts.e.down_proj).

    Each slice is a contiguous byte range of the fused tensor, so it is copied, never loaded.
    """
    arch = ckpt.arch
    prefix, which = arch.fused_expert_parts(info.name)
    if len(info.shape) != 3:
        raise SplicerError(f"{ckpt.label}: {info.name} should be 3-D [experts, out, in] but is {list(info.shape)}")
    n_exp, rows, cols = info.shape
    item = DTYPE_SIZES[info.dtype]
    per_expert = rows * cols * item
    out = []
    projs = dict(arch.fused_expert_shards)[which]
    if rows % len(projs):
        raise SplicerError(
            f"{ckpt.label}: {info.name} stacks {len(projs)} projections but its dimension {rows} does not split evenly"
        )
    part = rows // len(projs)
    for e in range(n_exp):
        base = info.start + e * per_expert
        for i, proj in enumerate(projs):  # projection i = rows [i*part, (i+1)*part)
            src = ByteSource(info.path, base + i * part * cols * item, part * cols * item)
            name = f"{prefix}.{e}.{proj}"
            out.append(Module(name, arch.module_class(name), fused_slice=(info, src, (part, cols)), shape=(part, cols)))
    return out


def weight_source(module: Module) -> tuple[str, tuple[int, int], ByteSource]:
    """(dtype, shape, bytes) of a BF16 module's weight, sliced if it comes from fused experts."""
    if module.fused_slice:
        info, src, shape = module.fused_slice
        return info.dtype, shape, src
    w = module.plain["weight"]
    return w.dtype, tuple(w.shape), ByteSource(w.path, w.start, w.nbytes)
