"""Splice speed and memory against `cp` of the same bytes, measured side by side in one run.

Builds fixture pairs of two sizes (bench preset, 4 and 8 decoder layers: ~1.1 and ~2.1 GB BF16),
then for each size and each restore choice:
  * runs `splicer splice` as a child process (wall time, peak RSS from wait4),
  * copies exactly the shards the splice wrote with `cp` (the same output bytes; page cache warm for both),
and prints the ratio splice / cp. Goal (issue 2): ratio <= 1.2 and peak RSS <= 1.5 GB, flat in size.

Usage: python benchmarks/splice_bench.py [WORKDIR] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_child(argv: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one child process.

    RSS comes from GNU time's %M: rusage of a child forked from this (large) process would
    count the pages it inherited before exec.
    """
    with tempfile.NamedTemporaryFile("r") as rss_file:
        t0 = time.perf_counter()
        proc = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", rss_file.name, *argv],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"{argv} failed: {proc.stderr.decode()[-2000:]}")
        return wall, int(rss_file.read().split()[-1]) * 1024


def dir_bytes(paths) -> int:
    return sum(p.stat().st_size for p in paths)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir", nargs="?", default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", default="4,8")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="splice-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for n_layers in [int(x) for x in args.layers.split(",")]:
        root = work / f"L{n_layers}"
        if not (root / "lowlatency" / "config.json").exists():
            t0 = time.perf_counter()
            # In a child process, so this process stays small.
            subprocess.run([sys.executable, "-c", "import sys; from splicer.fixtures import FixtureSpec, write_pair; "
                            "write_pair(sys.argv[1], FixtureSpec(preset='bench', text_overrides={'num_hidden_layers': int(sys.argv[2])}), "
                            "kinds=('lowlatency',))", str(root), str(n_layers)], check=True)
            print(f"fixture L{n_layers}: {time.perf_counter() - t0:.1f} s", flush=True)
        build, base = root / "lowlatency", root / "base"
        build_bytes = dir_bytes(build.glob("*.safetensors"))
        for restore in ("gdn,shared_expert", "all"):
            splice_walls, cp_walls, rss = [], [], []
            for rep in range(args.reps):
                out = work / "out"
                shutil.rmtree(out, ignore_errors=True)
                wall, peak = run_child([sys.executable, "-m", "splicer", "splice", "-q", "--restore", restore, str(build), str(base), "-o", str(out)])
                splice_walls.append(wall)
                rss.append(peak)
                # The bytes the splice wrote: shards that are not hard links to the build's files.
                written = [p for p in out.glob("*.safetensors") if p.stat().st_nlink == 1]
                dst = work / "cp"
                shutil.rmtree(dst, ignore_errors=True)
                dst.mkdir()
                cp_wall, _ = run_child(["cp", *map(str, written), str(dst)])
                cp_walls.append(cp_wall)
            written_bytes = dir_bytes(written)
            # In-process splice time (no interpreter start / imports), for the same work.
            from splicer.splice import splice

            shutil.rmtree(work / "out", ignore_errors=True)
            t0 = time.perf_counter()
            splice(str(build), str(base), work / "out", restore, progress=False)
            inproc = time.perf_counter() - t0
            s, c = statistics.median(splice_walls), statistics.median(cp_walls)
            rows.append({
                "layers": n_layers, "build_GB": round(build_bytes / 1e9, 3), "restore": restore,
                "written_GB": round(written_bytes / 1e9, 3), "splice_s": round(s, 2), "cp_s": round(c, 2),
                "ratio": round(s / c, 2), "splice_in_process_s": round(inproc, 2), "ratio_in_process": round(inproc / c, 2),
                "peak_rss_MB": round(max(rss) / 1e6),
            })
            print(json.dumps(rows[-1]), flush=True)
            shutil.rmtree(work / "cp", ignore_errors=True)
    from tabulate import tabulate

    print()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; medians of {args.reps} runs")
    print(tabulate(rows, headers="keys", tablefmt="github"))


if __name__ == "__main__":
    main()
