"""On the GPU machine, after install_bundle.sh and the stand-in: how steady is batch-1 decode timing, and which estimator
is steadier? One process, one engine at a time (no overlap): the build's engine timed in three blocks, a second engine
of the build timed in three blocks, then the gdn variant's engine in two. Every block is the ablate's timing call
(1,500-token prompt, 64 new tokens, 3 warm-ups, 7 runs), which reports decode both from the engine's own token times
and as the wall-clock difference (t(64) - t(1)) / 63. Writes OUT/timing-noise.json and prints a summary.

usage: python3 scripts/gpu/timing_noise.py WORK OUT   (WORK holds pair/build and pair/reference)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _spread(timing: dict) -> str:
    """'4.354 [4.341-4.366]', or 'not resolved' where the backend gave no positive estimate (decode_ms_per_token None)."""
    if timing.get("decode_ms_per_token") is None:
        return "not resolved"
    lo, hi = timing["decode_min_max"]
    return f"{timing['decode_ms_per_token']:.3f} [{lo:.3f}-{hi:.3f}]"


def main() -> None:
    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    import torch

    from splicer.backends.vllm_backend import VllmBackend
    from splicer.splice.core import splice

    build, reference = work / "pair" / "build", work / "pair" / "reference"
    gdn = work / "noise" / "gdn"
    gdn.parent.mkdir(parents=True, exist_ok=True)
    if not (gdn / "config.json").exists():
        splice(str(build), str(reference), gdn, "gdn", force=True, progress=False, allow_quantized_base=True)
    cfg = json.loads((build / "config.json").read_text())
    vocab = cfg.get("text_config", cfg)["vocab_size"]
    prompt = torch.randint(vocab // 100, vocab - 1, (1500,), generator=torch.Generator().manual_seed(0)).tolist()
    args = {
        "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]},
        "language_model_only": True,
        "gpu_memory_utilization": 0.5,
    }
    backend = VllmBackend(engine_args=args, log_dir=work / "noise" / "logs")
    record = {
        "engine_args": backend.engine_args,
        "env": {k: os.environ.get(k) for k in ("VLLM_TRITON_FORCE_FIRST_CONFIG",)},
        "device": torch.cuda.get_device_name(0),
        "engines": [],
    }
    try:
        for label, folder, blocks in (("build #1", build, 3), ("build #2", build, 3), ("gdn", gdn, 2)):
            t0 = time.perf_counter()
            backend.load(folder)
            info = backend.load_info()
            engine = {
                "label": label,
                "start_s": time.perf_counter() - t0,
                "startup_breakdown": info.get("startup_breakdown"),
                "blocks": [],
            }
            for _ in range(blocks):
                engine["blocks"].append(backend.time_decode(prompt, 64, 3, 7))
            backend.unload()
            record["engines"].append(engine)
            (out / "timing-noise.json").write_text(json.dumps(record, indent=1))
            for b in engine["blocks"]:
                print(
                    f"{label:9s} engine {_spread(b)}  wall {_spread(b.get('wall_diff') or {})}  ttft {b['ttft_ms']:.0f} "
                    f"{[round(x) for x in b['ttft_min_max']]}",
                    flush=True,
                )
            print(f"{label}: engine start {engine['start_s']:.0f} s", flush=True)
    finally:
        backend.close()


if __name__ == "__main__":
    main()
