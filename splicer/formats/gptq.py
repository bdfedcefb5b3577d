"""GPTQ as GPTQModel / AutoGPTQ write it (`quant_method: gptq`): every Linear of the decoder is quantized, `dynamic`
rules exclude (`-:REGEX`) or override (`+:REGEX`) per module."""

from __future__ import annotations

import re

from ..arch.table import Architecture
from ..errors import SplicerError
from ..io.config_schema import GPTQ, QC
from . import module_regexes
from .base import QuantFormat
from .module import Module
from .readings import Reading, fused_on_disk, note_other_releases, readings_vs_storage, record_dead
from .vllm_versions import modeled, refusing_group_actorder


def rule_regex(key: str) -> str:
    """The regex of a `dynamic` key: `-:X` and `+:X` are X, a bare key (a positive rule to GPTQModel and vLLM) itself."""
    return key[2:] if key[:2] in ("-:", "+:") else key


def matching_rule(dynamic: dict | None, name: str) -> tuple[str, object] | None:
    """(key, overrides) of the first `dynamic` rule whose regex re.matches `name`, in the config's order, as vLLM's
    `gptq_utils.get_dynamic_override` and GPTQModel's `dynamic_get` both walk them; None where none matches."""
    return next(((k, v) for k, v in (dynamic or {}).items() if re.match(rule_regex(k), name)), None)


def dynamic_rule(dynamic: dict | None, name: str) -> bool | dict | None:
    """What the first matching `dynamic` rule says (matching_rule): False for a `-:` rule (the module stays
    unquantized), the rule's overrides for a `+:` or bare one, None where no rule matches. So a `+:` rule listed
    before a `-:` rule that also matches keeps the module quantized: a splice puts its `-:` rules first."""
    hit = matching_rule(dynamic, name)
    if hit is None:
        return None
    return False if hit[0].startswith("-:") else hit[1]


def vllm_gptq_quantized(
    layer: str, shards: list[str] | None, kind: str, dynamic: dict | None, listed: list[str], empty_list_quantized: bool
) -> bool:
    """vLLM's answer for one layer of a GPTQ build (`get_moe_quant_method` / `get_linear_quant_method`): routed experts
    are quantized unless the first `dynamic` rule matching `...mlp.experts` is `-:`; any other layer also needs an entry
    of `listed` (`modules_in_block_to_quantize`: the config's, else every module the checkpoint stores packed) to be a
    substring of its name or, for a fused layer (`shards`, None when it is not fused), of every shard's name. Shards
    that disagree are refused (ValueError), before `dynamic` is read. An empty list reads every layer as quantized from
    vLLM 0.32 (`empty_list_quantized`), as unquantized before; vLLM fills an absent list from the checkpoint, so only
    a config that names no module at all reaches it."""
    if kind == "moe":
        return dynamic_rule(dynamic, layer) is not False
    if not listed:
        quantized = empty_list_quantized
    elif shards is None:
        quantized = any(e in layer for e in listed)
    else:
        states = {any(e in s for e in listed) for s in shards}
        if len(states) > 1:
            raise ValueError(f"Detected some but not all shards of {layer} are quantized")
        quantized = states.pop()
    return quantized and dynamic_rule(dynamic, layer) is not False


def listed_modules(qc: dict) -> list[str] | None:
    """The config's `modules_in_block_to_quantize` as vLLM reads it (AutoGPTQConfig.maybe_update_config; None where
    absent or empty: vLLM then scans the checkpoint). vLLM flattens it when its first item is a list, iterating every
    item, so a name among lists is read letter by letter; a list after a first name is refused (ValueError: vLLM's
    mapper fails on it)."""
    listed = qc.get("modules_in_block_to_quantize")
    if not listed:
        return None
    if isinstance(listed[0], list):
        return [e for item in listed for e in item]
    if any(isinstance(item, list) for item in listed):
        raise ValueError(
            "modules_in_block_to_quantize mixes names and lists of names, with a name first: vLLM fails to read it; "
            "give a list of names or a list of lists"
        )
    return list(listed)


# AutoGPTQConfig.TYPE_MAP (0.26 to 0.33): the (bits, symmetric) vLLM's GPTQ loader builds; any other is refused.
VLLM_GPTQ_TYPES = {(4, True), (8, True)}


def module_scheme(qc: dict, name: str) -> tuple[int, int | None, bool, str | None]:
    """(bits, group size, symmetric, the rule that set any of them) a quantized module of this name is built with, by
    vLLM (gptq_utils.override_config, on its vLLM name) and GPTQModel (on the HF name) alike: the config's values,
    overridden by the first `dynamic` rule that matches, where that rule is not `-:` and gives an int or a bool."""
    bits, group, sym = qc.get("bits"), qc.get("group_size"), qc.get("sym", True)
    hit = matching_rule(qc.get("dynamic"), name)
    if hit is None or hit[0].startswith("-:") or not isinstance(hit[1], dict):
        return bits, group, sym, None
    key, overrides = hit
    bits = overrides["bits"] if isinstance(overrides.get("bits"), int) else bits
    group = overrides["group_size"] if isinstance(overrides.get("group_size"), int) else group
    sym = overrides["sym"] if isinstance(overrides.get("sym"), bool) else sym
    return bits, group, sym, key


def desc_act_refused(qc: dict) -> str | None:
    """What of a GPTQ config vLLM 0.30+ refuses as group activation ordering, or None: desc_act with groups (with one
    group per output channel, group_size -1, ordering is a no-op and is dropped), in the config or in a `dynamic`
    rule's overrides (vLLM 0.33 gptq_utils.normalize_and_validate_gptq_desc_act; `-:` rules exclude, they set nothing)."""
    desc_act, group_size = bool(qc.get("desc_act")), qc.get("group_size")
    if desc_act and group_size != -1:
        return f"desc_act=true with group_size {group_size}"
    for pattern, overrides in (qc.get("dynamic") or {}).items():
        if pattern.startswith("-:") or not isinstance(overrides, dict):
            continue
        if overrides.get("desc_act", desc_act) and overrides.get("group_size", group_size) != -1:
            return f"dynamic rule {pattern!r} enables desc_act with groups"
    return None


class GptqHfReader:
    """GPTQModel's view (HF names): every Linear of a decoder or MTP layer is quantized unless the first `dynamic`
    rule that re.matches its name is a `-:` rule; lm_head only with `lm_head: true`."""

    def __init__(self, qc: dict, arch: Architecture):
        self.arch, self.qc = arch, qc
        self.dynamic = qc.get("dynamic") or {}

    def reading(self, module: Module) -> Reading:
        name = module.name
        if dynamic_rule(self.dynamic, name) is False:
            return Reading(None)
        cls = self.arch.module_class(name)
        if cls == "lm_head":
            return Reading("gptq" if self.qc.get("lm_head") else None)
        if cls == "other" or self.arch.vllm_layer(name).kind in ("unquantized", "embedding"):
            return Reading(None)
        return Reading("gptq")


class GptqVllmReader:
    """vLLM's GPTQ / GPTQ-Marlin view (`quantization/utils/gptq_utils.py`, `vllm_gptq_quantized`): the list of
    quantized modules is the config's `modules_in_block_to_quantize` (renamed as vLLM's mapper renames it), else the
    modules the checkpoint stores packed (vLLM scans the safetensors headers)."""

    def __init__(self, qc: dict, arch: Architecture, modules: dict[str, Module], release=None):
        self.arch, self.qc = arch, qc
        self.dynamic = qc.get("dynamic") or {}
        self.release = release or modeled()
        self.list_error = None
        try:
            listed = listed_modules(qc)
        except ValueError as e:
            listed, self.list_error = [], str(e)
        if listed is not None:
            self.listed = [arch.vllm_rename_entry(e) for e in listed]
        else:
            self.listed = [arch.to_vllm_name(n) if not arch.is_mtp(n) else n for n, m in modules.items() if m.quantized]
        # vLLM 0.27+ (qwen3_5_mtp.py): any `-:` key containing "mtp" leaves the drafter's decoder layers unquantized
        rule = arch.vllm_gptq_mtp_rule_layers if self.release.gptq_mtp_rule else None
        self.mtp_unquantized = re.compile(rule) if rule and any(k.startswith("-:") and "mtp" in k for k in self.dynamic) else None
        self.tested: set[str] = set()
        self._cache: dict[str, Reading] = {}

    def reading(self, module: Module) -> Reading:
        layer = self.arch.vllm_layer(module.name)
        if layer.kind in ("unquantized", "embedding"):
            return Reading(None)
        if layer.name in self._cache:
            return self._cache[layer.name]
        if layer.kind == "lm_head" and not self.qc.get("lm_head"):
            reading = Reading(None)
        elif self.mtp_unquantized is not None and self.mtp_unquantized.fullmatch(module.name):
            reading = Reading(None)
        elif self.list_error and layer.kind != "moe":
            reading = Reading(None, error=self.list_error)
        else:
            self.tested.add(layer.name)
            try:
                quantized = vllm_gptq_quantized(
                    layer.name,
                    self.arch.vllm_fused_shards(layer),
                    layer.kind,
                    self.dynamic,
                    self.listed,
                    self.release.gptq_empty_list_quantized,
                )
                reading = Reading("gptq" if quantized else None)
            except ValueError as e:
                reading = Reading(None, error=str(e))
        self._cache[layer.name] = reading
        return reading


class Gptq(QuantFormat):
    quant_method = "gptq"
    read_as = "GPTQ"
    config_fields = GPTQ

    def check_config_fields(self, qc, where):
        if qc.get("group_size") == 0:
            raise SplicerError(
                f"{where}: config.json field {QC}.group_size is 0, but it should be -1 or a positive whole "
                "number; fix config.json or restore it from the original checkpoint"
            )

    def validate_regexes(self, qc, label):
        """`dynamic` rules too (`-:`/`+:`, or bare keys, which GPTQModel treats as positive rules)."""
        for key in qc.get("dynamic") or {}:
            try:
                re.compile(rule_regex(key))
            except re.error as e:
                raise SplicerError(f"{label}: dynamic rule {key[:60]!r} is not a valid regex ({e}); fix config.json") from None
        super().validate_regexes(qc, label)

    def validate_config(self, build, qc):
        if qc.get("bits") not in (2, 3, 4, 8):
            raise SplicerError(f"build {build.label}: GPTQ bits {qc.get('bits')!r} is not 2, 3, 4 or 8; the config is invalid")
        self.validate_regexes(qc, f"build {build.label}")
        if not any(t.endswith(".qweight") for t in build.weight_map):
            raise SplicerError(
                f"build {build.label}: config.json says gptq but no tensor is packed (no qweight); the shards do not belong to this config"
            )

    def validate_schemes(self, build, qc, modules):
        if any(k.startswith("+:") for k in qc.get("dynamic") or {}):
            return  # per-module overrides: bits and group size may differ by design
        for name, m in sorted(modules.items()):
            g = qc.get("group_size")
            if m.quantized and ((m.bits, m.group_size) != (qc["bits"], g if g and g > 0 else m.shape[1])):
                raise SplicerError(
                    f"build {build.label}: {name} is stored as {m.bits}-bit g{m.group_size} but the config says "
                    f"{qc['bits']}-bit g{g}; the config does not match the shards, re-export the build"
                )

    def check(self, modules, qc, arch, report, tensor_dtypes=None):
        hr, vr = GptqHfReader(qc, arch), GptqVllmReader(qc, arch, modules)
        for name in sorted(modules):
            report.hf[name] = hr.reading(modules[name])
            report.vllm[name] = vr.reading(modules[name])
        readings_vs_storage(modules, report)
        fused_on_disk(modules, arch, report)
        # `-:X` rules are re.match'ed against HF names by GPTQModel and against vLLM names, unrenamed, by vLLM.
        rules = [(k, "re:" + k[2:], "re:" + k[2:]) for k in (qc.get("dynamic") or {}) if k.startswith("-:")]
        record_dead(report, rules, set(modules), vr.tested, "dynamic exclusions")
        bits = {(m.bits, m.group_size) for m in modules.values() if m.quantized}
        want = (qc.get("bits"), qc.get("group_size"))
        if bits and bits != {want}:
            report.add("scheme-mismatch", "hf", f"config says {want[0]}-bit g{want[1]}, tensors are {sorted(bits)}")
        self.check_module_schemes(modules, qc, arch, report)
        # Where other checked releases read modules otherwise (vllm_versions), once per way of reading
        note_other_releases(
            report,
            modules,
            vr.release,
            ("gptq_empty_list_quantized", "gptq_mtp_rule"),
            lambda release: GptqVllmReader(qc, arch, modules, release),
        )
        refused = desc_act_refused(qc)
        if refused:
            text = (
                f"{refused}: group activation ordering, refused by {refusing_group_actorder()}; "
                're-quantize with desc_act=false (or, through llm-compressor, actorder="weight")'
            )
            # a problem where the release modeled refuses it, a note where only later ones do
            if vr.release.refuses_group_actorder:
                report.add("refused", "vllm", text)
            else:
                report.notes.append(text)
        return report

    def check_module_schemes(self, modules, qc, arch, report) -> None:
        """Each module a reader builds quantized, with the bits and group size its first matching `dynamic` rule gives
        (module_scheme), against the tensors stored; and what vLLM's GPTQ loader refuses outright (VLLM_GPTQ_TYPES)."""
        refused = {}
        for name in sorted(modules):
            m = modules[name]
            for naming, reading, rule_name in (
                ("hf", report.hf[name], name),
                ("vllm", report.vllm[name], arch.vllm_layer(name).name),
            ):
                if reading.group != "gptq":
                    continue
                bits, group, sym, key = module_scheme(qc, rule_name)
                if naming == "vllm" and (bits, sym) not in VLLM_GPTQ_TYPES:
                    refused.setdefault((bits, sym, key), name)
                if not m.quantized or m.bits is None:
                    continue
                want = group if group and group > 0 else m.shape[1]
                if (m.bits, m.group_size) != (bits, want):
                    where = f"dynamic rule {key!r}" if key else "the config"
                    report.add(
                        "scheme-mismatch",
                        naming,
                        f"{name}: {where} reads it as {bits}-bit g{group}, tensors are {m.bits}-bit g{m.group_size}",
                    )
        for (bits, sym, key), name in refused.items():
            where = f"dynamic rule {key!r}" if key else "the config"
            report.add(
                "refused",
                "vllm",
                f"{where} asks for {bits}-bit {'symmetric' if sym else 'asymmetric'} GPTQ (e.g. {name}), which vLLM's GPTQ "
                "loader refuses (it builds 4- and 8-bit symmetric only, vLLM 0.26 to 0.33); re-quantize to one of those",
            )

    def exclude_restored(self, qc, modules, picked, arch):
        # vLLM and GPTQModel stop at the first `dynamic` rule that matches: the new `-:` rules go first. They name the
        # restored modules and the vLLM layers those load into (fused names, the MoE prefix), under both namings.
        units = {arch.atomic_unit(n) for n in picked}
        names = dict(picked) | {u: Module(u, arch.module_class(u), shape=(0, 0)) for u in units}
        universe = dict(modules)
        for u in {arch.atomic_unit(n) for n, m in modules.items() if m.quantized}:
            universe[u] = Module(u, arch.module_class(u), packed={"qweight": None}, shape=(0, 0))
        self.add_exclusions(qc, module_regexes.ignore_entries(names, universe, arch))
        if "lm_head" in picked:
            qc["lm_head"] = False

    def add_exclusions(self, qc, entries):
        """`-:X` rules, put first in `dynamic`."""
        rules = ["-:" + (e[3:] if e.startswith("re:") else re.escape(e) + "$") for e in entries]
        old = qc.get("dynamic") or {}
        qc["dynamic"] = {**{r: {} for r in rules if r not in old}, **old}

    def remove_exclusions(self, qc, entries):
        qc["dynamic"] = {k: v for k, v in qc["dynamic"].items() if k not in entries}

    def exclusions(self, qc):
        return [k for k in qc.get("dynamic") or {} if k.startswith("-:")]

    def torch_schemes(self, ckpt, qc, modules):
        if qc.get("checkpoint_format", "gptq") != "gptq":
            raise SplicerError(
                f"{ckpt.label}: GPTQ checkpoint_format {qc.get('checkpoint_format')!r}; the torch backend reads v1 ('gptq') only"
            )
        return {n: (m, m.bits) for n, m in modules.items()}


FORMAT = Gptq()
