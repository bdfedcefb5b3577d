#!/usr/bin/env bash
# On the GPU machine, after install_bundle.sh: the Qwen3.6-35B-A3B-shaped stand-in and `splicer ablate all` on it with
# the vLLM backend under vLLM's default engine settings (torch.compile on, FULL_AND_PIECEWISE CUDA graphs), except that
# CUDA graphs are captured for batch sizes 1-32 only instead of vLLM's 51 sizes up to 512: batch-1 decode replays the
# size-1 graph either way, and the scoring and timing prefills are longer than 512 tokens, so no measured figure
# changes, while every engine start saves the capture of ~90 graphs.
# Resumable: call it again on the same machine and it keeps the pair, the finished rows, the base pass and the caches.
# BUDGET_S: the ablate is interrupted after this many seconds of the call (one device call may run 600 s), so that
# what is finished comes back under $OUT; the next call continues.
set -uo pipefail
source scripts/gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/fulldims}; BUDGET_S=${BUDGET_S:-540}
RUN=${RUN:-run}   # results folder under WORK; OVERLAP=N adds --overlap-starts N (use another RUN to compare)
ROWS=${ROWS:-all}  # or a comma list of the plan's rows (the build and its repeat rows always run)
t0=$(date +%s)
mkdir -p "$WORK"
if [ ! -f "$WORK/pair/reference/config.json" ]; then
  python3 -m splicer fixture "$WORK/pair" --full-dims 2>&1 | tail -4 | tee "$WORK/$RUN-standin.log"
fi
# The card: its memory bandwidth for the decode floor column (vendor datasheets: H200 4.8 TB/s, H100 SXM 3.35 TB/s),
# and PRECOMPILE=auto as many compiling processes as fit beside the base pass's engine (half the card): each holds the
# variant's dummy weights (~20 GiB) and a fixed 12 GiB KV cache, so three fit an H200's 141 GB and one an H100's 80 GB.
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
# Other cards: set BANDWIDTH_GBS (the column is a floor, and a wrong bandwidth moves it).
case "$GPU_NAME" in *H100*) BW=${BANDWIDTH_GBS:-3350} ;; *) BW=${BANDWIDTH_GBS:-4800} ;; esac
if [ "${PRECOMPILE:-0}" = auto ]; then
  if ! [[ "$GPU_MIB" =~ ^[0-9]+$ ]]; then echo "PRECOMPILE=auto: nvidia-smi gave no memory size ($GPU_MIB): set PRECOMPILE=N"; exit 2; fi
  if [ "$GPU_MIB" -ge 120000 ]; then PRECOMPILE=3; else PRECOMPILE=1; fi
fi
echo "card: $GPU_NAME, $GPU_MIB MiB; --bandwidth-gbs $BW; PRECOMPILE=${PRECOMPILE:-0}"
D="$WORK/$RUN-disk.txt"
du -sh --apparent-size "$WORK/pair/build" "$WORK/pair/reference" > "$D" 2>&1; du -sh "$WORK" >> "$D"; df -h "$WORK" >> "$D"
CMD=(python3 -m splicer ablate "$ROWS" "$WORK/pair/build" "$WORK/pair/reference" -o "$WORK/$RUN" --plan h200-fulldims
     --backend vllm --allow-quantized-base --language-model-only --bandwidth-gbs "$BW" -q
     --engine-arg 'compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]}')
# Without overlap one engine has the GPU and half of it is enough; with overlap each engine gets a fixed KV cache.
if [ "${OVERLAP:-0}" -gt 0 ]; then CMD+=(--overlap-starts "$OVERLAP"); else CMD+=(--gpu-memory-utilization 0.5); fi
# PRECOMPILE=N: every variant's engine compiled ahead in N processes while the base pass runs; rows stay serial.
if [ "${PRECOMPILE:-0}" -gt 0 ]; then CMD+=(--precompile "$PRECOMPILE"); fi
# GPUS=0,1: the rows spread over these GPUs (--gpus), each timing the build first and last; PRECOMPILE's processes are
# spread over them too.
if [ -n "${GPUS:-}" ]; then CMD+=(--gpus "$GPUS"); fi
# MTLOAD=1: vLLM's multithreaded weight loading (8 threads; weight loading was about half of each engine start in run 10).
if [ "${MTLOAD:-0}" = 1 ]; then CMD+=(--engine-arg 'model_loader_extra_config={"enable_multithread_load": true, "num_threads": 8}'); fi
# NOAUTOTUNE=1: Triton autotuning off in every engine (vLLM's VLLM_TRITON_FORCE_FIRST_CONFIG: first valid config). A
# cold engine spent 121.5 to 157 s of its start in the profiling run autotuning the GDN prefill kernels (runs 8 and 10);
# vLLM 0.26's GDN decode path (causal_conv1d_update, the packed fused recurrent and fused sigmoid-gating kernels) has no
# autotuned kernel, so batch-1 decode should run the same kernels; TTFT and scoring speed run the untuned prefill ones.
if [ "${NOAUTOTUNE:-0}" = 1 ]; then CMD+=(--engine-env VLLM_TRITON_FORCE_FIRST_CONFIG=1); fi
# EXPERT_CACHE=1: --expert-cache under WORK (the first engine saves the routed experts, ~18 GB; every engine with the
# same expert bytes copies them: results/engine-starts). Removed with the run folder's other scratch by hand.
if [ "${EXPERT_CACHE:-0}" = 1 ]; then CMD+=(--expert-cache "$WORK/expert-cache"); fi
# REWAKE=1: one more sleep and wake right before each decode timing (with OVERLAP only).
if [ "${REWAKE:-0}" = 1 ]; then CMD+=(--rewake-before-timing); fi
# GPU use every 5 s beside the run (outside DIR: ablate refuses a DIR holding files it did not write).
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,clocks.sm --format=csv -l 5 > "$WORK/gpu-$RUN.csv" 2>&1 &
smi=$!
# A device call ends at 600 s: the budget, the 30 s given to a clean stop and the packaging below must fit (run 10's
# first call, BUDGET_S=580, was ended by the device before its files were packed).
if [ "$BUDGET_S" -gt 560 ]; then echo "BUDGET_S=$BUDGET_S leaves no room for the stop and the packaging in a 600 s call: using 560"; BUDGET_S=560; fi
left=$(( BUDGET_S - ($(date +%s) - t0) ))
timeout -s INT -k 30 "$left" "${CMD[@]}" > "$OUT/ablate.log" 2>&1
rc=$?
kill $smi 2>/dev/null
sleep 2; pkill -9 -f "multiprocessing.spawn" 2>/dev/null  # a worker left behind by a killed run would hold the GPU
{ echo "command: splicer fixture DIR --full-dims; ${CMD[*]:3} (paths shortened: BUILD, REFERENCE under DIR)" | sed "s#$WORK#DIR#g"
  echo "exit $rc (124/130: stopped at the call's budget; rerun to resume), call wall $(( $(date +%s) - t0 )) s"; date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import vllm, torch, transformers, compressed_tensors as ct; print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| compressed-tensors', ct.__version__)"
  nproc; lscpu | grep -E 'Model name|Socket|Core|Thread|MHz' ; free -g | head -2
} > "$OUT/run.txt" 2>&1
cp "$WORK/$RUN/results.json" "$WORK/$RUN/table.md" "$WORK/$RUN/report.md" "$OUT/" 2>/dev/null
# A device call brings back at most 8 files: logs.tgz (engine logs, the job, disk use, the stand-in's log) and
# scores.tar.xz (per-position scores, for recomputing intervals) beside the five above.
cp "$WORK/gpu-$RUN.csv" "$WORK/$RUN/logs/gpu.csv" 2>/dev/null; cp "$WORK/$RUN-standin.log" "$WORK/$RUN/standin.log" 2>/dev/null; cp "$D" "$WORK/$RUN/disk.txt" 2>/dev/null
( cd "$WORK/$RUN" && tar czf "$OUT/logs.tgz" logs ablate.log job.json disk.txt standin.log cache/base-*/done.json 2>/dev/null )
pack_scores "$OUT/scores.tar.xz" "$WORK" "$RUN"
tail -5 "$OUT/ablate.log"; cat "$OUT/run.txt"; cat "$OUT/table.md" 2>/dev/null | head -30
