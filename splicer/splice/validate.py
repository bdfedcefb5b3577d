"""Input checks for splice: the build, the base, the class list and the output path.

Each check raises SplicerError with one line naming the problem and the fix, before anything is written.
"""

from __future__ import annotations

import json
import re

from ..arch import family_mismatch
from ..arch.table import Architecture
from ..checkpoint import Checkpoint
from ..errors import SplicerError
from ..formats.layouts import is_packed_tensor
from ..formats.module import Module
from ..formats.registry import format_or_default, read_format
from .selection import DRAFTER_CLASS, check_serves, clip, entry_layers, layer_numbers, layers_read, split_restore


def validate_family(ckpt: Checkpoint, role: str) -> None:
    """The checkpoint's tensors must be its model_type's: a family's table names its modules, and tensors of another
    family (qwen3_moe tensors labelled llama) would leave them unclassed, so nothing of them could be restored."""
    why = family_mismatch(ckpt.config.get("model_type"), ckpt.weight_map)
    if why:
        raise SplicerError(f"{role} {ckpt.label}: {why}")


def validate_build(build: Checkpoint) -> None:
    validate_family(build, "build")
    qc = build.quantization_config
    if not qc:
        raise SplicerError(
            f"build {build.label} has no quantization_config in config.json; it is not a quantized build (did you swap BUILD and BASE?)"
        )
    read_format(qc, f"build {build.label}").validate_config(build, qc)


def validate_schemes(build: Checkpoint, modules: dict[str, Module]) -> None:
    """Every packed module must agree with the config group that claims it (bits, group size dividing its input dim)."""
    qc = build.quantization_config
    format_or_default(qc).validate_schemes(build, qc, modules)


def validate_base(base: Checkpoint, build: Checkpoint, allow_quantized: bool = False) -> list[str]:
    """Check that BASE can serve as the build's reference; returns the classes the base itself keeps quantized.

    A partly quantized base (allow_quantized) is a stand-in reference: e.g. experts kept INT4 because BF16
    experts do not fit the disk. Its quantized modules must be stored exactly as in the build (same packed
    tensors), so that the reference and every variant share them; those classes cannot be restored.
    """
    validate_family(base, "base")
    packed = next((t for t in base.weight_map if is_packed_tensor(t)), None)
    if (base.quantization_config or packed) and not allow_quantized:
        what = (
            f"is itself quantized ({base.quantization_config.get('quant_method')})"
            if base.quantization_config
            else f"holds packed tensors ({packed})"
        )
        raise SplicerError(
            f"base {base.label} {what}; pass the BF16 model the build was made from "
            "(or --allow-quantized-base to use it as a partly quantized reference)"
        )
    frozen: list[str] = []
    if base.quantization_config or packed:
        if not base.quantization_config:
            raise SplicerError(
                f"base {base.label} holds packed tensors ({packed}) but no quantization_config; it cannot be loaded, re-export it"
            )
        missing = next((t for t in base.weight_map if is_packed_tensor(t) and t not in build.weight_map), None)
        if missing:
            raise SplicerError(
                f"base {base.label} has the packed tensor {missing} and the build has not; a partly quantized "
                "reference must keep its quantized modules exactly as the build stores them"
            )
        # From names alone: a base opened for a splice has read only the headers of the shards it restores from.
        frozen = sorted(
            {base.arch.module_class(t.rpartition(".")[0]) for t in base.weight_map if is_packed_tensor(t)} - {"other"}
        )
    if base.config.get("model_type") != build.config.get("model_type"):
        raise SplicerError(
            f"base {base.label} is a {base.config.get('model_type')!r} model but the build is {build.config.get('model_type')!r}; "
            "pass the base the build was made from"
        )
    for key in ("hidden_size", "vocab_size", "num_hidden_layers", "num_experts", "moe_intermediate_size"):
        a, b = base.text_config.get(key), build.text_config.get(key)
        if a != b:
            raise SplicerError(f"base {base.label} has {key}={a} but the build has {b}; pass the base the build was made from")
    # The rest of the model's shape, where both configs state it: ablate builds each model from its own config, and a
    # base that differs would be refused only by the torch backend, once the run has started writing DIR.
    for key in build.arch.shape_keys:
        a, b = base.text_config.get(key), build.text_config.get(key)
        if a is not None and b is not None and a != b:
            raise SplicerError(
                f"base {base.label} has {key}={_short(a)} but the build has {_short(b)}; pass the base the build was made from"
            )
    return frozen


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
        raise SplicerError(
            f"unknown class {unknown[0]!r} in --restore: this build's family ({arch.name}) has "
            f"{', '.join(arch.classes)}; choose from those or all"
        )
    empty = [c for c in items if c not in quantized]
    if empty and empty[0] == DRAFTER_CLASS and arch.no_mtp_reason:
        raise SplicerError(f"this checkpoint has no MTP layer ({arch.no_mtp_reason}); drop mtp from --restore")
    if empty:
        raise SplicerError(
            f"class {empty[0]} has no quantized modules in this build, so there is nothing to restore; "
            f"quantized classes: {', '.join(c for c in arch.classes if c in quantized) or 'none'} (see splicer inspect)"
        )
    return [c for c in arch.classes if c in items]


def parse_restore(
    spec: str,
    arch: Architecture,
    modules: dict[str, Module],
    build_has_mtp: bool,
    num_layers: int,
    mtp_layer: int | None = None,
    layers_option: str | None = None,
) -> dict[str, set[int] | None]:
    """`--restore gdn@0-9,attention@3,7,experts` -> {class: the decoder layers to restore it in, or None for all}, in
    the family's class order. Checked against the build: each class as parse_classes checks it, each layer in range,
    and a class given layers must have quantized modules in them."""
    items = split_restore(spec)
    if any(not c for c, _ in items):
        raise SplicerError(f"--restore {clip(spec)}: an entry has no class before @; write CLASS or CLASS@LAYERS, e.g. gdn@0-9")
    if any(c == "all" for c, _ in items) and (len(items) > 1 or items[0][1] is not None):
        raise SplicerError(
            f"--restore {clip(spec)}: all means every quantized class in every layer and stands alone; "
            "drop it, or drop the other entries"
        )
    classes = parse_classes(",".join(c for c, _ in items), arch, modules, build_has_mtp)
    if any(layers is not None for _, layers in items) and layers_option is not None:
        raise SplicerError(
            "--restore names layers with @ and --layers is given too; put the layers after each class "
            "(gdn@0-9) or use --layers for all of them, not both"
        )
    per: dict[str, set[int] | None] = {}
    layers_of = quantized_layers(modules, arch)
    for cls, text in items:
        if text is None:
            per[cls] = None
            continue
        have = layers_of.get(cls, [])
        where = f"--restore {cls}@{clip(text)[1:-1]}"
        if have and not text.strip():
            parse_layers(text, num_layers, mtp_layer, what=f"--restore {cls}@")  # refused, in the option's own words
        got = entry_layers(cls, text, have, where, num_layers, mtp_layer)
        if cls in per and per[cls] is None:
            continue
        per[cls] = (per.get(cls) or set()) | got
        check_serves(cls, got, have, where)
    # One variant, one name: layers without the class dropped, all of its layers written as the bare class.
    for cls, got in per.items():
        if got is not None:
            per[cls] = layers_read(got, layers_of[cls])
    return {c: per.get(c) for c in classes}


def quantized_layers(modules: dict[str, Module], arch: Architecture) -> dict[str, list[int]]:
    """class -> the decoder layers holding its quantized modules (the MTP head, stored apart or as a layer, not counted)."""
    out: dict[str, set[int]] = {}
    for n, m in modules.items():
        if m.quantized and not arch.is_mtp(n) and arch.layer_index(n) is not None:
            out.setdefault(m.cls, set()).add(arch.layer_index(n))
    return {c: sorted(v) for c, v in out.items()}


def parse_layers(spec: str | None, num_layers: int, mtp_layer: int | None = None, what: str = "--layers") -> set[int] | None:
    """`--layers 0,4-7` as a set of decoder layers of a build with num_layers layers (None: all of them). mtp_layer:
    the index of an MTP head stored as one more decoder layer (DeepSeek-V3, GLM-4.5), which --layers does not select.

    The numbers are read by the grammar's one parser (selection.layer_numbers); an empty value is refused here, in the
    option's own words.
    """
    if spec is None:
        return None
    if not spec.strip():
        raise SplicerError(
            f"{what} is empty; give layer numbers or ranges like 0,4-7 (this build has {num_layers} "
            f"decoder layers, 0-{num_layers - 1}), or "
            + ("drop --layers" if what == "--layers" else "name the class alone for all its layers")
        )
    label = f"{what}{clip(spec)[1:-1]}" if what.endswith("@") else f"{what} {clip(spec)}"
    return set(layer_numbers(spec, label, num_layers, mtp_layer))


def check_modules_regex(regex: str | None) -> str | None:
    """`--modules REGEX` must compile (select_modules re.search'es it against every module name); returns it."""
    if regex is None:
        return None
    try:
        re.compile(regex)
    except (re.error, RecursionError, OverflowError, ValueError) as e:
        detail = str(e).splitlines()[0] if str(e) else e.__class__.__name__
        raise SplicerError(
            f"--modules {clip(regex)} is not a valid Python regular expression ({detail}); fix the pattern, "
            "e.g. 'layers\\.[0-3]\\.' (see splicer inspect for module names)"
        ) from None
    return regex
