"""The results (DIR/results.json, table.md, report.md): the base pass's record, the corpora, every finished
row, the verdicts and where the time went; rewritten after every row."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from ..corpora.core import Corpus
from ..io import results_record
from .base_pass import base_pass_kl_support
from .common import AblateRun, atomic_text
from .job import host_info, started_from_cli
from .scores import noise_floor


def new_results(run: AblateRun, *, job: dict, corpora: list[Corpus], cache: Path, earlier_runs: list[dict], started: str) -> dict:
    """results.json as a run starts: the base pass (read from its cache), the corpora, the rows skipped, and one entry
    per invocation that worked on this job (a resumed job has several), the rows still to come.

    The build and base are recorded as this invocation was given them too ("given"). The job names inputs by their
    real paths (so that a rerun compares what they are, not how they were spelled); the table's caption shows them as
    the user wrote them, which keeps this machine's folders out of a table meant for a model card."""
    plan, settings = run.plan, run.settings
    given = {"build": str(run.build_src), "base": str(run.base_src)}
    return {
        "schema": 1,
        "base_pass": json.loads((cache / "done.json").read_text()),
        "job": job,
        "plan": {"name": plan.name, "description": plan.description, "source": plan.source},
        "top_k": plan.top_k,  # the KL columns are over the base's top-k: the table names k from here
        # how every row's KL was measured, as the base pass was (rows.hold_base_pass_scoring): the table words it from here
        "kl_support": base_pass_kl_support(cache, corpora),
        "backend": None,
        "engine_version": None,
        "device": None,
        "inputs": {role: dict(job[role], **({"given": given[role]} if given.get(role) else {})) for role in ("build", "base")},
        "corpora": {
            c.name: {
                "kind": c.kind,
                "sequences": len(c.sequences),
                "positions": c.positions(),
                "answer_tokens": (sum(len(s) - p for s, p in zip(c.sequences, c.prompt_lens)) if c.prompt_lens else None),
            }
            for c in corpora
        },
        "quantized_classes": run.quantized,
        "base_quantized_classes": run.frozen,
        "noise_floor": noise_floor(cache, corpora, settings.bootstrap),
        "timing_settings": plan.timing if settings.time_decode else None,
        "bandwidth_bytes_per_s": settings.bandwidth_gbs * 1e9 if settings.bandwidth_gbs else None,
        "variants": [],
        "skipped": run.skipped,
        "runs": [
            *earlier_runs,
            {
                "started": started,
                "rows_run": [],
                "finished": False,
                "host": host_info(),
                "command": " ".join(shlex.quote(a) for a in ["splicer", *sys.argv[1:]]) if started_from_cli() else None,
            },
        ],
    }


def finish_results(results: dict, out: Path, backends, reps: int = 2000) -> None:
    from ..analysis.verdicts import attach

    info = backends[0].describe()
    if len(backends) > 1:  # spread over GPUs: what differs per GPU
        info["per_gpu"] = [
            {k: d[k] for k in ("cuda_device", "cpus", "precompile", "worker_starts", "ray_lane") if k in d}
            for d in (b.describe() for b in backends)
        ]
    results["backend"] = info.get("backend")
    results["engine_version"] = info.get("engine")
    results["device"] = info.get("device")
    results["backend_info"] = info
    from ..analysis.breakdown import time_breakdown

    results["time_breakdown"] = time_breakdown(results)
    from ..analysis import cluster_scores

    # Every finished row's sums per sequence, so that the folder's intervals survive without DIR/scores/.
    cluster_scores.update(out, results)
    attach(results, out, reps)
    results_record.write(out, results)
    render_outputs(out, results)


def render_outputs(out: Path, results: dict) -> None:
    """DIR/table.md and DIR/report.md from results.json (and the later stages' files where they wrote them:
    DIR/tasks.json, DIR/speculative.json, DIR/mtp-teacher-forced.json)."""
    from ..analysis.report import render_report
    from ..analysis.table import render_markdown

    atomic_text(out / "table.md", render_markdown(results, out) + "\n")
    if (out / "plot-kl.png").exists():  # `splicer plot DIR` made one: keep the table's link to it
        from ..analysis.plot import link

        link(out)
    atomic_text(out / "report.md", render_report(results, out))
