#!/usr/bin/env bash
# On the GPU machine: rows with --ray against a plain run of the same rows (scripts/gpu/README.md, "Ray on the H200").
# After vLLM's bundle is installed (trained_call.sh install-vllm or install_bundle.sh) and Ray's parts are staged in
# /tmp/carry (trained_call.sh stage .raywhl/ray.part00, then part01 and part02, one per call):
#   bash scripts/gpu/ray_check.sh install    join the parts, check them against .raywhl/SHA256SUMS, install /tmp/ray_site
#   bash scripts/gpu/ray_check.sh run        the fixture's rows ($ROWS of the gpu-fixture plan) plainly and with --ray
#                                            (a local cluster on this host: one lane, the one H200), REPEATS times each,
#                                            alternating (plain-1 ray-1 ray-2 plain-2 plain-3 ray-3 ...: neither side
#                                            always first), each interrupted at BUDGET_S of the call and resumed by the
#                                            same command; then scripts/compare_runs.py --effect plain ray (what Ray
#                                            changes, with a t interval over the repeats); results, tables, logs and
#                                            scores under $OUT
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RAY_SITE=/tmp/ray_site
verb=${1:?install or run}
case "$verb" in
  install)
    if [ ! -f "$RAY_SITE/.splicer-installed" ]; then
      cat /tmp/carry/ray.part* > /tmp/ray.tar && sha256sum -c .raywhl/SHA256SUMS && tar -C /tmp -xf /tmp/ray.tar \
        && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$RAY_SITE" /tmp/raywhl/*.whl \
        && touch "$RAY_SITE/.splicer-installed" || exit 1
    fi
    PYTHONPATH=/tmp/vllm_site:$RAY_SITE python3 -c "import ray; print('ray', ray.__version__, 'imports beside vLLM')" 2>&1 | tail -2
    ;;
  run)
    source scripts/gpu/env.sh
    export PYTHONPATH=$PYTHONPATH:$RAY_SITE
    WORK=${WORK:-/tmp/ray-check}; ROWS=${ROWS:-gdn,shared_expert,lm_head}; BUDGET_S=${BUDGET_S:-500}; REPEATS=${REPEATS:-3}
    t0=$(date +%s)
    mkdir -p "$WORK"
    [ -f "$WORK/pair/base/config.json" ] || python3 -m splicer fixture "$WORK/pair" --preset tiny --builds lowlatency > /dev/null || exit 1
    cc=$(python3 -c 'import json,os; print(json.dumps(json.loads(os.environ["SPLICER_GPU_ENGINE_ARGS"])["compilation_config"]))')
    CMD=(python3 -m splicer ablate "$ROWS" "$WORK/pair/lowlatency" "$WORK/pair/base" --plan gpu-fixture --backend vllm -q
         --engine-arg "compilation_config=$cc" --gpu-memory-utilization 0.3 --language-model-only)
    rc=0
    order=()
    for i in $(seq 1 "$REPEATS"); do
      if [ $((i % 2)) = 1 ]; then order+=("plain-$i" "ray-$i"); else order+=("ray-$i" "plain-$i"); fi
    done
    for how in "${order[@]}"; do
      extra=(); case "$how" in ray-*) extra=(--ray) ;; esac
      [ -f "$WORK/$how.done" ] && continue
      left=$(( BUDGET_S - ($(date +%s) - t0) ))
      [ "$left" -gt 30 ] || { echo "$how: no time left in this call; run the same command again to resume"; rc=124; break; }
      s=$(date +%s)
      timeout -s INT -k 30 "$left" "${CMD[@]}" -o "$WORK/$how" "${extra[@]}" >> "$WORK/$how.log" 2>&1
      r=$?
      echo "$how: exit $r, $(( $(date +%s) - s )) s in this call" | tee -a "$WORK/walls.txt"
      sleep 2; pkill -9 -f "multiprocessing.spawn" 2>/dev/null  # a worker left behind by a stopped run holds the GPU
      if [ "$r" = 0 ]; then touch "$WORK/$how.done"; else rc=$r; break; fi
    done
    done_runs=(); for how in "${order[@]}"; do [ -f "$WORK/$how.done" ] && done_runs+=("$how=$WORK/$how"); done
    [ "${#done_runs[@]}" -ge 2 ] && python3 scripts/compare_runs.py "${done_runs[@]}" --effect plain ray \
      --json "$OUT/ray-vs-plain.json" | tee "$OUT/ray-vs-plain.txt"
    { echo "command: splicer ablate $ROWS BUILD BASE -o DIR --plan gpu-fixture --backend vllm -q --engine-arg compilation_config=$cc --gpu-memory-utilization 0.3 --language-model-only [--ray]"
      echo "fixture: splicer fixture --preset tiny --builds lowlatency"; echo "exit $rc (124/130: stopped at the call's budget; rerun to resume)"
      cat "$WORK/walls.txt" 2>/dev/null; date -u
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
      python3 -c "import vllm, torch, transformers, ray; print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| ray', ray.__version__)"
    } > "$OUT/run.txt" 2>&1
    list=()
    for how in "${order[@]}"; do
      for f in results.json table.md job.json ablate.log logs; do [ -e "$WORK/$how/$f" ] && list+=("$how/$f"); done
      [ -f "$WORK/$how.log" ] && list+=("$how.log")
    done
    tar -C "$WORK" -czf "$OUT/ray-check.tgz" "${list[@]}" 2>/dev/null
    pack_scores "$OUT/scores.tar.xz" "$WORK" "${order[@]}"
    cat "$OUT/run.txt"
    exit $rc ;;
  *) echo "usage: ray_check.sh install | run"; exit 2 ;;
esac
