"""The torch reference's BF16 matrix products on the CPU: torch's own BF16 GEMM against FP32 products of the same BF16
values rounded back to BF16 (what TorchBackend does on the CPU), measured side by side in one run.

Two measurements, each in alternating order (own, fp32, own, fp32, ...), with the same thread count:
  * one linear layer of the demo model's shapes (1016 positions x 256 -> 1024), milliseconds per call;
  * the demo pair's build scored on 4 sequences of 255 tokens of the demo's text by TorchBackend, with its matmuls as loaded (FP32
    products, as it scores) and without them (torch's BF16 GEMM), seconds per pass, and how far the two passes'
    log-probs of the next tokens lie apart.
Prints the ratios (own / fp32) and writes every run's time to OUT.json with the machine, its load before and after,
the versions and the command.

Usage: python benchmarks/cpu_bf16_matmul.py OUT.json [--reps 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx512", "amx", "avx2")))
    except OSError:
        pass
    return []


def bench_args() -> argparse.Namespace:
    """OUT.json, --reps and --threads, as both CPU benchmarks take them; torch's threads set to --threads."""
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    return args


def bench_record(script: str, threads: int) -> dict:
    """What a benchmark's OUT.json opens with: its command, the date, the machine, its load before, the versions and
    the commit."""
    import torch
    import transformers

    from splicer.ablate.job import host_info

    record = {
        "command": f"python benchmarks/{script} " + " ".join(sys.argv[2:] + ["OUT.json"]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {**host_info(), "flags": cpu_flags(), "threads": threads},
        "load_before": os.getloadavg(),  # 1, 5 and 15 minutes
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__},
    }
    try:
        record["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except OSError:
        pass
    return record


def demo_build(tmp: Path, threads: int):
    """(TorchBackend with the demo pair's build loaded, the demo text's tokens, 4 sequences of 255 of them: the demo's
    wiki-en corpus is 4 x 255)."""
    from transformers import AutoTokenizer

    from splicer.backends.torch_ref import TorchBackend
    from splicer.corpora.demo_tokenizer import demo_texts
    from splicer.fixtures.core import FixtureSpec, write_pair

    pair = write_pair(Path(tmp) / "pair", FixtureSpec(), kinds=("lowlatency",))
    tokens = AutoTokenizer.from_pretrained(pair["base"])("\n".join(demo_texts()))["input_ids"]
    seqs = [tokens[i * 255 : (i + 1) * 255] for i in range(4)]
    assert all(len(s) == 255 for s in seqs), "the demo text is shorter than 4 x 255 tokens"
    backend = TorchBackend("cpu", threads=threads)
    backend.load(pair["lowlatency"])
    return backend, tokens, seqs


def timed_with(backend, method: str, mode, fn):
    """(seconds, fn()) with the backend's `method` (_scoring_products or _generation_products) answering mode() instead
    of its own where mode is given (None: the backend's own arithmetic)."""
    if mode is not None:
        setattr(backend, method, lambda model: mode())
    try:
        t = time.perf_counter()
        out = fn()
        return time.perf_counter() - t, out
    finally:
        vars(backend).pop(method, None)


def main() -> None:
    args = bench_args()

    import torch

    from splicer.backends.torch_ref import _Bf16InFp32

    record = bench_record("cpu_bf16_matmul.py", args.threads)

    # one linear layer
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1016, 256, generator=g).bfloat16()
    w = torch.randn(1024, 256, generator=g).bfloat16()
    own_out = torch.nn.functional.linear(x, w)
    with _Bf16InFp32():
        fp32_out = torch.nn.functional.linear(x, w)
    calls = 20
    linear = {"own_ms": [], "fp32_ms": []}
    for _ in range(args.reps):
        for key, mode in (("own_ms", contextlib.nullcontext), ("fp32_ms", _Bf16InFp32)):
            t = time.perf_counter()
            with mode():
                for _ in range(calls):
                    torch.nn.functional.linear(x, w)
            linear[key].append(1000 * (time.perf_counter() - t) / calls)
    linear["outputs_differing"] = float((own_out != fp32_out).float().mean())
    linear["max_abs_difference"] = float((own_out.float() - fp32_out.float()).abs().max())
    record["linear_1016x256_to_1024"] = linear

    # the demo build scored on 4 sequences of 255 tokens of the demo's text
    with tempfile.TemporaryDirectory() as tmp:
        backend, _, seqs = demo_build(Path(tmp), args.threads)

        def score(own: bool):  # own: torch's BF16 GEMM, no FP32 products around the pass
            return timed_with(
                backend, "_scoring_products", contextlib.nullcontext if own else None, lambda: list(backend.score(seqs, 20))
            )

        scoring = {"sequences": len(seqs), "positions": sum(len(s) - 1 for s in seqs), "own_s": [], "fp32_s": []}
        for _ in range(args.reps):
            t_own, own = score(True)
            t_fp32, fp32 = score(False)
            scoring["own_s"].append(t_own)
            scoring["fp32_s"].append(t_fp32)
        diff = max(float((a.target_logprobs - b.target_logprobs).abs().max()) for a, b in zip(own, fp32))
        scoring["max_abs_difference_of_next_token_logprobs"] = diff
        record["demo_build_scoring_wiki_en"] = scoring

    lin = statistics.median(linear["own_ms"]) / statistics.median(linear["fp32_ms"])
    sc = statistics.median(scoring["own_s"]) / statistics.median(scoring["fp32_s"])
    record["ratios_own_over_fp32"] = {"linear": lin, "demo_build_scoring": sc}
    record["load_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"{record['machine']['cpu']} ({record['torch_cpu_capability']}), {args.threads} thread(s), medians of {args.reps}")
    print(
        f"linear 1016x256->1024: own BF16 {statistics.median(linear['own_ms']):.2f} ms, FP32 products "
        f"{statistics.median(linear['fp32_ms']):.2f} ms: {lin:.1f}x"
    )
    print(
        f"demo build, wiki-en ({scoring['positions']} positions): own BF16 {statistics.median(scoring['own_s']):.2f} s, "
        f"FP32 products {statistics.median(scoring['fp32_s']):.2f} s: {sc:.1f}x; log-probs apart by at most {diff:.4f}"
    )


if __name__ == "__main__":
    main()
