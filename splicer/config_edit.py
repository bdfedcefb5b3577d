"""config.json for a splice: the exclusion entries that make both readers (compressed-tensors / GPTQModel with HF names,
vLLM with its own) load the restored modules unquantized, and the groups that no longer target anything removed. Each
format's own edit is its module's in splicer/formats/; the regexes that name modules under both namings are here.

Edited as a plain dict: a pydantic round-trip through compressed-tensors 0.20 rejects fields that 0.17 wrote.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

from .arch import Architecture
from .checkpoint import Checkpoint
from .formats import format_or_default
from .modules import Module
from .rules import check


def restored_config(
    build: Checkpoint,
    modules: dict[str, Module],
    picked: dict[str, Module],
    added: dict[str, Module] | None = None,
    drop_dead: bool = False,
) -> tuple[dict, list[str]]:
    """config.json with exclusions for the restored (and added) modules; returns it and the dead entries dropped."""
    arch = build.arch
    config = json.loads(json.dumps(build.config))
    qc = config["quantization_config"]
    fmt = format_or_default(qc)
    fmt.exclude_restored(qc, modules, picked, arch)
    after = modules_after(modules, picked, added)
    report = check(after, qc, arch)
    if added and any(r.group for readings in (report.hf, report.vllm) for n, r in readings.items() if n in added):
        # the added BF16 MTP head must not be read as quantized
        fmt.exclude_added(qc, added, arch)
        report = check(after, qc, arch)
    dropped = []
    if drop_dead:
        dropped = sorted(
            set(report.dead_ignore.get("hf", [])) & set(report.dead_ignore.get("vllm", [])), key=fmt.exclusions(qc).index
        )
        fmt.remove_exclusions(qc, set(dropped))
    fmt.drop_unused(config, report, after)
    return config, dropped


def _layered(arch: Architecture) -> re.Pattern:
    """root.layer.path[.expert].proj for a decoder-layer module of arch (root: one of its HF decoder roots)."""
    roots = "|".join(re.escape(hf) for hf, _ in arch.decoder_roots) or "(?!)"
    return re.compile(rf"^(?P<root>{roots})\.(?P<layer>\d+)\.(?P<path>.+?)(?:\.(?P<expert>\d+))?\.(?P<proj>[^.]+)$")


def _root_regex(arch: Architecture, root: str) -> str:
    r"""A decoder root under both namings, HF's and vLLM's (they differ where vLLM's mapper renames it)."""
    vllm = dict(arch.decoder_roots).get(root, root)
    if vllm == root:
        return re.escape(root)
    a, b = root.split("."), vllm.split(".")
    common = 0  # the dotted tail both share, written once: (model\.language_model|language_model\.model)\.layers
    while common < min(len(a), len(b)) - 1 and a[-1 - common] == b[-1 - common]:
        common += 1
    head = "(" + re.escape(".".join(a[: len(a) - common])) + "|" + re.escape(".".join(b[: len(b) - common])) + ")"
    return head + "".join(r"\." + re.escape(p) for p in a[len(a) - common :])


def _head_regex(arch: Architecture) -> str:
    r"""The head under every name it has (HF's, vLLM's), e.g. re:(language_model\.)?lm_head$."""
    head, others = arch.lm_head_names[0], arch.lm_head_names[1:]
    if not others:
        return f"re:{re.escape(head)}$"
    prefixes = [n[: -len(head)] for n in others if n.endswith(head)]
    if prefixes and len(prefixes) == len(others):
        return "re:(" + "|".join(re.escape(p) for p in prefixes) + ")?" + re.escape(head) + "$"
    return "re:(" + "|".join(re.escape(n) for n in arch.lm_head_names) + ")$"


def ignore_entries(picked: dict[str, Module], modules: dict[str, Module], arch: Architecture) -> list[str]:
    """A few readable regexes, each ending in `$`, that match the restored modules under both namings.

    Decoder names are matched in HF form and vLLM form (for qwen3_5_moe model.language_model. and
    language_model.model.), because vLLM does not rename regexes (facts §3).
    """
    layered = _layered(arch)
    entries: list[str] = []
    parsed = {}
    projs_at: dict[tuple, set[str]] = defaultdict(set)  # (root, layer, path) -> restored projections
    for name in picked:
        if name == arch.lm_head_names[0]:
            entries.append(_head_regex(arch))
        elif (m := layered.match(name)) is None:
            entries.append(name)  # e.g. mtp.fc: exact names are renamed by vLLM where needed
        else:
            parsed[name] = m
            projs_at[(m["root"], m["layer"], m["path"])].add(m["proj"])
    by_key: dict[tuple, set[int]] = defaultdict(set)
    for m in parsed.values():
        projs = frozenset(projs_at[(m["root"], m["layer"], m["path"])])
        by_key[(m["root"], m["path"], m["expert"] is not None, projs)].add(int(m["layer"]))
    all_layers: dict[tuple, set[int]] = defaultdict(set)
    for name in modules:
        if (m := layered.match(name)) and modules[name].quantized:
            all_layers[(m["root"], m["path"], m["proj"])].add(int(m["layer"]))
    for (root, path, is_expert, projs), layers in sorted(by_key.items(), key=lambda kv: str(kv[0])):
        everywhere = all(all_layers[(root, path, p)] <= layers for p in projs)
        layer_re = r"\d+" if everywhere else "(" + "|".join(str(i) for i in sorted(layers)) + ")"
        root_re = _root_regex(arch, root)
        proj_re = "(" + "|".join(re.escape(p) for p in sorted(projs)) + ")" if len(projs) > 1 else re.escape(next(iter(projs)))
        expert_re = r"\.\d+" if is_expert else ""
        entries.append(f"re:{root_re}\\.{layer_re}\\.{re.escape(path)}{expert_re}\\.{proj_re}$")
    return list(dict.fromkeys(entries))


def modules_after(
    modules: dict[str, Module], picked: dict[str, Module], added: dict[str, Module] | None = None
) -> dict[str, Module]:
    after = dict(added or {})
    for name, m in modules.items():
        if name in picked:
            after[name] = Module(name, m.cls, plain={"weight": None}, shape=m.shape)
        else:
            after[name] = m
    return after


def add_exclusions(qc: dict, entries: list[str]) -> None:
    """Entries added to what keeps modules unquantized: `re:X` entries appended to `ignore` (compressed-tensors), `-:X`
    rules put first in `dynamic` (GPTQ), or full names appended to the skip lists (native FP8, AWQ)."""
    format_or_default(qc).add_exclusions(qc, entries)


def exclusions(qc: dict) -> list[str]:
    """The entries that keep modules unquantized: `ignore` (compressed-tensors), `-:` rules of `dynamic` (GPTQ), or the
    skip list (native FP8, AWQ)."""
    return format_or_default(qc).exclusions(qc)
