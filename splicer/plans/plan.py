"""Ablation plans: TOML files under ablations/ that declare corpora, timing settings and rows."""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ..corpora.core import check_name, validate_spec
from ..errors import SplicerError
from ..io.config_schema import MISSING, check_value, expect
from ..splice.selection import canonical_entries, entry_class, normalize_entry

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PLAN_KEYS = {"name", "description", "top_k", "corpus", "timing", "row"}
ROW_KEYS = {"name", "restore", "keep", "base", "repeat", "checkpoint", "requantized_without"}
TIMING_KEYS = {"prompt_tokens", "new_tokens", "warmup", "runs"}


@dataclass
class Row:
    name: str
    restore: list[str] | None = None  # these classes restored
    keep: list[str] | None = None  # every quantized class restored except these
    base: bool = False
    # A second measurement of a variant another row already covers (e.g. the build again at the end
    # of the run): the spread between the two timings is the run's timing noise band.
    repeat: bool = False
    # Another checkpoint of the same model (a folder or a Hub repo id), in any format the backend loads: scored and
    # timed as it is, against the same base pass, beside the build's splices (seed 000's table of formats).
    checkpoint: str | None = None
    # A checkpoint row that is the build's own recipe run again with these classes left in BF16 (the quantizer
    # re-fitting every later layer to them): scored beside the splice of the same classes, which shows the build
    # without those classes' own error only (`splicer report`'s splice-against-re-quantize table).
    requantized_without: list[str] | None = None

    def definition(self) -> dict:
        """The row as a plan file declares it, name aside: a rerun keeps this row's finished result only while its
        definition is unchanged (job.json's rows)."""
        out = {
            k: v for k, v in (("restore", self.restore), ("keep", self.keep), ("checkpoint", self.checkpoint)) if v is not None
        }
        if self.base:
            out["base"] = True
        if self.repeat:
            out["repeat"] = True
        if self.requantized_without:
            out["requantized_without"] = list(self.requantized_without)
        return out

    def restored(self, quantized: list[str]) -> list[str] | None:
        """What this row restores in a build that quantizes `quantized`: classes, or `class@layers` entries, in class
        order (None: the base itself, or a checkpoint)."""
        if self.base or self.checkpoint:
            return None
        if self.keep is not None:
            return [c for c in quantized if c not in self.keep]
        by_class = {entry_class(e): e for e in self.restore or []}
        return [by_class[c] for c in quantized if c in by_class]


@dataclass
class Plan:
    name: str
    description: str
    top_k: int
    corpora: list[dict]
    timing: dict | None
    rows: list[Row]
    source: str
    digest: str = field(default="")

    @property
    def settings_digest(self) -> str:
        """What every row of the plan is measured with (corpora, top_k, timing): rows measured under another one are
        not comparable, so a rerun keeps none of them; rows may be added or changed without touching the others."""
        return hashlib.sha256(json.dumps([self.corpora, self.top_k, self.timing], sort_keys=True).encode()).hexdigest()[:16]


def plan_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.is_file():
        if not p.exists():
            raise SplicerError(f"plan file {p} does not exist; pass a .toml path or a plan name from ablations/")
        return p
    for folder in (Path.cwd() / "ablations", Path(str(resources.files("splicer") / "ablations"))):
        cand = folder / f"{name_or_path}.toml"
        if cand.exists():
            return cand
    known = sorted(q.stem for q in Path(str(resources.files("splicer") / "ablations")).glob("*.toml"))
    raise SplicerError(f"no plan named {name_or_path!r}; known plans: {', '.join(known)} (or pass a .toml path)")


PLAN_FIX = "fix the plan file"
TIMING_FIELDS = {
    "prompt_tokens": expect("int", required=True, lo=1, hi=1 << 20),
    "new_tokens": expect("int", required=True, lo=2, hi=1 << 16),  # decode ms/token divides by new_tokens - 1
    "warmup": expect("int", required=True, lo=0, hi=1000),
    "runs": expect("int", required=True, lo=1, hi=1000),  # the median needs at least one run
}
ROW_FIELDS = {
    "name": expect("str", required=True),
    "restore": expect("list", items="str"),
    "keep": expect("list", items="str"),
    "base": expect("bool", choices=(True,)),  # `base = false` would silently make the row the build
    "repeat": expect("bool"),
    "checkpoint": expect("str"),
    "requantized_without": expect("list", items="str"),
}


def _get(table: dict, key: str):
    return table.get(key, MISSING)


def load_plan(name_or_path: str, classes: tuple[str, ...]) -> Plan:
    try:
        path = plan_path(name_or_path)
        raw = path.read_bytes()
    except OSError as e:  # a folder named x.toml, no permission, a name too long for the filesystem
        raise SplicerError(
            f"cannot read plan {str(name_or_path)[:80]!r} ({e.strerror or e.__class__.__name__}); "
            "pass a readable .toml file or a plan name from ablations/"
        ) from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise SplicerError(
            f"plan {path} is not valid TOML ({str(e).splitlines()[0] if str(e) else e.__class__.__name__}); fix the file"
        ) from None
    where = f"plan {path}"
    unknown = sorted(set(data) - PLAN_KEYS)
    if unknown:
        raise SplicerError(f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(sorted(PLAN_KEYS))}")
    check_value(expect("str"), _get(data, "name"), where, "name", PLAN_FIX)
    check_value(expect("str"), _get(data, "description"), where, "description", PLAN_FIX)
    # log-probs kept per position: at least one (the top-1 metrics), and a bound a typo cannot turn into gigabytes
    check_value(expect("int", lo=1, hi=1000), _get(data, "top_k"), where, "top_k", PLAN_FIX)
    # [[row]] and [[corpus]] are arrays of tables; `row = "x"` or a single [row] table would iterate characters or keys.
    for key, header in (("row", "[[row]]"), ("corpus", "[[corpus]]")):
        check_value(expect("list", items="object"), _get(data, key), where, f"{key} (an array of {header} tables)", PLAN_FIX)
    rows_raw = data.get("row") or []
    if not rows_raw:
        raise SplicerError(f"{where} declares no [[row]]; add at least one row")
    corpora = data.get("corpus") or []
    if not corpora:
        raise SplicerError(f"{where} declares no [[corpus]]; add at least one corpus")
    names = set()
    for c in corpora:
        validate_spec(c, where)
        if c["name"] in names:
            raise SplicerError(f"{where}: corpus {c['name']!r} is declared twice")
        names.add(c["name"])
    timing = data.get("timing")
    if timing is not None:
        check_value(expect("object"), timing, where, "timing (a [timing] table)", PLAN_FIX)
        bad = sorted(set(timing) - TIMING_KEYS)
        if bad:
            raise SplicerError(f"{where}: unknown timing key {bad[0]!r}; allowed: {', '.join(sorted(TIMING_KEYS))}")
        for key, spec in TIMING_FIELDS.items():
            check_value(spec, _get(timing, key), where, f"timing.{key}", PLAN_FIX)
    rows, seen = [], set()
    for r in rows_raw:
        bad = sorted(set(r) - ROW_KEYS)
        if bad:
            raise SplicerError(
                f"{where}: row {str(r.get('name'))[:40]!r} has unknown key {bad[0]!r}; allowed: {', '.join(sorted(ROW_KEYS))}"
            )
        check_name(_get(r, "name"), where, "a row's name")
        name = r["name"]
        if name in seen:
            raise SplicerError(f"{where}: every row needs a unique name ({name!r} is used twice)")
        seen.add(name)
        for key, spec in ROW_FIELDS.items():
            check_value(spec, _get(r, key), where, f"row {name!r}: {key}", PLAN_FIX)
        given = [k for k in ("restore", "keep", "base", "checkpoint") if k in r]
        if len(given) != 1:
            raise SplicerError(f"{where}: row {name!r} needs exactly one of restore, keep, base or checkpoint")
        if "checkpoint" in r and not r["checkpoint"].strip():
            raise SplicerError(f"{where}: row {name!r} has an empty checkpoint; give a folder or a Hub repo id")
        if "requantized_without" in r:
            r = dict(r, requantized_without=requantized_classes(r["requantized_without"], classes, f"{where}: row {name!r}"))
            if "checkpoint" not in r:
                raise SplicerError(
                    f"{where}: row {name!r}: requantized_without describes a checkpoint; give the re-quantized "
                    "build as its checkpoint"
                )
        if r.get("restore"):
            r = dict(r, restore=canonical_entries(r["restore"], f"{where}: row {name!r}: restore"))
        if any("@" in c for c in r.get("keep") or []):
            raise SplicerError(f"{where}: row {name!r}: keep takes whole classes; name layers in restore (gdn@0-9)")
        for key in ("restore", "keep"):
            for c in (entry_class(e) for e in r.get(key) or []):
                if c not in classes:
                    raise SplicerError(f"{where}: row {name!r} names unknown class {c[:40]!r}; classes: {', '.join(classes)}")
        rows.append(
            Row(
                name,
                r.get("restore"),
                r.get("keep"),
                bool(r.get("base", False)),
                bool(r.get("repeat", False)),
                r.get("checkpoint"),
                r.get("requantized_without"),
            )
        )
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
    return Plan(
        data.get("name", path.stem),
        data.get("description", ""),
        int(data.get("top_k", 20)),
        corpora,
        timing,
        rows,
        str(path),
        digest,
    )


def write_plan(out: Path, data: dict, header: str) -> Path:
    """Write plan data to `out` as TOML with a comment line on top, checked by reading it back as any plan is read
    (a plan that would not load is never put in place); written beside it first, then renamed over it
    (outputs.write_file: a read-only folder or a full disk is one line, and leaves nothing)."""
    import tomli_w

    from ..arch import all_classes
    from ..io.outputs import write_file

    text = f"# {header}\n" + tomli_w.dumps(data)

    def fill(tmp: Path) -> None:
        tmp.write_text(text, encoding="utf-8")
        load_plan(str(tmp), all_classes())

    return write_file(out, fill)


def requantized_classes(value: list[str], classes: tuple[str, ...], where: str, what: str = "requantized_without") -> list[str]:
    """The whole classes a re-quantized build left in BF16, sorted and once each, or a one-line error."""
    if not value or not all(value):
        raise SplicerError(f"{where}: {what} names no class, or an empty one; name the classes the build left in BF16")
    for c in value:
        if "@" in c:
            raise SplicerError(f"{where}: {what} takes whole classes ({c!r} names layers); name the class")
        if c not in classes:
            raise SplicerError(f"{where}: {what} names unknown class {c[:40]!r}; classes: {', '.join(classes)}")
    return sorted(set(value))


def add_checkpoints(plan: Plan, specs: list[str], requantized: list[str] = (), classes: tuple[str, ...] = ()) -> list[str]:
    """`--add NAME=DIR` and `--add-requantized CLASSES=DIR` rows appended to the plan (its digest covers them);
    returns their names. A re-quantized build's row is named requantized-CLASS (classes joined by +)."""
    added = []
    for spec in specs:
        name, sep, source = spec.partition("=")
        if not sep or not name.strip() or not source.strip():
            raise SplicerError(f"--add {spec[:80]!r} should be NAME=DIR (a checkpoint folder or a Hub repo id)")
        check_name(name.strip(), "--add", "a row's name")
        added.append(Row(name.strip(), checkpoint=source.strip()))
    for spec in requantized:
        what, sep, source = spec.partition("=")
        if not sep or not what.strip() or not source.strip():
            raise SplicerError(
                f"--add-requantized {spec[:80]!r} should be CLASSES=DIR (the classes the build left in BF16, "
                "e.g. gdn or gdn,attention, and the re-quantized checkpoint)"
            )
        without = requantized_classes([c.strip() for c in what.split(",")], classes, "--add-requantized", "CLASSES")
        row = Row("requantized-" + "+".join(without), checkpoint=source.strip(), requantized_without=without)
        if any(r.name == row.name for r in added):
            raise SplicerError(
                f"--add-requantized: classes {', '.join(without)} given twice; give one re-made build per set of classes"
            )
        added.append(row)
    for row in added:
        if any(r.name == row.name for r in plan.rows):
            if row.requantized_without:
                raise SplicerError(
                    f"--add-requantized {', '.join(row.requantized_without)}: plan {plan.name} already has a row named "
                    f"{row.name}; rename that row in the plan, or declare the build there (requantized_without)"
                )
            raise SplicerError(f"--add {row.name!r}: plan {plan.name} already has a row of that name; choose another NAME")
        plan.rows.append(row)
    if added:
        # A row without requantized_without digests as it did before the field existed, so older jobs resume.
        extra = json.dumps(
            [
                (r.name, r.checkpoint, *((r.requantized_without,) if r.requantized_without else ()))
                for r in plan.rows
                if r.checkpoint
            ]
        )
        plan.digest = hashlib.sha256((plan.digest + extra).encode()).hexdigest()[:16]
    return [r.name for r in added]


@dataclass
class PlannedRow:
    row: Row
    restored: list[str] | None  # classes restored (None: the base itself, or row.checkpoint; []: the build)
    splice_name: str  # the row whose splice it uses (itself, or the first row of the same variant for a repeat)

    @property
    def checkpoint(self) -> str | None:
        return self.row.checkpoint


def resolve_rows(
    plan: Plan,
    family: str,
    family_classes: tuple[str, ...],
    quantized: list[str],
    base_quantized: list[str],
    class_layers: dict[str, list[int]] | None = None,
    num_layers: int | None = None,
) -> tuple[list[PlannedRow], list[dict]]:
    """The plan's rows for one build: what each restores, and the rows skipped with their reason.

    Skipped: a row naming a class the family lacks, a row whose classes the build does not quantize, a row that needs
    a class the base keeps quantized, and a second row of the same variant unless it is a repeat (more engines of it).
    Restoring every quantized class stays its own row: it must reproduce the base exactly, an end-to-end check.
    class_layers (class -> the build's layers holding it quantized) and num_layers turn `class@layers` entries into this
    build's reading of them (selection.normalize_entry), so that one variant has one name; an entry no layer of the
    build can serve is refused here, before anything runs.
    """
    seen: dict[tuple, str] = {}
    todo, skipped = [], []
    for row in plan.rows:
        if row.checkpoint:
            todo.append(PlannedRow(row, None, row.name))
            continue
        lacking = [c for c in (entry_class(e) for e in (row.restore or []) + (row.keep or [])) if c not in family_classes]
        if lacking:
            what = f"class {lacking[0]}" if len(lacking) == 1 else f"classes {', '.join(lacking)}"
            skipped.append({"name": row.name, "reason": f"{family} has no {what}"})
            continue
        restored = row.restored(quantized)
        if restored and class_layers is not None:
            restored = list(
                dict.fromkeys(
                    normalize_entry(e, class_layers, f"plan {plan.name}: row {row.name!r}", num_layers) for e in restored
                )
            )
        if restored is not None and row.restore and not restored:
            skipped.append({"name": row.name, "reason": f"{', '.join(row.restore)} not quantized in this build"})
            continue
        frozen = sorted({entry_class(e) for e in restored or []} & set(base_quantized))
        if frozen:
            skipped.append({"name": row.name, "reason": f"needs BF16 {', '.join(frozen)}, which the base keeps quantized"})
            continue
        key = ("BASE",) if restored is None else tuple(sorted(restored))
        if key in seen and not row.repeat:
            skipped.append({"name": row.name, "reason": f"same variant as {seen[key]}"})
            continue
        seen.setdefault(key, row.name)
        todo.append(PlannedRow(row, restored, seen[key]))
    return todo, skipped
