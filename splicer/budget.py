"""`splicer budget DIR`: which restores to make under a size, decode-time or KL budget, predicted from the rows a
results folder measured (issue 17, first part: prediction and the front; splicing and measuring the chosen points,
`--verify`, is not built yet).

The model, from DIR/results.json alone:
  * atoms: the rows that restore one entry (a class, or a class in some layers: `gdn`, `gdn@0-9`); each has a
    measured KL reduction against the build, a size change and (when timed) a decode-time change;
  * a combination of atoms that do not overlap (different classes, or one class in disjoint layers) is predicted as
    the build less the sum of its atoms' reductions, times the measured additivity: the mean, over rows that restore
    several atoms together (the all row, leave-one-out rows, a sweep's whole-class row), of their measured reduction
    over the sum of their atoms' (1.00 = additive; no such row: 1.00, and the error cannot be stated). Size adds
    exactly (bytes on disk); decode time adds with its own measured ratio.
  * the model's own error: each multi-atom row predicted from the others (leave one out) against what it measured.
KL is pooled over corpora (position-weighted) unless --corpus names one. MTP entries are left out of the KL model:
the drafter never runs in a scoring pass (as the table's additivity note does).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

from .arch import DRAFTER_CLASS
from .errors import SplicerError
from .selection import layer_numbers
from .verdicts import pooled_kl

MAX_ATOMS = 16  # 2^16 combinations at most, enumerated exactly


@dataclass(frozen=True)
class Atom:
    entry: str
    cls: str
    layers: frozenset | None  # None: every layer of the class
    d_kl: float  # KL reduction against the build (positive: better)
    d_size: float  # bytes added
    d_decode: float | None  # ms/token added (None: not timed)


@dataclass
class Prediction:
    atoms: tuple[Atom, ...]
    kl: float
    size_gb: float
    decode: float | None
    measured: dict | None = None  # the row that restored exactly this set, if one did

    @property
    def label(self) -> str:
        """The restore in splice's spelling (`gdn@0-1,attention`), ready for --restore or a plan row."""
        from .selection import canonical_entries

        return ",".join(canonical_entries([a.entry for a in self.atoms], "budget")) or "none (the build)"


@dataclass
class Model:
    build_kl: float
    build_size: float
    build_decode: float | None
    atoms: list[Atom]
    kl_ratio: float
    decode_ratio: float | None
    checks: list[dict] = field(default_factory=list)  # multi-atom rows: measured against predicted from the others
    measured: dict = field(default_factory=dict)  # frozenset of atom entries -> the row that restored exactly those


def _kl(variant: dict, corpus: str | None) -> float | None:
    if corpus is None:
        return pooled_kl(variant)
    return ((variant.get("metrics") or {}).get(corpus) or {}).get("kl")


def _parse(entry: str) -> tuple[str, frozenset | None]:
    cls, _, text = entry.partition("@")
    return cls, frozenset(layer_numbers(text, entry)) if text else None


def _disjoint(a: Atom, b: Atom) -> bool:
    if a.cls != b.cls:
        return True
    return a.layers is not None and b.layers is not None and not (a.layers & b.layers)


def fit(results: dict, corpus: str | None = None) -> Model:
    """The additive model of a results folder (see the module docstring)."""
    ok = [v for v in results.get("variants", []) if isinstance(v, dict) and v.get("status") == "ok"
          and isinstance(v.get("restored"), list) and not v.get("repeat_of")]
    build = next((v for v in ok if v["restored"] == []), None)
    if build is None or _kl(build, corpus) is None:
        known = sorted({c for v in ok for c in (v.get("metrics") or {})})
        raise SplicerError("the results hold no scored build row" + (f" on corpus {corpus!r} (corpora: {', '.join(known)})"
                                                                      if corpus and known else "") + "; run the plan's build row first")
    b_kl, b_size, b_dec = _kl(build, corpus), build.get("size_bytes") or 0, build.get("decode_ms_per_token")
    scored = [(v, [e for e in v["restored"] if _parse(e)[0] != DRAFTER_CLASS]) for v in ok if v is not build]
    class_layers = {c: frozenset(ls) for c, ls in (results.get("class_layers") or {}).items()}
    singles = {}
    for v, entries in scored:
        if len(entries) == 1 and len(v["restored"]) == 1 and _kl(v, corpus) is not None:
            singles.setdefault(entries[0], v)

    def layer_set(entry: str) -> frozenset | None:
        cls, layers = _parse(entry)
        return layers if layers is not None else class_layers.get(cls)

    # Atoms: the single-entry rows that hold no smaller single-entry row of their class (a sweep's groups, not its
    # leave-one-out or whole-class rows, which are unions of them and measure additivity instead).
    def minimal(entry: str) -> bool:
        cls, mine = _parse(entry)[0], layer_set(entry)
        if mine is None:
            return not any(_parse(o)[0] == cls and o != entry for o in singles)
        return not any(_parse(o)[0] == cls and o != entry and (layer_set(o) or mine) < mine for o in singles)

    atoms = {}
    for entry, v in singles.items():
        if minimal(entry):
            cls, layers = _parse(entry)
            dec = v.get("decode_ms_per_token")
            atoms[entry] = Atom(entry, cls, layers if layers is not None else class_layers.get(cls), b_kl - _kl(v, corpus),
                                (v.get("size_bytes") or 0) - b_size, dec - b_dec if dec is not None and b_dec is not None else None)
    if not atoms:
        raise SplicerError("the results hold no row that restores one class (or one class in some layers); a budget "
                           "needs them: run a plan with single-class rows (where-error-comes-from, or splicer plan sweep)")
    if len(atoms) > MAX_ATOMS:
        raise SplicerError(f"the results hold {len(atoms)} single-entry rows; the budget search enumerates up to {MAX_ATOMS}")

    def decompose(entries: list[str]) -> list[Atom] | None:
        """The atoms a row restores, when it is exactly a union of disjoint atoms."""
        parts = []
        for e in entries:
            if e in atoms:
                parts.append(atoms[e])
                continue
            cls, want = _parse(e)[0], layer_set(e)
            mine = [a for a in atoms.values() if a.cls == cls and a.layers is not None and want is not None and a.layers <= want]
            if want is None or not mine or frozenset().union(*(a.layers for a in mine)) != want:
                return None
            parts += mine
        if any(not _disjoint(a, b) for a, b in itertools.combinations(parts, 2)):
            return None
        return parts

    multi = []
    for v, entries in scored:
        parts = decompose(entries) if entries and _kl(v, corpus) is not None else None
        if parts and len(parts) >= 2:
            multi.append((v, parts))

    def ratio(rows, measure, part) -> float | None:
        rs = []
        for v, parts in rows:
            total = sum(part(a) for a in parts)
            if total:
                rs.append(measure(v) / total)
        return sum(rs) / len(rs) if rs else None

    kl_measure = lambda v: b_kl - _kl(v, corpus)  # noqa: E731
    kl_ratio = ratio(multi, kl_measure, lambda a: a.d_kl)
    timed = b_dec is not None and all(a.d_decode is not None for a in atoms.values())
    dec_measure = lambda v: v["decode_ms_per_token"] - b_dec  # noqa: E731
    dec_rows = [(v, p) for v, p in multi if v.get("decode_ms_per_token") is not None] if timed else []
    decode_ratio = ratio(dec_rows, dec_measure, lambda a: a.d_decode) if timed else None
    checks = []
    for i, (v, parts) in enumerate(multi):
        others = multi[:i] + multi[i + 1:]
        r = ratio(others, kl_measure, lambda a: a.d_kl)
        checks.append({"row": v["name"], "measured_kl": _kl(v, corpus),
                       "predicted_kl": None if r is None else b_kl - r * sum(a.d_kl for a in parts)})
    measured = {frozenset(): build, **{frozenset([e]): singles[e] for e in atoms}}
    for v, parts in multi:
        measured.setdefault(frozenset(a.entry for a in parts), v)
    return Model(b_kl, b_size, b_dec, list(atoms.values()), kl_ratio if kl_ratio is not None else 1.0,
                 (decode_ratio if decode_ratio is not None else 1.0) if timed else None, checks, measured)


def predictions(model: Model, results: dict, corpus: str | None = None) -> list[Prediction]:
    """Every combination of non-overlapping atoms (the build included), predicted; the measured row attached where one
    restored exactly that set."""
    measured = model.measured
    out = []
    n = len(model.atoms)
    for k in range(n + 1):
        for combo in itertools.combinations(model.atoms, k):
            if not all(_disjoint(a, b) for a, b in itertools.combinations(combo, 2)):
                continue
            red = sum(a.d_kl for a in combo)
            kl = model.build_kl - (model.kl_ratio * red if len(combo) > 1 else red)
            size = (model.build_size + sum(a.d_size for a in combo)) / 1e9
            dec = None
            if model.decode_ratio is not None:
                add = sum(a.d_decode for a in combo)
                dec = model.build_decode + (model.decode_ratio * add if len(combo) > 1 else add)
            m = measured.get(frozenset(a.entry for a in combo))
            out.append(Prediction(combo, kl, size, dec, None if m is None else
                                  {"row": m["name"], "kl": _kl(m, corpus), "decode": m.get("decode_ms_per_token")}))
    return out


def front(preds: list[Prediction], cost: str) -> list[Prediction]:
    """The predictions no other beats on both predicted KL and `cost` (size_gb or decode), by increasing cost."""
    from .plot import pareto

    return pareto(preds, lambda p: getattr(p, cost), lambda p: p.kl)


def budget_report(folder: str | Path, max_decode_ms: float | None = None, max_gb: float | None = None,
                  max_kl: float | None = None, corpus: str | None = None) -> str:
    from tabulate import tabulate

    from .table import load_results

    results = load_results(Path(folder))
    model = fit(results, corpus)
    if max_decode_ms is not None and model.decode_ratio is None:
        raise SplicerError("--max-decode-ms needs timed rows, and this run did not time every single-entry row and the build "
                           "(was it run with --no-time?); use --max-gb or --max-kl, or run the plan with timing")
    preds = predictions(model, results, corpus)
    cost = "decode" if model.decode_ratio is not None and (max_decode_ms is not None or max_gb is None) else "size_gb"
    feasible = [p for p in preds if (max_gb is None or p.size_gb <= max_gb)
                and (max_decode_ms is None or (p.decode is not None and p.decode <= max_decode_ms))
                and (max_kl is None or p.kl <= max_kl)]
    lines = [f"KL {'on ' + corpus if corpus else 'pooled over corpora'}; build {model.build_kl:.4f}, "
             f"{model.build_size / 1e9:.3f} GB" + (f", {model.build_decode:.3f} ms/token" if model.build_decode is not None else "")
             + f"; {len(model.atoms)} single-entry rows: {', '.join(a.entry for a in model.atoms)}."]
    if model.checks:
        lines.append(f"Additivity of KL reductions: {model.kl_ratio:.2f} (mean over {len(model.checks)} rows restoring several "
                     "of them: 1.00 = additive).")
        errs = [c for c in model.checks if c["predicted_kl"] is not None]
        if errs:
            worst = max(errs, key=lambda c: abs(c["predicted_kl"] - c["measured_kl"]))
            lines.append("Prediction error, each such row predicted from the others: " + ", ".join(
                f"{c['row']} {c['predicted_kl']:.4f} predicted, {c['measured_kl']:.4f} measured" for c in errs)
                + f"; largest |error| {abs(worst['predicted_kl'] - worst['measured_kl']):.4f} ({worst['row']}).")
        else:
            lines.append("Prediction error: one row restores several atoms, so none can be predicted from the others.")
    else:
        lines.append("No row restores several of these together: additivity is assumed (1.00), not measured, and the "
                     "prediction error cannot be stated; add an all row or leave-one-out rows.")
    best = front(feasible, cost)
    rows = [[p.label, f"{p.kl:.4f}", f"{p.size_gb:.3f}", "" if p.decode is None else f"{p.decode:.3f}",
             "" if p.measured is None else f"{p.measured['row']}: KL {p.measured['kl']:.4f}"] for p in best]
    limits = ", ".join(x for x in ((f"size <= {max_gb:g} GB" if max_gb is not None else ""),
                                   (f"decode <= {max_decode_ms:g} ms/token" if max_decode_ms is not None else ""),
                                   (f"KL <= {max_kl:g}" if max_kl is not None else "")) if x) or "no limit"
    lines.append(f"Pareto front of predicted KL against {'decode ms/token' if cost == 'decode' else 'size on disk'} "
                 f"({limits}; {len(feasible)} of {len(preds)} combinations within it):")
    if not rows:
        lines.append("no combination fits the limits.")
    else:
        lines.append(tabulate(rows, headers=["restore", "KL predicted", "size GB", "decode ms/tok predicted", "measured row"],
                              tablefmt="github"))
    lines.append("Splicing and measuring the chosen points (--verify) is not built yet: splice one with "
                 "`splicer splice --restore ENTRIES BUILD BASE -o OUT`, or add it as a plan row.")
    return "\n".join(lines)
