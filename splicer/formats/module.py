"""One module of a checkpoint as its tensors store it: the record every stage passes around (modules.py lists a
checkpoint's; the formats read and edit their configs by them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..io.safetensors_io import ByteSource, TensorInfo


@dataclass
class Module:
    """One Linear-like module (or embedding) of a checkpoint."""

    name: str
    cls: str
    # The tensors of a quantized module (weight_packed, weight_scale, ...; an FP8/INT8 `weight` too): dropped on restore.
    packed: dict[str, TensorInfo] = field(default_factory=dict)
    plain: dict[str, TensorInfo] = field(default_factory=dict)  # weight, bias
    # For a BF16 base with fused 3-D experts: this expert's slice of the fused tensor.
    fused_slice: tuple[TensorInfo, ByteSource, tuple[int, int]] | None = None
    shape: tuple[int, int] | None = None  # (out_features, in_features)
    bits: int | None = None
    group_size: int | None = None
    layout: str | None = None  # formats.layouts.LAYOUT key of a quantized module
    scheme: str | None = None  # what it is stored as, in words: int4 g128, fp8 channel, fp8 block128x128, nvfp4 g16

    @property
    def quantized(self) -> bool:
        return bool(self.packed)

    @property
    def weight_dtype(self) -> str:
        if self.fused_slice:
            return self.fused_slice[0].dtype
        return self.plain["weight"].dtype

    def disk_bytes(self) -> int:
        if self.fused_slice:
            return self.fused_slice[1].nbytes
        return sum(t.nbytes for t in self.packed.values()) + sum(t.nbytes for t in self.plain.values())

    def tensor_names(self) -> list[str]:
        return [t.name for t in list(self.packed.values()) + list(self.plain.values())]
