"""On the GPU machine: a GPTQ fixture build (seed 003's layout) and one of its splices load and score in vLLM.

Writes $OUT/gptq-check.json: per variant, load status, the kernels vLLM chose per class and top-1/KL against the base.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

from splicer.backends.vllm_backend import VllmBackend
from splicer.fixtures import FixtureSpec, write_pair
from splicer.metrics import fill_missing, kl_top_lumped
from splicer.splice import splice


def main() -> int:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    work = Path("/tmp/gptq-check")
    paths = write_pair(work / "pair", FixtureSpec(), kinds=("gptq-experts-g32",))
    splice(str(paths["gptq-experts-g32"]), str(paths["base"]), work / "experts-0-2", "experts", layers="0,2", progress=False)
    engine = VllmBackend(engine_args=json.loads(os.environ["SPLICER_GPU_ENGINE_ARGS"]), log_dir=work / "logs")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(10, 2000, (96,), generator=g).tolist() for _ in range(4)]
    report, base = {}, None
    for name, folder in (("base", paths["base"]), ("gptq-build", paths["gptq-experts-g32"]), ("gptq-experts-0-2-restored", work / "experts-0-2")):
        t0 = time.time()
        try:
            engine.load(folder)
            scores = list(engine.score(seqs, 20, batch_size=4))
            info = engine.load_info()
            row = {"ok": True, "load_s": round(time.time() - t0, 1), "kernels_by_class": info.get("kernels_by_class"),
                   "log_lines": info.get("kernel_log_lines")}
            if base is None:
                base = scores
            else:
                kl = torch.cat([kl_top_lumped(b.topk_logprobs, fill_missing(b.topk_ids, v.topk_ids, v.topk_logprobs)) for b, v in zip(base, scores)])
                top1 = torch.cat([(b.topk_ids[:, 0] == v.topk_ids[:, 0]) for b, v in zip(base, scores)]).float()
                row.update(kl=round(kl.mean().item(), 4), top1=round(top1.mean().item(), 4))
        except Exception as e:
            row = {"ok": False, "error": str(e)[-1500:]}
        finally:
            engine.unload()
        report[name] = row
        print(name, json.dumps(row, indent=1), flush=True)
    (out / "gptq-check.json").write_text(json.dumps(report, indent=2))
    return 0 if all(r["ok"] for r in report.values()) else 1


# The vLLM backend starts its engines with multiprocessing's spawn, which re-imports this file: keep the work under main.
if __name__ == "__main__":
    sys.exit(main())
