"""vLLM's outputs as splicer's records: prompt log-probs (and the log-probs of given ids, prompt_token_id_logprobs) ->
SequenceScores, and per-run request times -> the decode summary (engine estimator beside the wall-clock one). Pure
functions: the child process and tests use them."""

from __future__ import annotations

import statistics

import torch

from .base import SequenceScores, decode_summary

PAD_LOGPROB = -1.0e4  # for a missing top-k slot: exp() is 0, and 0 * finite stays 0 in the KL sums
# The first vLLM release with SamplingParams.prompt_logprob_token_ids (PR #56984), as messages name it; whether a vLLM
# has it is asked of the vLLM itself (vllm_child), never read from this.
TOKEN_ID_SCORING_SINCE = "0.31"


def scores_from_prompt_logprobs(prompt_ids: list[int], prompt_logprobs: list, top_k: int) -> SequenceScores:
    """vLLM's prompt_logprobs ([None, {token: Logprob(logprob, rank, ...)}, ...]) -> SequenceScores.

    Entry t+1 is the distribution at position t over token t+1; it holds the top-k by rank
    and the actual token (whose rank may be larger than k).
    """
    n = len(prompt_ids) - 1
    ids = torch.full((n, top_k), -1, dtype=torch.int32)
    lps = torch.full((n, top_k), PAD_LOGPROB, dtype=torch.float32)
    target = torch.empty(n, dtype=torch.float32)
    for t in range(n):
        entry = prompt_logprobs[t + 1] or {}
        ranked = sorted(((lp.rank, tok, lp.logprob) for tok, lp in entry.items() if lp.rank is not None and lp.rank <= top_k))
        for j, (_, tok, lp) in enumerate(ranked[:top_k]):
            ids[t, j] = tok
            lps[t, j] = lp
        actual = entry.get(prompt_ids[t + 1])
        if actual is None:
            raise RuntimeError(f"vLLM returned no logprob for the actual token at position {t + 1}")
        target[t] = actual.logprob
    return SequenceScores(topk_ids=ids, topk_logprobs=lps, target_logprobs=target)


def scores_from_flat_logprobs(prompt_ids: list[int], flat, top_k: int) -> SequenceScores:
    """vLLM's FlatLogprobs (SamplingParams(flat_logprobs=True), vLLM >= 0.12) -> SequenceScores without per-logprob objects.

    vLLM appends, for every prompt position after the first, the actual next token with its rank followed by
    the top-k in rank order (vllm/logprobs.py, append_logprobs_for_next_position): k + 1 entries per position.
    """
    n = len(prompt_ids) - 1
    starts = torch.tensor(flat.start_indices[1:], dtype=torch.long)
    ends = torch.tensor(flat.end_indices[1:], dtype=torch.long)
    if len(starts) != n or not bool(((ends - starts) == top_k + 1).all()):
        raise RuntimeError(f"vLLM's flat prompt logprobs do not hold {top_k} + 1 entries at each of {n} positions")
    idx = starts[:, None] + torch.arange(top_k + 1)
    ids = torch.tensor(flat.token_ids, dtype=torch.long)[idx]
    lps = torch.tensor(flat.logprobs, dtype=torch.float32)[idx]
    if not torch.equal(ids[:, 0], torch.tensor(prompt_ids[1:], dtype=torch.long)):
        raise RuntimeError("vLLM's flat prompt logprobs do not start each position with the actual next token")
    return SequenceScores(
        topk_ids=ids[:, 1:].to(torch.int32).contiguous(),
        topk_logprobs=lps[:, 1:].contiguous(),
        target_logprobs=lps[:, 0].contiguous(),
    )


def gathered_logprobs(token_id_logprobs, ids) -> torch.Tensor:
    """vLLM's RequestOutput.prompt_token_id_logprobs (vLLM >= 0.31: [prompt_len - 1, num_ids], row t the log-probs of
    the ids asked for position t as predictions of token t+1, -inf where an id was -1) -> SequenceScores.gathered,
    float32 of the ids' shape; an id of -1 (a top-k slot the base pass left empty) gets PAD_LOGPROB as its top-k slot
    has, so that 0 x its log-prob stays 0 in the KL sums."""
    import numpy as np

    ids = torch.as_tensor(np.asarray(ids))
    if token_id_logprobs is None:
        # vLLM 0.33 drops them for a request resumed after preemption (v1/worker/gpu/sample/prompt_logprob.py)
        raise RuntimeError(
            "vLLM returned no prompt_token_id_logprobs for a sequence scored with prompt_logprob_token_ids (vLLM drops "
            "them for a request preempted and resumed); fewer sequences per engine call (--batch-size) leave less to preempt"
        )
    got = torch.from_numpy(np.array(token_id_logprobs, dtype=np.float32))
    if tuple(got.shape) != tuple(ids.shape):
        raise RuntimeError(
            f"vLLM's prompt_token_id_logprobs have shape {tuple(got.shape)}, not the {tuple(ids.shape)} of the ids asked"
        )
    return torch.where(ids < 0, torch.tensor(PAD_LOGPROB, dtype=torch.float32), got)


def sequence_scores(prompt_ids, prompt_logprobs, top_k) -> SequenceScores:
    if hasattr(prompt_logprobs, "start_indices"):
        return scores_from_flat_logprobs(prompt_ids, prompt_logprobs, top_k)
    return scores_from_prompt_logprobs(prompt_ids, prompt_logprobs, top_k)


def engine_step_s(metrics) -> float | None:
    """Seconds per decode step from a finished request's stats (vLLM's RequestStateStats), None without them."""
    first, last = getattr(metrics, "first_token_ts", 0.0), getattr(metrics, "last_token_ts", 0.0)
    n = getattr(metrics, "num_generation_tokens", 0)
    if not first or not last or n < 2 or last < first:
        return None
    return (last - first) / (n - 1)


ENGINE_METHOD = "engine: (last token time - first token time) / (n - 1), from vLLM's request stats (TPOT), batch 1"


WALL_METHOD = "wall: (t(n) - t(1)) / (n - 1), wall clock around LLM.generate, batch 1"


def summarise_decode_runs(
    t1_s: list[float],
    tn_s: list[float],
    engine_step_s_runs: list[float | None],
    *,
    new_tokens: int,
    warmup: int,
    prompt_tokens: int,
) -> dict:
    """The timing entry of results.json from time_decode's runs (pure: the worker measures, this summarises).

    Per run: t1_s and tn_s are the wall seconds of a request generating 1 and new_tokens tokens, engine_step_s_runs
    the engine's own seconds per decode step (engine_step_s; None where the request had no stats). The engine's
    times are used when every run has them, else the wall-clock difference (t(n) - t(1)) / (n - 1). When the chosen
    estimate's median is not positive, decode_ms_per_token is None, the method says it was not resolved, and the
    per-run values stay under per_run_ms.
    """
    runs, n = len(tn_s), new_tokens
    # With one new token there is no decode step to time: no per-run value at all rather than a division by zero.
    wall_diff = [(tn - t1) * 1000 / (n - 1) for t1, tn in zip(t1_s, tn_s)] if n > 1 else []
    engine = [s * 1000 for s in engine_step_s_runs if s is not None]
    # The wall-clock difference carries two prefills' jitter (TTFT of the 1.5k-token prompt ranged 85-211 ms on
    # the H200, i.e. up to +-1 ms/token over 63 steps); the engine's own token times carry none.
    use_engine = runs > 0 and len(engine) == runs
    per_token, method = (engine, ENGINE_METHOD) if use_engine else (wall_diff, WALL_METHOD)
    summary = decode_summary(per_token)
    if summary["decode_ms_per_token"] is None:
        median = f"{statistics.median(per_token):.4g} ms/token" if per_token else "no value (fewer than 2 new tokens or no runs)"
        method = (
            f"not resolved: {method} gave a median of {median}, which is no measurement (decode steps shorter "
            "than the clock's noise); the per-run values are in per_run_ms"
        )
    ttft = [t * 1000 for t in t1_s]
    out = {
        **summary,
        "ttft_ms": statistics.median(ttft) if ttft else None,
        "ttft_min_max": [min(ttft), max(ttft)] if ttft else None,
        "runs": runs,
        "warmup": warmup,
        "prompt_tokens": prompt_tokens,
        "new_tokens": n,
        "method": method,
    }
    if use_engine:  # the old estimator beside it, from the same runs
        out["wall_diff"] = decode_summary(wall_diff)
    return out


# vLLM's spec-decode counters (vllm/v1/metrics/loggers.py, SpecDecodingProm), as LLM.get_metrics() names them: drafts
# (one per decode step that proposed tokens), draft tokens (k per draft), accepted tokens, and accepted tokens per
# draft position (a vector of k).
SPEC_PREFIX = "vllm:spec_decode"
SPEC_DRAFTS = "vllm:spec_decode_num_drafts"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _count(value) -> int:
    if isinstance(value, (list, tuple)):
        return int(sum(value))
    return int(value or 0)


def spec_from_request(metrics: dict, k: int) -> dict:
    """One sequence's drafts from vLLM's own per-request counts (vLLM 0.33, `--per-request-spec-decode-metrics`:
    CompletionOutput.spec_decode_metrics, RequestSpecDecodeMetrics.to_dict): its histogram of accepted draft tokens per
    verify step gives the drafts (steps), the accepted tokens and the accepted tokens per position (a step that
    accepted j tokens accepted positions 1..j), as the engine's counters count them."""
    hist = [int(c) for c in metrics["acceptance_histogram"]]
    if len(hist) != k + 1:
        raise ValueError(f"vLLM's per-request spec-decode histogram has {len(hist)} entries for k={k} (want {k + 1})")
    return {
        "drafts": sum(hist),
        "draft_tokens": int(metrics["num_draft_tokens"]),
        "accepted": sum(j * c for j, c in enumerate(hist)),
        "accepted_per_pos": [sum(hist[i + 1 :]) for i in range(k)],
    }


def spec_counts(answer: dict, k: int) -> dict:
    """One request's drafts: the sequence's own counts where the engine gave them, else the engine counters' difference
    (spec_decode_delta); `counted_by` says which, and `counters_agree` whether both, where both were there, agree."""
    delta = spec_decode_delta(answer["before"], answer["after"], k)
    if not answer.get("request"):
        return {**delta, "counted_by": "engine counters"}
    own = spec_from_request(answer["request"], k)
    counted = SPEC_DRAFTS in answer["after"]  # the engine reports its counters only with stats on
    return {**own, "counted_by": "request", **({"counters_agree": own == delta} if counted else {})}


def spec_decode_delta(before: dict, after: dict, k: int) -> dict:
    """One request's drafts from the counters read before and after it (the `speculate` op): drafts, draft tokens,
    accepted tokens and accepted tokens per position (k of them). Counters the engine did not report count 0; a counter
    that went down (an engine whose metrics were reset meanwhile) is an error, not a negative count."""
    out = {}
    for key, name in (("drafts", SPEC_DRAFTS), ("draft_tokens", SPEC_DRAFT_TOKENS), ("accepted", SPEC_ACCEPTED)):
        out[key] = _count(after.get(name)) - _count(before.get(name))
    pos_a, pos_b = list(after.get(SPEC_PER_POS) or []), list(before.get(SPEC_PER_POS) or [])
    pos_a += [0] * (k - len(pos_a))
    pos_b += [0] * (len(pos_a) - len(pos_b))
    out["accepted_per_pos"] = [int(x) - int(y) for x, y in zip(pos_a, pos_b)][:k]
    if any(v < 0 for v in (out["drafts"], out["draft_tokens"], out["accepted"], *out["accepted_per_pos"])):
        raise ValueError(f"vLLM's spec-decode counters went down during one request: {before} -> {after}")
    return out
