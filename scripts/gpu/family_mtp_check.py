"""On the GPU machine: the MTP layer of the families that store it as one more decoder layer (DeepSeek-V3, GLM-4.5:
model.layers.{num_hidden_layers}) loads as vLLM's speculative drafter, in the INT4 build and after
`splice --restore mtp`.

Per family (the `splicer fixture --family F` pair, made here when missing) and per checkpoint (the int4 build, whose MTP
layer is quantized like the rest, and its splice with the MTP layer restored to BF16): greedy output without and with
MTP speculative decoding (`speculative_config={"method": "mtp", "num_speculative_tokens": 1}`; speculation must not
change greedy tokens), the quantization method of every drafter layer and per splicer class, and vLLM's spec-decode
counters. Checks facts the design notes read from vLLM's code without running it: the drafter reuses the target's
quantization config, its prefixes equal the checkpoint's names, eh_proj stays unquantized.
Writes $OUT/family-mtp.json. Usage (after install_bundle.sh and `source scripts/gpu/env.sh`):
  python3 scripts/gpu/family_mtp_check.py WORK [FAMILY ...]
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from splicer.arch import get_architecture
from splicer.backends.vllm_backend import VllmBackend, kernels_by_class
from splicer.splice.core import splice

FAMILIES = ("deepseek_v3", "glm4_moe")
MTP = {"method": "mtp", "num_speculative_tokens": 1}


def _save(out: Path, report: dict) -> None:
    """After every check: a call stopped by its time limit still brings back what finished."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "family-mtp.json").write_text(json.dumps(report, indent=2, default=str) + "\n")


def check(engine: VllmBackend, folder: Path, arch, prompts: list[list[int]], base_args: dict) -> dict:
    row: dict = {"ignore": (json.loads((folder / "config.json").read_text()).get("quantization_config") or {}).get("ignore")}
    try:
        engine.engine_args = {k: v for k, v in {**engine.engine_args, **base_args}.items() if k != "speculative_config"}
        engine.load(folder)
        greedy = engine.generate(prompts, 24, [])
        engine.unload()
        engine.engine_args = {**engine.engine_args, "speculative_config": MTP, "disable_log_stats": False}
        t0 = time.time()
        engine.load(folder)
        row["spec_load_s"] = round(time.time() - t0, 1)
        with_mtp = engine.generate(prompts, 24, [])
        drafter = engine.drafter_layers()
        row.update(
            ok=True,
            greedy_equal_with_mtp=with_mtp == greedy,
            drafter_layers=dict(sorted(drafter.items())),
            drafter_by_class=kernels_by_class(drafter, arch),
            spec_metrics=engine.engine_metrics("vllm:spec_decode"),
        )
    except Exception as e:  # what vLLM raised is the finding
        row.update(ok=False, error=str(e)[-2000:])
    finally:
        engine.unload()
    return row


def main(argv: list[str]) -> int:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    work = Path(argv[0])
    families = argv[1:] or list(FAMILIES)
    base_args = {"enforce_eager": True, "gpu_memory_utilization": 0.3, "max_model_len": 512}  # nothing here is timed
    engine = VllmBackend(
        engine_args=base_args,
        log_dir=work / "mtp-logs",
        cache_dir=work / "mtp-engine-cache",
        engine_env={"VLLM_TRITON_FORCE_FIRST_CONFIG": "1"},
    )
    prompts = [list(range(5, 53)), list(range(300, 348))]
    report: dict = {"engine_args": base_args, "speculative_config": MTP}
    t_all = time.time()
    work.mkdir(parents=True, exist_ok=True)
    for family in families:
        pair = work / family
        if not (pair / "int4" / "config.json").exists():
            subprocess.run(
                [sys.executable, "-m", "splicer", "fixture", str(pair), "--family", family], check=True, capture_output=True
            )
        restored = work / f"{family}-restore-mtp"
        if not restored.exists():
            splice(str(pair / "int4"), str(pair / "base"), restored, "mtp", progress=False)
        arch = get_architecture(json.loads((pair / "int4" / "config.json").read_text()))
        for name, folder in (("int4", pair / "int4"), ("restore-mtp", restored)):
            row = check(engine, folder, arch, prompts, base_args)
            report[f"{family}/{name}"] = row
            print(family, name, json.dumps({k: v for k, v in row.items() if k != "drafter_layers"}, default=str), flush=True)
            _save(out, report)
    engine.close()
    report["wall_s"] = round(time.time() - t_all, 1)
    _save(out, report)
    return 0 if all(r.get("ok") for r in report.values() if isinstance(r, dict) and "ok" in r) else 1


# The vLLM backend starts its worker with multiprocessing's spawn, which re-imports this file: keep the work under main.
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
