"""The stand-in's depth check on the CPU: build vs base at 40 layers, with and without RESIDUAL_SCALE.

A random 40-layer stack with the tiny fixture's scales is chaotic under INT4 rounding (the build's predictions are
unrelated to the base's); splicer.fixtures.standin scales the projections that write into the residual stream by
RESIDUAL_SCALE so that they are not. This measures both on the tiny preset (hidden 256) with 40 layers: the torch
reference backend scores random token sequences with the base and the lowlatency build, and reports KL(base || build)
(over the base's top-20 with the rest lumped, as `splicer ablate` reports it, and exact over the full vocabulary)
and top-1 agreement, per residual scale.

Usage: python benchmarks/standin_depth_check.py [--layers 40] [--seqs 8] [--tokens 128] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build_vs_base(root: Path, spec, seqs: list[list[int]]) -> dict:
    import torch

    from splicer.analysis.metrics import fill_missing, kl_full, kl_top_lumped
    from splicer.backends.torch_ref import TorchBackend
    from splicer.fixtures.core import write_pair

    p = write_pair(root, spec, kinds=("lowlatency",))
    b = TorchBackend("cpu")
    b.load(p["base"])
    base = list(b.score(seqs, 20, want_full=True, batch_size=4))
    b.load(p["lowlatency"])
    var = list(b.score(seqs, 20, want_full=True, batch_size=4))
    kl_top = torch.cat(
        [kl_top_lumped(x.topk_logprobs, fill_missing(x.topk_ids, y.topk_ids, y.topk_logprobs)) for x, y in zip(base, var)]
    )
    kl_exact = torch.cat([kl_full(x.full, y.full) for x, y in zip(base, var)])
    top1 = torch.cat([(x.full.argmax(-1) == y.full.argmax(-1)).double() for x, y in zip(base, var)])
    return {
        "positions": int(top1.numel()),
        "kl_top20_lumped": kl_top.double().mean().item(),
        "kl_exact": kl_exact.double().mean().item(),
        "top1": top1.mean().item(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    from splicer.fixtures.core import FixtureSpec
    from splicer.fixtures.standin import RESIDUAL_SCALE

    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(10, 2000, (args.tokens,), generator=g).tolist() for _ in range(args.seqs)]
    over = {"num_hidden_layers": args.layers}
    rows = []
    with tempfile.TemporaryDirectory(prefix="standin-depth-") as tmp:
        for scale in (1.0, RESIDUAL_SCALE):
            t0 = time.perf_counter()
            spec = FixtureSpec(preset="tiny", text_overrides=over, residual_scale=scale)
            r = {
                "residual_scale": scale,
                **build_vs_base(Path(tmp) / f"s{scale}", spec, seqs),
                "seconds": round(time.perf_counter() - t0, 1),
            }
            rows.append(r)
            print(json.dumps(r), flush=True)
    if args.json:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).resolve().parent
            ).stdout.strip()
            or None
        )
        cpu = next(
            (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), platform.processor()
        )
        import transformers

        record = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "started": started,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "commit": commit,
            "machine": {"cpu": cpu, "cores": os.cpu_count(), "arch": platform.machine()},
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
            },
            "setup": {
                "preset": "tiny",
                "num_hidden_layers": args.layers,
                "hidden_size": FixtureSpec(preset="tiny").text_config()["hidden_size"],
                "sequences": args.seqs,
                "tokens_per_sequence": args.tokens,
                "top_k": 20,
                "backend": "torch, cpu, bfloat16",
            },
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
