"""config.json for a splice: the exclusion entries that make both readers (compressed-tensors / GPTQModel with HF names,
vLLM with its own) load the restored modules unquantized, and the groups that no longer target anything removed. Each
format's own edit is in its module in splicer/formats/ (the regexes that name modules under both namings in
formats/module_regexes.py).

Edited as a plain dict: a pydantic round-trip through compressed-tensors 0.20 rejects fields that 0.17 wrote.
"""

from __future__ import annotations

import json

from ..checkpoint import Checkpoint
from ..formats.module import Module
from ..formats.registry import format_or_default
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
    if added and any(r.group for _, readings in report.by_reader() for n, r in readings.items() if n in added):
        # the added BF16 MTP head must not be read as quantized
        fmt.exclude_added(qc, added, arch)
        report = check(after, qc, arch)
    dropped = []
    if drop_dead:
        dropped = sorted(report.dead_for_every_reader(), key=fmt.exclusions(qc).index)
        fmt.remove_exclusions(qc, set(dropped))
    fmt.drop_unused(config, report, after)
    return config, dropped


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
