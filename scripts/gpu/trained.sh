#!/usr/bin/env bash
# On the GPU machine: the trained qwen3_5_moe end to end (issue 31), as resumable stages with a marker file each.
#   data -> train (seeds 0 and 1 at once) -> builds by llm-compressor in its own site (GPTQ both seeds, AWQ experts,
#   RTN g32, FP8 block, NVFP4A16 seed 0), the MTP head restored into any that dropped it -> then, at once on the one GPU
#   and none of it timed: seed 0's GPTQ build through the default rows plus one row per GDN layer, then the GPTQ builds
#   re-made with gdn, attention or shared_expert left in BF16 added to that folder (splice against re-quantize), then
#   budget --verify 3; seed 1's class rows and GDN layers; every seed-0 build scored against one base pass.
# Table, report and plot are made from what comes back (results.json and the per-position scores), on any machine.
# Started in the background (setsid) by `trained_call.sh start`, so it outlives one device call; later calls
# (`trained_call.sh wait`) watch it and bring back what is finished. Everything lives under W=/tmp/trained.
#
# Why nothing is timed: at about 2 ms a token this model's batch-1 decode is launch-bound and run 2 resolved no row's
# decode difference from the build's (results/trained-h200/), so the GPU is shared instead, which a timed row forbids.
# Engines that share the GPU get a fixed KV cache (vLLM's memory profiling assumes no other process allocates meanwhile)
# and Triton's first kernel configuration (no autotuning races between processes; starts are shorter too).
set -uo pipefail
cd "$(dirname "$0")/../.."
# BACKEND=torch TRAIN_ARGS="--recipe tiny --device cpu" LC_PY=PYTHON LC_SITE=: the same stages on a CPU box (a dry run).
BACKEND=${BACKEND:-vllm}
W=${W:-/tmp/trained}; mkdir -p "$W"
LC_SITE=${LC_SITE-/tmp/lcsite}
# The vLLM bundle may still be arriving while the data and training stages run (trained_call.sh installs it and then
# writes this file); those stages need only torch, transformers and compressed-tensors, which llm-compressor's site has.
VLLM_READY=${VLLM_READY:-/tmp/vllm_site/.splicer-installed}
export PYTHONPATH=$PWD${LC_SITE:+:$LC_SITE} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
TRAIN_S=${TRAIN_S:-300}
LOG="$W/pipeline.log"
stage() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
done_mark() { touch "$W/done.$1"; stage "done: $1"; }
is_done() { [ -f "$W/done.$1" ]; }
LC="env PYTHONPATH=${LC_SITE} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false ${LC_PY:-python3}"
DEVICE=cuda; ENGINE=(--backend torch --device cpu)

# From the builds' post-processing on, splicer runs beside vLLM 0.26 and the compressed-tensors 0.17 it pins.
vllm_env() {
  [ "$BACKEND" = vllm ] || return 0
  [ "${ENGINE[1]}" = vllm ] && return 0
  local t0=$SECONDS
  while [ ! -f "$VLLM_READY" ]; do
    [ $((SECONDS - t0)) -gt 1200 ] && { stage "no vLLM bundle after 20 minutes ($VLLM_READY)"; exit 1; }
    sleep 5
  done
  [ $((SECONDS - t0)) -gt 0 ] && stage "vLLM bundle ready after $((SECONDS - t0)) s of waiting"
  export PYTHONPATH=$PWD
  source scripts/gpu/env.sh
  ENGINE=(--backend vllm --language-model-only --gpu-memory-utilization 0.1 --engine-arg kv_cache_memory_bytes=$((4 << 30))
          --engine-env VLLM_TRITON_FORCE_FIRST_CONFIG=1
          --engine-arg "compilation_config=$(python3 -c 'import json,os; print(json.dumps(json.loads(os.environ["SPLICER_GPU_ENGINE_ARGS"])["compilation_config"]))')")
}
[ "$BACKEND" = vllm ] || DEVICE=cpu
DATA_TAR=${DATA_TAR:-/tmp/carry/trained-data.tar.xz}
PLAN=${PLAN:-ablations/trained-h200.toml}; GDN_GROUPS=${GDN_GROUPS:-6}
# Calibration samples of 512 tokens: GPTQ 256 took 206 s for both seeds at once; AWQ at 256 passed layer 5 of 8 only after
# 13 minutes (20 grid points of a few seconds per smoothed norm), so it takes fewer.
GPTQ_SAMPLES=${GPTQ_SAMPLES:-256}; AWQ_SAMPLES=${AWQ_SAMPLES:-64}
# Classes whose GPTQ build is re-made with the class left in BF16, scored beside the splice of that class.
# These two lists take their default only when unset: set to the empty string (`REQUANT_CLASSES=`) they mean none.
REQUANT_CLASSES=${REQUANT_CLASSES-gdn attention shared_expert}
# What runs (a shorter lease runs less; run 4: SEEDS=0 OTHER_BUILDS=rtn-g32-experts AWQ_BUILD=0 SCORE_BUILDS=0
# GDN_LAYERS=0 VERIFY=0): the training seeds (seed 0 carries every stage, seed 1 the class rows), seed 0's other builds,
# the all-builds score branch, one row per GDN layer in seed 0's plan, budget --verify, and the MTP stage.
SEEDS=${SEEDS:-0 1}
OTHER_BUILDS=${OTHER_BUILDS-rtn-g32-experts,fp8-block,nvfp4a16}
AWQ_BUILD=${AWQ_BUILD:-1}; SCORE_BUILDS=${SCORE_BUILDS:-1}; GDN_LAYERS=${GDN_LAYERS:-1}; VERIFY=${VERIFY:-1}
# MTP acceptance (splicer mtp), once every other branch has ended so that its engines are alone on the GPU and timed:
# seed 0's rows below, and the RTN g32 build (the one build that quantizes the drafter's experts) against its MTP
# head restored.
MTP=${MTP:-1}
MTP_ROWS0=${MTP_ROWS0:-build,gdn,attention,shared_expert,lm_head,all}
MTP_ARGS=${MTP_ARGS:---tokens 1,2 --prompts 5 --new-tokens 48}
# The RTN build's MTP rows count acceptance only (no decode timing), so they run beside the other branches instead of
# after them: acceptance is a count of greedy tokens, which another process on the GPU does not change.
MTP_RTN_ARGS=${MTP_RTN_ARGS:-$MTP_ARGS --no-time}
# The teacher-forced acceptance estimate (splicer mtp --teacher-forced: the torch reference's MTP head over each row's
# scored text), on every row the engine's MTP stage measures, for how well the cheap estimate agrees with the engine.
TEACHER_FORCED=${TEACHER_FORCED:-1}; TF_ROWS0=${TF_ROWS0:-build,lm_head,gdn,attention,shared_expert,experts-only,all}
# Task accuracy (splicer tasks through lm-eval's VLLM model, DIR's engine arguments): multiple-choice cloze items cut
# from the English held-out text, on every finished row of seed 0's folders. lm-eval travels as wheels
# (trained_call.sh start installs them into LMEVAL_SITE).
TASKS=${TASKS:-1}; TASK_ITEMS=${TASK_ITEMS:-1000}
LMEVAL_SITE=${LMEVAL_SITE-/tmp/lmeval_site}
has_seed() { case " $SEEDS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
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
  stage "train: seeds ${SEEDS} at once, ${TRAIN_S} s each"
  for s in $SEEDS; do
    rm -rf "$W/seed$s/base"; mkdir -p "$W/seed$s"
    TOKENIZERS_PARALLELISM=true python3 -m splicer.trained.train "$D" "$W/seed$s/base" --seed $s --max-seconds "$TRAIN_S" ${TRAIN_ARGS:-} > "$W/seed$s/train.log" 2>&1 &
  done
  wait
  for s in $SEEDS; do
    tail -2 "$W/seed$s/train.log" | tee -a "$LOG"
    [ -f "$W/seed$s/base/config.json" ] || { stage "train failed (seed $s)"; exit 1; }
  done
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
  case "$name" in base|raw|raw-*|splice-*) return 0 ;; esac
  python3 -m splicer inspect "$b" --base "$W/seed$s/base" --json > "$W/seed$s/inspect-$name.json" 2>> "$LOG" || stage "inspect failed for seed$s/$name"
}

# build_in_background SEED OUT NAME BUILDS [SAMPLES]: one llm-compressor process, logging to seedS/NAME.log, its pid in
# $W/pid.seedS.NAME.
build_in_background() {
  local s=$1 out=$2 name=$3 builds=$4 samples=${5:-}
  rm -rf "$out"
  $LC scripts/gpu/trained_builds.py "$W/seed$s/base" "$D/calib.jsonl" "$out" --builds "$builds" ${samples:+--samples "$samples"} \
    --device $DEVICE > "$W/seed$s/$name.log" 2>&1 &
  echo $! > "$W/pid.seed$s.$name"
}

# finish_build SEED NAME RAWDIR: wait for a background build, then make each build in RAWDIR the build as shipped
# (seedS/BUILD), and inspect it against the base.
finish_build() {
  local s=$1 name=$2 raw=$3 pidfile="$W/pid.seed$1.$2" b
  if [ -f "$pidfile" ]; then
    while kill -0 "$(cat "$pidfile")" 2>/dev/null; do sleep 5; done
    rm -f "$pidfile"
  fi
  tail -n 1 "$W/seed$s/$name.log" 2>/dev/null | tee -a "$LOG"
  vllm_env
  for b in "$raw"/*/; do
    [ -d "$b" ] || continue
    [ -d "$W/seed$s/$(basename "$b")" ] || restore_mtp "$s" "${b%/}"
    inspect_vs_base "$s" "$W/seed$s/$(basename "$b")"
  done
}

# The GPTQ build re-made with one class left in BF16, per class, for the splice-against-re-quantize rows.
start_requant_builds() {
  local c
  for c in $REQUANT_CLASSES; do
    [ -d "$W/seed0/gptq-w4a16-g128-keep-$c" ] || [ -f "$W/pid.seed0.builds-keep-$c" ] \
      || build_in_background 0 "$W/seed0/raw-keep-$c" "builds-keep-$c" "gptq-w4a16-g128-keep-$c" "$GPTQ_SAMPLES"
  done
}

if ! is_done builds; then
  stage "builds: llm-compressor GPTQ (seeds $SEEDS), re-made without $REQUANT_CLASSES, $OTHER_BUILDS$([ "$AWQ_BUILD" = 1 ] && echo ", AWQ experts") (seed 0)"
  for s in $SEEDS; do build_in_background "$s" "$W/seed$s/raw" builds-gptq gptq-w4a16-g128 "$GPTQ_SAMPLES"; done
  # The re-made GPTQ builds start now too: ablate_seed0 waits for them only after its own rows.
  start_requant_builds
  [ -n "$OTHER_BUILDS" ] && build_in_background 0 "$W/seed0/raw-other" builds-other "$OTHER_BUILDS"
  [ "$AWQ_BUILD" = 1 ] && { [ -d "$W/seed0/awq-experts" ] || build_in_background 0 "$W/seed0/raw-awq" builds-awq awq-experts "$AWQ_SAMPLES"; }
  for s in $SEEDS; do
    finish_build "$s" builds-gptq "$W/seed$s/raw"
    [ -f "$W/seed$s/gptq-w4a16-g128/config.json" ] || { stage "GPTQ build failed (seed $s)"; exit 1; }
  done
  done_mark builds
fi
vllm_env

G=$W/seed0/gptq-w4a16-g128
# Each branch below runs in the background; a failed branch leaves the others their time.
ablate_seed0() {
  local c adds=()
  start_requant_builds  # a resumed pipeline whose builds stage was done before these builds existed
  if ! is_done ablate0; then
    if [ ! -f "$W/plan0.toml" ] && [ "$GDN_LAYERS" = 1 ]; then
      stage "ablate: seed 0 GPTQ build, default rows + one row per GDN layer"
      rm -f "$W/sweep0.toml"
      python3 -m splicer plan sweep "$G" --class gdn --groups "$GDN_GROUPS" --from "$PLAN" -o "$W/sweep0.toml" >> "$LOG" 2>&1
      python3 -m splicer.trained.plans gdn-layers "$PLAN" "$W/sweep0.toml" "$W/plan0.toml" || return 1
    elif [ ! -f "$W/plan0.toml" ]; then
      stage "ablate: seed 0 GPTQ build, the single-class rows"
      python3 -m splicer.trained.plans seed-rows "$PLAN" "$W/plan0.toml" || return 1
    fi
    python3 -m splicer ablate all "$G" "$W/seed0/base" -o "$W/ablate0" --plan "$W/plan0.toml" "${CORPORA[@]}" "${ENGINE[@]}" \
      --bandwidth-gbs 4800 --no-time ${ABLATE_ARGS:-} -q > "$W/ablate0.log" 2>&1 && done_mark ablate0 \
      || { stage "ablate0 exit $?"; tail -5 "$W/ablate0.log" | tee -a "$LOG"; return 1; }
  fi
  if ! is_done requant; then
    stage "waiting for the GPTQ builds re-made without $REQUANT_CLASSES"
    for c in $REQUANT_CLASSES; do
      finish_build 0 "builds-keep-$c" "$W/seed0/raw-keep-$c"
      [ -d "$W/seed0/gptq-w4a16-g128-keep-$c" ] && adds+=(--add-requantized "${c//+/,}=$W/seed0/gptq-w4a16-g128-keep-$c")
    done
    # The same job with the re-made builds added: only their rows run, each paired with the splice row of its class.
    # Before the verification, since a plain rerun keeps only the plan's own rows and the ones added now.
    stage "ablate: seed 0, splice against re-quantize ($(( ${#adds[@]} / 2 )) re-made builds)"
    python3 -m splicer ablate all "$G" "$W/seed0/base" -o "$W/ablate0" --plan "$W/plan0.toml" "${CORPORA[@]}" "${ENGINE[@]}" \
      --bandwidth-gbs 4800 --no-time "${adds[@]}" ${ABLATE_ARGS:-} -q >> "$W/ablate0.log" 2>&1 && done_mark requant \
      || { stage "requant exit $?"; tail -5 "$W/ablate0.log" | tee -a "$LOG"; }
  fi
  if [ "$VERIFY" = 1 ] && ! is_done verify; then
    stage "budget --verify 3 on seed 0's ablate folder"
    python3 -m splicer budget "$W/ablate0" --verify 3 -q > "$W/verify.txt" 2>&1 && done_mark verify \
      || { stage "verify exit $?"; tail -5 "$W/verify.txt" | tee -a "$LOG"; }
  fi
  tasks_stage ablate0 gptq
  teacher_forced_stage ablate0 "$TF_ROWS0" gptq
}

# tasks_stage DIR NAME: lm-eval's cloze items through every finished row of DIR (one command per folder at a time:
# each stage holds DIR's lock while it writes there).
tasks_stage() {
  local dir=$1 name=$2
  [ "$TASKS" = 1 ] || return 0
  is_done "tasks-$name" && return 0
  # the task's YAML names its items by absolute path, so they are made where they stay (the maker writes both or none)
  if [ ! -f "$W/tasks/cloze.yaml" ]; then
    python3 -m splicer.tasks.cloze "$D/heldout/en-dict.txt" "$D/heldout/en-kernel.txt" "$D/heldout/en-python.txt" \
      -o "$W/tasks" --items "$TASK_ITEMS" >> "$LOG" 2>&1 || { stage "cloze items could not be made"; return 1; }
  fi
  stage "tasks: $dir, cloze items through lm-eval"
  PYTHONPATH=$PYTHONPATH${LMEVAL_SITE:+:$LMEVAL_SITE} HF_DATASETS_OFFLINE=1 \
    python3 -m splicer tasks "$W/$dir" --tasks cloze --include-path "$W/tasks" -q > "$W/tasks-$name.log" 2>&1 \
    && done_mark "tasks-$name" || { stage "tasks $name exit $?"; tail -5 "$W/tasks-$name.log" | tee -a "$LOG"; }
}

# teacher_forced_stage DIR ROWS NAME: the torch reference's MTP head over DIR's scored text, on the GPU beside the
# other branches (nothing of it is timed).
teacher_forced_stage() {
  local dir=$1 rows=$2 name=$3
  [ "$TEACHER_FORCED" = 1 ] || return 0
  is_done "teacher-forced-$name" && return 0
  rows=$(finished_rows "$dir" "$rows")
  stage "mtp --teacher-forced: $dir rows $rows"
  python3 -m splicer mtp "$W/$dir" --teacher-forced --rows "$rows" --device $DEVICE -q > "$W/teacher-forced-$name.log" 2>&1 \
    && done_mark "teacher-forced-$name" || { stage "teacher-forced $name exit $?"; tail -5 "$W/teacher-forced-$name.log" | tee -a "$LOG"; }
}

# finished_rows DIR ROWS: those of the comma list ROWS that DIR finished (a row that failed is left out, not the stage)
finished_rows() {
  python3 -c "import json,sys; ok={v['name'] for v in json.load(open(sys.argv[1]))['variants'] if v.get('status')=='ok'}
print(','.join(r for r in sys.argv[2].split(',') if r in ok))" "$W/$1/results.json" "$2"
}

ablate_seed1() {
  is_done ablate1 && return 0
  has_seed 1 || return 0
  stage "ablate: seed 1 GPTQ build, class rows + one row per GDN layer"
  if [ ! -f "$W/plan1.toml" ]; then
    rm -f "$W/sweep1.toml"
    python3 -m splicer.trained.plans seed-rows "$PLAN" "$W/seed-rows1.toml" || return 1
    python3 -m splicer plan sweep "$W/seed1/gptq-w4a16-g128" --class gdn --groups "$GDN_GROUPS" --from "$PLAN" -o "$W/sweep1.toml" >> "$LOG" 2>&1
    python3 -m splicer.trained.plans gdn-layers "$W/seed-rows1.toml" "$W/sweep1.toml" "$W/plan1.toml" || return 1
  fi
  python3 -m splicer ablate all "$W/seed1/gptq-w4a16-g128" "$W/seed1/base" -o "$W/ablate1" --plan "$W/plan1.toml" \
    "${CORPORA[@]}" "${ENGINE[@]}" --no-time -q > "$W/ablate1.log" 2>&1 && done_mark ablate1 \
    || { stage "ablate1 exit $?"; tail -5 "$W/ablate1.log" | tee -a "$LOG"; return 1; }
}

score_seed0() {
  is_done score && return 0
  [ "$SCORE_BUILDS" = 1 ] || return 0
  stage "waiting for the model_free_ptq builds"
  finish_build 0 builds-other "$W/seed0/raw-other"
  # The AWQ build (a grid search per smoothed norm: 743 s in run 3, the longest build) is scored last, by a second
  # invocation on the same folder that runs only its row, so the other rows need not wait for it.
  score_builds || return 1
  stage "waiting for the AWQ build"
  finish_build 0 builds-awq "$W/seed0/raw-awq"
  score_builds && done_mark score
}

# score_builds: every seed-0 build made so far against one base pass, untimed; the GPTQ build first (the table's
# reference row). A second call adds what is new.
score_builds() {
  local builds=("$G") b
  for b in rtn-g32-experts fp8-block nvfp4a16 awq-experts; do [ -d "$W/seed0/$b" ] && builds+=("$W/seed0/$b"); done
  stage "score: ${#builds[@]} seed-0 builds against one base pass"
  python3 -m splicer score "$W/seed0/base" "${builds[@]}" -o "$W/score0" --plan "$PLAN" "${CORPORA[@]}" \
    "${ENGINE[@]}" --no-time -q >> "$W/score0.log" 2>&1 || { stage "score exit $?"; tail -5 "$W/score0.log" | tee -a "$LOG"; return 1; }
}

# The RTN g32 build, which quantizes the MTP head's experts, scored with its MTP head restored (restoring it changes
# no score), for splicer mtp.
ablate_rtn_mtp() {
  [ "$MTP" = 1 ] || return 0
  case ",$OTHER_BUILDS," in *,rtn-g32-experts,*) ;; *) return 0 ;; esac
  if ! is_done ablate-rtn; then
    [ "$SCORE_BUILDS" = 1 ] || finish_build 0 builds-other "$W/seed0/raw-other"
    [ -d "$W/seed0/rtn-g32-experts" ] || { stage "no RTN g32 build for the MTP rows"; return 1; }
    [ -f "$W/plan-mtp.toml" ] || python3 -m splicer.trained.plans mtp-rows "$PLAN" "$W/plan-mtp.toml" || return 1
    stage "ablate: seed 0 RTN g32 experts build and its MTP head restored"
    python3 -m splicer ablate all "$W/seed0/rtn-g32-experts" "$W/seed0/base" -o "$W/ablate-rtn" --plan "$W/plan-mtp.toml" \
      "${CORPORA[@]}" "${ENGINE[@]}" --no-time -q > "$W/ablate-rtn.log" 2>&1 && done_mark ablate-rtn \
      || { stage "ablate-rtn exit $?"; tail -5 "$W/ablate-rtn.log" | tee -a "$LOG"; return 1; }
  fi
  # acceptance of the build's INT4 drafter against its drafter restored: counted here, beside the other branches
  mtp_stage ablate-rtn build,mtp rtn "$MTP_RTN_ARGS"
  teacher_forced_stage ablate-rtn build,mtp rtn
  tasks_stage ablate-rtn rtn
}

# mtp_stage DIR ROWS NAME [ARGS]: splicer mtp on those of ROWS that DIR finished (a re-made build that failed is left
# out, not the whole stage).
mtp_stage() {
  local dir=$1 rows=$2 name=$3 args=${4:-$MTP_ARGS}
  [ "$MTP" = 1 ] || return 0
  is_done "mtp-$name" && return 0
  [ -f "$W/$dir/results.json" ] || { stage "no $dir for MTP acceptance"; return 1; }
  rows=$(finished_rows "$dir" "$rows")
  stage "mtp: $dir rows $rows ($args)"
  python3 -m splicer mtp "$W/$dir" --rows "$rows" $args -q > "$W/mtp-$name.log" 2>&1 && done_mark "mtp-$name" \
    || { stage "mtp $name exit $?"; tail -5 "$W/mtp-$name.log" | tee -a "$LOG"; }
}

ablate_seed0 & p0=$!
ablate_seed1 & p1=$!
score_seed0 & p2=$!
ablate_rtn_mtp & p3=$!
wait $p0 $p1 $p2 $p3

# MTP acceptance of seed 0's GPTQ rows: every engine alone on the GPU now, timed with and without the drafter.
mtp_stage ablate0 "$MTP_ROWS0" gptq
stage "pipeline ended"
touch "$W/done.pipeline"
