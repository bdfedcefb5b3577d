#!/usr/bin/env bash
# On the GPU machine, after install_bundle.sh: a short check of timing after sleep (vLLM's sleep mode) on the tiny
# fixture before the stand-in run: `splicer ablate` of the build, gdn and build-again rows with --overlap-starts 1,
# so every engine sleeps once started and is woken at its turn. Its engine caches are kept apart from the stand-in
# run's, which must start from cold caches. Writes sleep-check.txt (table, report, sleep/wake seconds) under $OUT.
set -uo pipefail
source scripts/gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=/tmp/sleep-check; rm -rf "$WORK"; mkdir -p "$WORK"
export TRITON_CACHE_DIR=$WORK/triton VLLM_CACHE_ROOT=$WORK/vllm TORCHINDUCTOR_CACHE_DIR=$WORK/inductor
python3 -m splicer fixture "$WORK/pair" --preset tiny --builds lowlatency > /dev/null
t0=$(date +%s)
python3 -m splicer ablate gdn,build-again "$WORK/pair/lowlatency" "$WORK/pair/base" -o "$WORK/run" --plan gpu-fixture \
  --backend vllm -q --overlap-starts 1 --language-model-only \
  --engine-arg "compilation_config=$(python3 -c 'import json,os; print(json.dumps(json.loads(os.environ["SPLICER_GPU_ENGINE_ARGS"])["compilation_config"]))')" \
  > "$WORK/ablate.log" 2>&1
rc=$?
{ echo "exit $rc, wall $(( $(date +%s) - t0 )) s"; tail -5 "$WORK/ablate.log"; cat "$WORK/run/report.md" "$WORK/run/table.md"
  python3 - "$WORK/run/results.json" <<'P'
import json, sys
r = json.load(open(sys.argv[1]))
for v in r["variants"]:
    e = v.get("engine") or {}
    print(v["name"], v.get("status"), "sleep_s", e.get("sleep_s"), "wake_s", e.get("wake_s"), "state", (v.get("timing") or {}).get("state"),
          "per_run_ms", [round(x, 4) for x in (v.get("timing") or {}).get("per_run_ms") or []], (v.get("error") or "")[:300])
P
  grep -h "Sleep mode freed\|CuMemAllocator" "$WORK"/run/logs/*.log | sed 's/^.*\] //' | sort | uniq -c | head
} 2>&1 | tee "$OUT/sleep-check.txt"
