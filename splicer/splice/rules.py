"""Lint a checkpoint's config against its tensors: check() runs the readers of the config's format (each format's
module in splicer/formats/; what they share, the Reading and Report, is formats/readings.py).
"""

from __future__ import annotations

from ..arch.table import Architecture
from ..formats.module import Module
from ..formats.readings import Report
from ..formats.registry import format_or_default


def check(modules: dict[str, Module], qc: dict | None, arch: Architecture, tensor_dtypes: dict[str, str] | None = None) -> Report:
    """Lint a checkpoint's config against its tensors, under HF and vLLM naming (tensor_dtypes: every tensor's
    safetensors dtype, for the one reader that decides from them, vLLM's AWQ loader with an empty skip list)."""
    qc = qc or {}
    return format_or_default(qc).check(modules, qc, arch, Report(), tensor_dtypes)
