"""How compressed-tensors (HF names) and vLLM (its own names) read `quantization_config`.

The two readers disagree in ways that bite: vLLM renames exact dotted names with the
model's prefix mapper but leaves regexes and dot-free names alone, tests the shards of
fused layers (and refuses shards that disagree), decides all routed experts of a layer
from expert 0, and matches class targets as case-insensitive substrings of its own layer
class names. Sources: vLLM `layers/quantization/compressed_tensors/utils.py`
(should_ignore_layer, find_matched_target), `compressed_tensors.py` (get_scheme_dict),
`compressed_tensors_moe.py` (get_moe_method); compressed-tensors `utils/match.py`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .arch import Architecture
from .errors import SplicerError
from .formats import group_scheme
from .modules import Module

CLASS_TARGET_HF = "Linear"  # the class target compressed-tensors exporters write


def match_name(name: str, target: str) -> bool:
    """compressed-tensors' `utils.match.match_name` for module names: `re:` patterns are re.match'ed,
    anything else must be equal. Mirrored (and checked against the library in the tests) because
    importing compressed-tensors costs ~3 s, which would dominate `splice` on small checkpoints."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


@dataclass
class Reading:
    """What one reader (hf or vllm) makes of a module: the config group it lands in, or None."""

    group: str | None
    error: str | None = None


@dataclass
class Report:
    hf: dict[str, Reading] = field(default_factory=dict)
    vllm: dict[str, Reading] = field(default_factory=dict)
    issues: list[dict] = field(default_factory=list)  # {check, naming, detail}
    dead_ignore: dict[str, list[str]] = field(default_factory=dict)  # naming -> entries
    notes: list[str] = field(default_factory=list)  # not wrong for vLLM or transformers, but worth knowing

    def add(self, check: str, naming: str, detail: str) -> None:
        self.issues.append({"check": check, "naming": naming, "detail": detail})


def validate_regexes(qc: dict, label: str) -> None:
    """Every regex the readers will compile: `re:` ignore entries and targets, and GPTQ's `dynamic` rules (`-:`/`+:`,
    or bare keys, which GPTQModel treats as positive rules)."""
    for key in (qc.get("dynamic") or {}) if is_gptq(qc) else ():
        try:
            re.compile(key[2:] if key[:2] in ("-:", "+:") else key)
        except re.error as e:
            raise SplicerError(f"{label}: dynamic rule {key[:60]!r} is not a valid regex ({e}); fix config.json") from None
    for entry in list(qc.get("ignore") or []) + [
        t for g in (qc.get("config_groups") or {}).values() for t in g.get("targets", [])
    ]:
        if not isinstance(entry, str):
            raise SplicerError(f"{label}: quantization_config has a non-string ignore/target entry {entry!r}; fix config.json")
        if entry.startswith("re:"):
            try:
                re.compile(entry[3:])
            except re.error as e:
                raise SplicerError(
                    f"{label}: quantization_config entry {entry!r} is not a valid regex ({e}); fix config.json"
                ) from None


class Entries:
    """A list of ignore/target entries, compiled once: exact names in a set, `re:` patterns compiled."""

    def __init__(self, entries):
        self.entries = list(entries)
        self.exact = {e for e in self.entries if not e.startswith("re:")}
        self.compiled = [(e, re.compile(e[3:])) for e in self.entries if e.startswith("re:")]

    def match(self, name: str) -> bool:
        return name in self.exact or any(p.match(name) for _, p in self.compiled)


def _eq_or_re(value: str, entry: str, contains: bool = False) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], value) is not None
    if contains:
        return entry.lower() in value.lower()
    return entry == value


def _groups(qc: dict) -> list[tuple[str, list[str]]]:
    return [(name, list(g.get("targets") or [])) for name, g in (qc.get("config_groups") or {}).items()]


class HfReader:
    """compressed-tensors' view (HF names). Its match_targets order: exact names, then regexes,
    then class names; the first target in that order decides the group; ignore wins over all."""

    def __init__(self, qc: dict, arch: Architecture):
        self.arch = arch
        self.ignore = Entries(qc.get("ignore") or [])
        # apply_quantization_config keys schemes by target string (a later group wins a shared
        # target), and match_targets sorts targets as sorted(key=("re:" in t, t)).
        target_to_group = {t: g for g, ts in _groups(qc) for t in ts}
        self.exact = {t: g for t, g in target_to_group.items() if not t.startswith("re:")}
        self.regex = [(g, re.compile(t[3:])) for t, g in sorted(target_to_group.items()) if t.startswith("re:")]
        self.class_group = target_to_group.get(CLASS_TARGET_HF)

    def reading(self, module: Module) -> Reading:
        name = module.name
        if self.ignore.match(name):
            return Reading(None)
        if name in self.exact:
            return Reading(self.exact[name])
        for g, p in self.regex:
            if p.match(name):
                return Reading(g)
        if self.class_group and not self.arch.is_embedding(name):
            return Reading(self.class_group)
        return Reading(None)


class VllmReader:
    def __init__(self, qc: dict, arch: Architecture):
        self.arch = arch
        self.ignore = Entries(arch.vllm_rename_entry(e) for e in qc.get("ignore") or [])
        self.targets = [(g, arch.vllm_rename_entry(t)) for g, ts in _groups(qc) for t in ts]
        self.name_targets = [(g, t, re.compile(t[3:]) if t.startswith("re:") else None) for g, t in self.targets]
        self.tested: set[str] = set()  # every name vLLM tests against ignore (for dead entries)
        self._moe_cache: dict[str, Reading] = {}

    def _ignored(self, name: str) -> bool:
        self.tested.add(name)
        return self.ignore.match(name)

    def _name_target(self, name: str) -> str | None:
        for g, t, p in self.name_targets:
            if p.match(name) if p is not None else t == name:
                return g
        return None

    def _should_ignore_layer(self, layer, shards: list[str]) -> bool:
        self.tested.add(layer.name)
        if len(shards) > 1 and layer.name not in self.ignore.exact:
            states = {s: self._ignored(s) for s in shards}
            if len(set(states.values())) > 1:
                raise ValueError(
                    f"Found different quantization schemes for the shards of {layer.name}: "
                    + ", ".join(f"{s.rsplit('.', 1)[-1]} {'ignored' if v else 'quantized'}" for s, v in states.items())
                )
            return next(iter(states.values()))
        return self._ignored(shards[0]) or layer.name in self.ignore.exact

    def _match_target(self, name: str, class_names: tuple[str, ...], shards: list[str]) -> str | None:
        g = self._name_target(name)
        if g:
            return g
        for g, t in self.targets:
            if any(_eq_or_re(c, t, contains=True) for c in class_names):
                return g
        if len(shards) > 1:  # all fused shards must match some target
            hits = [self._name_target(s) for s in shards]
            if all(hits):
                return hits[0]
        return None

    def reading(self, module: Module) -> Reading:
        layer = self.arch.vllm_layer(module.name)
        if layer.kind in ("unquantized", "embedding"):
            return Reading(None)
        if layer.kind == "moe" and layer.name in self._moe_cache:
            return self._moe_cache[layer.name]  # vLLM reads every expert of a layer from expert 0
        shards = self.arch.vllm_shards_of(layer)
        try:
            if layer.kind == "moe":
                per_proj = []
                for s in shards:
                    per_proj.append(None if self._ignored(s) else self._match_target(s, layer.class_names, [s]))
                if len(set(per_proj)) > 1:
                    raise ValueError(
                        f"All MoE projections need to have same quantization scheme ({layer.name}: expert 0 gate/up/down read as {per_proj})"
                    )
                reading = Reading(per_proj[0])
            elif self._should_ignore_layer(layer, shards):
                reading = Reading(None)
            else:
                reading = Reading(self._match_target(layer.name, layer.class_names, shards))
        except ValueError as e:
            reading = Reading(None, error=str(e))
        if layer.kind == "moe":
            self._moe_cache[layer.name] = reading
        return reading


def is_gptq(qc: dict | None) -> bool:
    return bool(qc) and qc.get("quant_method") == "gptq"


def _dynamic_negative(qc: dict) -> list[tuple[str, re.Pattern]]:
    return [(k, re.compile(k[2:])) for k in (qc.get("dynamic") or {}) if k.startswith("-:")]


class GptqHfReader:
    """GPTQModel's view (HF names): every Linear of a decoder or MTP layer is quantized unless a `-:` rule of
    `dynamic` re.matches its name; lm_head only with `lm_head: true`."""

    def __init__(self, qc: dict, arch: Architecture):
        self.arch, self.qc = arch, qc
        self.negative = _dynamic_negative(qc)

    def reading(self, module: Module) -> Reading:
        name = module.name
        if any(p.match(name) for _, p in self.negative):
            return Reading(None)
        cls = self.arch.module_class(name)
        if cls == "lm_head":
            return Reading("gptq" if self.qc.get("lm_head") else None)
        if cls == "other" or self.arch.vllm_layer(name).kind in ("unquantized", "embedding"):
            return Reading(None)
        return Reading("gptq")


class GptqVllmReader:
    """vLLM's GPTQ / GPTQ-Marlin view (`quantization/utils/gptq_utils.py`). Linear layers: quantized when the
    checkpoint holds packed tensors for them (vLLM scans it into `modules_in_block_to_quantize` and matches by
    substring; shards of a fused layer must agree) and no `-:` rule of `dynamic` re.matches the layer's vLLM name.
    MoE layers: quantized unless a `-:` rule matches the `...mlp.experts` prefix (the scan does not cover them)."""

    def __init__(self, qc: dict, arch: Architecture, modules: dict[str, Module]):
        self.arch, self.qc = arch, qc
        self.negative = _dynamic_negative(qc)
        self.quantized = [arch.to_vllm_name(n) if not arch.is_mtp(n) else n for n, m in modules.items() if m.quantized]
        self.tested: set[str] = set()
        self._cache: dict[str, Reading] = {}

    def _excluded(self, prefix: str) -> bool:
        self.tested.add(prefix)
        return any(p.match(prefix) for _, p in self.negative)

    def _scanned(self, prefix: str) -> bool:
        return any(q in prefix for q in self.quantized)

    def reading(self, module: Module) -> Reading:
        layer = self.arch.vllm_layer(module.name)
        if layer.kind in ("unquantized", "embedding"):
            return Reading(None)
        if layer.name in self._cache:
            return self._cache[layer.name]
        if layer.kind == "moe":
            reading = Reading(None if self._excluded(layer.name) else "gptq")
        elif layer.kind == "lm_head" and not self.qc.get("lm_head"):
            reading = Reading(None)
        else:
            shards = self.arch.vllm_shards_of(layer)
            states = {s: self._scanned(s) for s in shards}
            if len(set(states.values())) > 1:
                reading = Reading(None, error=f"Detected some but not all shards of {layer.name} are quantized")
            else:
                quantized = next(iter(states.values())) and not self._excluded(layer.name)
                reading = Reading("gptq" if quantized else None)
        self._cache[layer.name] = reading
        return reading


SKIP_LIST_METHODS = ("fp8", "awq")  # formats whose config lists the modules left unquantized, not the quantized ones


def is_skip_list(qc: dict | None) -> bool:
    """Native FP8 (`ignored_layers`) and AWQ (`modules_to_not_convert`): everything is quantized but what is listed."""
    return bool(qc) and qc.get("quant_method") in SKIP_LIST_METHODS


def skip_lists(qc: dict) -> tuple[list[str] | None, list[str]]:
    """(the list transformers reads, None when absent; the list vLLM reads) of a skip-list config.

    vLLM 0.26 `Fp8Config.from_config` reads `ignored_layers` and only when that is missing or empty
    `modules_to_not_convert`; transformers' FineGrainedFP8Config reads `modules_to_not_convert` and takes
    `ignored_layers` only as an alias when the former is absent. AWQ: `modules_to_not_convert` for both.
    """
    if qc.get("quant_method") == "fp8":
        vllm = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or []
        hf = qc.get("modules_to_not_convert")
        return (qc.get("ignored_layers") if hf is None else hf), list(vllm)
    return qc.get("modules_to_not_convert"), list(qc.get("modules_to_not_convert") or [])


def skip_list_keys(qc: dict) -> list[str]:
    """The config keys a splice appends its entries to: the list each reader reads (see skip_lists), else
    modules_to_not_convert (read by transformers, and by vLLM's FP8 loader when ignored_layers is missing or empty).
    An empty ignored_layers beside a full modules_to_not_convert is not one of them: filling it would hide the other
    list from vLLM."""
    if qc.get("quant_method") == "fp8":
        vllm_key = (
            "ignored_layers"
            if qc.get("ignored_layers")
            else "modules_to_not_convert"
            if qc.get("modules_to_not_convert")
            else None
        )
        hf_key = (
            "modules_to_not_convert"
            if qc.get("modules_to_not_convert") is not None
            else "ignored_layers"
            if qc.get("ignored_layers") is not None
            else None
        )
        keys = [k for k in ("ignored_layers", "modules_to_not_convert") if k in (vllm_key, hf_key)]
        return keys or ["modules_to_not_convert"]
    return ["modules_to_not_convert"]


def skip_list_scheme(qc: dict) -> str:
    """What a skip-list config says every quantized module is stored as, in the words of `Module.scheme`."""
    if qc.get("quant_method") == "fp8":
        block = qc.get("weight_block_size")
        return f"fp8 block{block[0]}x{block[1]}" if block else "fp8 tensor"
    return f"int{qc.get('w_bit', qc.get('bits'))} g{qc.get('q_group_size', qc.get('group_size'))}"


def skip_list_mismatch(qc: dict, modules: dict[str, Module]) -> Module | None:
    """The first quantized module (by name) stored otherwise than a skip-list config says every one is (None: all agree)."""
    said = skip_list_scheme(qc)
    return next((m for _, m in sorted(modules.items()) if m.quantized and m.scheme != said), None)


def hf_should_skip(name: str, patterns: list[str]) -> bool:
    """transformers 5 `quantizers_utils.should_convert_module`, negated: a pattern matches from the start of the name up
    to a module boundary (as a regex), or as a suffix. Mirrored because transformers imports in seconds."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{p}){boundary}", name) or name.endswith(p) for p in patterns)


AWQ_HF_EXPERTS = (
    "transformers 5 replaces only nn.Linear modules with AWQ ones (integrations/awq.py), so it cannot load "
    "routed experts stored as AWQ (vLLM can)"
)


class SkipListHfReader:
    """transformers' view of a native FP8 or AWQ build: every Linear is replaced unless `should_convert_module` says
    skip; routed experts are one module per layer (`...mlp.experts`), decided together, and only FP8 replaces them
    (`replace_with_fp8_linear` swaps `.experts` modules; `replace_with_awq_linear` only nn.Linear). Its default skips (the
    output head) apply when the FP8 list is absent, and always for AWQ (`add_default_skips=True`)."""

    def __init__(self, qc: dict, arch: Architecture):
        self.arch, self.method = arch, qc["quant_method"]
        listed, _ = skip_lists(qc)
        defaults = self.method == "awq" or listed is None
        self.patterns = list(listed or []) + (list(arch.lm_head_names[:1]) if defaults else [])
        self.tested: set[str] = set()

    def reading(self, module: Module) -> Reading:
        if self.arch.is_embedding(module.name):
            return Reading(None)
        parts = self.arch.expert_parts(module.name)
        if parts and self.method == "awq":
            return Reading(None, error=AWQ_HF_EXPERTS if module.quantized else None)
        name = parts[0] if parts else module.name
        self.tested.add(name)
        return Reading(None if hf_should_skip(name, self.patterns) else self.method)


class SkipListVllmReader:
    """vLLM 0.26's view (`quant_utils.is_layer_skipped`): FP8 matches a layer's full name exactly, AWQ as a substring
    of it; a fused layer is skipped when its own name matches, else all its shards must agree; FP8 skips a whole MoE
    layer when its prefix is a substring of any listed name that contains "experts" (so one listed expert skips them
    all). The head is never FP8, and AWQ only with `lm_head: true`. An empty AWQ list makes vLLM list the parent of
    every tensor whose dtype is float16, bfloat16 or float32 unless a sibling tensor is not (`AutoAWQConfig.
    maybe_update_config`): that includes parents such as `...linear_attn` (its A_log, dt_bias), which as a substring
    then unquantizes every projection under it. tensor_dtypes (tensor name -> safetensors dtype) gives those parents;
    without it the modules stored unquantized stand in for them."""

    def __init__(self, qc: dict, arch: Architecture, modules: dict[str, Module], tensor_dtypes: dict[str, str] | None = None):
        self.arch, self.method = arch, qc["quant_method"]
        _, listed = skip_lists(qc)
        if self.method == "awq" and not listed:
            if tensor_dtypes:
                parents = {t.rpartition(".")[0] for t in tensor_dtypes}
                quant = {t.rpartition(".")[0] for t, d in tensor_dtypes.items() if d not in ("F16", "BF16", "F32")}
                listed = sorted(parents - quant)
            else:
                listed = [n for n, m in modules.items() if not m.quantized]
        self.entries = [arch.vllm_rename_entry(e) for e in listed]
        self.entry_set = set(self.entries)
        self.substr = self.method == "awq"
        self.head_quantized = self.method == "awq" and bool(qc.get("lm_head"))
        self.tested: set[str] = set()
        self._cache: dict[str, Reading] = {}

    def _match(self, prefix: str) -> bool:
        self.tested.add(prefix)
        return any(e in prefix for e in self.entries) if self.substr else prefix in self.entry_set

    def _skipped(self, layer) -> bool:
        if layer.kind == "moe":
            if self.substr:
                return self._match(layer.name)
            self.tested.add(layer.name)
            return any(layer.name in e for e in self.entries if "experts" in e)
        shards = self.arch.vllm_shards_of(layer)
        if len(shards) > 1:
            if self._match(layer.name):
                return True
            states = {s: self._match(s) for s in shards}
            if len(set(states.values())) > 1:
                raise ValueError(f"Detected some but not all shards of {layer.name} are quantized")
            return next(iter(states.values()))
        return self._match(layer.name)

    def entry_live(self, entry: str) -> bool:
        if self.substr:
            return any(entry in t for t in self.tested)
        return entry in self.tested or ("experts" in entry and any(t in entry for t in self.tested))

    def reading(self, module: Module) -> Reading:
        layer = self.arch.vllm_layer(module.name)
        if layer.kind in ("unquantized", "embedding") or (layer.kind == "lm_head" and not self.head_quantized):
            return Reading(None)
        if layer.name not in self._cache:
            try:
                self._cache[layer.name] = Reading(None if self._skipped(layer) else self.method)
            except ValueError as e:
                self._cache[layer.name] = Reading(None, error=str(e))
        return self._cache[layer.name]


def _check_skip_list(
    modules: dict[str, Module], qc: dict, arch: Architecture, report: Report, tensor_dtypes: dict[str, str] | None = None
) -> Report:
    hr, vr = SkipListHfReader(qc, arch), SkipListVllmReader(qc, arch, modules, tensor_dtypes)
    for name in sorted(modules):
        report.hf[name] = hr.reading(modules[name])
        report.vllm[name] = vr.reading(modules[name])
    _readings_vs_storage(modules, report)
    _fused_on_disk(modules, arch, report)
    hf_list, vllm_list = skip_lists(qc)
    if qc.get("quant_method") == "fp8" and hf_list is not None and list(hf_list) != vllm_list:
        report.add(
            "skip-lists-differ",
            "hf+vllm",
            "ignored_layers and modules_to_not_convert differ: vLLM reads "
            "ignored_layers, transformers modules_to_not_convert; keep one list",
        )
    report.dead_ignore["hf"] = [e for e in hf_list or [] if not any(hf_should_skip(t, [e]) for t in hr.tested)]
    if qc.get("quant_method") != "awq" or qc.get("modules_to_not_convert"):
        report.dead_ignore["vllm"] = [e for e in vllm_list if not vr.entry_live(arch.vllm_rename_entry(e))]
    dead_both = [e for e in report.dead_ignore["hf"] if e in report.dead_ignore.get("vllm", [])]
    if dead_both:
        report.add("dead-ignore", "hf+vllm", f"{len(dead_both)} skip-list entries match no module, e.g. {dead_both[0]!r}")
    wrong = skip_list_mismatch(qc, modules)
    if wrong:
        report.add("scheme-mismatch", "hf", f"{wrong.name}: config says {skip_list_scheme(qc)}, tensors are {wrong.scheme}")
    if qc.get("quant_method") == "awq" and ("bits" not in qc or "group_size" not in qc):
        report.notes.append(
            "transformers' AwqConfig reads bits and group_size only (defaults 4 and 128), not w_bit / "
            "q_group_size, which vLLM also reads; write both spellings for transformers"
        )
    if qc.get("quant_method") == "fp8" and not qc.get("weight_block_size"):
        report.notes.append(
            "transformers' FineGrainedFP8 loader assumes 128x128 blocks (weight_scale_inv): it cannot load "
            "this per-tensor FP8 build; vLLM can"
        )
    return report


def _record_dead(
    report: Report, entries: list[tuple[str, str, str]], hf_names: set[str], vllm_names: set[str], what: str
) -> None:
    """Entries (raw, as HF reads it, as vLLM reads it; `re:` or exact) that match no module name a reader tests.

    An entry only vLLM skips (e.g. mlp.gate, which vLLM never quantizes) is still needed by the HF-side reader;
    one that neither reader uses is dead weight (seed 000 shipped 60).
    """

    def matches(entry: str, names: set[str]) -> bool:
        if not entry.startswith("re:"):
            return entry in names
        p = re.compile(entry[3:])
        return any(p.match(n) for n in names)

    report.dead_ignore["hf"] = [raw for raw, hf, _ in entries if not matches(hf, hf_names)]
    report.dead_ignore["vllm"] = [raw for raw, _, vl in entries if not matches(vl, vllm_names)]
    dead_both = [e for e in report.dead_ignore["hf"] if e in report.dead_ignore["vllm"]]
    if dead_both:
        report.add("dead-ignore", "hf+vllm", f"{len(dead_both)} {what} match no module, e.g. {dead_both[0]!r}")


def _readings_vs_storage(modules: dict[str, Module], report: Report) -> None:
    for naming, readings in (("hf", report.hf), ("vllm", report.vllm)):
        for err in sorted({r.error for r in readings.values() if r.error}):
            report.add("vllm-refuses" if naming == "vllm" else "hf-cannot-load", naming, err)
        wrong = [(n, r) for n, r in readings.items() if not r.error and (r.group is not None) != modules[n].quantized]
        for n, r in wrong[:20]:
            if modules[n].quantized:
                report.add("stored-quantized-read-bf16", naming, f"{n} is stored packed but the config reads it as unquantized")
            else:
                report.add("stored-bf16-read-quantized", naming, f"{n} is stored BF16 but the config reads it as {r.group}")
        if len(wrong) > 20:
            report.add("more", naming, f"{len(wrong) - 20} more modules disagree with the config")


def _fused_on_disk(modules: dict[str, Module], arch: Architecture, report: Report) -> None:
    """Fused groups whose shards differ on disk (vLLM cannot load a half-quantized fused layer)."""
    units: dict[str, list[Module]] = {}
    for m in modules.values():
        units.setdefault(arch.atomic_unit(m.name), []).append(m)
    for unit, ms in sorted(units.items()):
        kinds = {(m.quantized, m.scheme) for m in ms}
        if len(kinds) > 1:
            q = sorted(m.name.rsplit(".", 1)[-1] for m in ms if m.quantized)
            report.add(
                "fused-shards-disagree",
                "disk",
                f"{unit}: {len([m for m in ms if m.quantized])} of {len(ms)} shards packed ({', '.join(q[:3])}...) with {sorted(kinds, key=str)}",
            )


def _check_gptq(modules: dict[str, Module], qc: dict, arch: Architecture, report: Report) -> Report:
    hr, vr = GptqHfReader(qc, arch), GptqVllmReader(qc, arch, modules)
    for name in sorted(modules):
        report.hf[name] = hr.reading(modules[name])
        report.vllm[name] = vr.reading(modules[name])
    _readings_vs_storage(modules, report)
    _fused_on_disk(modules, arch, report)
    # `-:X` rules are re.match'ed against HF names by GPTQModel and against vLLM names, unrenamed, by vLLM.
    rules = [(k, "re:" + k[2:], "re:" + k[2:]) for k in (qc.get("dynamic") or {}) if k.startswith("-:")]
    _record_dead(report, rules, set(modules), vr.tested, "dynamic exclusions")
    bits = {(m.bits, m.group_size) for m in modules.values() if m.quantized}
    want = (qc.get("bits"), qc.get("group_size"))
    if bits and bits != {want}:
        report.add("scheme-mismatch", "hf", f"config says {want[0]}-bit g{want[1]}, tensors are {sorted(bits)}")
    return report


def check(modules: dict[str, Module], qc: dict | None, arch: Architecture, tensor_dtypes: dict[str, str] | None = None) -> Report:
    """Lint a checkpoint's config against its tensors, under HF and vLLM naming (tensor_dtypes: every tensor's
    safetensors dtype, for the one reader that decides from them, vLLM's AWQ loader with an empty skip list)."""
    report = Report()
    qc = qc or {}
    if is_gptq(qc):
        return _check_gptq(modules, qc, arch, report)
    if is_skip_list(qc):
        return _check_skip_list(modules, qc, arch, report, tensor_dtypes)
    vr, hr = VllmReader(qc, arch), HfReader(qc, arch)
    for name in sorted(modules):
        m = modules[name]
        report.hf[name] = hr.reading(m)
        report.vllm[name] = vr.reading(m)
    _readings_vs_storage(modules, report)
    _fused_on_disk(modules, arch, report)
    ignore = qc.get("ignore") or []
    _record_dead(report, [(e, e, arch.vllm_rename_entry(e)) for e in ignore], set(modules), vr.tested, "ignore entries")
    # compressed-tensors' model-free dequantizer (entrypoints/convert, CompressedTensorsDequantizer.process)
    # takes the first group in file order whose targets match, class targets included; with `Linear`
    # listed before `re:.*lm_head$` (seed 000's layout) it reads the INT8 head as INT4.
    for n, r in report.hf.items():
        if not (r.group and modules[n].quantized):
            continue
        first = next((g for g, ts in _groups(qc) if any(match_name(n, t) or t == CLASS_TARGET_HF for t in ts)), None)
        if first != r.group:
            report.notes.append(
                f"{n}: loaders use {r.group}, but compressed-tensors' model-free dequantizer takes {first} "
                f"(first group in file order); put {r.group} first for model-free tools"
            )
    # Each group's scheme against the tensors it claims.
    for n, r in report.hf.items():
        m = modules[n]
        if r.group and m.quantized:
            said = group_scheme(qc, r.group, m.shape[1])
            if said != m.scheme:
                report.add("scheme-mismatch", "hf", f"{n}: config {r.group} says {said}, tensors are {m.scheme}")
                break
    return report
