"""Results folders of the same plan and inputs, made different ways (plain runs, --ray, --gpus): where do they score
alike, and do their differences exceed what one engine of the same variant differs from the next anyway?

    python scripts/compare_runs.py NAME=DIR NAME=DIR [NAME=DIR ...] [--json OUT.json] [--effect A B]

Scores: for every pair of folders, every row finished in both, per corpus, its per-position file
(DIR/scores/ROW/CORPUS.safetensors) compared tensor by tensor, exactly (the same positions, the same KL, top-1 and
NLL bits). A lane's own build rows (build-rayN, build-gpuN, build-end-...) are compared with the other folder's `build`.

The yardstick is each folder's own build engines: the plan's `build` and its repeats (build-again, a lane's build rows)
are fresh engines of one variant in one run. Per corpus, a folder is "repeatable" when they agree bit for bit. Where
they do not, no other run can be expected to match either, and the per-row metric differences between folders (KL,
top-1, dNLL) are set beside the differences between those build engines.

Timing: a row's decode ms/token in each folder; the relative difference for every pair; and the spread of the build
engines ((max - min) / min), the only repeated engines a run has. Prints a summary; --json writes it all.

--effect A B, with folders named A-1, B-1, A-2, B-2, ... (repeats made alternately, e.g. plain and ray): per row, the
difference B-i minus A-i in decode (relative) and in each corpus's KL, averaged over the repeats with a Student's t
95 % interval over them (df = repeats - 1): what B changes, with the run-to-run variation in the interval.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

METRICS = ("kl", "top1", "dnll")


def _rows(folder: Path) -> dict:
    results = json.loads((folder / "results.json").read_text())
    return {v["name"]: v for v in results["variants"] if v.get("status") == "ok"}


def is_build_engine(name: str, row: dict) -> bool:
    """A row that loads the build itself: the plan's build and the rows results.json records as its repeats
    (`repeat_of`: build-again, a lane's build-rayN / build-end-...), as splicer's own engine noise counts them
    (analysis.verdicts.engine_noise), not guessed from the row's name."""
    return "build" in (name, row.get("repeat_of"))


def _score_files(folder: Path, row: str) -> dict:
    d = folder / "scores" / row
    return {p.stem: p for p in sorted(d.glob("*.safetensors"))} if d.is_dir() else {}


def diff_scores(a: Path, row_a: str, b: Path, row_b: str) -> dict:
    """Per corpus: None where the two rows' per-position files are identical, else what differs."""
    import torch
    from safetensors.torch import load_file

    fa, fb = _score_files(a, row_a), _score_files(b, row_b)
    out = {}
    for corpus in sorted(set(fa) | set(fb)):
        if corpus not in fa or corpus not in fb:
            out[corpus] = [f"only in {a if corpus in fa else b}"]
            continue
        ta, tb = load_file(str(fa[corpus])), load_file(str(fb[corpus]))
        differs = []
        for key in sorted(set(ta) | set(tb)):
            x, y = ta.get(key), tb.get(key)
            if x is None or y is None:
                differs.append(f"{key}: only in one")
            elif x.shape != y.shape:
                differs.append(f"{key}: shapes {tuple(x.shape)} and {tuple(y.shape)}")
            elif not torch.equal(x, y):
                n = int((x != y).sum())
                what = f"{key}: {n} of {x.numel()} values differ"
                if x.is_floating_point():
                    what += f" (max |diff| {(x.double() - y.double()).abs().max().item():.4g})"
                differs.append(what)
        out[corpus] = differs or None
    return out


def decode_ms(row: dict) -> float | None:
    t = row.get("timing")
    return t.get("decode_ms_per_token") if isinstance(t, dict) else None


def _metric_gaps(ma: dict, mb: dict) -> dict:
    return {
        corpus: {
            m: abs(ma[corpus][m] - mb[corpus][m])
            for m in METRICS
            if ma[corpus].get(m) is not None and mb[corpus].get(m) is not None
        }
        for corpus in sorted(set(ma) & set(mb))
    }


def _max_gaps(gaps: list[dict]) -> dict:
    out: dict = {}
    for g in gaps:
        for corpus, per in g.items():
            for m, v in per.items():
                out.setdefault(corpus, {})[m] = max(v, out.get(corpus, {}).get(m, 0.0))
    return out


def folder_yardstick(folder: Path, rows: dict) -> dict:
    """The folder's build engines: which corpora they score bit for bit alike, their largest metric gaps, and their
    decode spread."""
    builds = sorted(n for n, r in rows.items() if is_build_engine(n, r))
    repeatable: dict = {}
    gaps = []
    for x, y in itertools.combinations(builds, 2):
        for corpus, d in diff_scores(folder, x, folder, y).items():
            repeatable[corpus] = repeatable.get(corpus, True) and d is None
        gaps.append(_metric_gaps(rows[x]["metrics"], rows[y]["metrics"]))
    decode = {n: decode_ms(rows[n]) for n in builds}
    timed = [v for v in decode.values() if v is not None]
    return {
        "build_engines": builds,
        "repeatable": repeatable if len(builds) > 1 else None,
        "build_metric_gaps": _max_gaps(gaps),
        "build_decode_ms": decode,
        "build_decode_spread_rel": (max(timed) - min(timed)) / min(timed) if len(timed) > 1 else None,
    }


def _partner(name: str, row: dict, other: dict) -> str | None:
    if name in other:
        return name
    return "build" if is_build_engine(name, row) and "build" in other else None


def _compare_rows(a: Path, row_a: dict, name_a: str, b: Path, row_b: dict, name_b: str) -> dict:
    entry = {
        "row": name_a if name_a == name_b else f"{name_a} / {name_b}",
        "vs": [name_a, name_b],
        "scores_differ": {c: d for c, d in diff_scores(a, name_a, b, name_b).items() if d},
        "metric_gaps": _metric_gaps(row_a["metrics"], row_b["metrics"]),
    }
    da, db = decode_ms(row_a), decode_ms(row_b)
    if da is not None and db is not None and name_a == name_b:  # another engine of the build is no row's own decode
        entry["decode_rel_diff"] = (db - da) / da
    return entry


def compare_pair(na: str, a: Path, ra: dict, nb: str, b: Path, rb: dict) -> dict:
    rows = []
    for name in sorted(ra):
        pb = _partner(name, ra[name], rb)
        rows.append(_compare_rows(a, ra[name], name, b, rb[pb], pb) if pb else {"row": name, "only_in": na})
    for name in sorted(set(rb) - set(ra)):  # a lane's own build rows in B, compared with A's build
        pa = _partner(name, rb[name], ra)
        rows.append(_compare_rows(a, ra[pa], pa, b, rb[name], name) if pa else {"row": name, "only_in": nb})
    compared = [r for r in rows if "vs" in r]
    identical = {}
    for r in compared:
        for corpus in r["metric_gaps"]:
            identical[corpus] = identical.get(corpus, True) and corpus not in r["scores_differ"]
    decode = [abs(r["decode_rel_diff"]) for r in compared if "decode_rel_diff" in r]
    return {
        "pair": [na, nb],
        "rows": rows,
        "identical_per_corpus": identical,
        "max_metric_gaps": _max_gaps([r["metric_gaps"] for r in compared]),
        "max_abs_decode_rel_diff": max(decode) if decode else None,
    }


def compare(folders: dict[str, Path], effect_of: tuple[str, str] | None = None) -> dict:
    """Every folder's yardstick, every pair, and with effect_of=(A, B) what B changes over the repeats A-N, B-N."""
    rows = {n: _rows(p) for n, p in folders.items()}
    return {
        "folders": {n: str(p) for n, p in folders.items()},
        "yardsticks": {n: folder_yardstick(p, rows[n]) for n, p in folders.items()},
        "pairs": [
            compare_pair(na, folders[na], rows[na], nb, folders[nb], rows[nb]) for na, nb in itertools.combinations(folders, 2)
        ],
        **({"effect": effect(rows, *effect_of)} if effect_of else {}),
    }


class NoRepeats(ValueError):
    """--effect A B names no pair of repeats A-N, B-N among the folders."""


def effect(rows: dict[str, dict], a: str, b: str) -> dict:
    """Per row, B-i minus A-i over the repeats i (rows: each folder's finished rows by the folder's name): decode
    (relative to A-i) and KL per corpus, mean and t interval."""
    import statistics

    from splicer.analysis.metrics import t975

    repeats = sorted(int(n.rsplit("-", 1)[1]) for n in rows if n.startswith(f"{a}-") and f"{b}-{n.rsplit('-', 1)[1]}" in rows)
    if not repeats:
        raise NoRepeats(f"no folders named {a}-N with a {b}-N beside them")

    def summarize(values: list[float]) -> dict:
        out = {"values": values, "mean": statistics.fmean(values), "repeats": len(values)}
        if len(values) > 1:
            half = t975(len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5
            out["ci"] = [out["mean"] - half, out["mean"] + half]
            out["excludes_0"] = not out["ci"][0] <= 0 <= out["ci"][1]
        return out

    per_row: dict = {}
    names = set.intersection(*(set(rows[f"{x}-{i}"]) for i in repeats for x in (a, b)))
    for name in sorted(names):
        entry: dict = {}
        dec = [decode_ms(rows[f"{a}-{i}"][name]) for i in repeats], [decode_ms(rows[f"{b}-{i}"][name]) for i in repeats]
        if all(v is not None for v in dec[0] + dec[1]):
            entry["decode_rel"] = summarize([(y - x) / x for x, y in zip(*dec)])
        corpora = rows[f"{a}-{repeats[0]}"][name]["metrics"]
        for corpus in sorted(corpora):
            kl = [
                rows[f"{b}-{i}"][name]["metrics"][corpus]["kl"] - rows[f"{a}-{i}"][name]["metrics"][corpus]["kl"] for i in repeats
            ]
            entry.setdefault("kl", {})[corpus] = summarize(kl)
        per_row[name] = entry
    return {"a": a, "b": b, "repeats": repeats, "rows": per_row}


def _fmt_gaps(g: dict) -> str:
    return "; ".join(f"{c}: " + ", ".join(f"{m} {v:.3g}" for m, v in per.items()) for c, per in g.items() if any(per.values()))


def summary(c: dict) -> list[str]:
    lines = []
    for n, y in c["yardsticks"].items():
        sp = y["build_decode_spread_rel"]
        rep = y["repeatable"]
        lines.append(
            f"{n}: build engines {', '.join(y['build_engines'])}; "
            + (
                "bit-identical on "
                + (", ".join(k for k, v in rep.items() if v) or "no corpus")
                + ("; not on " + ", ".join(k for k, v in rep.items() if not v) if not all(rep.values()) else "")
                if rep is not None
                else "one build engine"
            )
            + (
                f" (largest metric gaps between them: {_fmt_gaps(y['build_metric_gaps'])})"
                if _fmt_gaps(y["build_metric_gaps"])
                else ""
            )
            + (f"; decode spread {100 * sp:.2f} %" if sp is not None else "")
        )
    for p in c["pairs"]:
        same = [k for k, v in p["identical_per_corpus"].items() if v]
        other = [k for k, v in p["identical_per_corpus"].items() if not v]
        d = p["max_abs_decode_rel_diff"]
        lines.append(
            f"{p['pair'][0]} vs {p['pair'][1]}: every row bit-identical on {', '.join(same) or 'no corpus'}"
            + (f"; differs on {', '.join(other)} (largest metric gaps: {_fmt_gaps(p['max_metric_gaps'])})" if other else "")
            + (f"; decode differs by at most {100 * d:.2f} %" if d is not None else "")
        )
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", metavar="NAME=DIR")
    p.add_argument("--json", type=Path, help="write the whole comparison here")
    p.add_argument("--effect", nargs=2, metavar=("A", "B"), help="repeats named A-1, B-1, A-2, ...: what B changes")
    args = p.parse_args(argv)
    folders = {}
    for spec in args.folders:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            print(f"error: {spec!r} is not NAME=DIR: name each results folder, e.g. plain=/tmp/run", file=sys.stderr)
            return 2
        if not (Path(path) / "results.json").is_file():
            print(f"error: {path} has no results.json: give results folders of splicer ablate", file=sys.stderr)
            return 2
        folders[name] = Path(path)
    if len(folders) < 2:
        print("error: give at least two results folders (NAME=DIR NAME=DIR)", file=sys.stderr)
        return 2
    try:
        c = compare(folders, tuple(args.effect) if args.effect else None)
    except NoRepeats as e:
        print(f"error: --effect {' '.join(args.effect)}: {e}: name the repeats A-1=DIR B-1=DIR ...", file=sys.stderr)
        return 2
    if args.json:
        args.json.write_text(json.dumps(c, indent=1) + "\n")
    print("\n".join(summary(c)))
    for name, e in (c.get("effect") or {}).get("rows", {}).items():
        d = e.get("decode_rel")
        if d and "ci" in d:
            a, b = c["effect"]["a"], c["effect"]["b"]
            lo, hi = d["ci"]
            print(
                f"{b} minus {a}, {name}: decode {100 * d['mean']:+.2f} % [{100 * lo:+.2f}, {100 * hi:+.2f}] over {d['repeats']} repeats"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
