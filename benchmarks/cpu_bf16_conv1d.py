"""The torch reference's BF16 convolutions on the CPU: torch's own BF16 depthwise conv1d (the Gated-DeltaNet layers'
short convolution) against the FP32 convolution of the same BF16 values rounded back to BF16 (what TorchBackend does
on the CPU since its _Bf16InFp32 routes convolutions too), measured side by side in one run.

Three measurements, each in alternating order (before, after, before, after, ...), with the same thread count:
  * the demo model's conv1d layer on 4 x 255 positions (a scoring pass) and on one position after a 3-wide state
    (a decode step), milliseconds per call;
  * the demo pair's build scored on 4 sequences of 255 tokens of the demo's text by TorchBackend, with FP32 products
    only (before) and with FP32 products and convolutions (after), seconds per pass, and how far the two passes'
    log-probs of the next tokens lie apart;
  * the same build's greedy generation of 32 tokens after a 64-token prompt, with torch's own kernels (before) and
    with the convolutions in FP32 (after), seconds, and whether the tokens are the same.
Prints the ratios (before / after) and writes every run's time to OUT.json with the machine, its load before and
after, the versions and the command.

Usage: python benchmarks/cpu_bf16_conv1d.py OUT.json [--reps 3] [--threads 1]
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from cpu_bf16_matmul import bench_args, bench_record, demo_build, timed_with


def main() -> None:
    args = bench_args()

    import torch

    from splicer.backends.torch_ref import _Bf16InFp32

    record = bench_record("cpu_bf16_conv1d.py", args.threads)

    def products_only():  # the routing before: FP32 products, torch's own BF16 convolutions
        mode = _Bf16InFp32(matmuls=True)
        mode.funcs = _Bf16InFp32.MATMULS
        return mode

    with tempfile.TemporaryDirectory() as tmp:
        backend, tokens, seqs = demo_build(Path(tmp), args.threads)
        conv = next(m for m in backend.model.modules() if isinstance(m, torch.nn.Conv1d))
        channels, width = conv.weight.shape[0], conv.weight.shape[-1]

        # one conv1d layer: a scoring pass's 4 x 255 positions, and a decode step's one position after the state
        g = torch.Generator().manual_seed(0)
        shapes = {"scoring_4x255": (4, channels, 255), "decode_1": (1, channels, width)}
        layer = {"channels": channels, "kernel": width}
        for name, shape in shapes.items():
            x = torch.randn(*shape, generator=g).bfloat16()
            pad = width - 1 if name.startswith("scoring") else 0

            def call(x=x, pad=pad):
                return torch.nn.functional.conv1d(x, conv.weight, conv.bias, padding=pad, groups=channels)

            with torch.no_grad():
                own = call()
                with _Bf16InFp32(matmuls=False):
                    fp32 = call()
            calls = 50 if name.startswith("scoring") else 500
            times = {"own_ms": [], "fp32_ms": []}
            for _ in range(args.reps):
                for key, mode in (("own_ms", contextlib.nullcontext), ("fp32_ms", lambda: _Bf16InFp32(matmuls=False))):
                    t = time.perf_counter()
                    with torch.no_grad(), mode():
                        for _ in range(calls):
                            call()
                    times[key].append(1000 * (time.perf_counter() - t) / calls)
            times["outputs_differing"] = float((own != fp32).float().mean())
            times["max_abs_difference"] = float((own.float() - fp32.float()).abs().max())
            layer[name] = times
        record["conv1d_layer"] = layer

        def score(before: bool):
            mode = products_only if before else None
            return timed_with(backend, "_scoring_products", mode, lambda: list(backend.score(seqs, 20)))

        scoring = {"sequences": len(seqs), "positions": sum(len(s) - 1 for s in seqs), "before_s": [], "after_s": []}
        for _ in range(args.reps):
            t_before, before = score(True)
            t_after, after = score(False)
            scoring["before_s"].append(t_before)
            scoring["after_s"].append(t_after)
        scoring["max_abs_difference_of_next_token_logprobs"] = max(
            float((a.target_logprobs - b.target_logprobs).abs().max()) for a, b in zip(before, after)
        )
        record["demo_build_scoring_wiki_en"] = scoring

        def generate(before: bool):
            mode = contextlib.nullcontext if before else None
            return timed_with(backend, "_generation_products", mode, lambda: backend.generate([tokens[:64]], 32, stop_ids=[]))

        generation = {"prompt_tokens": 64, "new_tokens": 32, "before_s": [], "after_s": []}
        for _ in range(args.reps):
            t_before, gen_before = generate(True)
            t_after, gen_after = generate(False)
            generation["before_s"].append(t_before)
            generation["after_s"].append(t_after)
        generation["same_tokens"] = gen_before == gen_after
        record["demo_build_generation"] = generation

    def ratio(d, a, b):
        return statistics.median(d[a]) / statistics.median(d[b])

    record["ratios_before_over_after"] = {
        "conv1d_scoring_4x255": ratio(layer["scoring_4x255"], "own_ms", "fp32_ms"),
        "conv1d_decode_1": ratio(layer["decode_1"], "own_ms", "fp32_ms"),
        "demo_build_scoring": ratio(scoring, "before_s", "after_s"),
        "demo_build_generation": ratio(generation, "before_s", "after_s"),
    }
    record["load_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    r = record["ratios_before_over_after"]
    print(f"{record['machine']['cpu']} ({record['torch_cpu_capability']}), {args.threads} thread(s), medians of {args.reps}")
    for name in shapes:
        d = layer[name]
        print(
            f"conv1d {channels} channels, {name}: own BF16 {statistics.median(d['own_ms']):.3f} ms, FP32 "
            f"{statistics.median(d['fp32_ms']):.3f} ms: {r['conv1d_' + name]:.1f}x; outputs differing "
            f"{d['outputs_differing']:.2e}"
        )
    print(
        f"demo build scoring ({scoring['positions']} positions): products only {statistics.median(scoring['before_s']):.2f} s, "
        f"products and convolutions {statistics.median(scoring['after_s']):.2f} s: {r['demo_build_scoring']:.2f}x; "
        f"log-probs apart by at most {scoring['max_abs_difference_of_next_token_logprobs']:.4f}"
    )
    print(
        f"demo build generation (32 tokens): own {statistics.median(generation['before_s']):.2f} s, convolutions in FP32 "
        f"{statistics.median(generation['after_s']):.2f} s: {r['demo_build_generation']:.2f}x; same tokens: "
        f"{generation['same_tokens']}"
    )


if __name__ == "__main__":
    main()
