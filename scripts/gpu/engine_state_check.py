"""On the GPU machine (vLLM bundle, the stand-in under WORK/pair, warm caches best): why do engines of one variant time
differently after a sleep and wake? Run 4 (results/h200-fulldims/run-4) saw the build's engines at 4.111, 4.114 and
4.631 ms/token; the logs line the fast ones up with engines built in a call's first start group and the slow ones with
engines built after another engine was released, in a reused process or a fresh one. This times the build's engine,
every time after a sleep and wake, in five states:

  A  fresh process P1 on an empty GPU
  B  the same engine slept and woken once more
  C  a second engine built in P1 after the first was released (the reused-process case; may fail with vLLM's
     "CuMem allocator can only be used for one instance per process", which is recorded)
  D  a fresh process P2 started while P1 still holds its engine, asleep (a GPU with history, a fresh process)
  E  every process ended, then a fresh process P3 on an empty GPU

Reading: C slow and D fast -> process reuse; C and D slow, A and E fast -> the GPU's memory history; B unlike A -> the
wake's placement; all alike -> the ablate's concurrent starts. Writes OUT/engine-state.json and prints one line per state.

usage: python3 scripts/gpu/engine_state_check.py WORK OUT [--second-wake N]   (about 5 engine starts; ~5 min with warm caches)

Run on 2026-12-01 (results/h200-fulldims/engine-state): A 4.375, B 4.124, C 4.394, D 4.372 ms/token; E cut by the time limit set
for it. Only B, a second sleep and wake after the engine had been timed, was fast. `--second-wake N` tests that: N fresh
processes one after another, each engine timed after its first wake (W1), then slept and woken again and timed (W2), and a
fresh engine without sleep mode timed last (NS); if W2 is fast on every engine and W1 is not, a second wake before timing
is the fix to build into the backend (`--rewake-before-timing`); W3, a third cycle, says whether the state then holds.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main() -> None:
    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    fake = "--cpu-smoke-test" in sys.argv  # the fake vllm of tests/ (no GPU): protocol only
    import torch

    from splicer.backends.vllm_backend import OVERLAP_DEFAULTS, VllmBackend

    build = work / "pair" / "build"
    cfg = json.loads((build / "config.json").read_text())
    vocab = cfg.get("text_config", cfg)["vocab_size"]
    prompt = torch.randint(
        vocab // 100, vocab - 1, (1500 if not fake else 24,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    # The ablate's engine settings with --overlap-starts (fixed KV cache) and sleep mode, but sleeps and wakes by hand.
    args = {**OVERLAP_DEFAULTS, "enable_sleep_mode": True, "language_model_only": True}
    if not fake:
        args["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}
    new_tokens, warmup, runs = (64, 3, 7) if not fake else (3, 0, 2)
    record = {"engine_args": args, "states": []}

    def backend(name, sleep_mode=True):
        engine_args = args if sleep_mode else {k: v for k, v in args.items() if k != "enable_sleep_mode"}
        return VllmBackend(
            engine_args=engine_args, log_dir=work / "engine-state" / "logs" / name, sleep_between=False, require_cuda=not fake
        )

    def state(label, b, note, reload=False, wake=True):
        entry = {"state": label, "note": note}
        t0 = time.perf_counter()
        try:
            if reload:
                b.load(build)
                entry["engine"] = {
                    k: b.load_info().get(k) for k in ("pid", "startup_s", "compile_time_s", "retried_in_fresh_worker")
                }
            if wake:
                entry["sleep_s"] = b._call("sleep", timeout=600)
                entry["wake_s"] = b._call("wake", timeout=600)
            entry["timing"] = b.time_decode(prompt, new_tokens, warmup, runs)
        except Exception as e:  # a state that cannot be reached is a result too (e.g. C's CuMem assertion)
            entry["error"] = f"{e.__class__.__name__}: {str(e)[:600]}"
        entry["wall_s"] = time.perf_counter() - t0
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            entry["gpu_free_gib_after"] = free / 2**30
        record["states"].append(entry)
        (out / "engine-state.json").write_text(json.dumps(record, indent=1))
        t = entry.get("timing") or {}
        ms = t.get("per_run_ms") or []
        retried = (entry.get("engine") or {}).get("retried_in_fresh_worker")
        print(
            f"{label}: {note}: "
            + (
                f"{sum(ms) / len(ms):.3f} ms/token mean of {len(ms)} blocks "
                f"[{min(ms):.3f}-{max(ms):.3f}], pid {(entry.get('engine') or {}).get('pid')}"
                if ms
                else entry.get("error", "no timing")
            )
            + (f" (the load in P1 failed and was retried in a fresh process: {retried[:120]})" if retried else ""),
            flush=True,
        )

    out.mkdir(parents=True, exist_ok=True)
    if "--second-wake" in sys.argv:
        n = int(sys.argv[sys.argv.index("--second-wake") + 1])
        for i in range(n):
            b = backend(f"w{i}")
            try:
                state(f"W1.{i}", b, f"fresh process {i}, timed after its first wake", reload=True)
                state(f"W2.{i}", b, f"fresh process {i}, slept and woken a second time")
                state(f"W3.{i}", b, f"fresh process {i}, slept and woken a third time")
            finally:
                b.close()
        b = backend("ns", sleep_mode=False)
        try:
            state("NS", b, "fresh process, no sleep mode, timed after load", reload=True, wake=False)
        finally:
            b.close()
        return
    p1 = backend("p1")
    try:
        state("A", p1, "fresh process P1, empty GPU", reload=True)
        state("B", p1, "same engine, slept and woken again")
        p1.unload()  # released in P1 (sleep_between=False keeps the process)
        state("C", p1, "second engine in P1 after a release", reload=True)
        p2 = backend("p2")
        try:
            state("D", p2, "fresh process P2 while P1 holds an engine", reload=True)
        finally:
            p2.close()
    finally:
        p1.close()
    p3 = backend("p3")
    try:
        state("E", p3, "fresh process P3 after every process ended", reload=True)
    finally:
        p3.close()


if __name__ == "__main__":
    main()
