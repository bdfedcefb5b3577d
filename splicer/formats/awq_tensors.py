"""AWQ checkpoints as AutoAWQ's GEMM kernel stores them (`quant_method: awq`, `version: gemm`, 4-bit, zero points).

Per quantized Linear `M` (weight [N, K], group g), transposed relative to GPTQ (shared formats fact sheet §5):
  M.qweight  int32 [K, N/8]    unsigned 4-bit values packed along N; nibble i of word c holds column 8c + ORDER[i]
  M.qzeros   int32 [K/g, N/8]  unsigned zero points (no GPTQ v1 "minus one"), packed the same way
  M.scales   float16 [K/g, N]
Dequantized: w[n, k] = scales[k // g, n] * (q[k, n] - z[k // g, n]).

Unpacking is compressed-tensors' own AutoAWQ converter (`AutoAWQConverter._convert_gemm_module`, which rewrites AWQ as
pack-quantized). AutoAWQ, whose `WQLinear_GEMM.from_linear` packs, is deprecated and pins transformers 4.51, so it
does not install beside transformers 5; the fixture writer packs with compressed-tensors' `pack_to_int32` after the
column interleave that converter undoes, and the tests check that the converter reads every packed value back.
"""

from __future__ import annotations

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils import calculate_qparams

BITS = 4
# AutoAWQ's packing order (awq/utils/packing_utils.py AWQ_ORDER): nibble i of a word holds column ORDER[i] of its 8.
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _interleave(columns: torch.Tensor) -> torch.Tensor:
    """[R, N] int8 -> the same values in AWQ's in-word order, ready for sequential packing along N."""
    r, n = columns.shape
    return columns.reshape(r, n // 8, 8)[:, :, list(ORDER)].reshape(r, n)


def quantize_awq(weight: torch.Tensor, group_size: int = 128) -> dict[str, torch.Tensor]:
    """Round-to-nearest asymmetric 4-bit group quantization (min-max, as compressed-tensors' W4A16_ASYM computes it)
    in AutoAWQ GEMM layout."""
    from compressed_tensors.quantization.lifecycle.forward import quantize

    out_f, in_f = weight.shape
    if in_f % group_size or out_f % 8:
        raise ValueError(
            f"AWQ needs the group size {group_size} to divide the input dim {in_f} and 8 to divide the output dim {out_f}"
        )
    args = QuantizationArgs(num_bits=BITS, type="int", symmetric=False, strategy="group", group_size=group_size)
    grouped = weight.float().reshape(out_f, in_f // group_size, group_size)
    scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)  # [N, K/g], zero int8 in -8..7
    scale = scale.to(torch.float16)  # AutoAWQ stores fp16 scales
    q = quantize(weight.float(), scale.float(), zero, args, dtype=torch.int8)  # [N, K] signed, q' = q + 8
    return {
        "qweight": pack_to_int32(_interleave(q.t().contiguous()), BITS).contiguous(),  # [K, N/8]
        "qzeros": pack_to_int32(_interleave(zero.to(torch.int8).t().contiguous()), BITS).contiguous(),  # [K/g, N/8]
        "scales": scale.t().contiguous(),  # [K/g, N]
    }


def awq_to_compressed_tensors(t: dict[str, torch.Tensor], group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ tensors -> (signed values [N, K], scale [N, K/g], signed zero point [N, K/g]), by compressed-tensors'
    converter."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    conv = AutoAWQConverter(bits=BITS, group_size=group_size, zero_point=True)
    return conv._convert_gemm_module(t["qweight"], t["scales"], t["qzeros"])


def dequantize_awq(t: dict[str, torch.Tensor], group_size: int, dtype=torch.bfloat16) -> torch.Tensor:
    """AWQ GEMM tensors -> dense [N, K] weight."""
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    values, scale, zero = awq_to_compressed_tensors(t, group_size)
    args = QuantizationArgs(num_bits=BITS, type="int", symmetric=False, strategy="group", group_size=group_size)
    w = dequantize(x_q=values, scale=scale.float(), zero_point=zero, args=args, dtype=torch.float32)
    return w.to(dtype)
