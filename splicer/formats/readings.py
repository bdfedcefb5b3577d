"""What the readers of a quantization_config share: a Reading of one module, the Report of a whole checkpoint, and the
checks of readings against storage that every format's readers feed. The readers themselves (compressed-tensors,
GPTQModel and transformers with HF names, vLLM with its own) are in each format's module; rules.check runs the config's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..arch.table import Architecture
from .module import Module


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

    def by_reader(self) -> list[tuple[str, dict[str, Reading]]]:
        """(naming, readings) of each reader of the config: the library's (hf) and vLLM's."""
        return [("hf", self.hf), ("vllm", self.vllm)]

    def dead_for_every_reader(self) -> set[str]:
        """The exclusion entries that no reader's modules match (dead_ignore of each naming): safe to drop."""
        dead = [set(self.dead_ignore.get(naming, [])) for naming, _ in self.by_reader()]
        return set.intersection(*dead)


def reading_words(reading: Reading) -> str:
    """A reading in the lint's words: the group, 'unquantized', or 'refused (why)'."""
    return f"refused ({reading.error})" if reading.error else (reading.group or "unquantized")


def note_other_releases(report, modules: dict, modeled_release, fields: tuple[str, ...], reader_for) -> None:
    """Where checked releases that differ from the modeled one in these behaviours (vllm_versions.ways_of_reading)
    would read a module otherwise, one note per way of reading, with the first such module: 'vLLM 0.26 reads 3 modules
    otherwise than vLLM 0.33 (modeled here), e.g. NAME: A against B'. reader_for(release): that release's vLLM reader."""
    from .vllm_versions import ways_of_reading

    for others in ways_of_reading(modeled_release, fields):
        other = reader_for(others[0])
        differ = [n for n in sorted(modules) if other.reading(modules[n]) != report.vllm[n]]
        if not differ:
            continue
        n = differ[0]
        who = f"vLLM {others[0].version}" + (f" to {others[-1].version} read" if len(others) > 1 else " reads")
        report.notes.append(
            f"{who} {len(differ)} modules otherwise than vLLM {modeled_release.version} (modeled here), e.g. {n}: "
            f"{reading_words(other.reading(modules[n]))} against {reading_words(report.vllm[n])}"
        )


class Entries:
    """A list of ignore/target entries, compiled once: exact names in a set, `re:` patterns compiled."""

    def __init__(self, entries):
        self.entries = list(entries)
        self.exact = {e for e in self.entries if not e.startswith("re:")}
        self.compiled = [(e, re.compile(e[3:])) for e in self.entries if e.startswith("re:")]

    def match(self, name: str) -> bool:
        return name in self.exact or any(p.match(name) for _, p in self.compiled)


def record_dead(report: Report, entries: list[tuple[str, str, str]], hf_names: set[str], vllm_names: set[str], what: str) -> None:
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


def readings_vs_storage(modules: dict[str, Module], report: Report) -> None:
    for naming, readings in report.by_reader():
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


def fused_on_disk(modules: dict[str, Module], arch: Architecture, report: Report) -> None:
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
