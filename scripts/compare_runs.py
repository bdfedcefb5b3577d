"""Two results folders of the same plan and inputs, made two ways (a plain run and one with --ray or --gpus): do they
score alike, and do their timings agree within the build engines' spread?

    python scripts/compare_runs.py A B [--json OUT.json]

Scores: every row finished in both, per corpus, its per-position file (DIR/scores/ROW/CORPUS.safetensors) compared
tensor by tensor, exactly (the same positions, the same KL, top-1 and NLL bits), and its metrics in results.json. A
lane's own build rows (build-rayN, build-gpuN, build-end-..., build-again) are compared with the other folder's `build`.

Timing: a row's decode ms/token in A and in B, their relative difference, and the spread of every build engine of both
folders ((max - min) / min of their decode ms/token): a difference inside that spread is what a fresh engine of the
same variant gives anyway. Also each row's decode-vs-build interval in both folders. Prints a summary; --json writes it
all.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _rows(folder: Path) -> dict:
    results = json.loads((folder / "results.json").read_text())
    return {v["name"]: v for v in results["variants"] if v.get("status") == "ok"}


def _is_build_engine(name: str, row: dict) -> bool:
    """A row that loads the build itself: the plan's build and its repeats, and a lane's build rows."""
    return (
        not row.get("restored")
        and not row.get("checkpoint")
        and not row.get("base")
        and (name == "build" or name.startswith("build-"))
    )


def _score_files(folder: Path, row: str) -> dict:
    d = folder / "scores" / row
    return {p.stem: p for p in sorted(d.glob("*.safetensors"))} if d.is_dir() else {}


def compare_scores(a: Path, b: Path, name_a: str, name_b: str) -> dict:
    import torch
    from safetensors.torch import load_file

    fa, fb = _score_files(a, name_a), _score_files(b, name_b)
    out = {"a": name_a, "b": name_b, "corpora": sorted(set(fa) | set(fb)), "differs": []}
    if not fa or not fb:
        out["differs"].append("per-position scores missing in " + ("A" if not fa else "B"))
        return out
    for corpus in out["corpora"]:
        if corpus not in fa or corpus not in fb:
            out["differs"].append(f"{corpus}: only in {'A' if corpus in fa else 'B'}")
            continue
        ta, tb = load_file(str(fa[corpus])), load_file(str(fb[corpus]))
        for key in sorted(set(ta) | set(tb)):
            x, y = ta.get(key), tb.get(key)
            if x is None or y is None:
                out["differs"].append(f"{corpus}/{key}: only in {'A' if y is None else 'B'}")
            elif x.shape != y.shape:
                out["differs"].append(f"{corpus}/{key}: shapes {tuple(x.shape)} and {tuple(y.shape)}")
            elif not torch.equal(x, y):
                n = int((x != y).sum())
                diff = (x.double() - y.double()).abs().max().item() if x.is_floating_point() else None
                out["differs"].append(f"{corpus}/{key}: {n} of {x.numel()} values differ (max |diff| {diff})")
    out["identical"] = not out["differs"]
    return out


def decode_ms(row: dict) -> float | None:
    t = row.get("timing")
    return t.get("decode_ms_per_token") if isinstance(t, dict) else None


def compare(a: Path, b: Path) -> dict:
    ra, rb = _rows(a), _rows(b)
    builds = {("A", n): decode_ms(r) for n, r in ra.items() if _is_build_engine(n, r)}
    builds.update({("B", n): decode_ms(r) for n, r in rb.items() if _is_build_engine(n, r)})
    timed = {k: v for k, v in builds.items() if v is not None}
    spread = (max(timed.values()) - min(timed.values())) / min(timed.values()) if len(timed) > 1 else None
    rows = []
    for name in sorted(set(ra) | set(rb)):
        in_a, in_b = name in ra, name in rb
        if in_a and in_b:
            na, nb = name, name
        elif in_b and _is_build_engine(name, rb[name]) and "build" in ra:
            na, nb = "build", name
        elif in_a and _is_build_engine(name, ra[name]) and "build" in rb:
            na, nb = name, "build"
        else:
            rows.append({"row": name, "only_in": "A" if in_a else "B"})
            continue
        entry = {
            "row": name,
            "scores": compare_scores(a, b, na, nb),
            "metrics_equal": ra[na].get("metrics") == rb[nb].get("metrics"),
        }
        if in_a and in_b:
            da, db = decode_ms(ra[name]), decode_ms(rb[name])
            if da is not None and db is not None:
                entry["decode_ms"] = {"A": da, "B": db, "rel_diff": (db - da) / da}
                if spread is not None:
                    entry["decode_ms"]["within_build_spread"] = abs(db - da) / min(da, db) <= spread
            for side, r in (("A", ra[name]), ("B", rb[name])):
                d = r.get("decode_vs_build")
                if d:
                    entry.setdefault("decode_vs_build", {})[side] = {
                        "rel": d.get("rel"),
                        "rel_ci": d.get("rel_ci"),
                        "resolved": d.get("resolved"),
                        "lane": d.get("gpu"),
                    }
        rows.append(entry)
    compared = [r for r in rows if "scores" in r]
    return {
        "A": str(a),
        "B": str(b),
        "build_engines_decode_ms": {f"{side}:{n}": v for (side, n), v in sorted(builds.items())},
        "build_spread_rel": spread,
        "rows": rows,
        "all_scores_identical": bool(compared) and all(r["scores"].get("identical") for r in compared),
        "all_metrics_equal": bool(compared) and all(r["metrics_equal"] for r in compared),
        "decode_all_within_build_spread": all(r["decode_ms"].get("within_build_spread") for r in compared if "decode_ms" in r)
        if spread is not None and any("decode_ms" in r for r in compared)
        else None,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--json", type=Path, help="write the whole comparison here")
    args = p.parse_args(argv)
    for folder in (args.a, args.b):
        if not (folder / "results.json").is_file():
            print(f"error: {folder} has no results.json: give two results folders of splicer ablate", file=sys.stderr)
            return 2
    c = compare(args.a, args.b)
    if args.json:
        args.json.write_text(json.dumps(c, indent=1) + "\n")
    sp = c["build_spread_rel"]
    print(
        f"build engines (decode ms/token): {c['build_engines_decode_ms']}; spread "
        + (f"{100 * sp:.2f} %" if sp is not None else "n/a")
    )
    for r in c["rows"]:
        if "only_in" in r:
            print(f"  {r['row']}: only in {r['only_in']}")
            continue
        s = r["scores"]
        line = f"  {r['row']} ({s['a']} vs {s['b']}): scores " + (
            "identical" if s.get("identical") else "DIFFER: " + "; ".join(s["differs"][:3])
        )
        if "decode_ms" in r:
            d = r["decode_ms"]
            line += f"; decode {d['A']:.4f} vs {d['B']:.4f} ms/token ({100 * d['rel_diff']:+.2f} %"
            line += (
                ", within the build spread)"
                if d.get("within_build_spread")
                else ", outside the build spread)"
                if "within_build_spread" in d
                else ")"
            )
        print(line)
    print(
        f"all scores identical: {c['all_scores_identical']}; all metrics equal: {c['all_metrics_equal']}; "
        f"decode within the build spread: {c['decode_all_within_build_spread']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
