#!/usr/bin/env bash
# On the GPU machine, after install_bundle.sh: issue 17 on the Qwen3.6-35B-A3B-shaped stand-in. A 4-group sweep of the
# Gated-DeltaNet layers (`splicer plan sweep --class gdn --groups 4 --from h200-fulldims`, its leave-one-group-out rows
# dropped to fit the device time: the whole-class row measures the groups' additivity), plus the attention and
# shared-expert rows, run serially under vLLM as fulldims.sh runs its plan (NOAUTOTUNE, PRECOMPILE=2); then
# `splicer budget DIR --verify 3`: the Pareto front of predicted KL against decode time, three of its points spliced,
# measured in the same folder and compared with their prediction.
# Resumable: call it again on the same machine (same BUDGET_S rules as fulldims.sh) and it continues where it stopped.
set -uo pipefail
source scripts/gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/fulldims}; BUDGET_S=${BUDGET_S:-540}; VERIFY=${VERIFY:-3}
DIR="$WORK/budget"
# tomli-w (plan sweep and budget --verify write plans with it) is not in bundles made before it was added to
# make_bundle.sh: its wheel travels in .bundle/extra (carried with the last bundle part) and is unpacked beside vLLM.
python3 -c "import tomli_w" 2>/dev/null || for w in .bundle/extra/tomli_w-*.whl; do python3 -m zipfile -e "$w" /tmp/vllm_site; done
t0=$(date +%s)
if [ "$BUDGET_S" -gt 560 ]; then BUDGET_S=560; fi
mkdir -p "$WORK"
if [ ! -f "$WORK/pair/reference/config.json" ]; then
  ( time python3 -m splicer fixture "$WORK/pair" --full-dims ) > "$WORK/standin.log" 2>&1; tail -4 "$WORK/standin.log"
fi
if [ ! -f "$WORK/sweep.toml" ]; then
  python3 -m splicer plan sweep "$WORK/pair/build" --class gdn --groups 4 --from h200-fulldims -o "$WORK/sweep-full.toml"
  python3 - "$WORK/sweep-full.toml" "$WORK/sweep.toml" <<'PY'
import sys, tomllib, tomli_w
plan = tomllib.loads(open(sys.argv[1]).read())
rows = [r for r in plan["row"] if not r["name"].startswith("gdn-without-")]
extra = [{"name": "attention", "restore": ["attention"]}, {"name": "shared_expert", "restore": ["shared_expert"]}]
plan["row"] = rows[:-1] + extra + rows[-1:]  # the build's second engine stays last
plan["name"] = "sweep-gdn-4-budget"
plan["description"] += "; leave-one-group-out rows dropped, attention and shared_expert added (scripts/gpu/budget.sh)"
open(sys.argv[2], "w").write(tomli_w.dumps(plan))
PY
fi
CMD=(python3 -m splicer ablate all "$WORK/pair/build" "$WORK/pair/reference" -o "$DIR" --plan "$WORK/sweep.toml"
     --backend vllm --allow-quantized-base --language-model-only --bandwidth-gbs 4800 -q --gpu-memory-utilization 0.5
     --engine-arg 'compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}'
     --engine-env VLLM_TRITON_FORCE_FIRST_CONFIG=1)
if [ ! -f "$DIR/results.json" ]; then CMD+=(--precompile 2); fi  # compiling ahead only beside the base pass
rc=0
if ! python3 -c "import json,sys; r=json.load(open('$DIR/results.json')); sys.exit(0 if r['runs'][-1].get('finished') and r['job']['plan']=='sweep-gdn-4-budget' else 1)" 2>/dev/null \
   && [ ! -f "$DIR/budget-plan.toml" ]; then
  left=$(( BUDGET_S - ($(date +%s) - t0) ))
  timeout -s INT -k 30 "$left" "${CMD[@]}" > "$WORK/ablate-$(date +%s).log" 2>&1; rc=$?
  sleep 2; pkill -9 -f "multiprocessing.spawn" 2>/dev/null
fi
left=$(( BUDGET_S - ($(date +%s) - t0) ))
if [ "$rc" = 0 ] && [ "$left" -gt 60 ]; then
  timeout -s INT -k 30 "$left" python3 -m splicer budget "$DIR" --verify "$VERIFY" -q > "$WORK/budget-verify.txt" 2>&1; rc=$?
  sleep 2; pkill -9 -f "multiprocessing.spawn" 2>/dev/null
  cat "$WORK/budget-verify.txt" >> "$WORK/budget-verify-all.txt"
fi
[ -f "$DIR/results.json" ] && python3 -m splicer budget "$DIR" > "$OUT/budget.txt" 2>&1
[ -f "$DIR/results.json" ] && python3 -m splicer plot "$DIR" > /dev/null 2>&1
{ echo "commands: splicer fixture DIR/pair --full-dims; splicer plan sweep ... (see the script); ${CMD[*]:3}; splicer budget DIR --verify $VERIFY" | sed "s#$WORK#WORK#g"
  echo "last step exit $rc (124/130: stopped at the call's budget; rerun to resume), call wall $(( $(date +%s) - t0 )) s"; date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import vllm, torch, transformers, compressed_tensors as ct; print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| compressed-tensors', ct.__version__)"
  nproc; lscpu | grep -E 'Model name' ; free -g | head -2
} > "$WORK/run-$(date +%s).txt" 2>&1
cp "$DIR/results.json" "$DIR/table.md" "$DIR/budget.json" "$DIR/plot-kl.png" "$DIR/plot-kl.svg" "$OUT/" 2>/dev/null
# One archive for the rest: a device call brings back at most 8 files.
( cd "$WORK" && tar czf "$OUT/logs.tgz" standin.log sweep-full.toml sweep.toml ablate-*.log budget-verify-all.txt run-*.txt \
    budget/job.json budget/report.md budget/ablate.log budget/budget-plan.toml budget/logs budget/cache/base-*/done.json 2>/dev/null )
# The eighth file: per-position scores, so that the rows' and the verification's intervals can be recomputed.
pack_scores "$OUT/scores.tar.xz" "$(dirname "$DIR")" "$(basename "$DIR")"
tail -3 "$WORK"/ablate-*.log 2>/dev/null | tail -4; cat "$OUT/budget.txt" 2>/dev/null | tail -25
