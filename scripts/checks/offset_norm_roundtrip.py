"""Whether a build's norm weights are its base's after llm-compressor's offset-norm round trip, bit for bit.

    python scripts/checks/offset_norm_roundtrip.py BUILD BASE

llm-compressor 0.14's oneshot (llmcompressor.modeling.offset_norm.CalibrationOffsetNorm) swaps every offset RMSNorm
(output * (1 + w): Qwen3.5, Qwen3-Next, Gemma) for a standard one holding (1 + w) in the model's dtype, and writes
w back as (weight - 1) on exit. In BF16 that is ((1 + w.float()).to(bf16).float() - 1).to(bf16): 1 + w is rounded to
BF16's spacing near 1 (2^-8 below, 2^-7 above), so w loses its low bits even when nothing smooths the norm. For each
`*norm.weight` stored in both, this says whether the build equals the base, equals the round trip of the base, or
neither (changed by something else, e.g. AWQ smoothing). Standard library + safetensors + torch only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from unquantized_diff import fail, load, tensor_files  # noqa: E402


def offset_roundtrip(w: torch.Tensor) -> torch.Tensor:
    return ((1.0 + w.float()).to(w.dtype).float() - 1.0).to(w.dtype)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("build", type=Path)
    p.add_argument("base", type=Path)
    args = p.parse_args(argv)
    for folder in (args.build, args.base):
        if not folder.is_dir():
            fail(f"{folder} is not a folder; pass BUILD and BASE checkpoint folders")
    bfiles, afiles = tensor_files(args.build), tensor_files(args.base)
    names = sorted(n for n in set(bfiles) & set(afiles) if n.endswith("norm.weight") and ".visual." not in n)
    counts = {"equal to base": 0, "equal to round trip, not base": 0, "neither": 0}
    print(f"{'tensor':64} {'verdict':30} {'max|build-base|':>16} {'moved by round trip':>20}")
    for name in names:
        b, a = load(bfiles[name], name), load(afiles[name], name)
        rt = offset_roundtrip(a)
        moved = int((rt != a).sum())
        if torch.equal(b, a):
            verdict = "equal to base"
        elif torch.equal(b, rt):
            verdict = "equal to round trip, not base"
        else:
            verdict = "neither"
        counts[verdict] += 1
        diff = float((b.double() - a.double()).abs().max())
        print(f"{name:64} {verdict:30} {diff:16.6g} {moved:>11d}/{a.numel():<8d}")
    print("summary: " + "; ".join(f"{v} {k}" for k, v in counts.items()) + f" (of {len(names)} norm weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
