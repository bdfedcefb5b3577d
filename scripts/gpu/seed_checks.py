"""On the GPU machine: the seed-003 and seed-004 layouts (and seed 000's missing MTP head) load and run in vLLM.

* GPTQ (seed 003's layout: GPTQModel v1 tensors, `dynamic` negative rules): the build, a splice of the experts of
  layers 0 and 2, and a splice of every expert (must score exactly as the base), each scored against the base.
* Seed 004's layout (compressed-tensors INT4 g32 on routed experts, MTP experts included) and seed 000's raw export
  (no MTP head), each before and after `splice --restore mtp`, started with MTP speculative decoding: the quantization
  method of every drafter layer, vLLM's spec-decode counters, and a check that greedy output with MTP equals greedy
  output without it (speculation must not change greedy tokens).
Writes $OUT/seed-checks.json. Run after install_bundle.sh and `source scripts/gpu/env.sh`.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

from splicer.analysis.metrics import fill_missing, kl_top_lumped
from splicer.arch.qwen3_5_moe import QWEN3_5_MOE
from splicer.backends.vllm_backend import VllmBackend, kernels_by_class
from splicer.fixtures.core import FixtureSpec, write_pair
from splicer.splice.core import splice

MTP = {"method": "mtp", "num_speculative_tokens": 1}


def _classes_of(layers: dict) -> dict:
    """Drafter layers -> {vLLM layer pattern: method}, trimmed to the interesting ones."""
    return {k: v for k, v in sorted(layers.items()) if any(s in k for s in ("experts", "proj", "fc", "lm_head"))}


def _save(out: Path, report: dict) -> None:
    """After every check: a call stopped by its time limit still brings back what finished."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "seed-checks.json").write_text(json.dumps(report, indent=2, default=str))


def main() -> int:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    work = Path("/tmp/seed-checks")
    base_args = json.loads(os.environ["SPLICER_GPU_ENGINE_ARGS"])
    engine = VllmBackend(engine_args=base_args, log_dir=work / "logs", cache_dir=work / "engine-cache")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(10, 2000, (96,), generator=g).tolist() for _ in range(4)]
    report: dict = {"engine_args": base_args}
    t_all = time.time()

    # --- seed 003: GPTQ
    gp = write_pair(work / "gptq", FixtureSpec(), kinds=("gptq-experts-g32",))
    splice(str(gp["gptq-experts-g32"]), str(gp["base"]), work / "gptq-experts-0-2", "experts", layers="0,2", progress=False)
    splice(str(gp["gptq-experts-g32"]), str(gp["base"]), work / "gptq-experts-all", "experts", progress=False)
    base_scores = None
    for name, folder in (
        ("base", gp["base"]),
        ("gptq-build", gp["gptq-experts-g32"]),
        ("gptq-experts-0-2-restored", work / "gptq-experts-0-2"),
        ("gptq-experts-all-restored", work / "gptq-experts-all"),
    ):
        t0 = time.time()
        try:
            engine.load(folder)
            scores = list(engine.score(seqs, 20, batch_size=4))
            info = engine.load_info()
            row = {
                "ok": True,
                "load_s": round(time.time() - t0, 1),
                "kernels_by_class": info.get("kernels_by_class"),
                "log_lines": info.get("kernel_log_lines"),
                "quantization_config": json.loads((Path(folder) / "config.json").read_text()).get("quantization_config"),
            }
            if base_scores is None:
                base_scores = scores
            else:
                kl = torch.cat(
                    [
                        kl_top_lumped(b.topk_logprobs, fill_missing(b.topk_ids, v.topk_ids, v.topk_logprobs))
                        for b, v in zip(base_scores, scores)
                    ]
                )
                top1 = torch.cat([(b.topk_ids[:, 0] == v.topk_ids[:, 0]) for b, v in zip(base_scores, scores)]).float()
                row.update(kl=round(kl.mean().item(), 5), top1=round(top1.mean().item(), 4))
        except Exception as e:
            row = {"ok": False, "error": str(e)[-2000:]}
        finally:
            engine.unload()
        report[name] = row
        print(name, json.dumps({k: v for k, v in row.items() if k != "quantization_config"}, indent=1), flush=True)
        _save(out, report)

    # --- seed 004 (MTP experts quantized) and seed 000's raw export (no MTP), with MTP speculative decoding
    ep = write_pair(work / "mtp", FixtureSpec(), kinds=("experts-g32", "lowlatency-nomtp"))
    splice(str(ep["experts-g32"]), str(ep["base"]), work / "004-restore-mtp", "mtp", progress=False)
    splice(str(ep["lowlatency-nomtp"]), str(ep["base"]), work / "000-restore-mtp", "mtp", progress=False)
    prompts = [s[:48] for s in seqs[:2]]
    plain_args = dict(base_args)
    spec_args = dict(base_args, speculative_config=MTP, disable_log_stats=False)
    for name, folder in (
        ("004-build", ep["experts-g32"]),
        ("004-restore-mtp", work / "004-restore-mtp"),
        ("000-raw-export-no-mtp", ep["lowlatency-nomtp"]),
        ("000-restore-mtp", work / "000-restore-mtp"),
    ):
        row = {
            "quantization_config_ignore": (
                json.loads((Path(folder) / "config.json").read_text()).get("quantization_config") or {}
            ).get("ignore")
        }
        try:
            engine.engine_args = {**engine.engine_args, **plain_args}
            engine.engine_args.pop("speculative_config", None)
            engine.load(folder)
            greedy = engine.generate(prompts, 32, [])
            engine.unload()
            engine.engine_args = {**engine.engine_args, **spec_args}
            t0 = time.time()
            engine.load(folder)
            row["spec_load_s"] = round(time.time() - t0, 1)
            with_mtp = engine.generate(prompts, 32, [])
            drafter = engine.drafter_layers()
            row.update(
                ok=True,
                greedy_equal_with_mtp=with_mtp == greedy,
                drafter_layers=_classes_of(drafter),
                drafter_by_class=kernels_by_class(drafter, QWEN3_5_MOE),
                spec_metrics=engine.engine_metrics("vllm:spec_decode"),
            )
        except Exception as e:
            row.update(ok=False, error=str(e)[-2000:])
        finally:
            engine.unload()
        report[name] = row
        print(name, json.dumps(row, indent=1, default=str), flush=True)
        _save(out, report)
    engine.close()
    report["wall_s"] = round(time.time() - t_all, 1)
    report["worker_starts"] = engine.worker_starts
    _save(out, report)
    return 0 if all(r.get("ok") for k, r in report.items() if isinstance(r, dict) and "ok" in r) else 1


# The vLLM backend starts its worker with multiprocessing's spawn, which re-imports this file: keep the work under main.
if __name__ == "__main__":
    sys.exit(main())
