"""Tensor-level quantize / pack / unpack through compressed-tensors' own functions, for every scheme it writes.

Used to build the fixture checkpoints (round to nearest from min/max, as llm-compressor's model_free_ptq does with
its static min-max observer) and to dequantize stored modules for checks and the torch backend. The scheme presets
(FP8_DYNAMIC, FP8_BLOCK, NVFP4A16, W8A8, W4A16, W8A16) are compressed-tensors' own (`preset_name_to_scheme`), the
format of a module is the one compressed-tensors infers for it (`infer_module_format`), and the tensors come out of
that format's compressor. Works with compressed-tensors 0.17 through 0.20.

Dequantizing goes through `dequantize(..., args=scheme.weights)` rather than a compressor's `decompress`: in 0.17
`decompress` calls `dequantize` without the args, which then guesses a block size from the scale's shape (wrong
when a block does not divide the weight) and NVFP4's grouping the same way.
"""

from __future__ import annotations

import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams

PACK_QUANTIZED = "pack-quantized"
# compressed-tensors' presets a fixture build can use without calibration data (model_free_ptq takes the same ones).
PRESETS = ("W4A16", "W8A16", "W8A8", "FP8_DYNAMIC", "FP8_BLOCK", "NVFP4A16")
# QuantizationArgs fields that compressed-tensors 0.17 (pinned by vLLM 0.26) and 0.20 both accept.
ARG_FIELDS = (
    "num_bits",
    "type",
    "symmetric",
    "group_size",
    "strategy",
    "block_structure",
    "dynamic",
    "actorder",
    "scale_dtype",
    "zp_dtype",
    "observer",
    "observer_kwargs",
)


def make_scheme(bits: int, group_size: int, symmetric: bool = True, targets=("Linear",)) -> QuantizationScheme:
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy="group", group_size=group_size)
    return QuantizationScheme(targets=list(targets), weights=args, format=PACK_QUANTIZED)


def preset_scheme(name: str, targets=("Linear",)) -> QuantizationScheme:
    """compressed-tensors' preset scheme `name` (FP8_DYNAMIC, NVFP4A16, ...) with its format filled in."""
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme(name, list(targets))
    scheme.format = infer_module_format(torch.nn.Linear, scheme).value
    return scheme


def _args(d: dict | None) -> QuantizationArgs | None:
    return QuantizationArgs(**{k: d[k] for k in ARG_FIELDS if d.get(k) is not None}) if d else None


def scheme_from_group(group: dict) -> QuantizationScheme:
    """A config group (as a dict) -> scheme, keeping only the fields every supported version accepts."""
    return QuantizationScheme(
        targets=list(group.get("targets") or ["Linear"]),
        weights=_args(group.get("weights")),
        input_activations=_args(group.get("input_activations")),
        format=group.get("format"),
    )


def config_group(scheme: QuantizationScheme) -> dict:
    """A scheme as a config group that compressed-tensors 0.17 reads back (the fields both versions share)."""

    def dump(args):
        if args is None:
            return None
        d = args.model_dump(mode="json")
        return {k: d[k] for k in ARG_FIELDS if d.get(k) is not None}

    return {
        "format": scheme.format,
        "input_activations": dump(scheme.input_activations),
        "output_activations": None,
        "targets": list(scheme.targets),
        "weights": dump(scheme.weights),
    }


def native_fp8_scheme(weight_block_size=None) -> QuantizationScheme:
    """The compressed-tensors scheme a native FP8 checkpoint (`quant_method: fp8`) is equivalent to: e4m3 weights with
    one scale per weight_block_size block (DeepSeek-V3, Qwen *-FP8: [128, 128]), or per tensor without it."""
    block = list(weight_block_size) if weight_block_size else None
    args = QuantizationArgs(
        num_bits=8, type="float", symmetric=True, strategy="block" if block else "tensor", block_structure=block
    )
    return QuantizationScheme(targets=["Linear"], weights=args, format="float-quantized")


def quantize_native_fp8(weight: torch.Tensor, weight_block_size=None) -> dict[str, torch.Tensor]:
    """A weight as a native FP8 checkpoint stores it: `weight` e4m3 and, with blocks, `weight_scale_inv` float32 (a
    multiplier despite its name, DeepSeek-V3's README), else a per-tensor `weight_scale`."""
    out = quantize_weight(weight, native_fp8_scheme(weight_block_size))
    scale = out.pop("weight_scale").float().contiguous()
    out["weight_scale_inv" if weight_block_size else "weight_scale"] = scale
    return out


def _compressor(scheme: QuantizationScheme):
    return BaseCompressor.get_value_from_registry(scheme.format or PACK_QUANTIZED)


def _min_max(weight: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-scale min and max of a [N, K] weight for the args' strategy (as a static min-max observer sees them)."""
    from compressed_tensors.quantization.utils import maybe_pad_tensor_for_block_quant

    w = weight.float()
    n, k = w.shape
    strategy = str(getattr(args.strategy, "value", args.strategy))
    if strategy in ("group", "tensor_group"):
        g = args.group_size
        if k % g:
            raise ValueError(f"group size {g} does not divide the input dim {k}")
        grouped = w.reshape(n, k // g, g)
        return grouped.amin(-1), grouped.amax(-1)
    if strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if strategy == "block":
        bh, bw = args.block_structure
        p = maybe_pad_tensor_for_block_quant(w, (bh, bw))
        tiles = p.reshape(p.shape[0] // bh, bh, p.shape[1] // bw, bw)
        return tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3))
    raise ValueError(f"weight strategy {strategy!r} is not supported")


def quantize_weight(
    weight: torch.Tensor, scheme: QuantizationScheme, global_scale: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Round-to-nearest quantization of a 2-D weight in the scheme's format; returns the tensors a checkpoint stores
    for the module (weight_packed/weight/weight_scale/weight_shape/weight_zero_point/weight_global_scale).
    global_scale: NVFP4's, shared by the shards of a fused group (default: this weight's own)."""
    from compressed_tensors.quantization.utils import generate_gparam

    args = scheme.weights
    lo, hi = _min_max(weight, args)
    state = {"weight": weight}
    if str(getattr(args.strategy, "value", args.strategy)) == "tensor_group":
        # NVFP4: one fp32 global scale puts the fp8 group scales in range (stored as a divisor).
        if global_scale is None:
            global_scale = generate_gparam(weight.float().amin(), weight.float().amax())
        state["weight_global_scale"] = global_scale
    else:
        global_scale = None
    scale, zero_point = calculate_qparams(lo, hi, args, global_scale=global_scale)
    state["weight_scale"] = scale if global_scale is not None else scale.to(weight.dtype)
    state["weight_zero_point"] = zero_point
    out = _compressor(scheme).compress(state, scheme)
    return {k: v.contiguous() for k, v in out.items()}


def dequantize_module(tensors: dict[str, torch.Tensor], scheme: QuantizationScheme, dtype=torch.bfloat16) -> torch.Tensor:
    """A module's stored tensors -> its dense [N, K] weight, by compressed-tensors' unpackers and `dequantize`."""
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    fmt = scheme.format or PACK_QUANTIZED
    args = scheme.weights
    if fmt == PACK_QUANTIZED:
        return _compressor(scheme).decompress(dict(tensors), scheme)["weight"].to(dtype)
    scale = tensors["weight_scale"] if "weight_scale" in tensors else tensors["weight_scale_inv"]  # native FP8's name
    if fmt == "nvfp4-pack-quantized":
        from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

        packed = tensors["weight_packed"]
        x_q = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2)
        w = dequantize(
            x_q=x_q, scale=scale.to(x_q.dtype), args=args, global_scale=tensors["weight_global_scale"], dtype=x_q.dtype
        )
        return w.to(dtype)
    if fmt in ("float-quantized", "int-quantized", "naive-quantized"):
        w = dequantize(
            x_q=tensors["weight"],
            scale=scale.float(),
            zero_point=tensors.get("weight_zero_point"),
            args=args,
            dtype=torch.float32,
        )
        return w.to(dtype)
    raise ValueError(f"compressed-tensors format {fmt!r} is not supported")
