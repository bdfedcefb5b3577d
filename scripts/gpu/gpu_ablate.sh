#!/usr/bin/env bash
# On the GPU machine, after install_bundle.sh: `splicer ablate all` with the vLLM backend on the fixture pair.
# Writes results.json, table.md and a run record under $OUT (the working folder stays in /tmp: too many files to return).
set -uo pipefail
source scripts/gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PRESET=${SPLICER_GPU_PRESET:-tiny}
WORK=/tmp/gpu-fixture; rm -rf "$WORK"; mkdir -p "$WORK"
python3 -m splicer fixture "$WORK/pair" --preset "$PRESET" --builds lowlatency > /dev/null
CMD=(python3 -m splicer ablate all "$WORK/pair/lowlatency" "$WORK/pair/base" -o "$WORK/run" --plan gpu-fixture
     --backend vllm -q --engine-arg "compilation_config=$(python3 -c 'import json,os; print(json.dumps(json.loads(os.environ["SPLICER_GPU_ENGINE_ARGS"])["compilation_config"]))')"
     --gpu-memory-utilization 0.3 --language-model-only)
t0=$(date +%s)
"${CMD[@]}" 2>&1 | tee "$OUT/ablate.log"
rc=${PIPESTATUS[0]}
{ echo "command: splicer ablate all BUILD BASE -o DIR --plan gpu-fixture --backend vllm --engine-arg compilation_config=<see results.json> --gpu-memory-utilization 0.3 --language-model-only"
  echo "fixture: splicer fixture --preset $PRESET --builds lowlatency"; echo "exit $rc, wall $(( $(date +%s) - t0 )) s"; date -u
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import vllm, torch, transformers; print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
} > "$OUT/run.txt" 2>&1
cp "$WORK/run/results.json" "$WORK/run/table.md" "$OUT/" 2>/dev/null
grep -h "Using\|GDN prefill" "$WORK"/run/logs/*.log 2>/dev/null | sed 's/^.*\] //' | sort | uniq -c > "$OUT/kernel-lines.txt"
pack_scores "$OUT/scores.tar.xz" "$WORK" run
cat "$OUT/run.txt"
