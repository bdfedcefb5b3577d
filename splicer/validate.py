"""Input checks for splice: the build, the base, the class list and the output path.

Each check raises SplicerError with one line naming the problem and the fix, before anything is written.
"""

from __future__ import annotations

import re

from .arch import Architecture
from .checkpoint import Checkpoint, is_packed_tensor
from .errors import SplicerError
from .modules import Module
from .rules import HfReader, is_gptq, validate_regexes


def validate_build(build: Checkpoint) -> None:
    qc = build.quantization_config
    if not qc:
        raise SplicerError(f"build {build.label} has no quantization_config in config.json; it is not a quantized build (did you swap BUILD and BASE?)")
    if is_gptq(qc):
        return _validate_gptq(build, qc)
    if qc.get("quant_method") != "compressed-tensors":
        raise SplicerError(
            f"build {build.label} uses quant_method {qc.get('quant_method')!r}; splicer handles compressed-tensors "
            "pack-quantized and GPTQ builds"
        )
    formats = {qc.get("format")} | {g.get("format") for g in (qc.get("config_groups") or {}).values()}
    formats.discard(None)
    if formats != {"pack-quantized"}:
        raise SplicerError(f"build {build.label} has format {sorted(formats)}; only pack-quantized (W4A16/W8A16) is supported")
    if not isinstance(qc.get("config_groups"), dict) or not qc["config_groups"]:
        raise SplicerError(f"build {build.label}: quantization_config has no config_groups; the config is invalid, restore it from the original export")
    validate_regexes(qc, f"build {build.label}")
    if not any(is_packed_tensor(t) for t in build.weight_map):
        raise SplicerError(
            f"build {build.label}: config.json says pack-quantized but no tensor is packed (no weight_packed); "
            "the shards do not belong to this config"
        )


def _validate_gptq(build: Checkpoint, qc: dict) -> None:
    if qc.get("bits") not in (2, 3, 4, 8):
        raise SplicerError(f"build {build.label}: GPTQ bits {qc.get('bits')!r} is not 2, 3, 4 or 8; the config is invalid")
    for key in qc.get("dynamic") or {}:
        try:
            re.compile(key[2:] if key[:2] in ("-:", "+:") else key)
        except re.error as e:
            raise SplicerError(f"build {build.label}: dynamic rule {key!r} is not a valid regex ({e}); fix config.json") from None
    if not any(t.endswith(".qweight") for t in build.weight_map):
        raise SplicerError(f"build {build.label}: config.json says gptq but no tensor is packed (no qweight); the shards do not belong to this config")


def validate_schemes(build: Checkpoint, modules: dict[str, Module]) -> None:
    """Every packed module must agree with the config group that claims it (bits, group size dividing its input dim)."""
    qc = build.quantization_config
    if is_gptq(qc):
        if any(k.startswith("+:") for k in qc.get("dynamic") or {}):
            return  # per-module overrides: bits and group size may differ by design
        for name, m in sorted(modules.items()):
            g = qc.get("group_size")
            if m.quantized and ((m.bits, m.group_size) != (qc["bits"], g if g and g > 0 else m.shape[1])):
                raise SplicerError(f"build {build.label}: {name} is stored as {m.bits}-bit g{m.group_size} but the config says "
                                   f"{qc['bits']}-bit g{g}; the config does not match the shards, re-export the build")
        return
    reader = HfReader(qc, build.arch)
    for name, m in sorted(modules.items()):
        if not m.quantized:
            continue
        group = reader.reading(m).group
        if group is None:
            continue  # reported by inspect's lint (stored packed, read as BF16)
        w = qc["config_groups"][group].get("weights") or {}
        g, bits = w.get("group_size"), w.get("num_bits")
        if g and m.shape[1] % int(g):
            raise SplicerError(f"build {build.label}: {group} has group_size {g}, which does not divide the input dim {m.shape[1]} "
                               f"of {name}; the build is corrupt, re-export it")
        if (bits, g) != (m.bits, m.group_size) and g:
            raise SplicerError(f"build {build.label}: {name} is stored as {m.bits}-bit g{m.group_size} but {group} says {bits}-bit g{g}; "
                               "the config does not match the shards, re-export the build")


def validate_base(base: Checkpoint, build: Checkpoint, allow_quantized: bool = False) -> list[str]:
    """Check that BASE can serve as the build's reference; returns the classes the base itself keeps quantized.

    A partly quantized base (allow_quantized) is a stand-in reference: e.g. experts kept INT4 because BF16
    experts do not fit the disk. Its quantized modules must be stored exactly as in the build (same packed
    tensors), so that the reference and every variant share them; those classes cannot be restored.
    """
    packed = next((t for t in base.weight_map if is_packed_tensor(t)), None)
    if (base.quantization_config or packed) and not allow_quantized:
        what = f"is itself quantized ({base.quantization_config.get('quant_method')})" if base.quantization_config else f"holds packed tensors ({packed})"
        raise SplicerError(f"base {base.label} {what}; pass the BF16 model the build was made from "
                           "(or --allow-quantized-base to use it as a partly quantized reference)")
    frozen: list[str] = []
    if base.quantization_config or packed:
        if not base.quantization_config:
            raise SplicerError(f"base {base.label} holds packed tensors ({packed}) but no quantization_config; it cannot be loaded, re-export it")
        missing = next((t for t in base.weight_map if is_packed_tensor(t) and t not in build.weight_map), None)
        if missing:
            raise SplicerError(f"base {base.label} has the packed tensor {missing} and the build has not; a partly quantized "
                               "reference must keep its quantized modules exactly as the build stores them")
        # From names alone: a base opened for a splice has read only the headers of the shards it restores from.
        frozen = sorted({base.arch.module_class(t.rpartition(".")[0]) for t in base.weight_map if is_packed_tensor(t)} - {"other"})
    if base.config.get("model_type") != build.config.get("model_type"):
        raise SplicerError(
            f"base {base.label} is a {base.config.get('model_type')!r} model but the build is {build.config.get('model_type')!r}; "
            "pass the base the build was made from"
        )
    for key in ("hidden_size", "vocab_size", "num_hidden_layers", "num_experts", "moe_intermediate_size"):
        a, b = base.text_config.get(key), build.text_config.get(key)
        if a != b:
            raise SplicerError(f"base {base.label} has {key}={a} but the build has {b}; pass the base the build was made from")
    return frozen


def parse_classes(spec: str, arch: Architecture, modules: dict[str, Module], build_has_mtp: bool = True) -> list[str]:
    items = [c.strip() for c in (spec or "").split(",") if c.strip()]
    if not items:
        raise SplicerError(f"--restore is empty; give a comma list of {', '.join(arch.classes)} or all")
    quantized = {m.cls for m in modules.values() if m.quantized}
    if not build_has_mtp:
        quantized.add("mtp")  # restoring it means adding the base's BF16 MTP head
    if items == ["all"]:
        return [c for c in arch.classes if c in quantized]
    unknown = [c for c in items if c not in arch.classes]
    if unknown:
        raise SplicerError(f"unknown class {unknown[0]!r} in --restore; choose from {', '.join(arch.classes)} or all")
    empty = [c for c in items if c not in quantized]
    if empty:
        raise SplicerError(
            f"class {empty[0]} has no quantized modules in this build, so there is nothing to restore; "
            f"quantized classes: {', '.join(c for c in arch.classes if c in quantized) or 'none'} (see splicer inspect)"
        )
    return [c for c in arch.classes if c in items]


def parse_layers(spec: str | None) -> set[int] | None:
    if not spec:
        return None
    layers: set[int] = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            layers.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise SplicerError(f"--layers {spec!r} is not a list of layer numbers or ranges like 0,4-7") from None
    return layers
