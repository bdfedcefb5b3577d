#!/usr/bin/env bash
# One device call of the trained-model run (scripts/gpu/README.md, "A trained model end to end"):
#   trained_call.sh stage PATH...   copy carried files (bundle parts, data, wheels) into /tmp/carry
#   trained_call.sh start SECONDS   install llm-compressor's wheels, start trained.sh in its own session (it outlives
#                                   the call), then as `wait`; the data and training stages need no vLLM
#   trained_call.sh install-vllm    join the bundle parts staged so far, install vLLM's bundle, and tell the waiting
#                                   pipeline (which needs it from the builds' post-processing on)
#   trained_call.sh probe-lmeval    say whether lm-eval (its wheels, LMEVAL_SITE) imports beside vLLM's site
#   trained_call.sh wait SECONDS    watch the pipeline until it ends or SECONDS pass, then bring back what is finished
#   trained_call.sh weights A B     bring back parts A..B of the seed-0 base and GPTQ build (for splicer tasks here)
# What comes back under $OUT: trained.tgz (results.json, tables, logs, train reports, builds.json, the run record) and
# one scores archive per results folder (per-position scores, for recomputing intervals here).
set -uo pipefail
cd "$(dirname "$0")/../.."
W=${W:-/tmp/trained}; OUT=${OUT:-/tmp/out}; mkdir -p /tmp/carry "$W" "$OUT"
VLLM_READY=/tmp/vllm_site/.splicer-installed  # trained.sh waits for this file
verb=${1:?stage, start or wait}; shift

collect() {
  if [ -f "$VLLM_READY" ]; then source scripts/gpu/env.sh; else pack_scores() { :; }; fi
  local list=()
  for f in pipeline.log nohup.log seed0/train.log seed1/train.log seed0/base/train_report.json seed1/base/train_report.json \
           seed0/builds-gptq.log seed1/builds-gptq.log seed0/builds-other.log seed0/builds-awq.log seed0/builds-keep-gdn.log \
           seed0/builds-keep-attention.log seed0/builds-keep-shared_expert.log sweep0.toml sweep1.toml seed-rows1.toml plan0.toml plan1.toml verify.txt \
           ablate0.log ablate1.log score0.log ablate-rtn.log plan-mtp.toml mtp-gptq.log mtp-rtn.log tasks-gptq.log tasks-rtn.log \
           teacher-forced-gptq.log teacher-forced-rtn.log tasks/cloze.yaml tasks/cloze.jsonl; do
    [ -f "$W/$f" ] && list+=("$f")
  done
  for d in ablate0 ablate1 score0 ablate-rtn; do
    for f in results.json table.md report.md job.json budget.json budget-plan.toml ablate.log cluster-scores.safetensors \
             speculative.json speculative.log mtp.log tasks.json tasks.log mtp-teacher-forced.json; do [ -f "$W/$d/$f" ] && list+=("$d/$f"); done
    for f in logs mtp-logs task-logs; do [ -d "$W/$d/$f" ] && list+=("$d/$f"); done
  done
  for b in "$W"/seed0/builds-keep-*.log; do [ -f "$b" ] && list+=("${b#$W/}"); done
  for b in "$W"/seed*/raw*/builds.json; do [ -f "$b" ] && list+=("${b#$W/}"); done
  for b in "$W"/seed*/inspect-*.json; do [ -f "$b" ] && list+=("${b#$W/}"); done
  for b in "$W"/seed*/*/config.json; do [ -f "$b" ] && list+=("${b#$W/}"); done
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import vllm, torch, transformers, compressed_tensors as ct; print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| compressed-tensors', ct.__version__)"
    PYTHONPATH=/tmp/lcsite python3 -c "import llmcompressor, compressed_tensors as ct; print('llm-compressor', llmcompressor.__version__, '| compressed-tensors (its site)', ct.__version__)"
    PYTHONPATH=/tmp/vllm_site:/tmp/lmeval_site python3 -c "import lm_eval, datasets; print('lm-eval', lm_eval.__version__, '| datasets', datasets.__version__)"
    nproc; free -g | head -2; ls "$W"/done.* 2>/dev/null
  } > "$W/machine.txt" 2>&1
  list+=(machine.txt)
  tar -C "$W" -czf "$OUT/trained.tgz" "${list[@]}" 2>/dev/null
  for d in ablate0 ablate1 score0 ablate-rtn; do [ -d "$W/$d/scores" ] && pack_scores "$OUT/scores-$d.tar.xz" "$W" "$d"; done
  ls -la "$OUT"
}

watch() {
  local until=$(( $(date +%s) + $1 )) last=""
  while [ "$(date +%s)" -lt "$until" ] && [ ! -f "$W/done.pipeline" ]; do
    sleep 10
    cur=$(tail -1 "$W/pipeline.log" 2>/dev/null); [ "$cur" != "$last" ] && echo "$cur" && last=$cur
  done
  tail -25 "$W/pipeline.log" 2>/dev/null
  for s in 0 1; do tail -2 "$W/seed$s/train.log" 2>/dev/null; done
  collect
}

case "$verb" in
  stage) for p in "$@"; do cp -r "$p" /tmp/carry/; done; ls -la /tmp/carry ;;
  start)
    if [ ! -d /tmp/lcsite/llmcompressor ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/lcsite /tmp/carry/.lcwhl/*.whl || exit 1
    fi
    # lm-eval for splicer tasks beside vLLM (trained.sh puts LMEVAL_SITE after vLLM's site): its wheels, and datasets
    # with its own two that the machine lacks, from llm-compressor's wheels (the same versions).
    if [ -d /tmp/carry/.lmwhl ] && [ ! -d /tmp/lmeval_site/lm_eval ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/lmeval_site /tmp/carry/.lmwhl/*.whl \
        /tmp/carry/.lcwhl/datasets-*.whl /tmp/carry/.lcwhl/multiprocess-*.whl || exit 1
    fi
    if [ ! -f "$W/pipeline.pid" ] || ! kill -0 "$(cat "$W/pipeline.pid")" 2>/dev/null; then
      setsid nohup bash scripts/gpu/trained.sh > "$W/nohup.log" 2>&1 < /dev/null & echo $! > "$W/pipeline.pid"
    fi
    watch "${1:-500}" ;;
  install-vllm)
    if [ ! -f "$VLLM_READY" ]; then
      mkdir -p /tmp/vb && cp /tmp/carry/bundle.part0* /tmp/vb/ && bash scripts/gpu/install_bundle.sh /tmp/vb .bundle/vb/SHA256SUMS || exit 1
      touch "$VLLM_READY"
    fi ;;
  probe-lmeval)
    # what trained.sh's task stage imports, beside vLLM's site: a missing package is said now, not after the builds
    PYTHONPATH=/tmp/vllm_site:$PWD:/tmp/lmeval_site python3 -c "import lm_eval, datasets, lm_eval.models.vllm_causallms
from lm_eval.tasks import TaskManager
print('lm-eval', lm_eval.__version__, 'imports beside vLLM; datasets', datasets.__version__)" 2>&1 | tail -3 ;;
  wait) watch "${1:-540}" ;;
  weights)
    # The seed-0 base and its GPTQ build, for what runs here on the CPU afterwards (splicer tasks): one tar in parts of
    # 15 MiB (a call brings back at most 8 files of 16 MiB); `weights FIRST LAST` brings back parts FIRST..LAST.
    if [ ! -f /tmp/weights/done ]; then
      mkdir -p /tmp/weights && tar -C "$W" -cf - seed0/base seed0/gptq-w4a16-g128 | split -b 15m -d -a 2 - /tmp/weights/weights.tar.part
      ( cd /tmp/weights && sha256sum weights.tar.part* > SHA256SUMS ) && touch /tmp/weights/done
    fi
    cp /tmp/weights/SHA256SUMS "$OUT/weights-SHA256SUMS"
    for i in $(seq -f %02g "${1:-0}" "${2:-6}"); do [ -f /tmp/weights/weights.tar.part$i ] && cp /tmp/weights/weights.tar.part$i "$OUT/"; done
    ls -la "$OUT" ;;
  *) echo "usage: trained_call.sh stage PATH... | start SECONDS | install-vllm | probe-lmeval | wait SECONDS | weights FIRST LAST"; exit 2 ;;
esac
