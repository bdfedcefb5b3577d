"""A fused group split by hand, and what splicer and vLLM say of it (issue 15: "a split fused group is refused by
splice and by vLLM; record vLLM's message").

For each family: the fixture pair (`splicer fixture DIR --family F`, made here when missing), then a checkpoint in which
one shard of a fused group in the first layer that has it (the attention's: q_proj of qkv_proj, q_a_proj of DeepSeek's
fused_qkv_a_proj; for qwen3_5_moe also the Gated-DeltaNet's in_proj_qkv of in_proj_qkvz, the split the issue trackers
report from NVFP4 Qwen3.5 builds) is put back to the base's BF16 tensor and named in `ignore` while its other shards stay
INT4: what a hand edit of an ignore list makes, and what `splicer splice` refuses to make. Recorded per family and group:
  * splicer's refusal of the same restore (`splice --restore attention --modules SHARD`): exit code and its one line;
  * `splicer inspect`'s lint of the hand-made checkpoint (fused-shards-disagree, and vllm-refuses: splicer's prediction);
  * vLLM loading it (eager, Triton autotuning off): the error it raises, or that it loaded.
Writes OUT/split-groups.json. Usage (GPU machine, after install_bundle.sh and `source scripts/gpu/env.sh`):
  python3 scripts/gpu/split_group_check.py WORK OUT [FAMILY[:BUILD] ...]
FAMILY:BUILD splits that fixture build instead of the family's INT4 one (issue 16: qwen3_5_moe:fp8-block, ...; the
module's tensors are whatever splicer.formats says its format stores).
`--no-vllm` makes and lints the checkpoints only (what the CPU test runs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

FAMILIES = ("llama", "qwen3", "mistral", "qwen3_moe", "glm4_moe", "deepseek_v3", "qwen3_next", "qwen3_5_moe")
# The fused groups split per family (prefix of the shard's suffix); the fixture build that quantizes every Linear.
GROUPS = {"qwen3_5_moe": ("linear_attn.", "self_attn.")}
BUILD = {"qwen3_5_moe": "lowlatency"}

# vLLM in a child: the load either raises (its last exception line is what a user sees) or serves one token.
_VLLM_LOAD = """
import sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], enforce_eager=True, gpu_memory_utilization=0.3, max_model_len=512,
          gdn_prefill_backend="triton", **({"language_model_only": True} if sys.argv[2] == "1" else {}))
print("LOADED", llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1))[0].outputs[0].token_ids, flush=True)
"""


def _splicer(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "splicer", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )


def make_split(int4: Path, base: Path, out: Path, group: str = "self_attn.") -> dict:
    """out: int4 with the first shard of a fused group under `group` (a shard-suffix prefix), in the first layer where
    it is quantized, restored from base and named in `ignore` (or the skip list). Files not changed are hard links; returns what was split."""
    from safetensors.torch import load_file, save_file

    from splicer.checkpoint import open_checkpoint
    from splicer.splice.config_edit import add_exclusions
    from splicer.splice.modules import list_modules

    config = json.loads((int4 / "config.json").read_text())
    ckpt = open_checkpoint(int4, "build")
    arch = ckpt.arch
    shard, (fused, shards) = next((s, g) for s, g in arch.fused_shards.items() if s.startswith(group))
    index = json.loads((int4 / "model.safetensors.index.json").read_text())
    quantized = {n: m for n, m in list_modules(ckpt).items() if m.quantized}
    module = min(
        (n for n in quantized if re.search(r"layers\.\d+\." + re.escape(shard) + "$", n) and not arch.is_mtp(n)),
        key=lambda m: arch.layer_index(m),
    )
    stored = {t.name for t in quantized[module].packed.values()}  # the module's tensors in its format
    base_index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    out.mkdir(parents=True)
    touched = {index["weight_map"][k] for k in index["weight_map"] if k.startswith(module + ".")}
    for p in int4.iterdir():
        if p.name not in touched | {"config.json", "model.safetensors.index.json"}:
            os.link(p, out / p.name)
    for name in sorted(touched):  # the module's packed tensors out, its BF16 weight into the first of their files
        tensors = load_file(str(int4 / name))
        for k in [k for k in tensors if k in stored]:
            del tensors[k]
            del index["weight_map"][k]
        if name == min(touched):
            tensors[module + ".weight"] = load_file(str(base / base_index[module + ".weight"]))[module + ".weight"]
            index["weight_map"][module + ".weight"] = name
        save_file(tensors, str(out / name), metadata={"format": "pt"})
    # Named in the build's own exclusion list: `ignore` (compressed-tensors), the skip list (native FP8, AWQ).
    add_exclusions(config["quantization_config"], [module])
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return {
        "module": module,
        "shard": shard,
        "fused": fused,
        "shards": list(shards),
        "class": arch.module_class(module),
        "format": quantized[module].scheme,
    }


def _vllm_says(folder: Path, timeout_s: int = 300) -> dict:
    # A multimodal checkpoint (qwen3_5_moe's vision tower) loads text-only: the fixture has no image processor.
    multimodal = "vision_config" in json.loads((folder / "config.json").read_text())
    t0 = time.perf_counter()
    env = dict(os.environ, VLLM_TRITON_FORCE_FIRST_CONFIG="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    try:
        p = subprocess.run(
            [sys.executable, "-c", _VLLM_LOAD, str(folder), "1" if multimodal else "0"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {"outcome": "timeout", "seconds": timeout_s}
    lines = (p.stdout + p.stderr).splitlines()
    loaded = next((line for line in lines if line.startswith("LOADED")), None)
    bare = [re.sub(r"^\[rank\d+\]:\s*", "", line).strip() for line in lines]  # vLLM's worker prefixes its rank
    errors = [line for line in bare if re.match(r"^\w*(Error|Exception)\b|^[\w.]+(Error|Exception): ", line)]
    # "refused": vLLM's own check of the fused layer (should_ignore_layer) stopped the load; "failed": something else did,
    # before that check could say anything (call 4's first qwen3_5_moe records, an image processor missing).
    # compressed-tensors: "Found a different quantization schemes for ..."; native FP8 / AWQ (is_layer_skipped):
    # "Detected some but not all shards of ... are quantized".
    refused = any("quantization schemes" in e or "not all shards" in e for e in errors)
    return {
        "outcome": "loaded" if loaded else "refused" if refused else "failed",
        "exit": p.returncode,
        "loaded": loaded,
        "error": errors[-1].strip() if errors else None,
        "last_lines": lines[-6:],
        "seconds": round(time.perf_counter() - t0, 1),
    }


def check_family(work: Path, family: str, vllm: bool) -> list[dict]:
    family, _, kind = family.partition(":")
    pair, build = work / family, kind or BUILD.get(family, "int4")
    if not (pair / build / "config.json").exists():
        shutil.rmtree(pair, ignore_errors=True)
        builds = ("--builds", build) if family == "qwen3_5_moe" else ()
        made = _splicer("fixture", str(pair), *(("--family", family) if family != "qwen3_5_moe" else builds))
        if made.returncode:
            return [{"family": family, "fixture_error": made.stderr.strip().splitlines()[-1:]}]
    return [check_group(work, family, pair / build, pair / "base", group, vllm) for group in GROUPS.get(family, ("self_attn.",))]


def check_group(work: Path, family: str, build: Path, base: Path, group: str, vllm: bool) -> dict:
    tag = f"{family}-{build.name}-{group.rstrip('.')}"
    split_dir = work / f"{tag}-split"
    shutil.rmtree(split_dir, ignore_errors=True)
    record = {"family": family, "build": build.name, **make_split(build, base, split_dir, group)}
    refused = _splicer(
        "splice",
        "--restore",
        record["class"],
        "--modules",
        re.escape(record["module"]),
        str(build),
        str(base),
        "-o",
        str(work / f"{tag}-refused"),
    )
    record["splice"] = {
        "exit": refused.returncode,
        "stderr": refused.stderr.strip(),
        "out_exists": (work / f"{tag}-refused").exists(),
    }
    lint = _splicer("inspect", str(split_dir), "--json")
    issues = json.loads(lint.stdout)["lint"]["issues"] if lint.returncode == 0 else [{"inspect_error": lint.stderr.strip()}]
    record["lint"] = issues  # expected: fused-shards-disagree (disk) and vllm-refuses (splicer's reading of vLLM's rule)
    if vllm:
        record["vllm"] = _vllm_says(split_dir)
    return record


def main(argv: list[str]) -> int:
    vllm = "--no-vllm" not in argv
    args = [a for a in argv if a != "--no-vllm"]
    work, out = Path(args[0]), Path(args[1])
    families = args[2:] or list(FAMILIES)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for family in families:
        for r in check_family(work, family, vllm):
            records.append(r)
            (out / "split-groups.json").write_text(json.dumps(records, indent=2) + "\n")  # what is done survives a timeout
            print(
                family,
                r.get("module"),
                "splice exit",
                (r.get("splice") or {}).get("exit"),
                "lint",
                [i.get("check") for i in r.get("lint", [])],
                "vllm",
                (r.get("vllm") or {}).get("outcome"),
                (r.get("vllm") or {}).get("error"),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
