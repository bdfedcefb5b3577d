# Sourced by the GPU scripts: where the bundle lives and the settings vLLM 0.26 needs on the lent H200.
export PYTHONPATH=/tmp/vllm_site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_USE_FLASHINFER_SAMPLER=0            # flashinfer is not installed there; engine init fails without this
export TRITON_CACHE_DIR=/tmp/triton-cache        # one cache for every engine process of the run
# Fast starts for the tiny fixture: no torch.compile, CUDA graphs for decode only (timings say so in results.json).
export SPLICER_GPU_ENGINE_ARGS='{"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4, 8]}, "gpu_memory_utilization": 0.3, "language_model_only": true}'
[ -d /tmp/vllm_site/vllm ] || { echo "no vLLM bundle in /tmp/vllm_site: run the two install calls first (scripts/gpu/README.md)"; exit 3; }

# pack_scores ARCHIVE ROOT DIR...: every DIR/scores/ (per-position scores, DIR/scores/ROW/CORPUS.safetensors; paths
# relative to ROOT) in one xz archive, so that a results folder's intervals can be recomputed (splicer compare, budget)
# from what comes back. A device call brings back files of at most 16 MiB: a larger archive is split into parts under
# that size (ARCHIVE.part00, .part01, ...), which `cat` joins again.
pack_scores() {
  local archive root=$2; archive=$(realpath -m "$1"); shift 2
  local dirs=(); for d in "$@"; do [ -d "$root/$d/scores" ] && dirs+=("$d/scores"); done
  [ ${#dirs[@]} -gt 0 ] || { echo "pack_scores: no scores/ in $*"; return 0; }
  ( cd "$root" && XZ_OPT=-6 tar cJf "$archive" "${dirs[@]}" )
  local size; size=$(stat -c %s "$archive" 2>/dev/null || echo 0)
  if [ "$size" -gt $((16 * 1024 * 1024 - 4096)) ]; then
    # Parts under the limit; here: cat ARCHIVE.part* > ARCHIVE (the call's output lists them).
    split -b 15m -d "$archive" "$archive.part" && rm -f "$archive"
    echo "pack_scores: $(basename "$archive") is $size bytes, over the 16 MiB a call brings back: split into" \
      "$(cd "$(dirname "$archive")" && ls "$(basename "$archive")".part* | tr '\n' ' ')(cat them back together)"
  else
    echo "pack_scores: $(basename "$archive") $size bytes (${dirs[*]})"
  fi
}
