"""A row's scores (DIR/scores/ROW/CORPUS.safetensors): the variant scored on the base pass's tokens, kept
per position (top-1, KL, dlogp, weights) so any two rows can be paired later; summarized into its results entry."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..analysis.metrics import fill_missing, kl_full, kl_top_lumped, summarize, top1_agreement
from ..corpora.core import Corpus
from .base_pass import load_tensors, write_tensors
from .common import AblateRun, pick_batch_size, progress_bar


def first_occurrence_weights(sequences: list[list[int]], lengths: torch.Tensor) -> torch.Tensor:
    """1 for a position whose context and next token appear here for the first time, 0 for a repeat.

    Chat conversations share a system prompt and history: a position inside the prefix a sequence shares with an
    earlier one sees the same context and predicts the same token, so it is the same measurement again (87 % of the
    demo's chat positions were). Counting it once keeps such a prefix from outweighing the answers, and keeps
    intervals from treating copies as independent evidence.
    """
    weights = torch.ones(int(lengths.sum()), dtype=torch.float32)
    start, seen = 0, []
    for seq, n in zip(sequences, lengths.tolist()):
        shared = max((_common_prefix(seq, other) for other in seen), default=0)
        # position t (context seq[:t+1], target seq[t+1]) repeats an earlier one while t + 1 < shared
        weights[start : start + max(0, min(shared - 1, n))] = 0
        seen.append(seq)
        start += n
    return weights


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def position_records(base: dict, var: dict, corpus: Corpus, gathered: torch.Tensor | None) -> dict[str, torch.Tensor]:
    lengths = base["lengths"]
    seq_index = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    if gathered is None:
        gathered = fill_missing(base["topk_ids"], var["topk_ids"], var["topk_logprobs"])
    # BF16 logits tie often, on either side: top-1 agreement counts ties symmetrically (metrics.top1_agreement).
    tied = base["topk_logprobs"] == base["topk_logprobs"][:, :1]
    # The token each position predicts, so that `compare` can check two rows were scored on the same tokens.
    target = (
        torch.cat([torch.as_tensor(seq[1 : 1 + n], dtype=torch.int32) for seq, n in zip(corpus.sequences, lengths.tolist())])
        if len(lengths)
        else torch.zeros(0, dtype=torch.int32)
    )
    rec = {
        "seq_index": seq_index.int(),
        "target": target,
        "top1": top1_agreement(base["topk_ids"], base["topk_logprobs"], var["topk_ids"], var["topk_logprobs"]),
        "base_tie": tied[:, 1:].any(-1),
        "weight": first_occurrence_weights(corpus.sequences, lengths),
        "kl_top": kl_top_lumped(base["topk_logprobs"], gathered),
        "tail": (1 - base["topk_logprobs"].double().exp().sum(-1)).clamp_min(0).float(),
        "dlogp": base["target_logprobs"] - var["target_logprobs"],
    }
    if corpus.groups is not None:  # sequences that share a prompt (chat): intervals resample whole groups
        rec["group"] = torch.repeat_interleave(torch.as_tensor(corpus.groups, dtype=torch.int32), lengths)
    if "full" in base and "full" in var:
        rec["kl_full"] = kl_full(base["full"], var["full"])
    if corpus.prompt_lens is not None:
        mask = torch.zeros(int(lengths.sum()), dtype=torch.bool)
        start = 0
        for n, p in zip(lengths.tolist(), corpus.prompt_lens):
            # position t predicts token t+1: answer tokens sit at p .. len-1, predicted from p-1 .. len-2
            mask[start + p - 1 : start + n] = True
            start += n
        rec["answer_mask"] = mask
    return rec


def dtype_differs(cache: Path, info: dict, row: str) -> str | None:
    """The line for a row whose engine computes in another dtype than the base pass's engine did (vLLM's dtype="auto"
    follows each checkpoint's config, and GPTQ exports often say float16): its scores then hold that difference beside
    the quantization's. None when both are known and the same, or either is unknown."""
    try:
        base = (json.loads((cache / "done.json").read_text()).get("engine") or {}).get("dtype")
    except (OSError, ValueError):
        return None
    mine = info.get("dtype")
    if not base or not mine or base == mine:
        return None
    return (
        f"{row}: its engine computes in {mine} (the checkpoint's config), the base pass's in {base}: its scores include "
        f"that difference beside the quantization's; --engine-arg dtype={base} runs every engine in {base}"
    )


def score_variant(
    run: AblateRun, backend, folder: Path, *, cache: Path, corpora: list[Corpus], score_dir: Path, before_scoring=None
) -> tuple[dict, dict]:
    """Load folder's model and score it against the cached base pass; before_scoring runs once it is loaded."""
    plan, settings = run.plan, run.settings
    metrics, timings = {}, {}
    stages = run.stages
    t0 = time.perf_counter()
    with stages.stage(f"{score_dir.name}: engine start"):
        backend.load(folder)
    timings["load_s"] = time.perf_counter() - t0
    if info := backend.load_info():
        timings["engine"] = info
        if note := dtype_differs(cache, info, score_dir.name):
            stages.notice(note)
    if before_scoring:
        before_scoring()
    score_dir.mkdir(parents=True, exist_ok=True)
    for c in corpora:
        t0 = time.perf_counter()
        base = load_tensors(cache / f"{c.name}.safetensors")
        offsets = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), base["lengths"]]), 0)
        gather = (
            [base["topk_ids"][offsets[i] : offsets[i + 1]] for i in range(len(c.sequences))] if backend.exact_gather else None
        )
        with stages.stage(f"{score_dir.name}: scoring {c.name} ({c.positions()} positions)"):
            scores = list(
                progress_bar(
                    backend.score(
                        c.sequences,
                        plan.top_k,
                        gather_ids=gather,
                        want_full="full" in base,
                        batch_size=pick_batch_size(settings, backend),
                    ),
                    total=len(c.sequences),
                    desc=f"  {folder.name} {c.name}",
                    disable=not settings.progress or None,
                    leave=False,
                )
            )
        var = {
            "topk_ids": torch.cat([s.topk_ids for s in scores]),
            "topk_logprobs": torch.cat([s.topk_logprobs for s in scores]),
            "target_logprobs": torch.cat([s.target_logprobs for s in scores]),
        }
        if "full" in base:
            var["full"] = torch.cat([s.full for s in scores])
        gathered = torch.cat([s.gathered for s in scores]) if backend.exact_gather else None
        rec = position_records(base, var, c, gathered)
        write_tensors(score_dir / f"{c.name}.safetensors", {k: v.contiguous() for k, v in rec.items()})
        metrics[c.name] = summarize(rec, settings.bootstrap)
        timings[f"score_{c.name}_s"] = time.perf_counter() - t0
        timings[f"positions_per_s_{c.name}"] = c.positions() / max(timings[f"score_{c.name}_s"], 1e-9)
    return metrics, timings


def noise_floor(cache: Path, corpora: list[Corpus], bootstrap: int) -> dict:
    out = {}
    for c in corpora:
        base = load_tensors(cache / f"{c.name}.safetensors")
        noise = load_tensors(cache / f"noise-{c.name}.safetensors")
        rec = position_records(base, noise, c, noise.get("gathered"))
        out[c.name] = summarize(rec, bootstrap)
    return out
