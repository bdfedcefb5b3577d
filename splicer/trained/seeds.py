"""Do two training seeds rank the module classes alike? From two ablate folders of builds made the same way.

    python -m splicer.trained.seeds DIR_A DIR_B [--rows lm_head,gdn,attention,shared_expert]

For each single-class row both folders hold: its KL change against its own build (pooled over corpora, as a share of the
build's KL, with the 95 % interval `ablate` computed), and its rank within its folder (1 = removes the most KL). Then
one sentence: the same ranking, or which pairs of rows change places and whether each seed's intervals tell that pair
apart (a swap of two rows whose intervals overlap in a seed is not a resolved disagreement).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tabulate import tabulate

from ..errors import SplicerError, exit_code
from ..io import results_record

DEFAULT_ROWS = ("lm_head", "gdn", "attention", "shared_expert")


def kl_changes(results: dict, rows: tuple[str, ...]) -> dict[str, tuple[float, float, float]]:
    """row -> (relative KL change vs the build, low, high), pooled over corpora, for the rows that have one."""
    out = {}
    for v in results.get("variants", []):
        if v.get("name") in rows:
            pooled = ((v.get("vs_build") or {}).get("kl") or {}).get("pooled")
            if pooled and pooled.get("rel") is not None and pooled.get("rel_ci"):
                out[v["name"]] = (pooled["rel"], *pooled["rel_ci"])
    return out


def _apart(a: tuple[float, float, float], b: tuple[float, float, float]) -> bool:
    return a[2] < b[1] or b[2] < a[1]


def compare(a: dict, b: dict, rows: tuple[str, ...] = DEFAULT_ROWS, names=("seed A", "seed B")) -> str:
    ka, kb = kl_changes(a, rows), kl_changes(b, rows)
    common = [r for r in rows if r in ka and r in kb]
    if len(common) < 2:
        raise SplicerError(
            f"fewer than two of the rows {', '.join(rows)} have a KL change in both folders; "
            "run the single-class rows on both builds first"
        )
    rank_a = {r: i + 1 for i, r in enumerate(sorted(common, key=lambda r: ka[r][0]))}
    rank_b = {r: i + 1 for i, r in enumerate(sorted(common, key=lambda r: kb[r][0]))}

    def cell(k):
        return f"{100 * k[0]:+.1f} % [{100 * k[1]:+.1f}, {100 * k[2]:+.1f}]"

    table = tabulate(
        [[r, cell(ka[r]), rank_a[r], cell(kb[r]), rank_b[r]] for r in sorted(common, key=rank_a.get)],
        headers=["row", f"ΔKL {names[0]}", "rank", f"ΔKL {names[1]}", "rank"],
        tablefmt="github",
    )
    swaps = [
        (x, y) for i, x in enumerate(common) for y in common[i + 1 :] if (rank_a[x] - rank_a[y]) * (rank_b[x] - rank_b[y]) < 0
    ]
    if not swaps:
        verdict = f"Both seeds rank the {len(common)} rows the same way."
    else:
        parts = []
        for x, y in swaps:
            resolved = [n for n, k in zip(names, (ka, kb)) if _apart(k[x], k[y])]
            how = f"resolved in {' and '.join(resolved)}" if resolved else "the intervals overlap in both seeds"
            parts.append(f"{x} and {y} change places ({how})")
        verdict = "The seeds rank the rows differently: " + "; ".join(parts) + "."
    return (
        f"{table}\n\nΔKL: the row's KL change against its own build, as a share of the build's KL, pooled over the "
        f"corpora, with its 95 % interval; rank 1 removes the most KL. {verdict}\n"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m splicer.trained.seeds", description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS))
    p.add_argument("--names", default="seed 0,seed 1", help="the two folders' names in the table")
    args = p.parse_args(argv)

    def run() -> int:
        names = tuple(args.names.split(","))
        if len(names) != 2:
            raise SplicerError(f"--names {args.names!r}: give two names separated by a comma")
        sys.stdout.write(compare(results_record.load(args.a), results_record.load(args.b), tuple(args.rows.split(",")), names))
        return 0

    return exit_code(run)


if __name__ == "__main__":
    sys.exit(main())
