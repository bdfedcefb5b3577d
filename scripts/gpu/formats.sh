#!/usr/bin/env bash
# On the GPU machine, after install_bundle.sh (issue 16, formats): the qwen3_5_moe fixture pair with one build per
# compressed-tensors format (`splicer fixture --builds ...`: INT4 seed-000-like, W8A8 INT8, FP8 per channel, FP8 128x128
# blocks, NVFP4A16, and a mixed config) and a native FP8 (quant_method fp8) and an AutoAWQ GEMM build, then
#   STEP=score : `splicer score BASE BUILD...`: every format's build against the one base, in vLLM (the mixed-format table);
#   STEP=ablate: per format, `splicer ablate all` with the gpu-families plan: each class restored alone and all together
#                (vLLM loads each, kernels_by_class says which kernel serves each class, all restored = the base?);
#   STEP=split : a hand-split fused group (attention q_proj, GDN in_proj_qkv) per format: splice's refusal and vLLM's.
# Engines run eager, text only (the fixture has no image processor), with Triton autotuning off: nothing here is timed. FORMATS overrides the builds of STEP=ablate/split;
# BUDGET_S stops before a build that would not finish. The work folder survives between calls of one lease.
set -uo pipefail
source scripts/gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/formats}; BUDGET_S=${BUDGET_S:-540}; STEP=${STEP:-score}
FORMATS=${FORMATS:-"fp8-native awq w8a8 fp8-dynamic fp8-block nvfp4a16 mixed"}
ENGINE=(--backend vllm --no-time -q --language-model-only --engine-arg enforce_eager=true --gpu-memory-utilization 0.3
        --engine-env VLLM_TRITON_FORCE_FIRST_CONFIG=1)
t0=$(date +%s)
mkdir -p "$WORK"
if [ ! -f "$WORK/pair/awq/config.json" ]; then
  python3 -m splicer fixture "$WORK/pair" --builds lowlatency,w8a8,fp8-dynamic,fp8-block,nvfp4a16,mixed,fp8-native,awq \
    > "$WORK/fixture.log" 2>&1
fi
P="$WORK/pair"
case "$STEP" in
  score)
    timeout -s INT -k 20 "$BUDGET_S" python3 -m splicer score "$P/base" "$P/lowlatency" "$P/w8a8" "$P/fp8-dynamic" \
      "$P/fp8-block" "$P/nvfp4a16" "$P/mixed" "$P/fp8-native" "$P/awq" -o "$WORK/score" --plan gpu-families "${ENGINE[@]}" > "$WORK/score.log" 2>&1
    echo "score: exit $?, $(( $(date +%s) - t0 )) s" >> "$WORK/formats.txt" ;;
  ablate)
    for f in $FORMATS; do
      left=$(( BUDGET_S - ($(date +%s) - t0) ))
      if [ "$left" -lt 60 ]; then echo "$f: not run (budget)" >> "$WORK/formats.txt"; continue; fi
      f0=$(date +%s)
      timeout -s INT -k 20 "$left" python3 -m splicer ablate all "$P/$f" "$P/base" -o "$WORK/run-$f" --plan gpu-families \
        "${ENGINE[@]}" > "$WORK/$f-ablate.log" 2>&1
      echo "$f: exit $?, $(( $(date +%s) - f0 )) s" >> "$WORK/formats.txt"
      pkill -9 -f "multiprocessing.spawn" 2>/dev/null
    done ;;
  split)
    args=(); for f in $FORMATS; do args+=("qwen3_5_moe:$f"); done
    timeout -s INT -k 20 "$BUDGET_S" python3 scripts/gpu/split_group_check.py "$WORK/split" "$WORK/split-out" "${args[@]}" \
      > "$WORK/split.log" 2>&1
    echo "split: exit $?, $(( $(date +%s) - t0 )) s" >> "$WORK/formats.txt"
    cp "$WORK/split-out/split-groups.json" "$OUT/split-groups.json" 2>/dev/null ;;
esac
{ echo "command: STEP=$STEP FORMATS=\"$FORMATS\" BUDGET_S=$BUDGET_S bash scripts/gpu/formats.sh"
  echo "engine options: ${ENGINE[*]}"
  echo "wall $(( $(date +%s) - t0 )) s"; date -u
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import vllm, torch, transformers, compressed_tensors as ct; print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| compressed-tensors', ct.__version__)"
  cat "$WORK/formats.txt"
} > "$OUT/run-$STEP.txt" 2>&1
( cd "$WORK" && tar czf "$OUT/formats-$STEP.tgz" formats.txt fixture.log *.log score/results.json score/table.md score/report.md \
    score/logs run-*/results.json run-*/table.md run-*/report.md run-*/logs split-out 2>/dev/null )
( cd "$WORK" && pack_scores "$OUT/scores-$STEP.tar.xz" "$WORK" score run-* )
cat "$OUT/run-$STEP.txt"
[ -f "$WORK/score/table.md" ] && head -14 "$WORK/score/table.md" | cut -c1-260
for f in $FORMATS; do [ -f "$WORK/run-$f/table.md" ] && { echo "== $f"; head -12 "$WORK/run-$f/table.md" | cut -c1-200; }; done
tail -5 "$WORK/score.log" "$WORK/split.log" 2>/dev/null
