"""What vLLM's engine log and the kernel probe say: the kernels and methods chosen per module class, and the
start-up breakdown (weights, compile, graph capture) read from the log lines."""

from __future__ import annotations

import json
import re
from pathlib import Path

# Log lines that name the kernels and methods vLLM chose (vllm 0.26 - 0.33 wording).
KERNEL_LINE = re.compile(
    r"(Using \S+ for CompressedTensorsWNA16|Using \S*MoEMethod\S*|Using '\S+' WNA16 MoE backend|"
    r"Using \S+ Unquantized MoE backend|Using \S+ attention backend|Using .* GDN prefill kernel|"
    r"Using \S+LinearKernel\S*|Selected \S+ for|Using FlashAttention version \d)"
)


def arch_of(folder):
    from ..arch import get_architecture

    return get_architecture(json.loads((Path(folder) / "config.json").read_text()))


def kernels_by_class(layers: dict, arch) -> dict:
    """{class: sorted distinct 'method / scheme / kernel' strings} from the per-layer probe (vLLM layer names ->
    classes by the family's table)."""
    out: dict[str, set] = {}
    for name, desc in layers.items():
        if name == "error":
            continue
        cls = arch.kernel_class(name)
        if cls:
            out.setdefault(cls, set()).update(re.sub(r" at 0x[0-9a-f]+>", ">", d) for d in str(desc).split(" | "))
    return {c: sorted(v) for c, v in out.items()}


# Lines of vLLM's own start-up log that split an engine's start into its parts (vllm 0.26 wording).
STARTUP_LINES = {
    "weights_load_s": re.compile(r"Loading weights took ([\d.]+) seconds"),
    "model_load_s": re.compile(r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) seconds"),
    "weight_memory_gib": re.compile(r"Model loading took ([\d.]+) GiB"),
    "compile_s": re.compile(r"torch\.compile took ([\d.]+) s in total"),
    # The profiling run holds a cold machine's Triton autotuning (121.5 s of the H200 stand-in's first start, run 8).
    "profiling_warmup_s": re.compile(r"Initial profiling/warmup run took ([\d.]+) s"),
    "graph_capture_s": re.compile(r"Graph capturing finished in ([\d.]+) secs"),
    "init_engine_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
    "kv_cache_gib": re.compile(r"Available KV cache memory: ([\d.]+) GiB"),
}


def startup_breakdown(log_text: str) -> dict:
    """{part: seconds or GiB} from one engine's log (the last match of each line)."""
    out = {}
    for key, pat in STARTUP_LINES.items():
        found = pat.findall(log_text)
        if found:
            out[key] = float(found[-1])
    return out
