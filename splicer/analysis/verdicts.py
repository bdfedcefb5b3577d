"""Which differences between variants are real: paired score differences and decode differences, with intervals.

Read by `ablate` (after every row, into results.json), `table`, `compare` and `report`; it reads only results.json and
the per-position score files under DIR/scores/, or where those are absent their per-cluster sums
(DIR/cluster-scores.safetensors, cluster_scores.py), which give the same intervals.

Scores. Two variants are scored on the same positions, so their difference is estimated paired, position by position,
with a 95 % interval from a stratified cluster bootstrap (metrics.paired_comparison): the independent unit is a
sequence (chat: a group of conversations that share a prompt, where the score files carry groups; chat.py),
resampled within its corpus, both variants together. Per corpus, and
pooled over corpora weighing every counted position once (a chat position repeating an earlier conversation's shared
prefix counts 0). A difference is significant when its interval excludes 0; a corpus with fewer than
metrics.MIN_SEQUENCES sequences (or groups) gets no interval and no verdict ("too few sequences", "too few groups"). The engine's own run-to-run
noise: where the build was scored on two or more engines (the plan's `repeat = true` rows of the build) their
differences measure it and it is folded into every interval (engine_noise, metrics.fold_engine_noise); otherwise the
intervals leave it out, and the table and report say so. The noise floor (the base scored again) is a reference
level, never a threshold.

Decode. Every engine of a variant times several blocks; engines of one variant differ more than blocks of one engine
do, so the build is timed on two or more engines (plan rows with `repeat = true`) and the engine-to-engine spread
sets the interval (metrics.decode_difference; an engine's level is the median of its blocks). A difference is resolved
when its interval excludes 0, which holds within the run: how far engines of another run land is not in the interval.
Rows spread over GPUs (--gpus) are compared with the build's engines on their own GPU, the spread pooled over GPUs.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import torch

from .cluster_scores import ClusterScores, collapse
from .metrics import decode_difference, engine_level, fold_engine_noise, paired_comparison, units

METHOD = (
    "paired on the same positions; 95 % intervals from a stratified bootstrap over sequences "
    "(chat: groups of conversations that share a prompt), Student's t on its standard error; pooled over corpora position-weighted, "
    "a shared chat prefix counted once; significant when the interval shown excludes 0"
)
QUANTITIES = ("kl", "top1", "dnll")


def load_scores(out: Path, row: str, corpus: str):
    """A row's scores of one corpus: its per-position file (DIR/scores/ROW/CORPUS.safetensors), else its collapsed
    record from DIR/cluster-scores.safetensors (cluster_scores: the same sums per cluster), else None."""
    from safetensors.torch import load_file

    p = Path(out) / "scores" / row / f"{corpus}.safetensors"
    return load_file(str(p)) if p.exists() else ClusterScores.get(out, row, corpus)


def same_form(records: list) -> list:
    """Records of several rows in one form: all collapsed per cluster when any is (a folder whose per-position files
    are there for some rows only), else as they are. None stays None."""
    if any(r is not None and "positions_sha256" in r for r in records):
        return [r if r is None or "positions_sha256" in r else collapse(r) for r in records]
    return records


def _same_positions(sa: dict, sb: dict, a: str, b: str, corpus: str) -> None:
    """Two rows' score files of one corpus cover the same positions of the same tokens, or a ValueError naming where
    they differ (files written before scores recorded their tokens: the same sequences, weights and answers)."""
    if "positions_sha256" in sa:  # collapsed records (same_form): their digests of the positions and tokens
        if not torch.equal(sa["positions_sha256"], sb["positions_sha256"]):
            raise ValueError(f"{a} and {b} were scored on different positions or tokens of {corpus}")
        return
    keys = ["target"] if "target" in sa and "target" in sb else ["seq_index", "weight", "answer_mask"]
    for key in keys:
        x, y = sa.get(key), sb.get(key)
        if x is None and y is None:
            continue
        if x is None or y is None or x.shape != y.shape:
            raise ValueError(f"{a} and {b} were scored on different positions of {corpus} ({key} differs in length)")
        if not torch.equal(x, y):
            first = int((x != y).flatten().nonzero()[0])
            what = "tokens" if key == "target" else "positions"
            raise ValueError(f"{a} and {b} were scored on different {what} of {corpus} (first at position {first})")


def compare_scores(out: Path, a: str, b: str, corpora: list[str], reps: int = 2000, seed: int = 0) -> dict | None:
    """Paired differences a - b of KL, top-1 and (corpora with answers) dNLL, per corpus and pooled; None when a
    variant has no score files here. Each quantity is a metrics.paired_comparison result; the unit resampled is a
    sequence, or a group of them where the score files carry a `group` per position."""
    kl, top1, dnll = {}, {}, {}
    for corpus in corpora:
        sa, sb = same_form([load_scores(out, a, corpus), load_scores(out, b, corpus)])
        if sa is None or sb is None:
            continue
        _same_positions(sa, sb, a, b, corpus)
        w, (unit, unit_name) = sa.get("weight"), units(sa)
        kl[corpus] = {"a": sa["kl_top"], "b": sb["kl_top"], "cluster": unit, "unit": unit_name, "weight": w}
        top1[corpus] = {"a": sa["top1"].double(), "b": sb["top1"].double(), "cluster": unit, "unit": unit_name, "weight": w}
        if "answer_mask" in sa and bool(sa["answer_mask"].any()):
            m = sa["answer_mask"].bool()
            dnll[corpus] = {
                "a": sa["dlogp"][m],
                "b": sb["dlogp"][m],
                "cluster": unit[m],
                "unit": unit_name,
                "weight": None if w is None else w[m],
            }
    if not kl:
        return None
    return {
        "kl": paired_comparison(kl, reps, seed),
        "top1": paired_comparison(top1, reps, seed),
        "dnll": paired_comparison(dnll, reps, seed) if dnll else None,
    }


def engine_noise(results: dict, out: Path) -> dict | None:
    """The engine's run-to-run noise on the scores, measured from the build's engines scored on the same positions
    (the build and its `repeat = true` rows): per quantity, per corpus and pooled, the standard deviation of the
    difference of two engines' means (diff) and of their ratio (rel), with its degrees of freedom (engines - 1), for
    metrics.fold_engine_noise. None when the build was scored on fewer than two engines; {"why": ...} and no quantities
    when their per-position scores are not at hand."""
    rows = [
        v["name"] for v in results.get("variants", []) if v.get("status") == "ok" and "build" in (v["name"], v.get("repeat_of"))
    ]
    corpora = list(results.get("corpora", {}))
    # per engine row: per quantity, per corpus (and pooled): (weighted sum, weight)
    sums = {}
    for row in rows:
        per = {q: {} for q in QUANTITIES}
        for corpus in corpora:
            s = load_scores(out, row, corpus)
            if s is None:
                break
            w = s["weight"].double() if "weight" in s else torch.ones(s["kl_top"].numel(), dtype=torch.float64)
            per["kl"][corpus] = (float((s["kl_top"].double() * w).sum()), float(w.sum()))
            per["top1"][corpus] = (float((s["top1"].double() * w).sum()), float(w.sum()))
            if "answer_mask" in s and bool(s["answer_mask"].any()):
                m = s["answer_mask"].double() * w
                per["dnll"][corpus] = (float((s["dlogp"].double() * m).sum()), float(m.sum()))
        else:
            sums[row] = per
    if len(rows) < 2:
        return None
    if len(sums) < 2:
        return {"rows": rows, "df": len(rows) - 1, "why": "the per-position scores of the build's engines are not in this folder"}
    first = next(iter(sums))

    def spread(parts):  # parts: per engine (sum, weight), the first the build's own row
        means = [x / n for x, n in parts]
        if any(n <= 0 for _, n in parts):
            return None
        rel = [m / means[0] for m in means] if means[0] else None
        return {"diff": _pair_sd(means), "rel": _pair_sd(rel) if rel else None}

    noise = {"rows": list(sums), "df": len(sums) - 1}
    for q in QUANTITIES:
        corp = [c for c in corpora if all(c in sums[r][q] for r in sums)]
        if not corp:
            noise[q] = None
            continue
        per_stratum = {c: spread([sums[r][q][c] for r in sums]) for c in corp}
        pooled = spread([(sum(sums[r][q][c][0] for c in corp), sum(sums[r][q][c][1] for c in corp)) for r in sums])
        noise[q] = {"per_stratum": per_stratum, "pooled": pooled}
    noise["reference_row"] = first
    return noise


def _pair_sd(values: list[float]) -> float:
    """Standard deviation of the difference of two of these (engines of one variant): sqrt(2 x their variance)."""
    return math.sqrt(2) * statistics.stdev(values)


def fold_noise(vs: dict, noise: dict | None) -> dict:
    """A compare_scores result with the measured engine noise (engine_noise) folded into every interval."""
    out = {}
    for q, cmp in vs.items():
        if not cmp:
            out[q] = cmp
            continue
        nq = (noise or {}).get(q) or {}
        scope = {"df": noise["df"], "rows": noise["rows"]} if noise else None
        pick = lambda part: None if not part or not scope else dict(scope, **part)  # noqa: E731
        out[q] = {
            "per_stratum": {
                c: fold_engine_noise(r, pick((nq.get("per_stratum") or {}).get(c))) for c, r in cmp["per_stratum"].items()
            },
            **({"pooled": fold_engine_noise(cmp["pooled"], pick(nq.get("pooled")))} if "pooled" in cmp else {}),
        }
    return out


def noise_text(results: dict) -> str:
    """What the score intervals hold of the engine's own noise, for table, report and compare."""
    verdicts = results.get("verdicts") or {}
    noise = verdicts.get("engine_noise")
    if "engine_noise" not in verdicts:
        return (
            "the engine's run-to-run noise is not in these intervals (this results.json was written before splicer "
            "measured it; rerun splicer ablate on the folder to fold it in)"
        )
    if not noise:
        return (
            "the engine's run-to-run noise is not in these intervals (the build was scored on one engine only; a "
            "`repeat = true` row of the build measures it)"
        )
    if noise.get("why"):
        return f"the engine's run-to-run noise is not in these intervals ({noise['why']})"
    kl = ((noise.get("kl") or {}).get("pooled") or {}).get("diff")
    size = (
        "0: this engine is deterministic" if kl == 0 else f"KL sd {kl:.2g} between two engines" if kl is not None else "measured"
    )
    return (
        f"the engine's run-to-run noise, measured from the build's engines scored on the same positions "
        f"({', '.join(noise['rows'])}; {size}), is folded into these intervals"
    )


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
    gpus = {
        v.get("gpu") for v in results.get("variants", []) if v.get("status") == "ok" and name in (v["name"], v.get("repeat_of"))
    }
    if not gpus:
        return None
    if len(gpus) > 1:  # a variant's repeat rows taken by other GPUs: no one GPU's build is its reference
        return {
            "rel": None,
            "rel_ci": None,
            "resolved": None,
            "engines": [0, 0],
            "df": 0,
            "why": f"{name}'s engines ran on GPUs {', '.join(sorted(map(str, gpus)))}; each is compared with the build "
            "on its own GPU, so a variant timed on several GPUs has no one difference",
        }
    gpu = gpus.pop()
    variant, build = timed_engines(results, name, gpu), timed_engines(results, "build", gpu)
    if not variant or not build:
        return None
    # The engine-to-engine spread is estimated from every variant timed on two or more engines of one GPU, not only
    # these two: the build on the other GPUs too.
    all_gpus = _gpus(results)
    groups = [
        (v["name"], g)
        for v in results.get("variants", [])
        if v.get("status") == "ok" and not v.get("repeat_of")
        for g in all_gpus
    ]
    others = [
        e for n, g in groups if (n, g) not in ((name, gpu), ("build", gpu)) for e in [timed_engines(results, n, g)] if len(e) > 1
    ]
    return dict(decode_difference(variant, build, extra_groups=others), **({"gpu": gpu} if gpu is not None else {}))


def attach(results: dict, out: Path, reps: int = 2000) -> None:
    """Every finished variant's paired differences from the build (scores and decode) into results.json's rows."""
    ok = {v["name"]: v for v in results.get("variants", []) if v.get("status") == "ok"}
    results["verdicts"] = {"method": METHOD, "reference": "build", "bootstrap": reps, "seed": 0}
    if "build" not in ok:
        return
    corpora = list(results.get("corpora", {}))
    results["verdicts"]["build_engines"] = build_engine_agreement(results)
    # Recomputed every time, like the decode verdicts: a later row may be another engine of the build.
    noise = results["verdicts"]["engine_noise"] = engine_noise(results, out)
    for name, v in ok.items():
        v.pop("paired_vs_build", None)
        v.pop("within_noise", None)
        if name == "build" or v.get("repeat_of") == "build":
            continue
        # A row's scores and the build's never change once written, so their comparison is made once (it resamples
        # every position: seconds per row at 100 k positions, and results.json is rewritten after every row).
        # (A comparison written before intervals needed enough sequences, and verdicts followed the interval shown, is
        # made again once.)
        stale = "vs_build" not in v or "rel_significant" not in (((v["vs_build"] or {}).get("kl") or {}).get("pooled") or {})
        scored = compare_scores(out, name, "build", corpora, reps) if not v.get("repeat_of") and stale else None
        if scored is not None:
            v["vs_build"] = scored
        if v.get("vs_build"):
            v["vs_build"] = fold_noise(v["vs_build"], noise)
        # Recomputed every time: a later row may be another engine of the build, which changes every interval.
        v.pop("decode_vs_build", None)
        d = decode_vs_build(results, name) if not v.get("repeat_of") else None
        if d is not None:
            v["decode_vs_build"] = d
    splice_vs_requantized(results, out, ok, noise, reps)


def splice_rows(variants: dict[str, dict]) -> dict[tuple, str]:
    """Whole classes restored -> the finished row that splices them into the build: a plan row restoring exactly those
    classes (no layer selection), else a checkpoint row that is splicer's own splice of this build (its splice.json)."""
    out: dict[tuple, str] = {}
    for name, v in variants.items():
        restored = v.get("restored")
        if isinstance(restored, list) and restored and not any("@" in e for e in restored) and not v.get("repeat_of"):
            out.setdefault(tuple(sorted(restored)), name)
    for name, v in variants.items():
        ck = v.get("checkpoint") or {}
        if ck.get("splice_of_build") and not ck.get("requantized_without"):  # never a re-made build's own partner
            out.setdefault(tuple(sorted(ck["splice_of_build"])), name)
    return out


def requantized_classes_note(results: dict, checkpoint: dict) -> str | None:
    """Where a re-made build (a checkpoint with requantized_without) quantizes other classes than the build less the
    classes it declares in BF16, what differs (its quantizer skipped or added a class): then it is not the build with
    those classes restored, and neither a splice nor a prediction of them is a like-for-like comparison. None where
    it matches, or where either list is unknown."""
    without = checkpoint.get("requantized_without")
    if not isinstance(without, list) or not isinstance(checkpoint.get("quantized_classes"), list):
        return None
    expected = [c for c in results.get("quantized_classes") or [] if c not in without]
    if sorted(checkpoint["quantized_classes"]) == sorted(expected):
        return None
    return (
        f"it quantizes {', '.join(checkpoint['quantized_classes']) or 'nothing'}, where the build without "
        f"{', '.join(sorted(without))} would quantize {', '.join(expected) or 'nothing'}"
    )


def splice_vs_requantized(results: dict, out: Path, ok: dict[str, dict], noise: dict | None, reps: int) -> None:
    """For every finished row of the build re-made without some classes (its checkpoint's requantized_without), the
    paired difference splice - re-quantized of KL, top-1 and dNLL on the same positions, into the row's vs_splice;
    recomputed every time, since either row may have been run again."""
    corpora = list(results.get("corpora", {}))
    splices = splice_rows(ok)
    failed = {
        tuple(sorted(v["restored"])): v["name"]
        for v in results.get("variants", [])
        if v.get("status") != "ok" and isinstance(v.get("restored"), list) and v["restored"]
    }
    for v in ok.values():
        v.pop("vs_splice", None)
        ck = v.get("checkpoint") or {}
        without = ck.get("requantized_without")
        if not without:
            continue
        key, classes = tuple(sorted(without)), ", ".join(sorted(without))
        splice = splices.get(key)
        entry = {"classes": sorted(without), "splice": splice}
        note = requantized_classes_note(results, ck)
        if note:
            entry["note"] = note
        if splice is None:
            entry["why"] = (
                f"the row splicing {classes}, {failed[key]}, failed"
                if key in failed
                else f"no finished row restores exactly {classes}: run one in this folder (a plan row restore = "
                f"[{', '.join(repr(c) for c in sorted(without))}])"
            )
        else:
            scored = compare_scores(out, splice, v["name"], corpora, reps)
            if scored is None:
                entry["why"] = "the scores of one of the two rows are not in this folder"
            else:
                entry.update(fold_noise(scored, noise))
        v["vs_splice"] = entry


def build_engine_agreement(results: dict) -> dict | None:
    """The build's engines: each one's level (metrics.engine_level, the median of its blocks) and the largest relative difference between two of them on one
    GPU (spread over GPUs: per GPU in by_gpu, and the largest of those as spread)."""
    per_gpu = {}
    for gpu in _gpus(results):
        engines = _timed_rows(results, "build", gpu)
        if len(engines) >= 2:
            means = [engine_level(e) for _, e in engines]
            per_gpu[gpu] = {
                "engines": len(engines),
                "mean_ms": means,
                "spread": max(means) / min(means) - 1,
                "rows": [row for row, _ in engines],
                "level": "median of blocks",
            }
    if not per_gpu:
        return None
    if list(per_gpu) == [None]:
        return per_gpu[None]
    return {
        "engines": sum(g["engines"] for g in per_gpu.values()),
        "mean_ms": [m for g in per_gpu.values() for m in g["mean_ms"]],
        "spread": max(g["spread"] for g in per_gpu.values()),
        "rows": [r for g in per_gpu.values() for r in g["rows"]],
        "by_gpu": {str(k): g for k, g in per_gpu.items()},
        "level": "median of blocks",
    }


def engine_means_text(engines: dict) -> str:
    """'build 4.356, build-again 4.379': each engine of the build (a row) and the median of its blocks in ms/token."""
    return ", ".join(f"{n} {m:.3f}" for n, m in zip(engines["rows"], engines["mean_ms"]))


def lane_name(lane) -> str:
    """How a report names where a row ran in a spread run: 'GPU 1' (a --gpus id), 'Ray lane ray1' (--ray)."""
    return f"GPU {lane}" if str(lane).isdigit() else f"Ray lane {lane}"


def lanes_word(results: dict) -> str:
    """'GPU' or 'Ray lane': what a spread run's rows ran on (a row's `gpu` holds the --gpus id or the Ray lane)."""
    lanes = [v["gpu"] for v in results.get("variants", []) if v.get("gpu") is not None]
    return "Ray lane" if lanes and not str(lanes[0]).isdigit() else "GPU"


def per_gpu_engines_text(engines: dict) -> str:
    """The build's engines per GPU (or Ray lane) of a spread run (build_engine_agreement's by_gpu), for report and
    table."""
    return "; ".join(
        f"{lane_name(g)}: {engine_means_text(e)} ms/token, largest difference {100 * e['spread']:.2f} %"
        for g, e in engines["by_gpu"].items()
    )


def pooled_kl(v: dict) -> float | None:
    """A row's KL over all corpora, every counted position weighing the same (the pooled estimate's convention)."""
    parts = [(m.get("kl"), m.get("positions") or 0) for m in (v.get("metrics") or {}).values()]
    parts = [(k, n) for k, n in parts if k is not None and n]
    total = sum(n for _, n in parts)
    return sum(k * n for k, n in parts) / total if total else None
