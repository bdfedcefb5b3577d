"""The regexes that name a set of modules under both namings (HF's and vLLM's), the entries the compressed-tensors and
GPTQ config edits exclude restored modules with."""

from __future__ import annotations

import re
from collections import defaultdict

from ..arch.table import Architecture
from .module import Module


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
