#!/usr/bin/env bash
# On the GPU machine, after install_bundle.sh and the stand-in (fulldims.sh makes it): is decode timed less steadily with
# --overlap-starts than without, on one lease of the machine? Runs the h200-fulldims plan's build, gdn and build-again rows
# (build-again is the noise band) serially, then with --overlap-starts 2, and prints both tables. Engine caches are the
# per-user defaults, so the second ablate starts warm; that changes start-up times, not decode.
# A = serial, B = overlapped; WHICH=A or WHICH=B runs one of them (e.g. one per device call).
# BASE_FROM=DIR/run: copy that run's base pass (same plan, corpora and CLI engine args) instead of computing it again.
set -uo pipefail
source scripts/gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; WORK=${WORK:-/tmp/fulldims}; BUDGET_S=${BUDGET_S:-560}; t0=$(date +%s)
[ -f "$WORK/pair/reference/config.json" ] || { echo "no stand-in in $WORK/pair: run fulldims.sh (or splicer fixture --full-dims) first"; exit 3; }
COMMON=(build,gdn,build-again "$WORK/pair/build" "$WORK/pair/reference" --plan h200-fulldims --backend vllm --allow-quantized-base
        --language-model-only --bandwidth-gbs 4800 -q --engine-arg 'compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}')
for which in ${WHICH:-A B}; do
  case $which in
    A) extra=() ;;
    B) extra=(--overlap-starts 2) ;;
    *) echo "WHICH takes A (serial) and/or B (overlapped), not $which"; exit 2 ;;
  esac
  if [ -n "${BASE_FROM:-}" ]; then mkdir -p "$WORK/ab-$which/cache"; cp -r "$BASE_FROM"/cache/base-* "$WORK/ab-$which/cache/"; fi
  left=$(( BUDGET_S - ($(date +%s) - t0) )); [ "$left" -gt 60 ] || { echo "budget spent before $which"; break; }
  timeout -s INT -k 30 "$left" python3 -m splicer ablate "${COMMON[@]}" -o "$WORK/ab-$which" "${extra[@]}" > "$OUT/ablate-$which.log" 2>&1
  echo "$which exit $?"
  sleep 2; pkill -9 -f "multiprocessing.spawn" 2>/dev/null
  cp "$WORK/ab-$which/results.json" "$OUT/results-$which.json" 2>/dev/null; python3 - "$WORK/ab-$which/results.json" <<'PY' 2>/dev/null
import json, sys
for v in json.load(open(sys.argv[1]))["variants"]:
    t = v.get("timing") or {}
    w = t.get("wall_diff") or {}
    ms = lambda x: "not resolved" if x.get("decode_ms_per_token") is None else (round(x["decode_ms_per_token"], 3), [round(y, 2) for y in x["decode_min_max"]])
    print(v["name"], "engine", ms(t), "| wall", ms(w), "| ttft", t.get("ttft_min_max"))
PY
done
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
  lscpu | grep -E 'Model name|Socket|Core|Thread|MHz'; } > "$OUT/run.txt" 2>&1
( cd "$WORK" && tar czf "$OUT/logs.tgz" ab-*/logs 2>/dev/null )
