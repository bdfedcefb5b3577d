"""What native FP8 and AWQ share: their config lists the modules left unquantized (a skip list), not the quantized
ones, and one scheme holds for every quantized module. transformers and vLLM read the list each in its own way; the
ways the two formats differ are the attributes of SkipListFormat that fp8.py and awq.py set."""

from __future__ import annotations

import json
import re
from abc import abstractmethod
from collections.abc import Collection

from ..arch.table import Architecture
from ..errors import SplicerError
from .base import QuantFormat
from .module import Module
from .readings import Reading, fused_on_disk, readings_vs_storage


def hf_should_skip(name: str, patterns: list[str]) -> bool:
    """transformers 5 `quantizers_utils.should_convert_module`, negated: a pattern matches from the start of the name up
    to a module boundary (as a regex), or as a suffix. Mirrored because transformers imports in seconds."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{p}){boundary}", name) or name.endswith(p) for p in patterns)


def skip_list_entries(modules: dict[str, Module], arch: Architecture) -> list[str]:
    """Full module names for a native FP8 / AWQ skip list, routed experts as their layer's `...mlp.experts`.

    Neither reader takes regexes there: vLLM's FP8 loader wants the exact name (and skips a whole MoE layer for a name
    under its experts), its AWQ loader a substring of the name, transformers a prefix up to a module boundary or a
    suffix. A full name is read the same by all three, and a layer's experts are decided together anyway.
    """
    names = []
    for name in modules:
        parts = arch.expert_parts(name)
        names.append(parts[0] if parts else name)
    return list(dict.fromkeys(names))


def vllm_layer_skipped(layer: str, shards: list[str] | None, entries: Collection[str], substring: bool) -> bool:
    """vLLM's `quant_utils.is_layer_skipped` for one layer, the same from 0.26 to 0.33 (tests/test_vllm_readers.py
    runs each release's own function): an entry matches the exact name (FP8) or as a substring of it (AWQ). A fused
    layer (`shards`, None when it is not fused) is skipped when its own name matches, else when every shard's does
    (shards that disagree: ValueError). With exact names, a name containing "experts" that is not fused (an MoE
    layer's `...mlp.experts`) is skipped when it is a substring of a listed name that contains "experts", so one listed
    expert skips its whole layer."""

    def match(name: str) -> bool:
        return any(e in name for e in entries) if substring else name in entries

    if shards is not None:
        if match(layer):
            return True
        states = {match(s) for s in shards}
        if len(states) > 1:
            raise ValueError(f"Detected some but not all shards of {layer} are quantized")
        return states.pop()
    if "experts" in layer and not substring:
        return any(layer in e for e in entries if "experts" in e)
    return match(layer)


class SkipListHfReader:
    """transformers' view of a native FP8 or AWQ build: every Linear is replaced unless `should_convert_module` says
    skip; routed experts are one module per layer (`...mlp.experts`), decided together, and only FP8 replaces them
    (`replace_with_fp8_linear` swaps `.experts` modules; `replace_with_awq_linear` only nn.Linear). Its default skips (the
    output head) apply when the FP8 list is absent, and always for AWQ (`add_default_skips=True`)."""

    def __init__(self, fmt: SkipListFormat, qc: dict, arch: Architecture):
        self.arch, self.fmt = arch, fmt
        listed, _ = fmt.skip_lists(qc)
        defaults = fmt.hf_default_skips_always or listed is None
        self.patterns = list(listed or []) + (list(arch.lm_head_names[:1]) if defaults else [])
        self.tested: set[str] = set()

    def reading(self, module: Module) -> Reading:
        if self.arch.is_embedding(module.name):
            return Reading(None)
        parts = self.arch.expert_parts(module.name)
        if parts and self.fmt.hf_cannot_load_experts:
            return Reading(None, error=self.fmt.hf_cannot_load_experts if module.quantized else None)
        name = parts[0] if parts else module.name
        self.tested.add(name)
        return Reading(None if hf_should_skip(name, self.patterns) else self.fmt.quant_method)


class SkipListVllmReader:
    """vLLM's view, the same from 0.26 to 0.33 (`vllm_layer_skipped`). The head is never FP8, and AWQ only with `lm_head: true`. An empty AWQ list makes vLLM list the parent of
    every tensor whose dtype is float16, bfloat16 or float32 unless a sibling tensor is not (`AutoAWQConfig.
    maybe_update_config`): that includes parents such as `...linear_attn` (its A_log, dt_bias), which as a substring
    then unquantizes every projection under it. tensor_dtypes (tensor name -> safetensors dtype) gives those parents;
    without it the modules stored unquantized stand in for them."""

    def __init__(
        self,
        fmt: SkipListFormat,
        qc: dict,
        arch: Architecture,
        modules: dict[str, Module],
        tensor_dtypes: dict[str, str] | None = None,
    ):
        self.arch, self.fmt = arch, fmt
        _, listed = fmt.skip_lists(qc)
        if fmt.vllm_detects_empty_list and not listed:
            if tensor_dtypes:
                parents = {t.rpartition(".")[0] for t in tensor_dtypes}
                quant = {t.rpartition(".")[0] for t, d in tensor_dtypes.items() if d not in ("F16", "BF16", "F32")}
                listed = sorted(parents - quant)
            else:
                listed = [n for n, m in modules.items() if not m.quantized]
        self.entries = [arch.vllm_rename_entry(e) for e in listed]
        self.entry_set = set(self.entries)
        self.substr = fmt.vllm_matches_substring
        self.head_quantized = fmt.vllm_reads_head_quantized(qc)
        self.tested: set[str] = set()
        self._cache: dict[str, Reading] = {}

    def _skipped(self, layer) -> bool:
        if layer.kind == "moe" and not self.fmt.vllm_quantizes_moe:
            return True
        self.tested.add(layer.name)
        shards = self.arch.vllm_fused_shards(layer)
        self.tested.update(shards or [])
        return vllm_layer_skipped(layer.name, shards, self.entries if self.substr else self.entry_set, self.substr)

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
                self._cache[layer.name] = Reading(None if self._skipped(layer) else self.fmt.quant_method)
            except ValueError as e:
                self._cache[layer.name] = Reading(None, error=str(e))
        return self._cache[layer.name]


class SkipListFormat(QuantFormat):
    """A format whose config lists what stays unquantized. Subclasses set how each reader reads the list."""

    inspect_validates_config = True
    hf_default_skips_always = False  # transformers adds its default skips (the head) even to a given list
    hf_cannot_load_experts: str | None = None  # why transformers cannot load routed experts stored so (None: it can)
    vllm_matches_substring = False  # vLLM matches an entry as a substring of a layer's name, not the exact name
    vllm_detects_empty_list = False  # vLLM fills an empty list from the tensor dtypes
    vllm_quantizes_moe = True  # vLLM's loader gives MoE layers a quantized method (False: they load as BF16)

    def vllm_reads_head_quantized(self, qc: dict) -> bool:
        return False

    def skip_lists(self, qc: dict) -> tuple[list[str] | None, list[str]]:
        """(the list transformers reads, None when absent; the list vLLM reads)."""
        return qc.get("modules_to_not_convert"), list(qc.get("modules_to_not_convert") or [])

    def skip_list_keys(self, qc: dict) -> list[str]:
        """The config keys a splice appends its entries to."""
        return ["modules_to_not_convert"]

    @abstractmethod
    def scheme(self, qc: dict) -> str:
        """What the config says every quantized module is stored as, in the words of `Module.scheme`."""

    @abstractmethod
    def module_scheme(self, qc: dict, module: Module):
        """What the torch reference dequantizes a quantized module with."""

    def add_notes(self, qc: dict, report) -> None:
        """Issues and notes about the config itself, beyond how it reads per module."""

    def mismatch(self, qc: dict, modules: dict[str, Module]) -> Module | None:
        """The first quantized module (by name) stored otherwise than the config says every one is (None: all agree)."""
        said = self.scheme(qc)
        return next((m for _, m in sorted(modules.items()) if m.quantized and m.scheme != said), None)

    def validate_entries(self, build, qc: dict) -> None:
        for key in ("ignored_layers", "modules_to_not_convert"):
            value = qc.get(key)
            if value is not None and (not isinstance(value, list) or not all(isinstance(e, str) for e in value)):
                raise SplicerError(
                    f"build {build.label}: quantization_config.{key} must be a list of module names, not "
                    f"{json.dumps(value)[:60]}; fix config.json"
                )

    def validate_schemes(self, build, qc, modules):
        wrong = self.mismatch(qc, modules)
        if wrong:
            raise SplicerError(
                f"build {build.label}: {wrong.name} is stored as {wrong.scheme} but the config says "
                f"{self.scheme(qc)}; the config does not match the shards, re-export the build"
            )

    def check(self, modules, qc, arch, report, tensor_dtypes=None):
        hr, vr = SkipListHfReader(self, qc, arch), SkipListVllmReader(self, qc, arch, modules, tensor_dtypes)
        for name in sorted(modules):
            report.hf[name] = hr.reading(modules[name])
            report.vllm[name] = vr.reading(modules[name])
        readings_vs_storage(modules, report)
        fused_on_disk(modules, arch, report)
        hf_list, vllm_list = self.skip_lists(qc)
        self.add_list_issues(qc, report)
        report.dead_ignore["hf"] = [e for e in hf_list or [] if not any(hf_should_skip(t, [e]) for t in hr.tested)]
        if not self.vllm_detects_empty_list or vllm_list:
            report.dead_ignore["vllm"] = [e for e in vllm_list if not vr.entry_live(arch.vllm_rename_entry(e))]
        dead_both = [e for e in report.dead_ignore["hf"] if e in report.dead_ignore.get("vllm", [])]
        if dead_both:
            report.add("dead-ignore", "hf+vllm", f"{len(dead_both)} skip-list entries match no module, e.g. {dead_both[0]!r}")
        wrong = self.mismatch(qc, modules)
        if wrong:
            report.add("scheme-mismatch", "hf", f"{wrong.name}: config says {self.scheme(qc)}, tensors are {wrong.scheme}")
        self.add_notes(qc, report)
        return report

    def add_list_issues(self, qc: dict, report) -> None:
        """Issues with the lists themselves (before the dead entries)."""

    def exclude_restored(self, qc, modules, picked, arch):
        # An empty list means "detect it" (vLLM's AWQ reads the dtypes, transformers' FP8 skips the head): once entries
        # are added that stops, so the modules stored unquantized are listed too, by name.
        if not any(qc.get(k) for k in self.skip_list_keys(qc)):
            self.add_exclusions(
                qc, skip_list_entries({n: m for n, m in modules.items() if not m.quantized and not arch.is_embedding(n)}, arch)
            )
        self.add_exclusions(qc, skip_list_entries(picked, arch))
        if "lm_head" in picked and qc.get("lm_head"):
            qc["lm_head"] = False

    def exclude_added(self, qc, added, arch):
        self.add_exclusions(qc, skip_list_entries(added, arch))

    def add_exclusions(self, qc, entries):
        """Full names appended to the skip lists."""
        for key in self.skip_list_keys(qc):
            have = list(qc.get(key) or [])
            qc[key] = have + [e for e in entries if e not in have]

    def remove_exclusions(self, qc, entries):
        for key in self.skip_list_keys(qc):
            qc[key] = [e for e in qc.get(key) or [] if e not in entries]

    def exclusions(self, qc):
        return list(dict.fromkeys(e for k in self.skip_list_keys(qc) for e in qc.get(k) or []))

    def torch_schemes(self, ckpt, qc, modules):
        # One scheme for every quantized module: the config's, checked against what the tensors say.
        wrong = self.mismatch(qc, modules)
        if wrong:
            raise SplicerError(
                f"{ckpt.label}: {wrong.name} is stored as {wrong.scheme} but the config says {self.scheme(qc)}; fix the config"
            )
        return {n: (m, self.module_scheme(qc, m)) for n, m in modules.items()}
