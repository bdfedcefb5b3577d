"""From tensor names to modules: which modules a checkpoint holds, quantized or not, and their shapes (a quantized
module's, by its storage layout's reader in formats/layouts.py)."""

from __future__ import annotations

from collections import defaultdict

from ..checkpoint import Checkpoint
from ..errors import SplicerError
from ..formats.layouts import (
    PLAIN_SUFFIXES,
    QUANT_SUFFIXES,
    QUANTIZED_WEIGHT_DTYPES,
    READ_QUANT_METHODS,
    StoredModule,
    layout_for,
    layout_method,
)
from ..formats.module import Module
from ..formats.registry import config_block
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
        raise SplicerError(
            f"{ckpt.label}: module {name} is stored as {layout.stored_as} ({', '.join(sorted(packed))}) but config.json "
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
    stored = StoredModule(
        ckpt.label,
        name,
        ckpt.arch.module_class(name),
        packed,
        plain,
        reader.read,
        lambda: config_block(ckpt.quantization_config),
    )
    m = layout.read(stored, layout)
    m.layout = layout.name
    if m.scheme is None:
        m.scheme = f"int{m.bits} g{m.group_size}"
    return m


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
