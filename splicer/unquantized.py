"""Does a build keep the base's values where it did not quantize?

Splicing restores quantized modules; every other tensor comes from the build as it is. A quantizer can change those
too: llm-compressor 0.14's `oneshot` converts offset RMSNorms (`x * (1 + w)`: Qwen3.5, Qwen3-Next, Gemma) to
`x * w` for calibration and back, in the model's dtype, which rounds `w` in BF16 even when no modifier smooths it.
Then restoring every quantized class does not give the base, and the remainder of the error lies outside any class.
This module finds such tensors (same name and shape in both, stored unquantized in the build, other values) so that
`inspect --base` can show them and `splice --unquantized-from-base` can copy them back.

It also tells that rounding apart from a real change. AWQ and SmoothQuant fold a per-channel scale into a norm (or a
previous Linear) and its inverse into the layers that read it, unquantized ones included (the router, the shared
expert's gate): then a class spliced back from the base reads inputs scaled for the build's weights, and its restored
values are not what the build would compute without its quantization error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .checkpoint import Checkpoint, load_shard_header
from .dtypes import torch_dtype
from .formats.layouts import QUANT_SUFFIXES
from .modules import list_modules
from .safetensors_io import TensorInfo

FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")


@dataclass(frozen=True)
class TensorDifference:
    name: str
    dtype: str  # the build's
    shape: tuple[int, ...]
    elements_differing: int
    elements: int
    max_abs_diff: float
    rounding_only: bool  # equal to the base's BF16 round trip through 1 + w (an offset norm wrapped for calibration)


def _read(info: TensorInfo) -> bytes:
    with open(info.path, "rb") as f:
        f.seek(info.start)
        return f.read(info.nbytes)


def _values(info: TensorInfo, data: bytes) -> torch.Tensor:
    t = torch.frombuffer(bytearray(data), dtype=torch_dtype(info.dtype)) if data else torch.empty(0)
    return t.reshape(info.shape)


def unquantized_names(build: Checkpoint) -> list[str]:
    """Tensors the build stores as plain values: not a part of a quantized module, no quantization suffix."""
    quantized_parts = {t.name for m in list_modules(build).values() if m.quantized for t in m.packed.values()}
    return sorted(
        n for n in build.weight_map if n not in quantized_parts and not any(n.endswith("." + s) for s in QUANT_SUFFIXES)
    )


def compare_unquantized(build: Checkpoint, base: Checkpoint) -> tuple[int, list[TensorDifference]]:
    """(tensors compared, those whose values differ). A base tensor in another float dtype is compared after the cast
    to the build's dtype, as vLLM would load it; tensors missing from the base or shaped otherwise are not compared."""
    compared, out = 0, []
    for name in unquantized_names(build):
        if name not in base.weight_map:
            continue
        shard = base.weight_map[name]
        if shard not in base.headers:
            load_shard_header(base, shard)
        b, a = build.tensor(name), base.tensor(name)
        if tuple(a.shape) != tuple(b.shape):
            continue
        if a.dtype != b.dtype and not (a.dtype in FLOAT_DTYPES and b.dtype in FLOAT_DTYPES):
            continue
        compared += 1
        bb, ab = _read(b), _read(a)
        if a.dtype == b.dtype and ab == bb:
            continue
        bv = _values(b, bb)
        av = _values(a, ab).to(bv.dtype)
        if torch.equal(av.view(-1).view(torch.uint8), bv.view(-1).view(torch.uint8)):
            continue
        differing = av != bv
        roundtrip = ((1.0 + _values(a, ab).float()).to(bv.dtype).float() - 1.0).to(bv.dtype)
        diff = (av.double() - bv.double()).abs()
        out.append(
            TensorDifference(
                name=name,
                dtype=b.dtype,
                shape=tuple(b.shape),
                elements_differing=int(differing.sum()),
                elements=bv.numel(),
                max_abs_diff=float(diff.max()) if bv.numel() else 0.0,
                rounding_only=bv.dtype == torch.bfloat16 and torch.equal(roundtrip, bv),
            )
        )
    return compared, out


def pattern(name: str) -> str:
    """The tensor's name with layer and expert numbers replaced by N, to group a report."""
    return re.sub(r"\.\d+\.", ".N.", re.sub(r"\.\d+\.", ".N.", name))


def summary(compared: int, diffs: list[TensorDifference]) -> dict:
    """For JSON: counts, and per name pattern the tensors, differing elements and largest difference."""
    groups: dict[str, dict] = {}
    for d in diffs:
        g = groups.setdefault(
            pattern(d.name), {"tensors": 0, "elements_differing": 0, "elements": 0, "max_abs_diff": 0.0, "changed": 0}
        )
        g["tensors"] += 1
        g["changed"] += not d.rounding_only
        g["elements_differing"] += d.elements_differing
        g["elements"] += d.elements
        g["max_abs_diff"] = max(g["max_abs_diff"], d.max_abs_diff)
    changed = sum(not d.rounding_only for d in diffs)
    return {"compared": compared, "differing": len(diffs), "changed": changed, "by_pattern": groups}


def changed_text(diffs: list[TensorDifference]) -> str:
    """The tensors changed beyond rounding, for messages (the largest difference first)."""
    changed = sorted((d for d in diffs if not d.rounding_only), key=lambda d: -d.max_abs_diff)
    names = ", ".join(f"{d.name} (largest difference {d.max_abs_diff:.3g})" for d in changed[:2])
    return f"{len(changed)} tensors, e.g. {names}"


SMOOTHING_NOTE = (
    "changed beyond rounding: a transform such as AWQ or SmoothQuant smoothing folds scales into these tensors and "
    "their inverse into the layers that read them, so a class spliced back from the base reads inputs scaled for the "
    "build's weights and its rows do not show the build without that class's error"
)


def format_summary(s: dict, build_label: str, base_label: str) -> str:
    if not s["differing"]:
        return f"Unquantized tensors: all {s['compared']} that {build_label} and {base_label} share hold the same values."
    lines = [
        f"Unquantized tensors that differ from the base: {s['differing']} of {s['compared']} compared "
        "(restoring every quantized class will not give the base; `splice --unquantized-from-base` copies them back):"
    ]
    for p, g in sorted(s["by_pattern"].items()):
        share = g["elements_differing"] / g["elements"] if g["elements"] else 0.0
        how = "rounded as 1 + w in BF16 and back" if not g.get("changed") else f"{g['changed']} changed beyond rounding"
        lines.append(
            f"  {p}: {g['tensors']} tensor(s), {100 * share:.1f} % of elements differ, largest |difference| "
            f"{g['max_abs_diff']:.3g} ({how})"
        )
    if s.get("changed"):
        lines.append(f"Warning: {s['changed']} of them {SMOOTHING_NOTE}.")
    return "\n".join(lines)
