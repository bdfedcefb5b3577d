"""Tensor-level quantize / pack / unpack through compressed-tensors' own functions.

Used to build the fixture checkpoints (round-to-nearest, like llm-compressor's
model_free_ptq) and to dequantize packed modules for checks and the torch backend.
Works with compressed-tensors 0.17 through 0.20 (the classmethod compressor interface
and `calculate_qparams` exist in both).
"""

from __future__ import annotations

import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams

PACK_QUANTIZED = "pack-quantized"


def make_scheme(bits: int, group_size: int, symmetric: bool = True, targets=("Linear",)) -> QuantizationScheme:
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy="group", group_size=group_size)
    return QuantizationScheme(targets=list(targets), weights=args, format=PACK_QUANTIZED)


def scheme_from_group(group: dict) -> QuantizationScheme:
    """A config group (as a dict) -> scheme, keeping only the fields every supported version accepts."""
    w = group.get("weights") or {}
    return make_scheme(int(w["num_bits"]), int(w["group_size"]), bool(w.get("symmetric", True)))


def _compressor():
    return BaseCompressor.get_value_from_registry(PACK_QUANTIZED)


def quantize_weight(weight: torch.Tensor, scheme: QuantizationScheme) -> dict[str, torch.Tensor]:
    """Round-to-nearest group quantization of a 2-D weight; returns weight_packed/scale/shape (+zero_point)."""
    args = scheme.weights
    out_f, in_f = weight.shape
    g = args.group_size
    if in_f % g:
        raise ValueError(f"group size {g} does not divide the input dim {in_f}")
    grouped = weight.float().reshape(out_f, in_f // g, g)
    scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    state = {"weight": weight, "weight_scale": scale.to(weight.dtype), "weight_zero_point": zero_point}
    return {k: v.contiguous() for k, v in _compressor().compress(state, scheme).items()}


def dequantize_module(tensors: dict[str, torch.Tensor], scheme: QuantizationScheme, dtype=torch.bfloat16) -> torch.Tensor:
    """weight_packed/scale/shape (+zero_point) -> dense weight, via compressed-tensors' decompress."""
    return _compressor().decompress(dict(tensors), scheme)["weight"].to(dtype)

