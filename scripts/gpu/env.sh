# Sourced by the GPU scripts: where the bundle lives and the settings vLLM 0.26 needs on the lent H200.
export PYTHONPATH=/tmp/vllm_site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_USE_FLASHINFER_SAMPLER=0            # flashinfer is not installed there; engine init fails without this
export TRITON_CACHE_DIR=/tmp/triton-cache        # one cache for every engine process of the run
# Fast starts for the tiny fixture: no torch.compile, CUDA graphs for decode only (timings say so in results.json).
export SPLICER_GPU_ENGINE_ARGS='{"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4, 8]}, "gpu_memory_utilization": 0.3, "language_model_only": true}'
[ -d /tmp/vllm_site/vllm ] || { echo "no vLLM bundle in /tmp/vllm_site: run the two install calls first (scripts/gpu/README.md)"; exit 3; }
