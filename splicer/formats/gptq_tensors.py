"""GPTQ checkpoints as AutoGPTQ / GPTQModel write them (`quant_method: gptq`, `checkpoint_format: gptq`, i.e. v1).

Per quantized Linear `M` (weight [N, K], b bits, group g, symmetric):
  M.qweight  int32 [K*b/32, N]  q' = q + 2^(b-1) in 0..2^b-1, element k at bits b*(k % (32/b)) of row k // (32/b)
  M.qzeros   int32 [K/g, N*b/32] zero point minus one (the v1 convention), packed along N the same way
  M.scales   float16 [K/g, N]
  M.g_idx    int32 [K]          group of input column k (k // g without act-order)
Dequantized: w[n, k] = scales[g_idx[k], n] * (q'[k, n] - zero[g_idx[k], n]).

Packing along K with element j at bits b*j is compressed-tensors' own layout (`pack_to_int32` on the transposed
weight), so packing and unpacking use its helpers; only the transposes and the v1 zero offset are GPTQ's.
"""

from __future__ import annotations

import torch
from compressed_tensors.compressors.pack_quantized.helpers import (
    pack_to_int32,
    unpack_from_int32,
)
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils import calculate_qparams


def quantize_gptq(weight: torch.Tensor, bits: int = 4, group_size: int = 32) -> dict[str, torch.Tensor]:
    """Round-to-nearest symmetric group quantization written in GPTQ v1 layout (what a GPTQModel RTN fallback writes)."""
    out_f, in_f = weight.shape
    if in_f % group_size:
        raise ValueError(f"group size {group_size} does not divide the input dim {in_f}")
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="group", group_size=group_size)
    grouped = weight.float().reshape(out_f, in_f // group_size, group_size)
    scale, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    scale = scale.to(torch.float16)  # GPTQ stores fp16 scales
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    q = torch.clamp(torch.round(grouped / scale.float()[..., None]), lo, hi).to(torch.int8).reshape(out_f, in_f)
    zero = 2 ** (bits - 1)
    qweight = pack_to_int32(q, bits).t().contiguous()  # [N, K*b/32] -> [K*b/32, N]
    zeros = torch.full((in_f // group_size, out_f), zero - 1 - zero, dtype=torch.int8)  # stored z-1, in CT's signed offset
    qzeros = pack_to_int32(zeros, bits).contiguous()  # packed along N
    g_idx = (torch.arange(in_f, dtype=torch.int32) // group_size).contiguous()
    return {"qweight": qweight, "qzeros": qzeros, "scales": scale.t().contiguous(), "g_idx": g_idx}


def dequantize_gptq(t: dict[str, torch.Tensor], bits: int, dtype=torch.bfloat16) -> torch.Tensor:
    """GPTQ v1 tensors -> dense [N, K] weight (any zero points, act-order through g_idx)."""
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    in_f, out_f = qweight.shape[0] * 32 // bits, scales.shape[1]
    offset = 2 ** (bits - 1)
    q = unpack_from_int32(qweight.t().contiguous(), bits, torch.Size((out_f, in_f))).to(torch.int32) + offset  # q' in 0..2^b-1
    z = unpack_from_int32(qzeros, bits, torch.Size((qzeros.shape[0], out_f))).to(torch.int32) + offset + 1  # v1: stored z-1
    g_idx = t.get("g_idx")
    if g_idx is None:
        g_idx = torch.arange(in_f, dtype=torch.int32) // (in_f // scales.shape[0])
    g = g_idx.long()
    w = scales.float()[g, :].t() * (q - z[g, :].t()).float()
    return w.to(dtype)
