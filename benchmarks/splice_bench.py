"""Splice speed and memory against `cp` of the same bytes, measured side by side in one run.

Builds fixture pairs of two sizes (bench preset, 8 and 16 decoder layers by default: ~2.2 and ~4.2 GB BF16),
then for each size and each restore choice, in alternating order:
  * runs `splicer splice` as a child process (wall time until its output is on disk, peak RSS),
  * copies exactly the shards the splice writes with `cp` (the same output bytes),
and prints the ratio of the medians splice / cp. Goal (issue 2): ratio <= 1.2 and peak RSS <= 1.5 GB, flat in size.

Usage: python benchmarks/splice_bench.py [WORKDIR] [--reps 3] [--json OUT.json]

With --json, writes the command, machine, versions, date, commit and every row with its per-run times and RSS
(the raw data behind the medians) to OUT.json.
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
    """(wall seconds until the output is on disk, peak RSS bytes) of one child process.

    Each command starts after a `sync` and its time includes the `sync` after it: on this machine's disk, write-back
    of one command's dirty pages otherwise lands on whichever command runs next (single runs of the same `cp` took
    0.9 to 8 s when timed without it). RSS comes from GNU time's %M: rusage of a child forked from this (large) process
    would count the pages it inherited before exec.
    """
    os.sync()
    with tempfile.NamedTemporaryFile("r") as rss_file:
        t0 = time.perf_counter()
        proc = subprocess.run(
            ["/usr/bin/time", "-f", "%M", "-o", rss_file.name, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        os.sync()
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
    ap.add_argument("--layers", default="8,16")
    ap.add_argument("--json", default=None, help="write the run's raw record (per-run times included) here")
    args = ap.parse_args()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    work = Path(args.workdir or tempfile.mkdtemp(prefix="splice-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rows, runs = [], []
    for n_layers in [int(x) for x in args.layers.split(",")]:
        root = work / f"L{n_layers}"
        if not (root / "lowlatency" / "config.json").exists():
            t0 = time.perf_counter()
            # In a child process, so this process stays small.
            subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import sys; from splicer.fixtures.core import FixtureSpec, write_pair; "
                    "write_pair(sys.argv[1], FixtureSpec(preset='bench', text_overrides={'num_hidden_layers': int(sys.argv[2])}), "
                    "kinds=('lowlatency',))",
                    str(root),
                    str(n_layers),
                ],
                check=True,
            )
            print(f"fixture L{n_layers}: {time.perf_counter() - t0:.1f} s", flush=True)
        build, base = root / "lowlatency", root / "base"
        build_bytes = dir_bytes(build.glob("*.safetensors"))
        base_bytes = dir_bytes(base.glob("*.safetensors"))
        for restore in ("gdn,shared_expert", "all"):
            splice_walls, cp_walls, rss = [], [], []
            ref = work / "ref"
            shutil.rmtree(ref, ignore_errors=True)
            subprocess.run(
                [sys.executable, "-m", "splicer", "splice", "-q", "--restore", restore, str(build), str(base), "-o", str(ref)],
                check=True,
            )
            # The bytes the splice writes: shards that are not hard links to the build's files.
            written = [p for p in ref.glob("*.safetensors") if p.stat().st_nlink == 1]
            for rep in range(args.reps):
                out, dst = work / "out", work / "cp"
                shutil.rmtree(out, ignore_errors=True)
                shutil.rmtree(dst, ignore_errors=True)
                dst.mkdir()
                for step in ("splice", "cp") if rep % 2 == 0 else ("cp", "splice"):  # alternate the order
                    if step == "splice":
                        wall, peak = run_child(
                            [
                                sys.executable,
                                "-m",
                                "splicer",
                                "splice",
                                "-q",
                                "--restore",
                                restore,
                                str(build),
                                str(base),
                                "-o",
                                str(out),
                            ]
                        )
                        splice_walls.append(wall)
                        rss.append(peak)
                    else:
                        cp_walls.append(run_child(["cp", *map(str, written), str(dst)])[0])
            written_bytes = dir_bytes(written)
            # In-process splice time (no interpreter start / imports), for the same work.
            from splicer.splice.core import splice

            shutil.rmtree(work / "out", ignore_errors=True)
            os.sync()
            t0 = time.perf_counter()
            splice(str(build), str(base), work / "out", restore, progress=False)
            os.sync()
            inproc = time.perf_counter() - t0
            s, c = statistics.median(splice_walls), statistics.median(cp_walls)
            rows.append(
                {
                    "layers": n_layers,
                    "base_GB": round(base_bytes / 1e9, 3),
                    "build_GB": round(build_bytes / 1e9, 3),
                    "restore": restore,
                    "written_GB": round(written_bytes / 1e9, 3),
                    "splice_s": round(s, 2),
                    "cp_s": round(c, 2),
                    "ratio": round(s / c, 2),
                    "splice_in_process_s": round(inproc, 2),
                    "ratio_in_process": round(inproc / c, 2),
                    "peak_rss_MB": round(max(rss) / 1e6),
                }
            )
            runs.append(
                {
                    "layers": n_layers,
                    "restore": restore,
                    "written_bytes": written_bytes,
                    "splice_runs_s": [round(x, 4) for x in splice_walls],
                    "cp_runs_s": [round(x, 4) for x in cp_walls],
                    "peak_rss_runs_MB": [round(x / 1e6, 1) for x in rss],
                    "splice_in_process_s": round(inproc, 4),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            for d in ("cp", "ref"):
                shutil.rmtree(work / d, ignore_errors=True)
    from tabulate import tabulate

    print()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; medians of {args.reps} runs"
    )
    print(tabulate(rows, headers="keys", tablefmt="github"))
    if args.json:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).resolve().parent
            ).stdout.strip()
            or None
        )
        versions = {"python": platform.python_version()}
        for mod in ("torch", "safetensors", "compressed_tensors", "splicer"):
            try:
                versions[mod] = __import__(mod).__version__
            except Exception:  # noqa: BLE001  a missing package is recorded as such
                versions[mod] = None
        cpu = next(
            (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), platform.processor()
        )
        record = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "started": started,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "commit": commit,
            "machine": {
                "cpu": cpu,
                "cores": os.cpu_count(),
                "arch": platform.machine(),
                "mem_GiB": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            },
            "versions": versions,
            "reps": args.reps,
            "rows": rows,
            "runs": runs,
        }
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
