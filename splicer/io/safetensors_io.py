"""Byte-level safetensors reading and streaming writing.

The `safetensors` package loads and saves whole state dicts; a splice of a 20-70 GB
checkpoint must not. Here we read only headers (validated before anything large is
allocated), copy tensor payloads file-to-file as byte ranges, and write a shard by
emitting its header first and then each tensor's bytes in order. The on-disk format is
the one `safetensors` documents: u64 little-endian header length, JSON header padded
with spaces, then the data block. Files written here are read back with
`safetensors.safe_open` in the tests.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..errors import SplicerError

DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
# A real header is a few MB at most (92k tensors in the 35B build ~ 10 MB); refuse
# anything larger before reading it, so a crafted file cannot make us allocate GBs.
MAX_HEADER_BYTES = 256 * 1024 * 1024
_COPY_CHUNK = 64 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes live in a shard."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    start: int  # absolute file offset of the first byte
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class ShardHeader:
    path: Path
    raw: bytes  # the header JSON exactly as stored (used for hashing)
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]


def read_header(path: Path) -> ShardHeader:
    """Parse and validate a safetensors header; never reads the data block."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise SplicerError(f"{path} is not a safetensors file (shorter than 8 bytes); re-download it")
            (hlen,) = struct.unpack("<Q", prefix)
            if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
                raise SplicerError(
                    f"{path} has a header length of {hlen} bytes that does not fit the file "
                    f"({size} bytes): the file is truncated or not safetensors; re-download it"
                )
            raw = f.read(hlen)
    except OSError as e:
        raise SplicerError(f"cannot read {path}: {e.strerror}; check the path and permissions") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise SplicerError(f"{path} has a header that is not valid JSON; re-download the shard") from None
    if not isinstance(header, dict):
        raise SplicerError(f"{path} has a header that is not a JSON object; re-download the shard")
    data_start = 8 + hlen
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SplicerError(f"{path}: __metadata__ is not an object of strings; the header is corrupt, re-download the shard")
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, spec in header.items():
        if not _valid_entry(spec):
            raise SplicerError(f"{path}: tensor {name!r} has a malformed header entry; re-download the shard")
        dtype, shape = spec["dtype"], tuple(spec["shape"])
        begin, end = spec["data_offsets"]
        if dtype not in DTYPE_SIZES or any(d < 0 for d in shape) or begin < 0 or end < begin:
            raise SplicerError(f"{path}: tensor {name!r} has an invalid dtype, shape or offsets; re-download the shard")
        if (end - begin) != math.prod(shape) * DTYPE_SIZES[dtype]:
            raise SplicerError(
                f"{path}: tensor {name!r} declares {end - begin} bytes for shape {list(shape)} {dtype}; "
                "the header is corrupt, re-download the shard"
            )
        if data_start + end > size:
            raise SplicerError(
                f"{path} is truncated: tensor {name!r} ends at byte {data_start + end} of a {size}-byte file; "
                "re-download the shard"
            )
        tensors[name] = TensorInfo(name, dtype, shape, path, data_start + begin, end - begin)
        spans.append((begin, end, name))
    spans.sort()
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise SplicerError(f"{path}: tensors {n0!r} and {n1!r} overlap; the shard is corrupt, re-download it")
    # The header must cover the data block exactly, as the safetensors library itself demands: bytes it does not
    # cover (a gap, or anything appended) are data no reader will load and no splice would carry over.
    covered, pos = 0, 0
    for b, e, _ in spans:
        if b != pos:
            break
        covered, pos = e, e
    if covered != size - data_start:
        raise SplicerError(
            f"{path}: its header covers {covered} of the {size - data_start} data bytes (a gap or bytes "
            "appended after the tensors); the shard is corrupt, re-download it"
        )
    return ShardHeader(path, raw, tensors, {str(k): str(v) for k, v in metadata.items()})


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _valid_entry(spec) -> bool:
    """A tensor entry as safetensors writes it: a dtype string, a shape of ints, two int offsets (never floats,
    which int() would silently truncate)."""
    return (
        isinstance(spec, dict)
        and isinstance(spec.get("dtype"), str)
        and isinstance(spec.get("shape"), list)
        and all(_is_int(d) for d in spec["shape"])
        and isinstance(spec.get("data_offsets"), list)
        and len(spec["data_offsets"]) == 2
        and all(_is_int(x) for x in spec["data_offsets"])
    )


def headers_digest(headers: Iterable[ShardHeader]) -> str:
    """A hash of a checkpoint's tensor layout: names, dtypes, shapes and offsets of every shard.

    Cheap (no tensor data read), and it changes whenever a shard is rewritten.
    """
    h = hashlib.sha256()
    for hdr in sorted(headers, key=lambda x: x.path.name):
        h.update(hdr.path.name.encode())
        h.update(hdr.raw)
    return h.hexdigest()


@dataclass(frozen=True)
class ByteSource:
    """A contiguous byte range of an existing file, to be copied verbatim into a new shard."""

    path: Path
    start: int
    nbytes: int


@dataclass(frozen=True)
class CastSource:
    """A float tensor stored as `from_dtype` at `raw`, written cast to `to_dtype` (round to nearest even, as torch
    and vLLM cast), a chunk at a time."""

    raw: ByteSource
    from_dtype: str
    to_dtype: str

    @property
    def path(self) -> Path:
        return self.raw.path

    @property
    def start(self) -> int:
        return self.raw.start

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes // DTYPE_SIZES[self.from_dtype] * DTYPE_SIZES[self.to_dtype]


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    source: ByteSource | CastSource | bytes

    @property
    def nbytes(self) -> int:
        return len(self.source) if isinstance(self.source, bytes) else self.source.nbytes


def _copy_range(src: BinaryIO, dst: BinaryIO, start: int, nbytes: int) -> None:
    remaining, pos = nbytes, start
    try:
        while remaining:
            n = os.copy_file_range(src.fileno(), dst.fileno(), min(remaining, 1 << 30), pos)
            if n == 0:
                raise OSError("short copy")
            remaining -= n
            pos += n
        return
    except (AttributeError, OSError) as e:
        if getattr(e, "errno", None) == 28:  # ENOSPC: let the caller report it
            raise
        # copy_file_range is missing or refused (e.g. across some filesystems): plain copy.
    src.seek(pos)
    while remaining:
        chunk = src.read(min(remaining, _COPY_CHUNK))
        if not chunk:
            raise SplicerError(f"{src.name} ended early while copying; it changed during the splice, rerun")
        dst.write(chunk)
        remaining -= len(chunk)


def _cast_range(src: BinaryIO, dst: BinaryIO, source: CastSource) -> None:
    import torch

    from .dtypes import torch_dtype

    step = _COPY_CHUNK - _COPY_CHUNK % DTYPE_SIZES[source.from_dtype]
    src.seek(source.raw.start)
    remaining = source.raw.nbytes
    while remaining:
        chunk = src.read(min(remaining, step))
        if not chunk:
            raise SplicerError(f"{src.name} ended early while copying; it changed during the splice, rerun")
        values = torch.frombuffer(bytearray(chunk), dtype=torch_dtype(source.from_dtype))
        dst.write(values.to(torch_dtype(source.to_dtype)).view(torch.uint8).numpy().tobytes())
        remaining -= len(chunk)


def _coalesce(sources):
    """Merge byte ranges that continue each other in the same file: one copy call instead of many."""
    run = None
    for s in sources:
        if isinstance(s, ByteSource) and isinstance(run, ByteSource) and s.path == run.path and s.start == run.start + run.nbytes:
            run = ByteSource(run.path, run.start, run.nbytes + s.nbytes)
            continue
        if run is not None:
            yield run
        run = s
    if run is not None:
        yield run


def write_shard(path: Path, tensors: list[OutTensor], metadata: dict[str, str] | None = None) -> int:
    """Write a safetensors file tensor by tensor; returns the number of tensor-data bytes.

    Memory use is one copy chunk, whatever the shard size.
    """
    header: dict = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for t in tensors:
        if t.nbytes != math.prod(t.shape) * DTYPE_SIZES[t.dtype]:
            raise AssertionError(f"{t.name}: {t.nbytes} bytes for {t.shape} {t.dtype}")
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * (-len(hjson) % 8)  # align the data block to 8 bytes, as safetensors does
    open_files: dict[Path, BinaryIO] = {}
    try:
        with open(path, "wb", buffering=0) as out:  # unbuffered: copy_file_range writes at the fd offset
            out.write(struct.pack("<Q", len(hjson)))
            out.write(hjson)
            for source in _coalesce(t.source for t in tensors):
                if isinstance(source, (ByteSource, CastSource)):
                    src = open_files.get(source.path)
                    if src is None:
                        src = open_files[source.path] = open(source.path, "rb")
                    if isinstance(source, CastSource):
                        _cast_range(src, out, source)
                    else:
                        _copy_range(src, out, source.start, source.nbytes)
                else:
                    out.write(source)
    finally:
        for f in open_files.values():
            f.close()
    return offset
