"""What running a plan's rows on Ray costs on one machine, measured side by side in one invocation.

    python benchmarks/ray_overhead.py OUT [--lanes 2]

On the tiny synthetic pair (the demo's) and the demo plan, with the torch backend on the CPU:
  1. Ray's own start and end alone: ray.init of a local cluster, `--lanes` actors each importing torch and splicer,
     ray.shutdown;
  2. the plan's rows one after another in this process (no --ray);
  3. the same rows with --ray, which starts a local cluster (one lane per core, at most `--lanes`; its start is in the
     run's wall time), the build timed first and last on each lane.
Each is timed once, in this order (run it on a quiet machine: the load average before is recorded); the record (command, machine, versions, seconds, ratios) goes
to OUT/ray-overhead.json and is printed. It answers whether `--gpus` on one host should run on Ray too: what Ray adds
before the first row, against a run's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path


def _ray_alone(lanes: int) -> dict:
    import ray

    t0 = time.perf_counter()
    ray.init(num_cpus=lanes, include_dashboard=False, log_to_driver=False)
    t_init = time.perf_counter() - t0

    @ray.remote(num_cpus=1)
    class Importer:
        def ready(self) -> int:
            import torch  # noqa: F401

            import splicer.backends.torch_ref  # noqa: F401

            return os.getpid()

    t1 = time.perf_counter()
    actors = [Importer.remote() for _ in range(lanes)]
    ray.get([a.ready.remote() for a in actors])
    t_actors = time.perf_counter() - t1
    t2 = time.perf_counter()
    ray.shutdown()
    return {"init_s": round(t_init, 2), "actors_ready_s": round(t_actors, 2), "shutdown_s": round(time.perf_counter() - t2, 2)}


def _run(rows: str, pair: dict, out: Path, ray_lanes: int | None) -> dict:
    from splicer.ablate import AblateSettings, run_ablate
    from splicer.backends import backend_options

    given = {"ray": "default", "ray_lanes": ray_lanes} if ray_lanes else {}
    settings = AblateSettings(
        backend="torch", device="cpu", progress=False, backend_options=backend_options("torch", given, "cpu")
    )
    t0 = time.perf_counter()
    results = run_ablate(rows, str(pair["lowlatency"]), str(pair["base"]), out, "demo", settings)
    wall = time.perf_counter() - t0
    ok = [v["name"] for v in results["variants"] if v["status"] == "ok"]
    return {"wall_s": round(wall, 2), "rows_ok": ok, "results_elapsed_s": round(results["elapsed_s"], 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--lanes", type=int, default=2)
    p.add_argument("--rows", default="all")
    args = p.parse_args(argv)
    import ray
    import torch
    import transformers

    from splicer.fixtures.core import FixtureSpec, write_pair

    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ray-overhead-"))
    pair = write_pair(work / "pair", FixtureSpec(), kinds=("lowlatency",))
    record = {
        "command": "python benchmarks/ray_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average before "
        f"{os.getloadavg()[0]:.2f}",
        "versions": {
            "python": platform.python_version(),
            "ray": ray.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "lanes": args.lanes,
        "rows": args.rows,
    }
    record["ray_alone"] = _ray_alone(args.lanes)
    record["plain"] = _run(args.rows, pair, work / "plain", None)
    import ray as _ray

    # as `--ray` on a machine with no cluster running: the run starts a local one (ray.init), counted in its wall time
    try:
        record["ray"] = _run(args.rows, pair, work / "ray", args.lanes)
    finally:
        _ray.shutdown()
    alone = record["ray_alone"]
    record["ray_start_and_end_s"] = round(alone["init_s"] + alone["actors_ready_s"] + alone["shutdown_s"], 2)
    record["ratio_ray_to_plain_wall"] = round(record["ray"]["wall_s"] / record["plain"]["wall_s"], 3)
    record["ray_start_share_of_plain_wall"] = round(record["ray_start_and_end_s"] / record["plain"]["wall_s"], 3)
    (args.out / "ray-overhead.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
