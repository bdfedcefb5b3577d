"""config.json for a splice: the exclusion entries that make both readers (compressed-tensors / GPTQModel with HF names,
vLLM with its own) load the restored modules unquantized, and the groups that no longer target anything removed.

Edited as a plain dict: a pydantic round-trip through compressed-tensors 0.20 rejects fields that 0.17 wrote.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

from .arch import Architecture
from .checkpoint import Checkpoint
from .modules import Module
from .rules import check, is_gptq, is_skip_list, skip_list_keys


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
    if is_skip_list(qc):
        # Native FP8 / AWQ list what stays unquantized. An empty list means "detect it" (vLLM's AWQ reads the dtypes,
        # transformers' FP8 skips the head): once entries are added that stops, so the modules stored unquantized are
        # listed too, by name.
        if not any(qc.get(k) for k in skip_list_keys(qc)):
            add_exclusions(
                qc, skip_list_entries({n: m for n, m in modules.items() if not m.quantized and not arch.is_embedding(n)}, arch)
            )
        add_exclusions(qc, skip_list_entries(picked, arch))
        if "lm_head" in picked and qc.get("lm_head"):
            qc["lm_head"] = False
    elif is_gptq(qc):
        # vLLM and GPTQModel stop at the first `dynamic` rule that matches: the new `-:` rules go first. They name the
        # restored modules and the vLLM layers those load into (fused names, the MoE prefix), under both namings.
        units = {arch.atomic_unit(n) for n in picked}
        names = dict(picked) | {u: Module(u, arch.module_class(u), shape=(0, 0)) for u in units}
        universe = dict(modules)
        for u in {arch.atomic_unit(n) for n, m in modules.items() if m.quantized}:
            universe[u] = Module(u, arch.module_class(u), packed={"qweight": None}, shape=(0, 0))
        add_exclusions(qc, ignore_entries(names, universe, arch))
        if "lm_head" in picked:
            qc["lm_head"] = False
    else:
        add_exclusions(qc, ignore_entries(picked, modules, arch))
        if "lm_head" in picked:
            # A group aimed at the head (re:.*lm_head$) would otherwise still claim it.
            for g in qc["config_groups"].values():
                g["targets"] = [t for t in g.get("targets") or [] if not _targets_only_head(t, arch)]
    after = modules_after(modules, picked, added)
    report = check(after, qc, arch)
    if added and any(r.group for readings in (report.hf, report.vllm) for n, r in readings.items() if n in added):
        # the added BF16 MTP head must not be read as quantized
        add_exclusions(qc, skip_list_entries(added, arch) if is_skip_list(qc) else [arch.mtp_ignore])
        report = check(after, qc, arch)
    dropped = []
    if drop_dead:
        dropped = sorted(
            set(report.dead_ignore.get("hf", [])) & set(report.dead_ignore.get("vllm", [])), key=exclusions(qc).index
        )
        _remove_exclusions(qc, set(dropped))
    if is_gptq(qc) or is_skip_list(qc):
        if not any(m.quantized for m in after.values()):
            del config["quantization_config"]
        return config, dropped
    live = {r.group for readings in (report.hf, report.vllm) for n, r in readings.items() if r.group and after[n].quantized}
    for gname in list(qc["config_groups"]):
        if gname not in live or not qc["config_groups"][gname].get("targets"):
            del qc["config_groups"][gname]
    if not qc["config_groups"] and not qc.get("kv_cache_scheme"):
        del config["quantization_config"]  # nothing is quantized any more: a plain BF16 checkpoint
    return config, dropped


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


def add_exclusions(qc: dict, entries: list[str]) -> None:
    """`re:X` entries appended to `ignore` (compressed-tensors), `-:X` rules put first in `dynamic` (GPTQ), or full
    names appended to the skip lists (native FP8, AWQ)."""
    if is_skip_list(qc):
        for key in skip_list_keys(qc):
            have = list(qc.get(key) or [])
            qc[key] = have + [e for e in entries if e not in have]
    elif is_gptq(qc):
        rules = ["-:" + (e[3:] if e.startswith("re:") else re.escape(e) + "$") for e in entries]
        old = qc.get("dynamic") or {}
        qc["dynamic"] = {**{r: {} for r in rules if r not in old}, **old}
    else:
        qc["ignore"] = list(qc.get("ignore") or []) + [e for e in entries if e not in (qc.get("ignore") or [])]


def _remove_exclusions(qc: dict, entries: set[str]) -> None:
    if is_skip_list(qc):
        for key in skip_list_keys(qc):
            qc[key] = [e for e in qc.get(key) or [] if e not in entries]
    elif is_gptq(qc):
        qc["dynamic"] = {k: v for k, v in qc["dynamic"].items() if k not in entries}
    else:
        qc["ignore"] = [e for e in qc["ignore"] if e not in entries]


def _targets_only_head(target: str, arch: Architecture) -> bool:
    if not target.startswith("re:"):
        return target in arch.lm_head_names
    pat = re.compile(target[3:])
    # A regex that also reaches a decoder module (e.g. re:.*proj$) is not the head's own group.
    decoder_module = f"{arch.decoder_roots[0][0]}.0.{next(iter(arch.fused_shards))}" if arch.decoder_roots else None
    return any(pat.match(n) for n in arch.lm_head_names) and not (decoder_module and pat.match(decoder_module))


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


def exclusions(qc: dict) -> list[str]:
    """The entries that keep modules unquantized: `ignore` (compressed-tensors), `-:` rules of `dynamic` (GPTQ), or the
    skip list (native FP8, AWQ)."""
    if is_skip_list(qc):
        return list(dict.fromkeys(e for k in skip_list_keys(qc) for e in qc.get(k) or []))
    return [k for k in qc.get("dynamic") or {} if k.startswith("-:")] if is_gptq(qc) else list(qc.get("ignore") or [])
