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


# Lines of vLLM's own start-up log that split an engine's start into its parts (vLLM 0.26 to 0.33 wording; from 0.33
# the compile and warm-up lines of each compiled model carry its tag, "[backbone] torch.compile took ...", a bracket
# without the dots and colons of the logger's own "[monitor.py:62]", and an engine
# with a drafter compiles, warms up and loads weights once per model).
STARTUP_LINES = {
    "weights_load_s": re.compile(r"Loading weights took ([\d.]+) seconds"),
    "model_load_s": re.compile(r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) seconds"),
    "weight_memory_gib": re.compile(r"Model loading took ([\d.]+) GiB"),
    "compile_s": re.compile(r"(?:\[([A-Za-z_][\w-]*)\] )?torch\.compile took ([\d.]+) s in total"),
    # The profiling run holds a cold machine's Triton autotuning (121.5 s of the H200 stand-in's first start, run 8).
    "profiling_warmup_s": re.compile(r"(?:\[([A-Za-z_][\w-]*)\] )?Initial profiling/warmup run took ([\d.]+) s"),
    # without a compile cache, or on torch before 2.10, vLLM compiles inside the warm-up run and times both together
    "compile_and_warmup_s": re.compile(
        r"(?:\[([A-Za-z_][\w-]*)\] )?torch\.compile and initial profiling/warmup run together took ([\d.]+) s in total"
    ),
    "graph_capture_s": re.compile(r"Graph capturing finished in ([\d.]+) secs"),
    "init_engine_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
    "kv_cache_gib": re.compile(r"Available KV cache memory: ([\d.]+) GiB"),
}
# Parts logged once per model an engine holds (the target and its drafter): the engine's figure is their sum.
PER_MODEL = ("weights_load_s", "compile_s", "profiling_warmup_s", "compile_and_warmup_s")
# The engine's own total of compilation, where its init line gives it ("... took 201.50 s (compilation: 47.02 s").
ENGINE_COMPILATION = re.compile(r"init engine \(profile, create kv cache, warmup model\) took [\d.]+ s \(compilation: ([\d.]+) s")


def startup_breakdown(log_text: str) -> dict:
    """{part: seconds or GiB} from one engine's log: the parts logged once per model summed over the models (and, where
    0.33 tags them, also per model under `<part>_by_model`), the others the last line's; compile_s is the engine's own
    total from its init line where it gives one."""
    out = {}
    for key, pat in STARTUP_LINES.items():
        found = pat.findall(log_text)
        if not found:
            continue
        if key not in PER_MODEL:
            out[key] = float(found[-1])
            continue
        pairs = [(f[0], float(f[1])) if isinstance(f, tuple) else ("", float(f)) for f in found]
        out[key] = round(sum(v for _, v in pairs), 6)
        if any(tag for tag, _ in pairs):
            by = {}
            for tag, v in pairs:
                by[tag or "untagged"] = round(by.get(tag or "untagged", 0.0) + v, 6)
            out[f"{key}_by_model"] = by
    total = ENGINE_COMPILATION.findall(log_text)
    if total:
        out["compile_s"] = float(total[-1])
    return out
