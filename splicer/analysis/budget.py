"""`splicer budget DIR`: which restores to make under a size, decode-time or KL budget, predicted from the rows a
results folder measured, then spliced and measured (`--verify N`) and compared with the prediction.

The model, from DIR/results.json (and DIR/scores/ for the intervals):
  * atoms: the rows that restore one entry (a class, or a class in some layers: `gdn`, `gdn@0-9`) and hold no smaller
    such row of their class; each has a measured KL reduction against the build, a size change and (when timed) a
    decode-time change (its engines' mean against the mean of the build's engines);
  * a combination of atoms that do not overlap (different classes, or one class in disjoint layers) is predicted as
    the build less its atoms' reductions combined by the measured additivity (Additivity): within a class, the sum
    of its atoms' reductions times that class's slope; across classes, the sum of the classes' times one more slope.
    Each slope is the least-squares slope, through 0, of the measured reduction of the rows that restore several
    atoms together (the all row, leave-one-out rows, a sweep's whole-class row, verified points) against what the
    atoms predict (1.00 = additive; a slope no row measures is 1.00, and said). A slope rather than a mean of ratios,
    so that rows whose atoms barely change KL weigh little; a row whose atoms all changed KL within noise (paired
    intervals including 0) fits none, as its slope would be a ratio of two noises. Size adds exactly (bytes on disk). Decode time adds without a correction:
    the stand-in's first verification fitted a decode slope of -1.34 from one row whose atoms' decode changes were
    all within the engine spread, and predicted +3.9 % where -2.3 % was measured (results/budget-h200/); each
    multi-atom row's decode against its atoms' sum is stated instead, with its interval.
  * the model's own error: each multi-atom row predicted from the others (leave one out) against what it measured.
  * intervals: a prediction's KL interval is the stratified bootstrap over sequences of the prediction made position
    by position (the same positions for every row), the additivity held fixed; its decode interval comes from the
    engine-to-engine spread of the run (Student's t, as the decode verdicts): a combination of k atoms is predicted as
    build + sum(atom - build) = sum(atom) - (k-1) build, so the build's mean enters with coefficient k-1. Neither
    carries the model's own error, which is stated beside them. KL and decode time are never negative: an interval's
    lower end below 0 is raised to 0 (the true value lies in [0, inf), so this cannot lower coverage), and a predicted
    KL below 0 (slopes that over-predict the reductions) is shown as 0, both said; when some combination's predicted
    decode is at or below 0 ms/token, the atoms' decode changes are timing noise larger than the build's time (a
    loaded machine) and the model predicts no decode at all, said, rather than a time no engine can reach.
  * re-made builds (a checkpoint row with requantized_without: `--add-requantized`) are no splices (their quantizer
    re-fitted every later layer), so they stay out of the fit; each is compared with the prediction for restoring its
    classes, with the interval --verify gives its points (requantized()), and report quotes that from budget.json.
KL is pooled over corpora (position-weighted) unless --corpus names one. MTP entries are left out of the KL model:
the drafter never runs in a scoring pass (as the table's additivity note does).

The search, `--verify` and the printed report are in budget/search.py.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SplicerError
from ..splice.selection import DRAFTER_CLASS, layer_numbers
from .formatting import decimals, fmt_change
from .verdicts import pooled_kl, requantized_classes_note, timed_engines

MAX_ATOMS = 16  # 2^16 combinations at most, enumerated exactly


@dataclass(frozen=True)
class Atom:
    entry: str
    cls: str
    layers: frozenset | None  # None: every layer of the class
    row: str  # the row that measured it (its scores are DIR/scores/ROW)
    d_kl: float  # KL reduction against the build (positive: better)
    d_size: float  # bytes added
    d_decode: float | None  # ms/token added (None: not timed)
    engines: int = 1  # timed engines of its variant
    significant: bool = True  # its KL change against the build excludes 0 (paired interval; unknown counts as yes)


@dataclass
class Additivity:
    """How KL reductions combine: within one class (a class's layer groups together) by that class's slope, and the
    classes' combined reductions across classes by one more slope; an unmeasured slope is 1 (additive), and said."""

    within: dict = field(default_factory=dict)  # class -> slope, for the classes some row measured
    across: float | None = None  # None: no row restored several classes

    def reduce(self, parts, value):
        """The predicted reduction of restoring `parts` together; value(atom) is an atom's reduction (a number, or a
        tensor of per-position reductions)."""
        by_cls: dict[str, list] = {}
        for a in parts:
            by_cls.setdefault(a.cls, []).append(a)
        sums = [(self.within.get(c, 1.0) if len(ps) > 1 else 1.0) * sum(value(a) for a in ps) for c, ps in by_cls.items()]
        total = sum(sums)
        return (self.across if self.across is not None else 1.0) * total if len(sums) > 1 else total

    unmeasurable: tuple = ()  # classes (and "across") whose rows' atoms all changed KL within noise: slope not fitted

    def to_json(self) -> dict:
        return {"within": self.within, "across": self.across, "unmeasurable": list(self.unmeasurable)}

    @classmethod
    def from_json(cls, d) -> Additivity:
        """A stored additivity (budget.json); anything that is not a number is dropped (taken as additive)."""
        d = d if isinstance(d, dict) else {}
        within = d.get("within") if isinstance(d.get("within"), dict) else {}
        return cls(
            {c: float(r) for c, r in within.items() if finite_number(r)},
            float(d["across"]) if finite_number(d.get("across")) else None,
        )

    @classmethod
    def fit(cls, multi: list, measure) -> Additivity:
        """Least-squares slopes through 0: per class from the rows restoring several of its atoms only, then across
        classes from the rows restoring several classes, against their classes' reductions as `within` predicts them.
        A row whose atoms all changed KL within noise (none significant) fits no slope: its slope would be a ratio of
        two noises, as the decode slope of results/budget-h200 was; when no row is left, the slope stays 1.00."""
        kept = [(v, p) for v, p in multi if any(a.significant for a in p)]
        unmeasurable = sorted(
            {p[0].cls if len({a.cls for a in p}) == 1 else "across" for v, p in multi}
            - {p[0].cls if len({a.cls for a in p}) == 1 else "across" for v, p in kept}
        )
        multi = kept
        within = {}
        for c in sorted({p[0].cls for _, p in multi if len({a.cls for a in p}) == 1}):
            r = slope([(v, p) for v, p in multi if {a.cls for a in p} == {c}], measure, lambda p: sum(a.d_kl for a in p))
            if r is not None:
                within[c] = r
        inner = cls(within)
        across = slope(
            [(v, p) for v, p in multi if len({a.cls for a in p}) > 1], measure, lambda p: inner.reduce(p, lambda a: a.d_kl)
        )
        return cls(within, across, tuple(unmeasurable))


@dataclass
class Prediction:
    atoms: tuple[Atom, ...]
    kl: float
    size_gb: float
    decode: float | None
    measured: dict | None = None  # the row that restored exactly this set, if one did
    kl_ci: list | None = None  # 95 % interval of the predicted KL (intervals(): front points only)
    decode_ci: list | None = None
    kl_by_corpus: dict = field(default_factory=dict)
    kl_ci_by_corpus: dict = field(default_factory=dict)
    class_layers: dict = field(default_factory=dict)  # to write a class restored in all its layers as the bare class
    name: str | None = None  # the plan row --verify measures it with, when row_name clashes with another row of DIR
    kl_floored: bool = False  # the model predicted a KL below 0, shown as 0
    kl_ci_why: str | None = None  # why kl_ci is None although the scores are at hand (metrics.TOO_FEW)

    @property
    def label(self) -> str:
        """The restore in splice's spelling (`gdn@0-1,attention`), ready for --restore or a plan row."""
        return ",".join(self.entries) or "none (the build)"

    @property
    def entries(self) -> list[str]:
        from ..splice.selection import canonical_entries

        out = []
        for e in canonical_entries([a.entry for a in self.atoms], "budget") if self.atoms else []:
            cls, layers = parse_entry(e)
            whole = layers is not None and cls in self.class_layers and layers == frozenset(self.class_layers[cls])
            out.append(cls if whole else e)  # one variant, one name: splice and plan rows read it so too
        return out

    @property
    def row_name(self) -> str:
        """A plan row's name for this restore: `gdn.0-7+attention` (row names are plain: no @ or commas), unless
        --verify gave it another (`name`) because DIR already has a row of that name defined otherwise."""
        import hashlib

        if self.name:
            return self.name
        name = "+".join(e.replace("@", ".").replace(",", "_") for e in self.entries)
        return name if len(name) <= 100 else name[:90] + "-" + hashlib.sha256(name.encode()).hexdigest()[:8]


@dataclass
class Model:
    build_kl: float
    build_size: float
    build_decode: float | None
    atoms: list[Atom]
    additivity: Additivity
    timed: bool  # the build and every atom have a decode time; decode then adds, atom by atom
    checks: list[dict] = field(default_factory=list)  # multi-atom rows: measured against predicted from the others
    measured: dict = field(default_factory=dict)  # frozenset of atom entries -> the row that restored exactly those
    corpus: str | None = None
    build_row: str = "build"
    build_engines: int = 1
    engine_sd_ms: float | None = None  # the run's engine-to-engine spread of a variant's mean decode (verdicts)
    engine_df: int = 0
    build_by_corpus: dict = field(default_factory=dict)  # corpus -> build KL
    atom_kl_by_corpus: dict = field(default_factory=dict)  # atom entry -> corpus -> its KL
    decode_checks: list = field(default_factory=list)  # multi-atom rows: decode measured against its atoms' sum
    class_layers: dict = field(default_factory=dict)  # class -> the build's layers holding it quantized
    left_out: list = field(default_factory=list)  # (row, why): rows whose measurements are not finite numbers
    unphysical_decode: str | None = None  # why decode is not predicted although the rows were timed
    # rows restoring several entries that are not unions of atoms, so in no fit: (row, its entries no atom makes up,
    # the rest of its entries); an all row that also restores experts, which no single-entry row measured
    unfitted: list = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "corpus": self.corpus,
            "build_kl": self.build_kl,
            "build_size_bytes": self.build_size,
            "build_decode_ms": self.build_decode,
            "build_engines": self.build_engines,
            "additivity": self.additivity.to_json(),
            "decode_ratio": 1.0 if self.timed else None,
            "engine_sd_ms": self.engine_sd_ms,
            "engine_df": self.engine_df,
            "atoms": [
                {
                    "entry": a.entry,
                    "row": a.row,
                    "d_kl": a.d_kl,
                    "d_size_bytes": a.d_size,
                    "d_decode_ms": a.d_decode,
                    "engines": a.engines,
                }
                for a in self.atoms
            ],
            "checks": self.checks,
            "decode_checks": self.decode_checks,
            "left_out": [{"row": n, "why": why} for n, why in self.left_out],
            "unphysical_decode": self.unphysical_decode,
        }


def finite_number(x) -> bool:
    """A real number (not a bool, NaN or infinity): what a budget.json field or a limit must be to be used."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def engine_half_width(sd_ms: float, df: int, terms) -> float:
    """95 % half-width of a linear combination of variants' mean decode times, each the mean over its engines:
    terms = (coefficient, engines) pairs; every engine mean varies by the run's engine spread sd_ms (Student's t with
    the spread's df, as the decode verdicts)."""
    from .metrics import t975

    return t975(df) * sd_ms * math.sqrt(sum(c * c / n for c, n in terms))


def variant_kl(variant: dict, corpus: str | None) -> float | None:
    if corpus is None:
        return pooled_kl(variant)
    return ((variant.get("metrics") or {}).get(corpus) or {}).get("kl")


def parse_entry(entry: str) -> tuple[str, frozenset | None]:
    cls, _, text = entry.partition("@")
    return cls, frozenset(layer_numbers(text, entry)) if text else None


def _layer_set(entry: str, class_layers: dict) -> frozenset | None:
    cls, layers = parse_entry(entry)
    return layers if layers is not None else class_layers.get(cls)


def decompose(entries: list[str], atoms: dict, class_layers: dict) -> list[Atom] | None:
    """The atoms (entry -> Atom) a restore is made of, when it is exactly a union of disjoint atoms; else None."""
    parts = []
    for e in entries:
        if e in atoms:
            parts.append(atoms[e])
            continue
        cls, want = parse_entry(e)[0], _layer_set(e, class_layers)
        mine = [a for a in atoms.values() if a.cls == cls and a.layers is not None and want is not None and a.layers <= want]
        if want is None or not mine or frozenset().union(*(a.layers for a in mine)) != want:
            return None
        parts += mine
    if any(not _disjoint(a, b) for a, b in itertools.combinations(parts, 2)):
        return None
    return parts


def _disjoint(a: Atom, b: Atom) -> bool:
    if a.cls != b.cls:
        return True
    return a.layers is not None and b.layers is not None and not (a.layers & b.layers)


def variant_decode(results: dict, v: dict) -> tuple[float | None, int]:
    """A variant's decode ms/token: the mean of its engines' levels (its row and its repeats, each engine's level as
    the decode verdicts take it: metrics.engine_level), or the row's own figure when no per-block times were kept; and
    how many engines that is."""
    from .metrics import engine_level

    engines = timed_engines(results, v["name"])
    if engines:
        levels = [engine_level(e) for e in engines]
        return sum(levels) / len(levels), len(levels)
    return v.get("decode_ms_per_token"), 1


def _significant(v: dict, corpus: str | None) -> bool:
    """Whether a row's KL differs from the build's beyond noise (its paired verdict, pooled or on the corpus); a row
    without verdicts (a results file written by hand) counts as significant."""
    kl = (v.get("vs_build") or {}).get("kl") or {}
    r = (kl.get("per_stratum") or {}).get(corpus) if corpus else kl.get("pooled")
    return True if not isinstance(r, dict) or r.get("significant") is None else bool(r["significant"])


def slope(rows, measure, x) -> float | None:
    """Least-squares slope through 0 of measure(row) against x(its atoms)."""
    num = den = 0.0
    for v, parts in rows:
        total = x(parts)
        num += measure(v) * total
        den += total * total
    return num / den if den > 0 else None


def _engine_spread(results: dict) -> tuple[float | None, int]:
    """The run's engine-to-engine standard deviation of one engine's mean decode and its degrees of freedom, as the
    decode verdicts estimated them (the same for every row of a run)."""
    for v in results.get("variants", []):
        d = v.get("decode_vs_build") if isinstance(v, dict) else None
        if (
            isinstance(d, dict)
            and finite_number(d.get("engine_sd_ms"))
            and d["engine_sd_ms"] >= 0
            and isinstance(d.get("df"), int)
            and not isinstance(d["df"], bool)
            and d["df"] >= 1
        ):
            return d["engine_sd_ms"], d["df"]
    return None, 0


def fit(results: dict, corpus: str | None = None) -> Model:
    """The additive model of a results folder (see the module docstring). Rows results_record.load marked unusable (a NaN
    or infinite measurement) are left out, and listed in Model.left_out."""
    from ..io.results_record import UNUSABLE

    ok = [v for v in results.get("variants", []) if _splice_row(v) and not v.get("repeat_of")]
    left_out = [(v["name"], v[UNUSABLE]) for v in ok if v.get(UNUSABLE)]
    if any(v["restored"] == [] for v in ok if v.get(UNUSABLE)):
        raise SplicerError(
            f"the build row {left_out[0][0]!r} has a measurement that is not a number ({left_out[0][1]}); "
            "every prediction is made from it: rerun the build row (splicer ablate on this folder)"
        )
    ok = [v for v in ok if not v.get(UNUSABLE)]
    build = next((v for v in ok if v["restored"] == []), None)
    if build is None or variant_kl(build, corpus) is None:
        known = sorted({c for v in ok for c in (v.get("metrics") or {})})
        raise SplicerError(
            "the results hold no scored build row"
            + (f" on corpus {corpus!r} (corpora: {', '.join(known)})" if corpus and known else "")
            + "; run the plan's build row first"
        )
    b_kl, b_size = variant_kl(build, corpus), build.get("size_bytes") or 0
    b_dec, b_engines = variant_decode(results, build)
    scored = [(v, [e for e in v["restored"] if parse_entry(e)[0] != DRAFTER_CLASS]) for v in ok if v is not build]
    class_layers = {c: frozenset(ls) for c, ls in (results.get("class_layers") or {}).items()}
    singles = {}
    for v, entries in scored:
        if len(entries) == 1 and len(v["restored"]) == 1 and variant_kl(v, corpus) is not None:
            singles.setdefault(entries[0], v)

    def layer_set(entry: str) -> frozenset | None:
        return _layer_set(entry, class_layers)

    # Atoms: the single-entry rows that hold no smaller single-entry row of their class (a sweep's groups, not its
    # leave-one-out or whole-class rows, which are unions of them and measure additivity instead).
    def minimal(entry: str) -> bool:
        cls, mine = parse_entry(entry)[0], layer_set(entry)
        if mine is None:
            return not any(parse_entry(o)[0] == cls and o != entry for o in singles)
        return not any(parse_entry(o)[0] == cls and o != entry and (layer_set(o) or mine) < mine for o in singles)

    atoms = {}
    for entry, v in singles.items():
        if minimal(entry):
            cls, layers = parse_entry(entry)
            dec, n = variant_decode(results, v)
            atoms[entry] = Atom(
                entry,
                cls,
                layers if layers is not None else class_layers.get(cls),
                v["name"],
                b_kl - variant_kl(v, corpus),
                (v.get("size_bytes") or 0) - b_size,
                dec - b_dec if dec is not None and b_dec is not None else None,
                n,
                _significant(v, corpus),
            )
    if not atoms:
        raise SplicerError(
            "the results hold no row that restores one class (or one class in some layers); a budget "
            "needs them: run a plan with single-class rows (where-error-comes-from, or splicer plan sweep)"
        )
    if len(atoms) > MAX_ATOMS:
        raise SplicerError(f"the results hold {len(atoms)} single-entry rows; the budget search enumerates up to {MAX_ATOMS}")

    multi, unfitted = [], []
    for v, entries in scored:
        parts = decompose(entries, atoms, class_layers) if entries and variant_kl(v, corpus) is not None else None
        if parts and len(parts) >= 2:
            multi.append((v, parts))
        elif parts is None and len(entries) >= 2 and variant_kl(v, corpus) is not None:
            missing = [e for e in entries if decompose([e], atoms, class_layers) is None]
            if missing:  # (entries that are atoms but overlap one another are no mistake to point out)
                unfitted.append((v["name"], missing, [e for e in entries if e not in missing]))

    kl_measure = lambda v: b_kl - variant_kl(v, corpus)  # noqa: E731
    additivity = Additivity.fit(multi, kl_measure)
    timed = b_dec is not None and all(a.d_decode is not None for a in atoms.values())
    sd, df = _engine_spread(results)
    decode_checks = []
    for v, parts in multi if timed else []:
        m, n = variant_decode(results, v)
        if m is None:
            continue
        pred = b_dec + sum(a.d_decode for a in parts)
        check = {"row": v["name"], "predicted_ms": pred, "measured_ms": m}
        if sd is not None and df:
            half = engine_half_width(sd, df, [(1, n), *((1, a.engines) for a in parts), (len(parts) - 1, b_engines)])
            check["error_ci_ms"] = [m - pred - half, m - pred + half]
        decode_checks.append(check)
    checks = []
    for i, (v, parts) in enumerate(multi):
        others = Additivity.fit(multi[:i] + multi[i + 1 :], kl_measure)
        checks.append(
            {
                "row": v["name"],
                "atoms": [a.entry for a in parts],
                "measured_kl": variant_kl(v, corpus),
                "predicted_kl": b_kl - others.reduce(parts, lambda a: a.d_kl),
            }
        )
    measured = {frozenset(): build, **{frozenset([e]): singles[e] for e in atoms}}
    for v, parts in multi:
        measured.setdefault(frozenset(a.entry for a in parts), v)
    corpora = list(results.get("corpora") or {}) or sorted({c for v in ok for c in (v.get("metrics") or {})})
    model = Model(
        b_kl,
        b_size,
        b_dec,
        list(atoms.values()),
        additivity,
        timed,
        checks,
        measured,
        corpus,
        build["name"],
        b_engines,
        sd,
        df,
        {c: variant_kl(build, c) for c in corpora if variant_kl(build, c) is not None},
        {e: {c: variant_kl(singles[e], c) for c in corpora if variant_kl(singles[e], c) is not None} for e in atoms},
        decode_checks,
        class_layers,
        left_out,
        unfitted=unfitted,
    )
    if timed:
        worst = min(predictions(model), key=lambda p: p.decode)
        if worst.decode <= 0:  # no engine decodes in 0 ms: the atoms' decode changes are noise larger than the build's time
            model.timed, model.decode_checks = False, []
            model.unphysical_decode = (
                f"{worst.label} is predicted at {worst.decode:.1f} ms/token from a build at "
                f"{b_dec:.1f}: the single-entry rows' decode changes are timing noise larger than "
                "the build's time (a loaded machine?); time the rows again on an idle machine"
            )
    return model


def _combine(model: Model, combo, build_value: float, atom_value) -> float:
    """build less the atoms' reductions combined by the measured additivity; one atom is its own measurement."""
    return build_value - model.additivity.reduce(combo, lambda a: build_value - atom_value(a))


def predictions(model: Model) -> list[Prediction]:
    """Every combination of non-overlapping atoms (the build included), predicted; the measured row attached where one
    restored exactly that set."""
    out = []
    n = len(model.atoms)
    for k in range(n + 1):
        for combo in itertools.combinations(model.atoms, k):
            if all(_disjoint(a, b) for a, b in itertools.combinations(combo, 2)):
                out.append(predict(model, combo))
    return out


def predict(model: Model, combo) -> Prediction:
    """One combination of non-overlapping atoms, predicted; the measured row attached where one restored exactly it."""
    combo = tuple(combo)
    kl = _combine(model, combo, model.build_kl, lambda a: model.build_kl - a.d_kl)
    m = model.measured.get(frozenset(a.entry for a in combo))
    return Prediction(
        combo,
        max(kl, 0.0),
        (model.build_size + sum(a.d_size for a in combo)) / 1e9,
        model.build_decode + sum(a.d_decode for a in combo) if model.timed else None,
        None if m is None else {"row": m["name"], "kl": variant_kl(m, model.corpus), "decode": m.get("decode_ms_per_token")},
        class_layers=model.class_layers,
        kl_floored=kl < 0,  # KL is never negative: slopes that over-predict the reductions
    )


def pareto(items: list, x=lambda p: p[0], y=lambda p: p[1]) -> list:
    """The items no other item beats on both x and y (lower is better on both), by increasing x; a y lower by less
    than 1e-12 (float noise of a sum) is no improvement. Used for the predicted combinations here and the
    measured points of `splicer plot`."""
    front, best = [], float("inf")
    for item in sorted(items, key=lambda p: (x(p), y(p))):
        if y(item) < best - 1e-12:
            front.append(item)
            best = y(item)
    return front


def front(preds: list[Prediction], cost: str) -> list[Prediction]:
    """The predictions no other beats on both predicted KL and `cost` (size_gb or decode), by increasing cost."""
    return pareto(preds, lambda p: getattr(p, cost), lambda p: p.kl)


class PositionScores:
    """Per-position KL of the rows of a results folder (DIR/scores/ROW/CORPUS.safetensors), loaded once each."""

    def __init__(self, folder: Path, corpora: list[str]):
        self.folder, self.corpora, self._cache = Path(folder), corpora, {}

    def get(self, row: str, corpus: str):
        key = (row, corpus)
        if key not in self._cache:
            from .verdicts import load_scores

            self._cache[key] = load_scores(self.folder, row, corpus)
        return self._cache[key]

    def strata(self, model: Model, combo, corpus: str | None, other=None) -> dict | None:
        """{corpus: paired_comparison stratum} of the prediction position by position (a) against `other` row's
        measurement (b; zeros when None); None when a row's score files are missing or cover other positions."""
        import torch

        from .metrics import units

        out = {}
        for c in [corpus] if corpus else self.corpora:
            from .verdicts import same_form

            build, meas, *parts = same_form(
                [self.get(model.build_row, c), self.get(other, c) if other else None] + [self.get(a.row, c) for a in combo]
            )
            if build is None or any(p is None for p in parts) or (other and meas is None):
                return None
            if any(p["seq_index"].shape != build["seq_index"].shape for p in parts + ([meas] if meas else [])):
                return None
            b = build["kl_top"].double()
            per_atom = {a.entry: b - p["kl_top"].double() for a, p in zip(combo, parts)}
            pred = b - model.additivity.reduce(combo, lambda a: per_atom[a.entry]) if combo else b
            unit, unit_name = units(build)
            out[c] = {
                "a": pred,
                "b": meas["kl_top"].double() if meas else torch.zeros_like(pred),
                "cluster": unit,
                "unit": unit_name,
                "weight": build.get("weight"),
            }
        return out


def pooled_or(comparison: dict, corpus: str | None) -> dict:
    return comparison["per_stratum"][corpus] if corpus else comparison["pooled"]


def intervals(model: Model, preds: list[Prediction], scores: PositionScores | None, reps: int = 2000) -> None:
    """Fill each prediction's KL interval (from the rows' per-position scores) and decode interval (from the run's
    engine spread), and its KL per corpus."""
    from .metrics import paired_comparison

    for p in preds:
        p.kl_by_corpus = {
            c: max(0.0, _combine(model, p.atoms, b, lambda a, c=c: model.atom_kl_by_corpus[a.entry][c]))
            for c, b in model.build_by_corpus.items()
            if all(c in model.atom_kl_by_corpus.get(a.entry, {}) for a in p.atoms)
        }
        strata = scores.strata(model, p.atoms, model.corpus) if scores is not None else None
        if strata:
            comparison = paired_comparison(strata, reps)
            p.kl_ci = nonnegative(pooled_or(comparison, model.corpus)["diff_ci"])
            p.kl_ci_why = pooled_or(comparison, model.corpus).get("why")
            p.kl_ci_by_corpus = {c: nonnegative(r["diff_ci"]) for c, r in comparison["per_stratum"].items()}
        if p.decode is not None and p.atoms and model.engine_sd_ms is not None and model.engine_df:
            half = engine_half_width(model.engine_sd_ms, model.engine_df, decode_terms(p.atoms, model.build_engines))
            p.decode_ci = nonnegative([p.decode - half, p.decode + half])


def decode_terms(atoms, build_engines: int) -> list[tuple[float, int]]:
    """engine_half_width's terms of an absolute decode prediction build + sum(atom - build) = sum(atom) - (k-1) build:
    each atom's engine mean once, the build's k-1 times (one atom is its own measurement)."""
    return [*((1, a.engines) for a in atoms), (len(atoms) - 1, build_engines)]


def nonnegative(ci) -> list | None:
    """An interval of a quantity that is never negative (KL, a decode time) with its lower end raised to 0: the true
    value lies in [0, inf), so intersecting with it keeps the coverage."""
    return None if ci is None else [max(0.0, ci[0]), max(0.0, ci[1])]


def pick_verify(best: list[Prediction], n: int) -> list[Prediction]:
    """N points of the front that no row measured: the lowest predicted KL first (the budget's answer), then the
    rest spread evenly along the front."""
    todo = [p for p in best if p.measured is None and p.atoms]
    if not todo or n <= 0:
        return []
    chosen = [min(todo, key=lambda p: p.kl)]
    rest = [p for p in todo if p is not chosen[0]]
    k = min(n - 1, len(rest))
    if k > 0:
        step = len(rest) / k
        chosen += [rest[int(i * step + step / 2)] for i in range(k)]
    return chosen


def _splice_row(v) -> bool:
    """A finished row of the build with some classes restored (repeats of one included): what the model is fitted on.
    A build re-made by its quantizer is no splice: it re-fitted every later layer, so requantized() compares it with
    the prediction instead."""
    return isinstance(v, dict) and v.get("status") == "ok" and isinstance(v.get("restored"), list) and not _requantized_without(v)


def _requantized_without(v: dict) -> list[str] | None:
    """The classes a re-made build's row (checkpoint.requantized_without: `--add-requantized`) left in BF16; None for
    any other row. results_record.load refuses a hand edit that is not a list of distinct classes the build quantizes,
    in one line, for every command alike."""
    ck = v.get("checkpoint")
    return ck["requantized_without"] if isinstance(ck, dict) and ck.get("requantized_without") else None


def kl_error(model: Model, atoms, row: str, predicted_kl: float, measured_kl, scores, reps: int = 2000):
    """measured - predicted KL of `row` against the model's prediction for `atoms` (with the model's additivity as it
    stands), and why it has no interval: paired position by position (the prediction from the atoms' rows, the
    measurement from the row's, DIR/scores/ or cluster-scores), its 95 % interval the stratified bootstrap over
    sequences; without those scores, the difference of the two means and no interval. --verify states its points so,
    and requantized() the re-made builds."""
    from .metrics import paired_comparison

    strata = scores.strata(model, atoms, model.corpus, other=row) if scores is not None else None
    if strata:
        r = pooled_or(paired_comparison(strata, reps), model.corpus)
        ci = r["diff_ci"]  # None: too few sequences for an interval (metrics.MIN_SEQUENCES)
        return {"diff": -r["diff"], "ci": None if ci is None else [-ci[1], -ci[0]]}, r.get("why")
    if measured_kl is None:
        return None, None
    where = f"neither {scores.folder / 'scores'} nor {scores.folder / 'cluster-scores.safetensors'}" if scores else "no file"
    return {"diff": measured_kl - predicted_kl, "ci": None}, f"{where} holds the rows' scores"


def fit_inputs(results: dict, corpus: str | None) -> dict:
    """Every finished splice row's KL (the build's engines included; not a number: None): what a fit of this folder
    can depend on. A stored comparison whose inputs differ from today's (a row rerun, added or dropped) is out of date."""
    out = {}
    for v in results.get("variants", []):
        if _splice_row(v):
            kl = variant_kl(v, corpus)
            out[v["name"]] = kl if finite_number(kl) else None
    return out


def requantized(model: Model, results: dict, scores: PositionScores | None, reps: int = 2000) -> list[dict]:
    """Each finished row of the build re-made by its quantizer with some classes in BF16 (a checkpoint row with
    requantized_without) against the model's prediction for restoring exactly those classes: the predicted KL (as for
    any combination: predict()), the measured, and measured - predicted with its 95 % interval as --verify states its
    points' (kl_error). The re-made rows are not in the fit (fit()). Compared only where the prediction combines
    several single-entry rows: a class that is one such row is predicted as that row's own measurement, which the
    re-made row's vs_splice already pairs with it; the entry says so (why), as it says why classes no single-entry
    rows make up are not predicted. MTP is left out, as in the KL model."""
    from ..io.results_record import UNUSABLE

    by_entry = {a.entry: a for a in model.atoms}
    inputs = fit_inputs(results, model.corpus)
    out = []
    for v in results.get("variants", []):
        classes = _requantized_without(v) if isinstance(v, dict) else None
        if not classes or v.get("status") != "ok" or v.get("repeat_of"):
            continue
        entry = {"row": v["name"], "classes": classes, "corpus": model.corpus}
        note = requantized_classes_note(results, v["checkpoint"])
        if note:  # it quantizes other classes than declared: its figures are kept, its verdict is not drawn
            entry["note"] = note
        out.append(entry)
        measured = None if v.get(UNUSABLE) else variant_kl(v, model.corpus)
        entries = [c for c in classes if c != DRAFTER_CLASS]
        parts = decompose(entries, by_entry, model.class_layers) if entries else None
        if measured is None:
            entry["why"] = (
                f"its KL is not a number ({v[UNUSABLE]})"
                if v.get(UNUSABLE)
                else f"it has no KL {'on ' + model.corpus if model.corpus else 'pooled over corpora'}"
            )
            continue
        if not entries:
            entry["why"] = f"the KL model leaves out {DRAFTER_CLASS}: the drafter never runs in a scoring pass"
            continue
        if parts is None:
            missing = [c for c in entries if decompose([c], by_entry, model.class_layers) is None] or entries
            entry["why"] = (
                f"no single-entry rows make up {', '.join(missing)}: run a row restoring "
                + ("it" if len(missing) == 1 else "each")
                + " (or a sweep of its layers)"
            )
            continue
        p = predict(model, sorted(parts, key=model.atoms.index))  # in the front's order: one restore, one spelling
        entry.update(restore=p.label, atoms=[a.entry for a in p.atoms], predicted_kl=p.kl, measured_kl=measured)
        if len(parts) == 1:
            entry["why"] = (
                f"its prediction is the row {parts[0].row}'s own measurement (one single-entry row), and the table's "
                "splice-against-re-quantize section pairs the two"
            )
            continue
        splice = model.measured.get(frozenset(a.entry for a in parts))
        if splice is not None:
            entry["splice_row"] = splice["name"]  # in the fit: it measured the additivity this prediction uses
        error, why = kl_error(model, parts, v["name"], p.kl, measured, scores, reps)
        entry["error_kl"] = error
        if p.kl > 0:  # the error as a share of the prediction: the same interval on a fixed scale, no new estimate
            entry["error_rel"] = {
                "diff": error["diff"] / p.kl,
                "ci": None if error["ci"] is None else [c / p.kl for c in error["ci"]],
            }
        entry["includes_0"] = None if error["ci"] is None else error["ci"][0] <= 0 <= error["ci"][1]
        if error["ci"] is None:
            entry["no_interval"] = why
        entry["fit_rows_kl"] = {**inputs, v["name"]: measured}  # what report checks before quoting it
    return out


def requantized_levels(e: dict) -> tuple[str, str]:
    """A requantized() entry's predicted and measured KL at one scale with three significant digits of the smaller
    (0.00207 and 0.00209, which four decimals print alike)."""
    d = decimals([e["predicted_kl"], e["measured_kl"]], 3)
    return f"{e['predicted_kl']:.{d}f}", f"{e['measured_kl']:.{d}f}"


def requantized_verdict(e: dict) -> str:
    """'+0.0500 [+0.0401, +0.0600], +11.0 % of the prediction [+8.8, +13.2], excludes 0: the re-made build leaves more
    KL than predicted' (a requantized() entry with an error): the error to two significant digits of its largest end,
    and as a share of the prediction where budget.json holds it. No verdict where the re-made build quantizes other
    classes than declared (its note): then it is not the build with these classes restored."""
    err, ci = e["error_kl"], e["error_kl"].get("ci")
    d = decimals([err["diff"], *(ci or [])], 2, of=max)
    text = f"{err['diff']:+.{d}f}" + (f" [{ci[0]:+.{d}f}, {ci[1]:+.{d}f}]" if ci else "")
    rel = e.get("error_rel")
    if isinstance(rel, dict) and finite_number(rel.get("diff")):
        lo, hi = rel["ci"] if _finite_pair(rel.get("ci")) else (None, None)
        text += ", " + fmt_change(rel["diff"], lo, hi, 100, " % of the prediction")
    if not ci:
        text += f" (no interval: {e.get('no_interval') or 'none'})"
    if isinstance(e.get("note"), str):
        return text + f"; no verdict, the comparison is not like for like: {e['note']}"
    if not ci:
        return text
    if ci[0] <= 0 <= ci[1]:
        return text + ", includes 0: the prediction holds"
    return text + f", excludes 0: the re-made build leaves {'more' if err['diff'] > 0 else 'less'} KL than predicted"


def _finite_pair(x) -> bool:
    return isinstance(x, list) and len(x) == 2 and all(finite_number(v) for v in x)


def _quotable(e) -> bool:
    """A requantized entry of budget.json report can quote (budget writes them so; a hand edit may not)."""
    err = e.get("error_kl") if isinstance(e, dict) else None
    ci = err.get("ci") if isinstance(err, dict) else None
    return (
        isinstance(err, dict)
        and isinstance(e.get("row"), str)
        and isinstance(e.get("classes"), list)
        and all(isinstance(c, str) for c in e["classes"])
        and (e.get("corpus") is None or isinstance(e["corpus"], str))
        and all(finite_number(e.get(k)) for k in ("predicted_kl", "measured_kl"))
        and finite_number(err.get("diff"))
        and (ci is None or _finite_pair(ci))
        and isinstance(e.get("fit_rows_kl"), dict)
        and (e.get("note") is None or isinstance(e["note"], str))
    )


def requantized_sentences(folder: Path, results: dict) -> list[str]:
    """report's sentences on the re-made builds `splicer budget` last compared with its predictions (DIR/budget.json),
    one per re-made build whose prediction combines several single-entry rows; one whose rows changed since (a row
    rerun, added or dropped) is named as out of date, not quoted."""
    import json

    try:
        record = json.loads((Path(folder) / "budget.json").read_text())
    except (OSError, ValueError):
        return []
    listed = record.get("requantized") if isinstance(record, dict) else None
    out = []
    for e in [e for e in listed if _quotable(e)] if isinstance(listed, list) else []:
        row = next((v for v in results.get("variants", []) if isinstance(v, dict) and v.get("name") == e["row"]), None)
        now = fit_inputs(results, e["corpus"])
        kl = variant_kl(row, e["corpus"]) if row is not None and row.get("status") == "ok" else None
        if {**now, e["row"]: kl if finite_number(kl) else None} != e["fit_rows_kl"]:
            out.append(
                f"{e['row']}: budget.json's prediction for it was made before this folder's rows changed; run "
                "`splicer budget DIR` again to compare it."
            )
            continue
        where = f"on {e['corpus']}" if e["corpus"] else "pooled over corpora"
        fitted = f"; row {e['splice_row']}, which splices exactly these classes, is in the fit" if e.get("splice_row") else ""
        predicted, measured = requantized_levels(e)
        out.append(
            f"Budget against re-quantize ({', '.join(e['classes'])} in BF16, KL {where}): row {e['row']} (the build "
            f"re-made by its quantizer) measured {measured} where budget predicts {predicted} "
            f"from the splice rows{fitted}; error (measured minus predicted) {requantized_verdict(e)}."
        )
    return out
