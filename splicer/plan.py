"""Ablation plans: TOML files under ablations/ that declare corpora, timing settings and rows."""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .corpora import validate_spec
from .errors import SplicerError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PLAN_KEYS = {"name", "description", "top_k", "corpus", "timing", "row"}
ROW_KEYS = {"name", "restore", "keep", "base", "repeat"}
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

    def restored(self, quantized: list[str]) -> list[str] | None:
        """Classes this row restores in a build that quantizes `quantized` (None: the base itself)."""
        if self.base:
            return None
        if self.keep is not None:
            return [c for c in quantized if c not in self.keep]
        return [c for c in quantized if c in (self.restore or [])]


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


def _plan_path(name_or_path: str) -> Path:
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


def load_plan(name_or_path: str, classes: tuple[str, ...]) -> Plan:
    path = _plan_path(name_or_path)
    raw = path.read_bytes()
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise SplicerError(f"plan {path} is not valid TOML ({e}); fix the file") from None
    where = f"plan {path}"
    unknown = sorted(set(data) - PLAN_KEYS)
    if unknown:
        raise SplicerError(f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(sorted(PLAN_KEYS))}")
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
        bad = sorted(set(timing) - TIMING_KEYS)
        if bad:
            raise SplicerError(f"{where}: unknown timing key {bad[0]!r}; allowed: {', '.join(sorted(TIMING_KEYS))}")
    rows, seen = [], set()
    for r in rows_raw:
        bad = sorted(set(r) - ROW_KEYS)
        if bad:
            raise SplicerError(f"{where}: row {r.get('name')!r} has unknown key {bad[0]!r}; allowed: {', '.join(sorted(ROW_KEYS))}")
        name = r.get("name")
        if not name or name in seen:
            raise SplicerError(f"{where}: every row needs a unique name (problem at {name!r})")
        seen.add(name)
        given = [k for k in ("restore", "keep", "base") if k in r]
        if len(given) != 1:
            raise SplicerError(f"{where}: row {name!r} needs exactly one of restore, keep or base")
        for key in ("restore", "keep"):
            for c in r.get(key) or []:
                if c not in classes:
                    raise SplicerError(f"{where}: row {name!r} names unknown class {c!r}; classes: {', '.join(classes)}")
        rows.append(Row(name, r.get("restore"), r.get("keep"), bool(r.get("base", False)), bool(r.get("repeat", False))))
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
    return Plan(data.get("name", path.stem), data.get("description", ""), int(data.get("top_k", 20)), corpora, timing, rows,
                str(path), digest)
