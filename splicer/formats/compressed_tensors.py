"""compressed-tensors (`quant_method: compressed-tensors`): config_groups name the quantized modules by target, `ignore`
the ones left out.

How compressed-tensors (HF names) and vLLM (its own names) read the config disagree in ways that bite: vLLM renames
exact dotted names with the model's prefix mapper but leaves regexes and dot-free names alone, tests the shards of
fused layers (and refuses shards that disagree), decides all routed experts of a layer from expert 0, and matches class
targets as case-insensitive substrings of its own layer class names. Sources: vLLM
`layers/quantization/compressed_tensors/utils.py` (should_ignore_layer, find_matched_target), `compressed_tensors.py`
(get_scheme_dict), `compressed_tensors_moe.py` (get_moe_method); compressed-tensors `utils/match.py`.
"""

from __future__ import annotations

import re

from ..arch.table import Architecture
from ..errors import SplicerError
from ..io.config_schema import COMPRESSED_TENSORS, QC, path_key
from . import module_regexes
from .base import QuantFormat
from .layouts import CT_FORMATS, group_format, group_scheme, is_packed_tensor
from .module import Module
from .readings import Entries, Reading, fused_on_disk, match_name, note_other_releases, readings_vs_storage, record_dead
from .vllm_versions import VllmReleaseReader, modeled, refusing_group_actorder

CLASS_TARGET_HF = "Linear"  # the class target compressed-tensors exporters write


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


def vllm_should_ignore(
    layer_name: str, shards: list[str], ignore: Entries, fused_name_first: bool, tested: set | None = None
) -> bool:
    """vLLM's should_ignore_layer for one layer (shards: the names it tests for a fused layer, else the layer's own):
    raises ValueError when the shards of a fused layer disagree. fused_name_first: vLLM 0.30 and later, where an entry
    matching the fused name itself decides before the shards (vllm_versions). tested: gets every name it tests."""
    tested = set() if tested is None else tested
    if fused_name_first:
        tested.add(layer_name)
        if ignore.match(layer_name):
            return True
    if len(shards) > 1 and (fused_name_first or layer_name not in ignore.exact):
        tested.update(shards)
        states = {s: ignore.match(s) for s in shards}
        if len(set(states.values())) > 1:
            raise ValueError(
                f"Found different quantization schemes for the shards of {layer_name}: "
                + ", ".join(f"{s.rsplit('.', 1)[-1]} {'ignored' if v else 'quantized'}" for s, v in states.items())
            )
        return next(iter(states.values()))
    tested.add(shards[0])
    return ignore.match(shards[0]) or layer_name in ignore.exact


def vllm_targets(target_group: dict) -> dict:
    """vLLM's target_scheme_map as its MoE layers read it (CompressedTensorsConfig._add_fused_moe_to_target_scheme_map,
    0.26 to 0.33): an exact "Linear" target is also given to "RoutedExperts", the MoE layer's class, last."""
    if "Linear" in target_group and "RoutedExperts" not in target_group:
        return {**target_group, "RoutedExperts": target_group["Linear"]}
    return target_group


def vllm_matched_target(
    name: str, class_names: tuple[str, ...], shards: list[str] | None, targets: Entries, fused_before_class: bool
) -> str | None:
    """vLLM's find_matched_target for one layer: the first target equal to or re.matching its name; else, for a fused
    layer (`shards`), the first shard's target when every shard matches one; else the first target contained in its
    class name, case-insensitively. fused_before_class: vLLM 0.27 and later, where the shards are tried before the
    class (before, a class target such as Linear won over targets naming the shards)."""

    def first(value: str) -> str | None:
        return next((t for t in targets.entries if _eq_or_re(value, t)), None)

    def by_class():
        return next((t for t in targets.entries if any(_eq_or_re(c, t, contains=True) for c in class_names)), None)

    def by_shards():  # all fused shards must match some name target
        hits = [first(s) for s in shards] if shards else []
        return hits[0] if hits and all(hits) else None

    hit = first(name)
    if hit:
        return hit
    tries = (by_shards, by_class) if fused_before_class else (by_class, by_shards)
    return tries[0]() or tries[1]()


class VllmReader:
    def __init__(self, qc: dict, arch: Architecture, release: VllmReleaseReader | None = None):
        self.release = release or modeled()
        self.arch = arch
        self.ignore = Entries(arch.vllm_rename_entry(e) for e in qc.get("ignore") or [])
        # vLLM's target_scheme_map: one entry per target, in the order first seen, the last group naming it winning
        self.target_group = vllm_targets({arch.vllm_rename_entry(t): g for g, ts in _groups(qc) for t in ts})
        self.name_targets = Entries(self.target_group)
        self.tested: set[str] = set()  # every name vLLM tests against ignore (for dead entries)
        self._moe_cache: dict[str, Reading] = {}

    def _ignored(self, name: str) -> bool:
        self.tested.add(name)
        return self.ignore.match(name)

    def _should_ignore_layer(self, layer, shards: list[str]) -> bool:
        self.tested.add(layer.name)
        return vllm_should_ignore(layer.name, shards, self.ignore, self.release.ignore_fused_name_first, self.tested)

    def _match_target(self, name: str, class_names: tuple[str, ...], shards: list[str] | None) -> str | None:
        target = vllm_matched_target(name, class_names, shards, self.name_targets, self.release.target_fused_before_class)
        return self.target_group.get(target)

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
                    per_proj.append(None if self._ignored(s) else self._match_target(s, layer.class_names, None))
                if len(set(per_proj)) > 1:
                    raise ValueError(
                        f"All MoE projections need to have same quantization scheme ({layer.name}: expert 0 gate/up/down read as {per_proj})"
                    )
                reading = Reading(per_proj[0])
            elif self._should_ignore_layer(layer, shards):
                reading = Reading(None)
            else:
                reading = Reading(self._match_target(layer.name, layer.class_names, self.arch.vllm_fused_shards(layer)))
        except ValueError as e:
            reading = Reading(None, error=str(e))
        if layer.kind == "moe":
            self._moe_cache[layer.name] = reading
        return reading


def _targets_only_head(target: str, arch: Architecture) -> bool:
    if not target.startswith("re:"):
        return target in arch.lm_head_names
    pat = re.compile(target[3:])
    # A regex that also reaches a decoder module (e.g. re:.*proj$) is not the head's own group.
    decoder_module = f"{arch.decoder_roots[0][0]}.0.{next(iter(arch.fused_shards))}" if arch.decoder_roots else None
    return any(pat.match(n) for n in arch.lm_head_names) and not (decoder_module and pat.match(decoder_module))


class CompressedTensors(QuantFormat):
    quant_method = "compressed-tensors"
    read_as = "compressed-tensors (" + ", ".join(CT_FORMATS) + ")"
    config_fields = COMPRESSED_TENSORS

    def check_config_fields(self, qc, where):
        for name, group in qc["config_groups"].items():
            w = group.get("weights") or {}
            if w.get("strategy") == "group" and w.get("group_size") is None:
                raise SplicerError(
                    f'{where}: config.json {QC}.config_groups.{path_key(name)}.weights has strategy "group" but '
                    "no group_size; fix config.json or restore it from the original checkpoint"
                )

    def unreadable(self, qc: dict) -> str | None:
        groups = qc.get("config_groups") or {}
        bad = sorted({str(group_format(qc, g)) for g in groups.values() if group_format(qc, g) not in CT_FORMATS})
        return f"compressed-tensors format {bad[0]}" if bad else None

    def validate_config(self, build, qc: dict) -> None:
        if not isinstance(qc.get("config_groups"), dict) or not qc["config_groups"]:
            raise SplicerError(
                f"build {build.label}: quantization_config has no config_groups; the config is invalid, restore it from the original export"
            )
        formats = {group_format(qc, g) for g in qc["config_groups"].values()}
        unknown = sorted(str(f) for f in formats if f not in CT_FORMATS)
        if unknown:
            raise SplicerError(
                f"build {build.label} has format {unknown[0]}; splicer reads compressed-tensors {', '.join(CT_FORMATS)} "
                "(give each config group its own format when the top-level one is mixed-precision)"
            )
        self.validate_regexes(qc, f"build {build.label}")
        if not any(is_packed_tensor(t) for t in build.weight_map):
            raise SplicerError(
                f"build {build.label}: config.json says {sorted(formats)[0]} but no module is stored quantized (no weight_packed "
                "or weight_scale); the shards do not belong to this config"
            )

    def validate_schemes(self, build, qc: dict, modules: dict[str, Module]) -> None:
        reader = HfReader(qc, build.arch)
        for name, m in sorted(modules.items()):
            if not m.quantized:
                continue
            group = reader.reading(m).group
            if group is None:
                continue  # reported by inspect's lint (stored packed, read as BF16)
            size = (qc["config_groups"][group].get("weights") or {}).get("group_size")
            if size and m.shape[1] % int(size):
                raise SplicerError(
                    f"build {build.label}: {group} has group_size {size}, which does not divide the input dim {m.shape[1]} "
                    f"of {name}; the build is corrupt, re-export it"
                )
            said = group_scheme(qc, group, m.shape[1])
            if said != m.scheme:
                raise SplicerError(
                    f"build {build.label}: {name} is stored as {m.scheme} but {group} says {said}; "
                    "the config does not match the shards, re-export the build"
                )

    def check(self, modules, qc, arch, report, tensor_dtypes=None):
        vr, hr = VllmReader(qc, arch), HfReader(qc, arch)
        for name in sorted(modules):
            m = modules[name]
            report.hf[name] = hr.reading(m)
            report.vllm[name] = vr.reading(m)
        # The releases read `ignore` and targets differently (vllm_versions): where other checked releases would read
        # a module otherwise than the one modeled, say so once per way of reading, with the first such module.
        note_other_releases(
            report,
            modules,
            vr.release,
            ("ignore_fused_name_first", "target_fused_before_class"),
            lambda release: VllmReader(qc, arch, release),
        )
        for g, group in (qc.get("config_groups") or {}).items():
            order = (group.get("weights") or {}).get("actorder")
            if order in ("group", "dynamic"):
                text = (
                    f"{g}: actorder {order!r} is refused by {refusing_group_actorder()} and by compressed-tensors 0.19 "
                    'and later; re-quantize with actorder="weight"'
                )
                # a problem where the release modeled refuses it, a note where only later ones do
                if vr.release.refuses_group_actorder:
                    report.add("refused", "vllm", text)
                else:
                    report.notes.append(text)
        readings_vs_storage(modules, report)
        fused_on_disk(modules, arch, report)
        ignore = qc.get("ignore") or []
        record_dead(report, [(e, e, arch.vllm_rename_entry(e)) for e in ignore], set(modules), vr.tested, "ignore entries")
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
        # Each group's scheme against the tensors it claims, as each reader assigns them.
        for naming, readings in report.by_reader():
            for n, r in readings.items():
                m = modules[n]
                if r.group and m.quantized:
                    said = group_scheme(qc, r.group, m.shape[1])
                    if said != m.scheme:
                        report.add("scheme-mismatch", naming, f"{n}: config {r.group} says {said}, tensors are {m.scheme}")
                        break
        return report

    def exclude_restored(self, qc, modules, picked, arch):
        self.add_exclusions(qc, module_regexes.ignore_entries(picked, modules, arch))
        if "lm_head" in picked:
            # A group aimed at the head (re:.*lm_head$) would otherwise still claim it.
            for g in qc["config_groups"].values():
                g["targets"] = [t for t in g.get("targets") or [] if not _targets_only_head(t, arch)]

    def add_exclusions(self, qc, entries):
        """`re:X` entries appended to `ignore`."""
        qc["ignore"] = list(qc.get("ignore") or []) + [e for e in entries if e not in (qc.get("ignore") or [])]

    def remove_exclusions(self, qc, entries):
        qc["ignore"] = [e for e in qc["ignore"] if e not in entries]

    def exclusions(self, qc):
        return list(qc.get("ignore") or [])

    def drop_unused(self, config, report, after):
        """Groups that no longer target a quantized module go; with none left (and no kv-cache scheme) the config
        goes too: a plain BF16 checkpoint."""
        qc = config["quantization_config"]
        live = {r.group for readings in (report.hf, report.vllm) for n, r in readings.items() if r.group and after[n].quantized}
        for gname in list(qc["config_groups"]):
            if gname not in live or not qc["config_groups"][gname].get("targets"):
                del qc["config_groups"][gname]
        if not qc["config_groups"] and not qc.get("kv_cache_scheme"):
            del config["quantization_config"]

    def torch_schemes(self, ckpt, qc, modules):
        """The scheme chosen the way compressed-tensors' loader chooses it (exact name, then regex, then class target).
        Its model-free dequantizer instead takes the first group in file order, which reads seed 000's INT8 head with
        the INT4 `Linear` group."""
        from .quantize import scheme_from_group

        reader = HfReader(qc, ckpt.arch)
        out = {}
        for name, m in modules.items():
            group = reader.reading(m).group
            if group is None:
                raise SplicerError(
                    f"{ckpt.label}: {name} is stored packed but quantization_config does not target it; fix the config (see splicer inspect)"
                )
            said = group_scheme(qc, group, m.shape[1])
            if said != m.scheme:
                raise SplicerError(f"{ckpt.label}: {name} is stored as {m.scheme} but {group} says {said}; fix the config")
            g = qc["config_groups"][group]
            scheme = scheme_from_group({**g, "format": group_format(qc, g)})
            out[name] = (m, scheme)
        return out


FORMAT = CompressedTensors()
