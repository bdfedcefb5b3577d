"""A stand-in for `vllm` with the few entry points splicer's vLLM backend uses, computed by the torch reference.

It lets the CPU suite exercise the backend's child-process protocol, prompt_logprobs parsing and failure handling.
It is not vLLM: nothing measured with it says anything about vLLM.

FAKE_VLLM_API=0.26 (the default) or 0.33 picks the release whose API it follows where the two differ for splicer:
0.33 takes SamplingParams.prompt_logprob_token_ids and answers RequestOutput.prompt_token_id_logprobs (vLLM 0.31,
PR #56984) with that release's checks; it takes the engine argument per_request_spec_decode_metrics and then gives
each finished sequence its spec_decode_metrics (CompletionOutput, vLLM 0.33); its LLM.wake_up returns whether the
engine is fully awake (FAKE_VLLM_WAKE_INCOMPLETE=1: not). 0.26 refuses the keywords as it refuses any it does not know,
and its wake_up returns None.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .inputs import TokensPrompt  # noqa: F401  (vLLM exports it at the top level too; lm-eval imports it from there)

__version__ = "0.0.0-fake"


def _exit_without_teardown(code=0):
    """sys.exit in a worker process that imported this fake: flush and end now, with the same exit code, skipping the
    interpreter's teardown of torch (about a second per process; the CPU suite starts ~30 of them). multiprocessing's
    spawned child calls sys.exit(exitcode) once its target has returned and its own finalizers have run. Only in such a
    child, never in the test process itself; the real vLLM is untouched (this module is only on the suite's path)."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr, flush=True)
        code = 1
    os._exit(code)


def _in_a_worker_process() -> bool:
    import multiprocessing

    return multiprocessing.parent_process() is not None


if _in_a_worker_process():
    import sys as _sys

    _sys.exit = _exit_without_teardown

# Every generated token after the first costs this much wall time (a sleep, which never returns early), as a decode
# step costs time in a real engine. Without it the torch reference's extra steps are shorter than the clock's jitter
# between two calls, and the backend's wall-clock estimate (t(n) - t(1)) / (n - 1) came out negative about one run
# in five. Only generation pays it: scoring asks for one token.
DECODE_STEP_S = 0.05
_SLEEP_MODE_ENGINES = 0  # engines built in this process with sleep mode on
COMPILE_S = 0.2  # what a compile costs here when the cache has no entry for the engine
# Engine arguments vLLM's compile-cache key leaves out (vllm/config/load.py and cache.py compute_hash).
_NOT_IN_COMPILE_KEY = {
    "load_format",
    "kv_cache_memory_bytes",
    "gpu_memory_utilization",
    "enable_prefix_caching",
    "disable_log_stats",
    "per_request_spec_decode_metrics",
    "max_logprobs",
    "model_loader_extra_config",
}


@dataclass
class _Metric:
    name: str
    values: list


class FakeModelRunner:
    """What vLLM's worker holds as model_runner (GPUModelRunner, or the V2 runner), reduced to a name."""


@dataclass
class _Counter:
    name: str
    value: float


# Speculative decoding (speculative_config={"method": "mtp", ...}): what share of draft tokens the stand-in accepts. A
# folder with a BF16 MTP head accepts MTP_ACCEPT_BF16, one whose MTP tensors are quantized MTP_ACCEPT_QUANTIZED, one
# without MTP tensors none (a drafter from missing weights); FAKE_VLLM_MTP_ACCEPT overrides all three. Which draft
# tokens are accepted follows from the generated tokens, so the same prompt on the same variant repeats exactly.
MTP_ACCEPT_BF16 = 0.6
MTP_ACCEPT_QUANTIZED = 0.45


def _drafter_accept(model: str) -> float:
    import glob

    from safetensors import safe_open

    if os.environ.get("FAKE_VLLM_MTP_ACCEPT"):
        return float(os.environ["FAKE_VLLM_MTP_ACCEPT"])
    names = [k for f in glob.glob(os.path.join(model, "*.safetensors")) for k in safe_open(f, "pt").keys()]
    mtp = [k for k in names if k.startswith("mtp.")]
    if not mtp:
        return 0.0
    return MTP_ACCEPT_QUANTIZED if any(k.endswith(("weight_packed", "qweight", "weight_scale")) for k in mtp) else MTP_ACCEPT_BF16


# The SamplingParams keywords of later releases, and the release each came in (vLLM 0.31.0: PR #56984).
_LATER_KEYWORDS = {"prompt_logprob_token_ids": (0, 31), "prompt_logprob_start": (0, 31)}
_LATER_ENGINE_ARGS = {"per_request_spec_decode_metrics": (0, 33)}  # vllm/engine/arg_utils.py EngineArgs fields


def _api() -> tuple[int, int]:
    """The release whose API this stand-in follows (FAKE_VLLM_API, read at each call: a test sets it for the worker)."""
    major, minor = os.environ.get("FAKE_VLLM_API", "0.26").split(".")[:2]
    return int(major), int(minor)


def _token_ids_served() -> bool:
    return _api() >= _LATER_KEYWORDS["prompt_logprob_token_ids"]


class VLLMValidationError(ValueError):
    """vLLM's refusal of a request's parameters (vllm/exceptions.py: a ValueError)."""


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class SamplingParams:
    def __init__(
        self,
        max_tokens=16,
        prompt_logprobs=None,
        temperature=1.0,
        stop_token_ids=None,
        detokenize=True,
        min_tokens=0,
        ignore_eos=False,
        flat_logprobs=False,
        **later,
    ):
        for key in later:  # vLLM's SamplingParams is a msgspec.Struct, which words an unknown keyword so
            if _api() < _LATER_KEYWORDS.get(key, (99, 0)):
                raise TypeError(f"Unexpected keyword argument '{key}'")
        self.max_tokens, self.prompt_logprobs, self.flat_logprobs = max_tokens, prompt_logprobs, flat_logprobs
        self.stop_token_ids = stop_token_ids or []
        # checked by the engine, as vLLM 0.33 checks them when a request arrives (SamplingParams.verify)
        self.prompt_logprob_token_ids = later.get("prompt_logprob_token_ids")
        self.prompt_logprob_start = later.get("prompt_logprob_start")


@dataclass
class FlatLogprobs:
    """vLLM's flat layout: per position [actual next token, top-1 .. top-k] (vllm/logprobs.py)."""

    start_indices: list
    end_indices: list
    token_ids: list
    logprobs: list
    ranks: list


@dataclass
class RequestSpecDecodeMetrics:
    """vLLM 0.33's per-sequence spec-decode accumulator (v1/metrics/stats.py): a histogram of accepted draft tokens per
    verify step and the draft tokens proposed."""

    num_spec_tokens: int
    histogram: list
    num_draft_tokens: int = 0

    def to_dict(self) -> dict:
        steps = sum(self.histogram)
        accepted = sum(j * c for j, c in enumerate(self.histogram))
        return {
            "mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
            "draft_acceptance_rate": accepted / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            "acceptance_histogram": list(self.histogram),
            "num_spec_steps": steps,
            "num_accepted_draft_tokens": accepted,
            "num_draft_tokens": self.num_draft_tokens,
            "num_spec_tokens": self.num_spec_tokens,
        }


@dataclass
class _Completion:
    token_ids: list
    spec_decode_metrics: RequestSpecDecodeMetrics | None = None


@dataclass
class RequestStateStats:
    num_generation_tokens: int = 0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0


@dataclass
class RequestOutput:
    prompt_logprobs: list | None
    outputs: list
    metrics: RequestStateStats | None = None


def _engine_dtype(model: str, asked) -> str:
    """vLLM's dtype rule as far as this stand-in needs it: the one asked for, else ("auto") the config's (the root
    config's, then the text config's, as vLLM's _find_dtype reads them), with float32 served as bfloat16. The stand-in
    still computes in bfloat16 (the torch backend)."""
    if asked and asked != "auto":
        return f"torch.{asked}"
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return "torch.bfloat16"
    sub = cfg.get("text_config") or {}
    name = cfg.get("dtype") or cfg.get("torch_dtype") or sub.get("dtype") or sub.get("torch_dtype") or "bfloat16"
    return "torch.bfloat16" if name == "float32" else f"torch.{name}"


class LLM:
    def __init__(self, model: str, **kwargs):
        for name, since in _LATER_ENGINE_ARGS.items():
            if name in kwargs and _api() < since:  # EngineArgs(**kwargs) in vLLM: a dataclass without the field
                raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument '{name}'")
        if kwargs.get("load_format") == "dummy" and kwargs.get("model_loader_extra_config"):
            # vLLM 0.26's DummyModelLoader.__init__ refuses any extra loader config (dummy_loader.py)
            raise ValueError("Model loader extra config is not supported for load format dummy (fake)")
        if os.environ.get("FAKE_VLLM_FAIL_ON") and os.environ["FAKE_VLLM_FAIL_ON"] in model:
            # FAKE_VLLM_FAIL_MESSAGE: another refusal (e.g. an attention layout no prefill backend supports)
            raise ValueError(
                os.environ.get("FAKE_VLLM_FAIL_MESSAGE")
                or "Found a different quantization schemes for ['in_proj_qkv', 'in_proj_z'] (fake)"
            )
        if os.environ.get("FAKE_VLLM_INIT_S"):  # an engine start that takes this long (a start stopped at a budget)
            time.sleep(float(os.environ["FAKE_VLLM_INIT_S"]))
        if os.environ.get("FAKE_VLLM_ECHO"):  # lets a test see which environment an engine process was given
            print(f"fake vllm engine for {os.path.basename(model)}: FAKE_VLLM_ECHO={os.environ['FAKE_VLLM_ECHO']}", flush=True)
        global _SLEEP_MODE_ENGINES
        if kwargs.get("enable_sleep_mode"):
            # vLLM's CuMem allocator serves one engine per process (gpu_worker: "CuMem allocator can only be used for
            # one instance per process"); the real check fails when the earlier engine's pool is still held, which
            # this stand-in takes as always.
            assert _SLEEP_MODE_ENGINES == 0, "CuMem allocator can only be used for one instance per process."
            _SLEEP_MODE_ENGINES += 1
        from types import SimpleNamespace

        from splicer.backends.torch_ref import TorchBackend

        self._ref = None
        if kwargs.get("load_format") != "dummy":  # dummy weights: built, never served
            self._ref = TorchBackend("cpu")
            self._ref.load(model)
        self.kwargs = kwargs
        compiled = _compile(model, kwargs)
        # the context length vLLM derives from the model's config unless max_model_len is given (lm-eval reads it)
        max_len = kwargs.get("max_model_len") or (self._ref.max_positions if self._ref is not None else 2048)
        self.llm_engine = SimpleNamespace(
            vllm_config=SimpleNamespace(compilation_config=SimpleNamespace(compilation_time=compiled)),
            model_config=SimpleNamespace(max_model_len=max_len, dtype=_engine_dtype(model, kwargs.get("dtype"))),
        )
        self.sleeping = False
        self.sleeps = self.wakes = 0
        spec = kwargs.get("speculative_config") or {}
        self.spec_k = int(spec.get("num_speculative_tokens") or 0)
        if self.spec_k and spec.get("method") != "mtp":
            raise ValueError(f"speculative method {spec.get('method')!r} is not served by this stand-in (fake)")
        self.spec_accept = _drafter_accept(model) if self.spec_k and self._ref is not None else 0.0
        self.spec = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0] * self.spec_k}

    def _served(self):
        if self._ref is None:
            raise RuntimeError("an engine with dummy weights was asked to serve (fake)")
        return self._ref

    def sleep(self, level: int = 1):
        if not self.kwargs.get("enable_sleep_mode"):
            raise ValueError("Sleep mode is not enabled in the engine (fake)")  # as vLLM refuses it
        self.sleeping, self.sleeps = True, self.sleeps + 1

    def wake_up(self, tags=None):
        self.sleeping, self.wakes = False, self.wakes + 1
        if _api() >= (0, 33):  # 0.33 returns whether the engine is fully awake
            return os.environ.get("FAKE_VLLM_WAKE_INCOMPLETE") != "1"
        return None

    def apply_model(self, fn):
        return [fn(self._ref.model if self._ref is not None else torch.nn.Module())]

    def collective_rpc(self, fn):
        from types import SimpleNamespace

        return [fn(SimpleNamespace(model_runner=FakeModelRunner()))]  # a worker whose runner has no drafter

    def get_metrics(self):
        out = [_Metric("fake:sleep_wake", [self.sleeps, self.wakes])]
        if self.spec_k and self.kwargs.get("disable_log_stats") is False:  # vLLM counts only with stats on
            out += [
                _Counter("vllm:spec_decode_num_drafts", float(self.spec["drafts"])),
                _Counter("vllm:spec_decode_num_draft_tokens", float(self.spec["draft_tokens"])),
                _Counter("vllm:spec_decode_num_accepted_tokens", float(self.spec["accepted"])),
                _Metric("vllm:spec_decode_num_accepted_tokens_per_pos", list(self.spec["per_pos"])),
            ]
        return out

    def _count_drafts(self, gen: list) -> RequestSpecDecodeMetrics:
        """Speculative decoding over the generated tokens: after the first, each target step checks k draft tokens and
        accepts a leading run of them (token t is accepted when its hash falls under the acceptance share)."""
        import zlib

        k, p = self.spec_k, 1
        mine = RequestSpecDecodeMetrics(k, [0] * (k + 1))
        while p < len(gen):
            run = 0
            while run < k and p + run < len(gen):
                if zlib.crc32(f"{gen[p + run]}:{p + run}".encode()) % 1000 >= 1000 * self.spec_accept:
                    break
                run += 1
            self.spec["drafts"] += 1
            self.spec["draft_tokens"] += k
            self.spec["accepted"] += run
            for j in range(run):
                self.spec["per_pos"][j] += 1
            mine.histogram[run] += 1
            mine.num_draft_tokens += k
            p += run + 1
        return mine

    def generate(self, prompts, sampling_params=None, use_tqdm=True, lora_request=None):
        """vLLM's signature: one SamplingParams for every prompt, or a list of one per prompt (lm-eval passes a list)."""
        per_prompt = (
            sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        )
        if use_tqdm and os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true", "yes"):
            # vLLM 0.26's LLM._run_engine divides by its progress bar's elapsed time, which a disabled tqdm leaves at 0
            # (seen on the H200 when lm-eval asked for the bar under TQDM_DISABLE=1)
            raise ZeroDivisionError("division by zero (fake: vLLM's progress bar under TQDM_DISABLE)")
        if self.sleeping:  # a real engine asleep has no weights on the GPU: serving it would be a bug in the caller
            raise RuntimeError("generate() on a sleeping engine (fake)")
        self._served()
        rows = []
        for p, params in zip(prompts, per_prompt):  # every request is checked before any is served, as vLLM adds them
            checked = (None, 0)
            if _token_ids_served():
                vocab = self._ref.model.get_output_embeddings().weight.shape[0]
                checked = _token_id_rows(params, len(p["prompt_token_ids"]), vocab, self.kwargs)
            rows.append(checked)
        out = []
        for p, params, (asked, start) in zip(prompts, per_prompt, rows):
            ids = p["prompt_token_ids"]
            plp, request_spec = None, None
            if params.prompt_logprobs:
                s = next(self._ref.score([ids], top_k=params.prompt_logprobs, want_full=True))
                plp = [None]
                for t in range(len(ids) - 1):
                    full = s.full[t]
                    entry = {int(i): Logprob(float(full[i]), r + 1) for r, i in enumerate(s.topk_ids[t].tolist())}
                    actual = ids[t + 1]
                    if actual not in entry:
                        entry[actual] = Logprob(float(full[actual]), int((full > full[actual]).sum()) + 1)
                    plp.append(entry)
                if params.flat_logprobs:
                    flat = FlatLogprobs([0], [0], [], [], [])
                    for t in range(len(ids) - 1):
                        full, actual = s.full[t], ids[t + 1]
                        flat.start_indices.append(len(flat.token_ids))
                        flat.token_ids += [actual, *s.topk_ids[t].tolist()]
                        flat.logprobs += [float(full[actual]), *[float(full[i]) for i in s.topk_ids[t].tolist()]]
                        flat.ranks += [int((full > full[actual]).sum()) + 1, *range(1, params.prompt_logprobs + 1)]
                        flat.end_indices.append(len(flat.token_ids))
                    plp = flat
                # a one-token prompt has no prompt position: its token comes from generation, as vLLM's does
                gen = [int(torch.argmax(s.full[-1]))] if len(ids) > 1 else self._ref.generate([ids], 1, [])[0]
            else:
                gen = self._ref.generate([ids], params.max_tokens, params.stop_token_ids)[0]
                if self.spec_k:
                    counted = self._count_drafts(gen)
                    if self.kwargs.get("per_request_spec_decode_metrics", "none") != "none":
                        request_spec = counted
            # The reference computed every token at once: call that the prefill and first token, then pay each
            # later token's decode step, so that the engine's token times and the wall clock both see steps of
            # DECODE_STEP_S (the wall clock also sees the reference's compute, which tells the two estimators apart).
            first = time.monotonic()
            time.sleep(DECODE_STEP_S * max(len(gen) - 1, 0))
            # vLLM fills request stats only with stats on (LLM's own default is off).
            stats = None
            if self.kwargs.get("disable_log_stats") is False:
                stats = RequestStateStats(len(gen), first, time.monotonic())
            answer = RequestOutput(plp, [_Completion(gen, request_spec)], stats)
            if _token_ids_served():  # vLLM 0.31's field, None unless asked: [prompt_len - 1 - start, num_ids], -inf at -1
                answer.prompt_token_id_logprobs = None
                if asked is not None:
                    full = next(self._ref.score([ids], top_k=1, want_full=True)).full[start:]
                    index = torch.from_numpy(asked).long()
                    got = full.gather(1, index.clamp_min(0)).masked_fill(index < 0, float("-inf"))
                    answer.prompt_token_id_logprobs = got.numpy().astype("float32")
            out.append(answer)
        return out


def _token_id_rows(params, prompt_len: int, vocab: int, engine_kwargs: dict):
    """A request's prompt_logprob_token_ids checked as vLLM 0.33 checks them (sampling_params.py _validate_logprobs,
    v1/engine/input_processor.py), in its order and words: (rows as an int64 array padded with -1, first row)."""
    import numpy as np

    ids, start = params.prompt_logprob_token_ids, params.prompt_logprob_start
    if ids is None:
        if start is not None:
            raise VLLMValidationError("prompt_logprob_start requires prompt_logprob_token_ids.")
        return None, 0
    shape = ()
    if isinstance(ids, list) and all(isinstance(row, list) for row in ids):
        shape = (len(ids), max(map(len, ids), default=0))
    elif isinstance(ids, np.ndarray) and ids.dtype.kind in "iu":
        shape = ids.shape
    if len(shape) != 2 or 0 in shape:
        raise VLLMValidationError("prompt_logprob_token_ids must be a non-empty integer array of shape [num_rows, num_ids].")
    max_logprobs = engine_kwargs.get("max_logprobs", 20)  # vLLM's default
    if shape[1] > max_logprobs:
        raise VLLMValidationError(
            f"Requested {shape[1]} token ids per row in prompt_logprob_token_ids, which is greater than max allowed: "
            f"{max_logprobs}. Set max_logprobs (--max-logprobs) to at least {shape[1]}."
        )
    if isinstance(ids, list):
        ids = np.array([row + [-1] * (shape[1] - len(row)) for row in ids], dtype=np.int64)
    if int(ids.min()) < -1 or int(ids.max()) >= vocab:
        raise VLLMValidationError(
            f"prompt_logprob_token_ids contain out-of-vocab token ids (-1 pads a row). Vocabulary size: {vocab}"
        )
    if start is not None and start < 0:
        raise VLLMValidationError("prompt_logprob_start must be non-negative.")
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0":
        raise VLLMValidationError("prompt_logprob_token_ids requires the V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1).")
    if engine_kwargs.get("kv_sharing_fast_prefill"):
        raise VLLMValidationError("prompt_logprob_token_ids is incorrect with --kv-sharing-fast-prefill; disable it for scoring.")
    start = start or 0
    rows = max(prompt_len - 1 - start, 0)
    if len(ids) != rows:
        raise VLLMValidationError(
            f"prompt_logprob_token_ids has {len(ids)} rows, but the prompt has {rows} scored rows "
            "(prompt_len - 1 - prompt_logprob_start)."
        )
    return ids, start


def _compile(model: str, kwargs: dict) -> float:
    """vLLM's compile cache, reduced to its key: the model folder and the arguments that shape the graph. A miss costs
    COMPILE_S and writes the entry (under VLLM_CACHE_ROOT, where the backend puts it with an engine cache folder;
    without one nothing is compiled, so that the other tests' engines start at once); returns the compile time."""
    import hashlib
    import json

    root = os.environ.get("VLLM_CACHE_ROOT")
    if not root:
        return 0.0
    key = {k: v for k, v in kwargs.items() if k not in _NOT_IN_COMPILE_KEY}
    digest = hashlib.sha256(json.dumps([model, key], sort_keys=True, default=str).encode()).hexdigest()[:16]
    entry = os.path.join(root, "fake-compile", digest)
    if os.path.exists(entry):
        return 0.0
    time.sleep(COMPILE_S)
    os.makedirs(os.path.dirname(entry), exist_ok=True)
    open(entry, "w").close()
    return COMPILE_S
