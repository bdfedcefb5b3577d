"""The quantization formats by quant_method: which format reads a config, and what splicer reads, in words. Above the
format modules (it imports them), below the stages that look a format up (rules.check, config_edit, validate, inspect).
"""

from __future__ import annotations

from functools import cache

from ..errors import SplicerError
from . import awq, compressed_tensors, fbgemm_fp8, fp8, gptq
from .base import QuantFormat


@cache
def registry() -> dict[str, QuantFormat]:
    """quant_method -> its format, in the order messages list them."""
    return {f.quant_method: f for f in (compressed_tensors.FORMAT, gptq.FORMAT, awq.FORMAT, fp8.FORMAT, fbgemm_fp8.FORMAT)}


def format_of(qc: dict | None) -> QuantFormat | None:
    """The format of a quantization_config (None: no config, or a quant_method splicer does not read)."""
    method = qc.get("quant_method") if qc else None
    return registry().get(method) if isinstance(method, str) else None


def format_or_default(qc: dict | None) -> QuantFormat:
    """The format of a config, or compressed-tensors' reading for one without a known quant_method: with no
    config_groups it targets nothing, so every module reads as unquantized (a BF16 base, an unreadable build)."""
    return format_of(qc) or registry()["compressed-tensors"]


def read_format(qc: dict, label: str) -> QuantFormat:
    """The format of a quantized checkpoint's config; a quant_method splicer does not read is refused in one line."""
    fmt = format_of(qc)
    if fmt is None:
        raise SplicerError(f"{label} uses quant_method {qc.get('quant_method')!r}; splicer handles {read_methods()} builds")
    return fmt


def read_methods() -> str:
    """What splicer reads, in words: compressed-tensors (its formats), GPTQ, AWQ (gemm) and native FP8."""
    names = [f.read_as for f in registry().values()]
    return ", ".join(names[:-1]) + " and " + names[-1]


def unreadable(qc: dict | None) -> str | None:
    """Why splicer cannot read a checkpoint's quantized modules (None: it can). Other formats store modules under
    names and layouts the layout table does not know (bitsandbytes' `weight.absmax`, ModelOpt's `weight_scale_2`, ...),
    so their modules, schemes and per-class sizes would be wrong rather than missing."""
    if not qc:
        return None
    fmt = format_of(qc)
    return fmt.unreadable(qc) if fmt else f"quant_method {qc.get('quant_method')!r}"


def checkpoint_format(qc: dict | None) -> str | None:
    """The storage format a quantization_config names, in a word: compressed-tensors' `format`, GPTQ's
    `checkpoint_format`, AWQ's `version` (gemm), native FP8's block size (or per-tensor)."""
    return format_or_default(qc).checkpoint_format(qc or {})


def config_block(qc: dict | None) -> tuple[int, int] | None:
    """The one FP8 block size a config states (native FP8's weight_block_size, or the block_structure every
    compressed-tensors block group shares); None when there is none or several."""
    return format_or_default(qc).config_block(qc or {})
