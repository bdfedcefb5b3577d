#!/usr/bin/env bash
# On the GPU machine: the trained qwen3_5_moe end to end (issue 31), as resumable stages with a marker file each.
#   data -> train (seeds 0 and 1 at once) -> builds by llm-compressor in its own site (GPTQ both seeds; RTN g32, FP8
#   block, NVFP4A16 seed 0), the MTP head restored into any that dropped it -> ablate seed 0's GPTQ build (default rows
#   + one row per GDN layer; timed, alone on the GPU) -> budget --verify 3 (timed) -> seed 1's class rows (untimed) beside
#   the AWQ build and the GPTQ builds re-made with gdn, attention or shared_expert left in BF16 -> every seed-0 build,
#   and the splice of each of those classes, scored against one base pass (untimed). Table, report and plot are made from
#   what comes back (results.json and the per-position scores), on any machine.
# Started in the background (setsid) by `trained_call.sh start`, so it outlives one device call; later calls
# (`trained_call.sh wait`) watch it and bring back what is finished. Everything lives under W=/tmp/trained.
set -uo pipefail
cd "$(dirname "$0")/../.."
# BACKEND=torch TRAIN_ARGS="--recipe tiny --device cpu" LC_PY=PYTHON: the same stages on a CPU box (a dry run of the script).
BACKEND=${BACKEND:-vllm}
if [ "$BACKEND" = vllm ]; then source scripts/gpu/env.sh; else export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; fi
W=${W:-/tmp/trained}; mkdir -p "$W"
TRAIN_S=${TRAIN_S:-300}
LOG="$W/pipeline.log"
stage() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
done_mark() { touch "$W/done.$1"; stage "done: $1"; }
is_done() { [ -f "$W/done.$1" ]; }
LC="env PYTHONPATH=${LC_SITE-/tmp/lcsite} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false ${LC_PY:-python3}"
DEVICE=cuda; ENGINE=(--backend torch --device cpu)
if [ "$BACKEND" = vllm ]; then
  ENGINE=(--backend vllm --gpu-memory-utilization 0.3 --language-model-only
          --engine-arg "compilation_config=$(python3 -c 'import json,os; print(json.dumps(json.loads(os.environ["SPLICER_GPU_ENGINE_ARGS"])["compilation_config"]))')")
else DEVICE=cpu; fi
DATA_TAR=${DATA_TAR:-/tmp/carry/trained-data.tar.xz}
PLAN=${PLAN:-ablations/trained-h200.toml}; GDN_GROUPS=${GDN_GROUPS:-6}
# Calibration samples of 512 tokens: GPTQ 256 took 206 s for both seeds at once; AWQ at 256 passed layer 5 of 8 only after
# 13 minutes (20 grid points of a few seconds per smoothed norm), so it takes fewer.
GPTQ_SAMPLES=${GPTQ_SAMPLES:-256}; AWQ_SAMPLES=${AWQ_SAMPLES:-64}
# Classes whose GPTQ build is re-made with the class left in BF16, scored beside the splice of that class.
REQUANT_CLASSES=${REQUANT_CLASSES:-gdn attention shared_expert}
D="$W/trained-data"
CORPORA=()
for c in en-dict en-kernel en-python zh chat; do CORPORA+=(--corpus "$c=$D/heldout/$c.txt"); done

if ! is_done data; then
  stage "data: unpack"
  tar -C "$W" -xJf "$DATA_TAR" || exit 1
  # The held-out chat conversations as one text, so they chunk like the other corpora.
  python3 -c "import json,sys; open(sys.argv[2],'w').write('\n'.join(json.loads(l)['text'] for l in open(sys.argv[1]) if l.strip()))" \
    "$D/heldout/chat.jsonl" "$D/heldout/chat.txt" || exit 1
  done_mark data
fi

if ! is_done train; then
  stage "train: seeds 0 and 1 at once, ${TRAIN_S} s each"
  for s in 0 1; do
    rm -rf "$W/seed$s/base"; mkdir -p "$W/seed$s"
    TOKENIZERS_PARALLELISM=true python3 -m splicer.trained.train "$D" "$W/seed$s/base" --seed $s --max-seconds "$TRAIN_S" ${TRAIN_ARGS:-} > "$W/seed$s/train.log" 2>&1 &
  done
  wait
  for s in 0 1; do tail -2 "$W/seed$s/train.log" | tee -a "$LOG"; done
  [ -f "$W/seed0/base/config.json" ] && [ -f "$W/seed1/base/config.json" ] || { stage "train failed"; exit 1; }
  done_mark train
fi

# restore_mtp SEED RAW NAME: the build as a publisher ships it. A build that dropped the MTP head gets it back in BF16
# from its base by splice (seed 000's fix-up); one that kept it (llm-compressor 0.14 copies it) is used as written.
restore_mtp() {
  local s=$1 b=$2 name; name=$(basename "$b")
  [ -f "$b/config.json" ] || { stage "no build at $b"; return 1; }
  if python3 -c "import sys,glob
from safetensors import safe_open
sys.exit(0 if any(k.startswith('mtp.') for f in glob.glob(sys.argv[1]+'/*.safetensors') for k in safe_open(f,'pt').keys()) else 1)" "$b"; then
    cp -r "$b" "$W/seed$s/$name"
  else
    python3 -m splicer splice --restore mtp "$b" "$W/seed$s/base" -o "$W/seed$s/$name" -q >> "$LOG" 2>&1 || stage "splice --restore mtp failed for seed$s/$name"
  fi
}

# inspect_vs_base SEED BUILD: what the build quantizes, and which of its unquantized tensors differ from the base.
inspect_vs_base() {
  local s=$1 b=$2 name; name=$(basename "$b")
  case "$name" in base|raw|raw-*) return 0 ;; esac
  python3 -m splicer inspect "$b" --base "$W/seed$s/base" --json > "$W/seed$s/inspect-$name.json" 2>> "$LOG" || stage "inspect failed for seed$s/$name"
}

if ! is_done builds; then
  stage "builds: llm-compressor GPTQ (both seeds), RTN g32, FP8 block, NVFP4A16 (seed 0); AWQ comes later, beside untimed work"
  rm -rf "$W/seed0/raw" "$W/seed1/raw" "$W/seed0/raw-other"
  $LC scripts/gpu/trained_builds.py "$W/seed0/base" "$D/calib.jsonl" "$W/seed0/raw" --builds gptq-w4a16-g128 --samples "$GPTQ_SAMPLES" --device $DEVICE > "$W/seed0/builds-gptq.log" 2>&1 &
  $LC scripts/gpu/trained_builds.py "$W/seed1/base" "$D/calib.jsonl" "$W/seed1/raw" --builds gptq-w4a16-g128 --samples "$GPTQ_SAMPLES" --device $DEVICE > "$W/seed1/builds-gptq.log" 2>&1 &
  $LC scripts/gpu/trained_builds.py "$W/seed0/base" "$D/calib.jsonl" "$W/seed0/raw-other" --builds rtn-g32-experts,fp8-block,nvfp4a16 --device $DEVICE > "$W/seed0/builds-other.log" 2>&1 &
  wait
  tail -n 2 "$W"/seed*/builds-*.log | tee -a "$LOG"
  for s in 0 1; do for b in "$W/seed$s"/raw/*/ "$W/seed$s"/raw-other/*/; do [ -d "$b" ] && restore_mtp $s "${b%/}"; done; done
  for s in 0 1; do for b in "$W/seed$s"/*/; do inspect_vs_base $s "${b%/}"; done; done
  ls -d "$W"/seed*/*/ | tee -a "$LOG"
  done_mark builds
fi

# The builds that run beside untimed work: AWQ (the slowest: a grid search per smoothed norm) and the GPTQ build re-made
# with one class left in BF16, per class (splice against re-quantize). Each leaves a pid file the score stage waits on.
start_side_builds() {
  if [ ! -d "$W/seed0/awq-experts" ] && [ ! -f "$W/awq.pid" ]; then
    rm -rf "$W/seed0/raw-awq"
    $LC scripts/gpu/trained_builds.py "$W/seed0/base" "$D/calib.jsonl" "$W/seed0/raw-awq" --builds awq-experts --samples "$AWQ_SAMPLES" --device $DEVICE > "$W/seed0/builds-awq.log" 2>&1 &
    echo $! > "$W/awq.pid"
  fi
  for c in $REQUANT_CLASSES; do
    { [ -d "$W/seed0/gptq-w4a16-g128-keep-$c" ] || [ -f "$W/keep-$c.pid" ]; } && continue
    rm -rf "$W/seed0/raw-keep-$c"
    $LC scripts/gpu/trained_builds.py "$W/seed0/base" "$D/calib.jsonl" "$W/seed0/raw-keep-$c" --builds "gptq-w4a16-g128-keep-$c" \
      --samples "$GPTQ_SAMPLES" --device $DEVICE > "$W/seed0/builds-keep-$c.log" 2>&1 &
    echo $! > "$W/keep-$c.pid"
  done
}

G=$W/seed0/gptq-w4a16-g128
# UNTIMED=1: no decode timing anywhere (seed 0's rows and the verification too), so the side builds start at once.
UNTIMED=${UNTIMED:-0}; TIME_ARGS=()
if [ "$UNTIMED" = 1 ]; then TIME_ARGS=(--no-time); start_side_builds; fi
if ! is_done ablate0; then
  stage "ablate: seed 0 GPTQ build, default rows + one row per GDN layer (timed alone on the GPU unless UNTIMED=1)"
  if [ ! -f "$W/plan0.toml" ]; then
    rm -f "$W/sweep.toml"
    python3 -m splicer plan sweep "$G" --class gdn --groups "$GDN_GROUPS" --from "$PLAN" -o "$W/sweep.toml" >> "$LOG" 2>&1
    python3 -m splicer.trained.plans gdn-layers "$PLAN" "$W/sweep.toml" "$W/plan0.toml" || exit 1
  fi
  python3 -m splicer ablate all "$G" "$W/seed0/base" -o "$W/ablate0" --plan "$W/plan0.toml" "${CORPORA[@]}" "${ENGINE[@]}" \
    --bandwidth-gbs 4800 "${TIME_ARGS[@]}" ${ABLATE_ARGS:-} -q > "$W/ablate0.log" 2>&1 && done_mark ablate0 || { stage "ablate0 exit $?"; tail -5 "$W/ablate0.log" | tee -a "$LOG"; }
fi

if is_done ablate0 && ! is_done verify; then
  stage "budget --verify 3 on seed 0's ablate folder (timed alone on the GPU unless UNTIMED=1)"
  python3 -m splicer budget "$W/ablate0" --verify 3 -q > "$W/verify.txt" 2>&1 && done_mark verify || { stage "verify exit $?"; tail -5 "$W/verify.txt" | tee -a "$LOG"; }
fi

# Later stages do not wait on earlier ones succeeding: a failed timed stage still leaves the untimed ones their time.
if ! is_done ablate1; then
  start_side_builds  # nothing is timed from here on
  stage "ablate: seed 1 GPTQ build, class rows, no timing"
  python3 -m splicer.trained.plans seed-rows "$PLAN" "$W/plan1.toml.new" && mv "$W/plan1.toml.new" "$W/plan1.toml"
  python3 -m splicer ablate all "$W/seed1/gptq-w4a16-g128" "$W/seed1/base" -o "$W/ablate1" --plan "$W/plan1.toml" \
    "${CORPORA[@]}" "${ENGINE[@]}" --no-time -q > "$W/ablate1.log" 2>&1 && done_mark ablate1 || { stage "ablate1 exit $?"; tail -5 "$W/ablate1.log" | tee -a "$LOG"; }
fi

if ! is_done score; then
  if [ -f "$W/awq.pid" ]; then
    stage "waiting for the AWQ build"
    while kill -0 "$(cat "$W/awq.pid")" 2>/dev/null; do sleep 5; done
    tail -n 2 "$W/seed0/builds-awq.log" | tee -a "$LOG"
    [ -d "$W/seed0/raw-awq/awq-experts" ] && restore_mtp 0 "$W/seed0/raw-awq/awq-experts"
    [ -d "$W/seed0/awq-experts" ] && inspect_vs_base 0 "$W/seed0/awq-experts"
    rm -f "$W/awq.pid"
  fi
  for c in $REQUANT_CLASSES; do
    if [ -f "$W/keep-$c.pid" ]; then
      stage "waiting for the GPTQ build without $c"
      while kill -0 "$(cat "$W/keep-$c.pid")" 2>/dev/null; do sleep 5; done
      tail -n 1 "$W/seed0/builds-keep-$c.log" | tee -a "$LOG"
      b="$W/seed0/raw-keep-$c/gptq-w4a16-g128-keep-$c"
      [ -d "$b" ] && restore_mtp 0 "$b" && inspect_vs_base 0 "$W/seed0/gptq-w4a16-g128-keep-$c"
      rm -f "$W/keep-$c.pid"
    fi
    # The splice of the same class into the GPTQ build, scored beside the re-made build on the same positions.
    [ -d "$W/seed0/splice-$c" ] || python3 -m splicer splice --restore "$c" "$G" "$W/seed0/base" -o "$W/seed0/splice-$c" -q >> "$LOG" 2>&1 \
      || stage "splice --restore $c failed"
  done
  stage "score: every seed-0 build against one base pass (no timing)"
  builds=()
  for b in gptq-w4a16-g128 awq-experts rtn-g32-experts fp8-block nvfp4a16; do [ -d "$W/seed0/$b" ] && builds+=("$W/seed0/$b"); done
  for c in $REQUANT_CLASSES; do for b in "splice-$c" "gptq-w4a16-g128-keep-$c"; do [ -d "$W/seed0/$b" ] && builds+=("$W/seed0/$b"); done; done
  python3 -m splicer score "$W/seed0/base" "${builds[@]}" -o "$W/score0" --plan "$PLAN" "${CORPORA[@]}" \
    "${ENGINE[@]}" --no-time -q > "$W/score0.log" 2>&1 && done_mark score || { stage "score exit $?"; tail -5 "$W/score0.log" | tee -a "$LOG"; }
fi
stage "pipeline ended"
touch "$W/done.pipeline"
