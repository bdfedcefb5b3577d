"""Which differences between variants are real: paired score differences and decode differences, with intervals.

Read by `ablate` (after every row, into results.json), `table`, `compare` and `report`; it reads only results.json and
the per-position score files under DIR/scores/.

Scores. Two variants are scored on the same positions, so their difference is estimated paired, position by position,
with a 95 % interval from a stratified cluster bootstrap (metrics.paired_comparison): the independent unit is a
sequence (a chat conversation is one sequence), resampled within its corpus, both variants together. Per corpus, and
pooled over corpora weighing every counted position once (a chat position repeating an earlier conversation's shared
prefix counts 0). A difference is significant when its interval excludes 0. The noise floor (the base scored again)
is what the engine's own nondeterminism costs: a reference level, never a threshold.

Decode. Every engine of a variant times several blocks; engines of one variant differ more than blocks of one engine
do, so the build is timed on two or more engines (plan rows with `repeat = true`) and the engine-to-engine spread
sets the interval (metrics.decode_difference). A difference is resolved when its interval excludes 0. Rows spread over
GPUs (--gpus) are compared with the build's engines on their own GPU, the spread pooled over GPUs.
"""

from __future__ import annotations

from pathlib import Path

from .metrics import decode_difference, paired_comparison

METHOD = ("paired on the same positions; 95 % intervals from a stratified bootstrap over sequences "
          "(a chat conversation is one sequence); pooled over corpora position-weighted, a shared chat prefix counted once; "
          "significant when the interval excludes 0")


def _load_scores(out: Path, row: str, corpus: str):
    from safetensors.torch import load_file

    p = Path(out) / "scores" / row / f"{corpus}.safetensors"
    return load_file(str(p)) if p.exists() else None


def compare_scores(out: Path, a: str, b: str, corpora: list[str], reps: int = 2000, seed: int = 0) -> dict | None:
    """Paired differences a - b of KL, top-1 and (corpora with answers) dNLL, per corpus and pooled; None when a
    variant has no score files here. Each quantity is a metrics.paired_comparison result."""
    kl, top1, dnll = {}, {}, {}
    for corpus in corpora:
        sa, sb = _load_scores(out, a, corpus), _load_scores(out, b, corpus)
        if sa is None or sb is None:
            continue
        if sa["seq_index"].shape != sb["seq_index"].shape:
            raise ValueError(f"{a} and {b} were scored on different positions of {corpus}")
        w = sa.get("weight")
        kl[corpus] = {"a": sa["kl_top"], "b": sb["kl_top"], "cluster": sa["seq_index"], "weight": w}
        top1[corpus] = {"a": sa["top1"].float(), "b": sb["top1"].float(), "cluster": sa["seq_index"], "weight": w}
        if "answer_mask" in sa and bool(sa["answer_mask"].any()):
            m = sa["answer_mask"].bool()
            dnll[corpus] = {"a": sa["dlogp"][m], "b": sb["dlogp"][m], "cluster": sa["seq_index"][m],
                            "weight": None if w is None else w[m]}
    if not kl:
        return None
    return {"kl": paired_comparison(kl, reps, seed), "top1": paired_comparison(top1, reps, seed),
            "dnll": paired_comparison(dnll, reps, seed) if dnll else None}


def _timed_rows(results: dict, name: str, gpu=...) -> list[tuple[str, list[float]]]:
    """(row name, per-block decode ms/token) for each engine of variant `name`: its row and every repeat of it; with
    gpu given, only those timed on that GPU (None: rows of a one-GPU run, which record none)."""
    rows = []
    for v in results.get("variants", []):
        if v.get("status") != "ok" or name not in (v["name"], v.get("repeat_of")):
            continue
        if gpu is not ... and v.get("gpu") != gpu:
            continue
        t = v.get("timing") or {}
        blocks = [x for x in t.get("per_run_ms") or [] if x is not None]
        if t.get("decode_ms_per_token") is not None and blocks:
            rows.append((v["name"], blocks))
    return rows


def timed_engines(results: dict, name: str, gpu=...) -> list[list[float]]:
    """Per engine of variant `name` (its row and every repeat of it), the per-block decode ms/token it measured."""
    return [blocks for _, blocks in _timed_rows(results, name, gpu)]


def _gpus(results: dict) -> list:
    """The GPUs rows were timed on (a run spread with --gpus records each row's; [None] for a one-GPU run)."""
    return sorted({v.get("gpu") for v in results.get("variants", []) if v.get("status") == "ok"}, key=str) or [None]


def decode_vs_build(results: dict, name: str) -> dict | None:
    """Relative decode difference of variant `name` from the build (metrics.decode_difference) over every timed engine
    of each, on the variant's GPU (engines on different GPUs differ by more than the differences sought); None when
    either was not timed there."""
    gpus = {v.get("gpu") for v in results.get("variants", []) if v.get("status") == "ok" and name in (v["name"], v.get("repeat_of"))}
    if not gpus:
        return None
    if len(gpus) > 1:  # a variant's repeat rows taken by other GPUs: no one GPU's build is its reference
        return {"rel": None, "rel_ci": None, "resolved": None, "engines": [0, 0], "df": 0,
                "why": f"{name}'s engines ran on GPUs {', '.join(sorted(map(str, gpus)))}; each is compared with the build "
                       "on its own GPU, so a variant timed on several GPUs has no one difference"}
    gpu = gpus.pop()
    variant, build = timed_engines(results, name, gpu), timed_engines(results, "build", gpu)
    if not variant or not build:
        return None
    # The engine-to-engine spread is estimated from every variant timed on two or more engines of one GPU, not only
    # these two: the build on the other GPUs too.
    all_gpus = _gpus(results)
    groups = [(v["name"], g) for v in results.get("variants", []) if v.get("status") == "ok" and not v.get("repeat_of")
              for g in all_gpus]
    others = [e for n, g in groups if (n, g) not in ((name, gpu), ("build", gpu))
              for e in [timed_engines(results, n, g)] if len(e) > 1]
    return dict(decode_difference(variant, build, extra_groups=others), **({"gpu": gpu} if gpu is not None else {}))


def attach(results: dict, out: Path, reps: int = 2000) -> None:
    """Every finished variant's paired differences from the build (scores and decode) into results.json's rows."""
    ok = {v["name"]: v for v in results.get("variants", []) if v.get("status") == "ok"}
    results["verdicts"] = {"method": METHOD, "reference": "build", "bootstrap": reps, "seed": 0}
    if "build" not in ok:
        return
    corpora = list(results.get("corpora", {}))
    results["verdicts"]["build_engines"] = build_engine_agreement(results)
    for name, v in ok.items():
        v.pop("paired_vs_build", None)
        v.pop("within_noise", None)
        if name == "build" or v.get("repeat_of") == "build":
            continue
        # A row's scores and the build's never change once written, so their comparison is made once (it resamples
        # every position: seconds per row at 100 k positions, and results.json is rewritten after every row).
        scored = compare_scores(out, name, "build", corpora, reps) if not v.get("repeat_of") and "vs_build" not in v else None
        if scored is not None:
            v["vs_build"] = scored
        # Recomputed every time: a later row may be another engine of the build, which changes every interval.
        v.pop("decode_vs_build", None)
        d = decode_vs_build(results, name) if not v.get("repeat_of") else None
        if d is not None:
            v["decode_vs_build"] = d


def build_engine_agreement(results: dict) -> dict | None:
    """The build's engines: each one's mean ms/token and the largest relative difference between two of them on one
    GPU (spread over GPUs: per GPU in by_gpu, and the largest of those as spread)."""
    per_gpu = {}
    for gpu in _gpus(results):
        engines = _timed_rows(results, "build", gpu)
        if len(engines) >= 2:
            means = [sum(e) / len(e) for _, e in engines]
            per_gpu[gpu] = {"engines": len(engines), "mean_ms": means, "spread": max(means) / min(means) - 1,
                            "rows": [row for row, _ in engines]}
    if not per_gpu:
        return None
    if list(per_gpu) == [None]:
        return per_gpu[None]
    return {"engines": sum(g["engines"] for g in per_gpu.values()), "mean_ms": [m for g in per_gpu.values() for m in g["mean_ms"]],
            "spread": max(g["spread"] for g in per_gpu.values()), "rows": [r for g in per_gpu.values() for r in g["rows"]],
            "by_gpu": {str(k): g for k, g in per_gpu.items()}}


def engine_means_text(engines: dict) -> str:
    """'build 4.356, build-again 4.379': each engine of the build (a row) and the mean of its blocks in ms/token."""
    return ", ".join(f"{n} {m:.3f}" for n, m in zip(engines["rows"], engines["mean_ms"]))


def per_gpu_engines_text(engines: dict) -> str:
    """The build's engines per GPU of a run spread over GPUs (build_engine_agreement's by_gpu), for report and table."""
    return "; ".join(f"GPU {g}: {engine_means_text(e)} ms/token, largest difference {100 * e['spread']:.2f} %"
                     for g, e in engines["by_gpu"].items())


def pooled_kl(v: dict) -> float | None:
    """A row's KL over all corpora, every counted position weighing the same (the pooled estimate's convention)."""
    parts = [(m.get("kl"), m.get("positions") or 0) for m in (v.get("metrics") or {}).values()]
    parts = [(k, n) for k, n in parts if k is not None and n]
    total = sum(n for _, n in parts)
    return sum(k * n for k, n in parts) / total if total else None
