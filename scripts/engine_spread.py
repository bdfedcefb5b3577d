"""How far the build's engines spread in serially timed runs, and what that spread leaves of the power to resolve a 2 %
decode difference with three build engines.

For each results.json: the level of each of the build's engines (the median of its blocks, splicer.analysis.metrics.engine_level,
as the verdicts take it) and their standard deviation as a percentage of their mean. Then, for each spread found and for 0.15 % (the
spread tests/test_verdicts.py plants), the share of simulated runs in which splicer.analysis.verdicts.decode_difference resolves
a planted +2 % difference: three build engines and one engine of the variant, five blocks each, blocks 0.1 % apart
(the test's model of the engines).

Usage (in results/h200-fulldims/): python ../../scripts/engine_spread.py run-8 run-9 run-11 > engine-spread.json
"""

from __future__ import annotations

import json
import random
import statistics
import sys

from splicer.analysis.metrics import engine_level
from splicer.analysis.verdicts import decode_difference, timed_engines
from splicer.io import results_record

TRIALS, SEED, BLOCKS, BLOCK_SD, PLANTED, MS = 2000, 4, 5, 0.001, 0.02, 4.38


def _engine(rng: random.Random, ms: float, sd: float) -> list[float]:
    level = ms * (1 + rng.gauss(0, sd))
    return [level * (1 + rng.gauss(0, BLOCK_SD)) for _ in range(BLOCKS)]


def resolved_share(sd: float) -> float:
    rng, found = random.Random(SEED), 0
    for _ in range(TRIALS):
        build = [_engine(rng, MS, sd) for _ in range(3)]
        r = decode_difference([_engine(rng, MS * (1 + PLANTED), sd)], build)
        found += bool(r["resolved"] and r["rel"] > 0)
    return found / TRIALS


def main(folders: list[str]) -> int:
    runs = {}
    for folder in folders:
        results = results_record.read(folder)
        means = [engine_level(blocks) for blocks in timed_engines(results, "build")]
        runs[folder] = {"engine_levels_ms": means, "sd_percent": 100 * statistics.stdev(means) / statistics.mean(means)}
    spreads = sorted({0.15, *(round(r["sd_percent"], 2) for r in runs.values())})
    power = {f"{sd:.2f}": resolved_share(sd / 100) for sd in spreads}
    print(
        json.dumps(
            {
                "runs": runs,
                "planted_difference": PLANTED,
                "trials": TRIALS,
                "build_engines": 3,
                "resolved_share_by_sd_percent": power,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
