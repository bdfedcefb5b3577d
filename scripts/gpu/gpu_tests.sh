#!/usr/bin/env bash
# On the GPU machine, after install_bundle.sh: versions, then the gpu-marked tests. Output under $OUT.
set -uo pipefail
source scripts/gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch, transformers, vllm, compressed_tensors as ct; print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__, '| compressed-tensors', ct.__version__)"
} 2>&1 | tee "$OUT/machine.txt"
t0=$(date +%s)
python3 -m pytest -q -m gpu -s -p no:cacheprovider tests/test_gpu_vllm.py 2>&1 | tee "$OUT/gpu-tests.log"
echo "gpu tests: exit ${PIPESTATUS[0]}, $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu-tests.log"
