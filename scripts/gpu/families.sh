#!/usr/bin/env bash
# On the GPU machine, after install_bundle.sh: every family's tiny fixture pair (`splicer fixture --family NAME`)
# through vLLM with the `gpu-families` plan: the int4 build, each of its module classes restored alone, all restored
# together, and the build again. Shows whether vLLM loads each splice, which kernel serves each class (kernels_by_class
# in results.json) and whether the all-restored row reproduces the base. Engines run eager (no compile, no CUDA graphs):
# nothing here is timed, so Triton autotuning is off too (a cold GDN prefill autotunes for about two minutes: qwen3_next
# ran out of its budget in call 3 doing that). FAMILIES overrides the list; BUDGET_S stops the loop before a family that would not finish.
set -uo pipefail
source scripts/gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/families}; BUDGET_S=${BUDGET_S:-540}
FAMILIES=${FAMILIES:-"llama qwen3 mistral qwen3_moe glm4_moe deepseek_v3 qwen3_next"}
t0=$(date +%s)
rm -rf "$WORK"; mkdir -p "$WORK"
for fam in $FAMILIES; do
  left=$(( BUDGET_S - ($(date +%s) - t0) ))
  if [ "$left" -lt 60 ]; then echo "$fam: not run (budget)" >> "$WORK/families.txt"; continue; fi
  f0=$(date +%s)
  python3 -m splicer fixture "$WORK/$fam" --family "$fam" > "$WORK/$fam-fixture.log" 2>&1
  timeout -s INT -k 20 "$left" python3 -m splicer ablate all "$WORK/$fam/int4" "$WORK/$fam/base" -o "$WORK/run-$fam" \
    --plan gpu-families --backend vllm --no-time -q --engine-arg enforce_eager=true --gpu-memory-utilization 0.3 \
    --engine-env VLLM_TRITON_FORCE_FIRST_CONFIG=1 \
    > "$WORK/$fam-ablate.log" 2>&1
  echo "$fam: exit $?, $(( $(date +%s) - f0 )) s" >> "$WORK/families.txt"
  pkill -9 -f "multiprocessing.spawn" 2>/dev/null
done
{ echo "command: FAMILIES=\"$FAMILIES\" bash scripts/gpu/families.sh (per family: splicer fixture DIR --family F; splicer ablate all DIR/int4 DIR/base -o RUN --plan gpu-families --backend vllm --no-time -q --engine-arg enforce_eager=true --gpu-memory-utilization 0.3 --engine-env VLLM_TRITON_FORCE_FIRST_CONFIG=1)"
  echo "BUDGET_S $BUDGET_S, wall $(( $(date +%s) - t0 )) s"; date -u
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import vllm, torch, transformers, compressed_tensors as ct; print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| compressed-tensors', ct.__version__)"
  cat "$WORK/families.txt"
} > "$OUT/run.txt" 2>&1
# One archive (a call brings back at most 8 files): each family's results, table, ablate log and engine logs.
( cd "$WORK" && tar czf "$OUT/families.tgz" families.txt *-fixture.log *-ablate.log run-*/results.json run-*/table.md \
    run-*/report.md run-*/logs 2>/dev/null )
( cd "$WORK" && pack_scores "$OUT/scores.tar.xz" "$WORK" run-* )
cat "$OUT/run.txt"
for fam in $FAMILIES; do echo "== $fam"; head -12 "$WORK/run-$fam/table.md" 2>/dev/null | cut -c1-220; tail -3 "$WORK/$fam-ablate.log"; done
