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

from ..checkpoint import Checkpoint, load_shard_header
from ..formats.layouts import QUANT_SUFFIXES
from ..formats.module import Module
from ..io.dtypes import FLOAT_DTYPES, torch_dtype
from ..io.safetensors_io import TensorInfo
from .modules import list_modules


@dataclass(frozen=True)
class TensorDifference:
    name: str
    dtype: str  # the build's
    shape: tuple[int, ...]
    elements_differing: int
    elements: int
    max_abs_diff: float
    rounding_only: bool  # equal to the base's BF16 round trip through 1 + w (an offset norm wrapped for calibration)


CHUNK = 1 << 22  # elements compared at a time: memory stays bounded for a 1 GB embedding


def _read(info: TensorInfo) -> bytearray:
    data = bytearray(info.nbytes)
    with open(info.path, "rb") as f:
        f.seek(info.start)
        f.readinto(data)
    return data


def _flat(info: TensorInfo, data: bytearray) -> torch.Tensor:
    return torch.frombuffer(data, dtype=torch_dtype(info.dtype)) if data else torch.empty(0)


def _difference(name: str, a: TensorInfo, ab: bytearray, b: TensorInfo, bb: bytearray) -> TensorDifference | None:
    """The build's tensor against the base's (cast to the build's dtype), chunk by chunk; None when equal."""
    av_all, bv_all = _flat(a, ab), _flat(b, bb)
    differing, largest, rounding_only = 0, 0.0, bv_all.dtype == torch.bfloat16
    for start in range(0, bv_all.numel(), CHUNK):
        bv = bv_all[start : start + CHUNK]
        av = av_all[start : start + CHUNK]
        cast = av.to(bv.dtype)
        neq = cast != bv
        n = int(neq.sum())
        if not n:
            continue
        differing += n
        largest = max(largest, float((cast.double() - bv.double()).abs().max()))
        if rounding_only:
            roundtrip = ((1.0 + av.float()).to(bv.dtype).float() - 1.0).to(bv.dtype)
            rounding_only = torch.equal(roundtrip, bv)
    if not differing:
        return None
    return TensorDifference(name, b.dtype, tuple(b.shape), differing, bv_all.numel(), largest, rounding_only)


def unquantized_names(build: Checkpoint, modules: dict[str, Module] | None = None) -> list[str]:
    """Tensors the build stores as plain values: not a part of a quantized module, no quantization suffix.
    `modules`: the build's, when the caller has listed them already."""
    modules = list_modules(build) if modules is None else modules
    quantized_parts = {t.name for m in modules.values() if m.quantized for t in m.packed.values()}
    return sorted(
        n for n in build.weight_map if n not in quantized_parts and not any(n.endswith("." + s) for s in QUANT_SUFFIXES)
    )


@dataclass(frozen=True)
class Comparison:
    compared: int
    differences: list[TensorDifference]
    not_compared: list[str]  # unquantized in the build, but missing from the base or stored otherwise there


def compare_unquantized(build: Checkpoint, base: Checkpoint, modules: dict[str, Module] | None = None) -> Comparison:
    """Every tensor the build stores unquantized against the base's of the same name. A base tensor in another float
    dtype is compared after the cast to the build's dtype, as vLLM would load it; tensors the base lacks or shapes
    otherwise (a fused expert tensor against per-expert ones, say) are listed as not compared."""
    compared, out, skipped = 0, [], []
    for name in unquantized_names(build, modules):
        if name not in base.weight_map:
            skipped.append(name)
            continue
        shard = base.weight_map[name]
        if shard not in base.headers:
            load_shard_header(base, shard)
        b, a = build.tensor(name), base.tensor(name)
        if tuple(a.shape) != tuple(b.shape) or (a.dtype != b.dtype and not (a.dtype in FLOAT_DTYPES and b.dtype in FLOAT_DTYPES)):
            skipped.append(name)
            continue
        compared += 1
        bb, ab = _read(b), _read(a)
        if a.dtype == b.dtype and ab == bb:
            continue
        if (d := _difference(name, a, ab, b, bb)) is not None:
            out.append(d)
    return Comparison(compared, out, skipped)


def pattern(name: str) -> str:
    """The tensor's name with layer and expert numbers replaced by N, to group a report."""
    return re.sub(r"\.\d+(?=\.)", ".N", name)


def summary(c: Comparison) -> dict:
    """For JSON: counts, and per name pattern the tensors, differing elements and largest difference."""
    compared, diffs = c.compared, c.differences
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
    return {
        "compared": compared,
        "differing": len(diffs),
        "changed": sum(g["changed"] for g in groups.values()),
        "by_pattern": groups,
        "not_compared": len(c.not_compared),
        "not_compared_examples": c.not_compared[:3],
    }


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


def _not_compared(s: dict) -> str:
    if not s.get("not_compared"):
        return ""
    return (
        f"\n{s['not_compared']} unquantized tensors of the build were not compared: the base lacks them or stores them "
        f"otherwise (e.g. {', '.join(s['not_compared_examples'])}); values from the base do not cover them."
    )


def _share(g: dict) -> str:
    share = 100 * g["elements_differing"] / g["elements"] if g["elements"] else 0.0
    return f"{share:.1f} %" if share >= 0.1 or not g["elements_differing"] else "under 0.1 %"


def format_summary(s: dict, build_label: str, base_label: str) -> str:
    if not s["differing"]:
        return (
            f"Unquantized tensors: all {s['compared']} compared that {build_label} and {base_label} share hold the same "
            "values." + _not_compared(s)
        )
    lines = [
        f"Unquantized tensors that differ from the base: {s['differing']} of {s['compared']} compared "
        "(restoring every quantized class will not give the base; `splice --unquantized-from-base` copies them back):"
    ]
    for p, g in sorted(s["by_pattern"].items()):
        how = "rounded as 1 + w in BF16 and back" if not g.get("changed") else f"{g['changed']} changed beyond rounding"
        lines.append(
            f"  {p}: {g['tensors']} tensor(s), {_share(g)} of elements differ, largest |difference| "
            f"{g['max_abs_diff']:.3g} ({how})"
        )
    if s.get("changed"):
        lines.append(f"Warning: {s['changed']} of them {SMOOTHING_NOTE}.")
    return "\n".join(lines) + _not_compared(s)
