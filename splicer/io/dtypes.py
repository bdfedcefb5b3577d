"""safetensors dtype strings <-> torch dtypes, and which of them are floats."""

import torch

_TO_TORCH = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}

# The float dtypes engines serve weights in (vLLM's --dtype offers bfloat16, float16 and float32): splice casts a base
# tensor among them to the build's float dtype (an F64 one is copied as stored) and restores no weight stored otherwise.
SERVED_FLOAT_DTYPES = ("BF16", "F16", "F32")
# Every float dtype safetensors stores: the unquantized comparison reads an F64 tensor too, cast like the others.
FLOAT_DTYPES = (*SERVED_FLOAT_DTYPES, "F64")


def torch_dtype(name: str) -> torch.dtype:
    return _TO_TORCH[name]


def st_dtype(dtype: torch.dtype) -> str:
    return _FROM_TORCH[dtype]
