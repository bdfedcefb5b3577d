"""On the GPU machine, after install_bundle.sh (scripts/gpu/README.md): the vLLM backend's exact-support KL on a real vLLM.

It needs prompt_logprob_token_ids (vLLM 0.31 and later); the machine has vLLM 0.26, so what this checks there is the
other side: the worker's probe finds no such parameter, each engine records why, scores asked with the base's ids come
back without them (the KL bounded from the variant's own top-20, as before), an ablate records kl_support own_top_k for the
run, its rows and its backend and words its table so, and a run whose base pass says exact is refused in one line when
resumed on it. On a vLLM that has the parameter the same script records the exact side. Usage:
    source scripts/gpu/env.sh && python3 scripts/gpu/exact_kl_check.py /tmp/exact-kl $OUT
writes OUT/exact-kl-check.json.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

PLAN = (
    'name = "exact-kl"\n[[corpus]]\nname = "en"\nkind = "builtin"\ntext = "wiki-en"\nchunk_tokens = 48\nmax_chunks = 5\n'
    '[[row]]\nname = "build"\nrestore = []\n[[row]]\nname = "gdn"\nrestore = ["gdn"]\n[[row]]\nname = "all"\nkeep = []\n'
)


def check(work: Path, out: Path) -> dict:
    import torch

    from splicer.ablate import AblateSettings, run_ablate
    from splicer.backends.vllm_backend import VllmBackend, VllmOptions
    from splicer.errors import SplicerError
    from splicer.fixtures.core import FixtureSpec, write_pair

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    args = json.loads(os.environ.get("SPLICER_GPU_ENGINE_ARGS") or "{}")
    pair = write_pair(work / "pair", FixtureSpec(experts_layout="fused"), kinds=("lowlatency",))
    report: dict = {"engine_args": args}

    b = VllmBackend(engine_args=args, log_dir=work / "logs")
    try:
        b.load(pair["lowlatency"])
        seqs = [list(range(20, 60)), list(range(100, 130))]
        own = list(b.score(seqs, 20))
        asked = list(b.score(seqs, 20, gather_ids=[s.topk_ids for s in own]))  # the variant's own top-20 as the ids
        report["backend"] = {
            "installed": b.installed,
            "token_id_scoring": b.load_info().get("token_id_scoring"),
            "model_runner": b.load_info().get("model_runner"),
            "exact_gather": b.exact_gather,
            "gathered": [None if s.gathered is None else list(s.gathered.shape) for s in asked],
            # exact: the engine's log-probs at its own top-20 from the ids' computation against prompt_logprobs'
            "gathered_vs_own_top_k_max_abs": [
                None if s.gathered is None else float((s.gathered - o.topk_logprobs).abs().max()) for s, o in zip(asked, own)
            ],
            "own_top_k_unchanged": all(torch.equal(s.topk_ids, o.topk_ids) for s, o in zip(asked, own)),
        }
    finally:
        b.close()

    plan = work / "plan.toml"
    plan.write_text(PLAN)
    run_dir = work / "run"

    def ablate(rows: str) -> dict:
        settings = AblateSettings(
            backend="vllm", progress=False, bootstrap=50, time_decode=False, backend_options=VllmOptions(engine_args=args)
        )
        return run_ablate(rows, str(pair["lowlatency"]), str(pair["base"]), run_dir, str(plan), settings)

    res = ablate("gdn")
    table = (run_dir / "table.md").read_text()
    report["ablate"] = {
        "kl_support": res.get("kl_support"),
        "rows": {v["name"]: {"status": v["status"], "kl_support": v.get("kl_support")} for v in res["variants"]},
        "backend_info_kl_support": res["backend_info"].get("kl_support"),
        "base_pass_kl_support": res["base_pass"].get("kl_support"),
        "kl": {v["name"]: v["metrics"]["en"]["kl"] for v in res["variants"] if v["status"] == "ok"},
        "table_kl_words": next((part for line in table.splitlines() for part in line.split("; ") if "KL = " in part), None),
    }
    # The same run resumed as if its base pass had been scored the other way: held to that way, or refused in one line.
    cache = next((run_dir / "cache").glob("base-*"))
    done = json.loads((cache / "done.json").read_text())
    other = "own_top_k" if done["kl_support"] == "exact" else "exact"
    (cache / "done.json").write_text(json.dumps(dict(done, kl_support=other)))
    try:
        again = ablate("all")
        report["resumed_as_" + other] = {v["name"]: v.get("kl_support") for v in again["variants"]}
    except SplicerError as e:
        report["resumed_as_" + other] = f"refused: {e}"
    shutil.copy(run_dir / "results.json", out / "exact-kl-results.json")
    return report


if __name__ == "__main__":
    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    report = check(work, out)
    (out / "exact-kl-check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
