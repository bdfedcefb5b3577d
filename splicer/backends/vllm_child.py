"""What runs in the engine's child process: import vLLM once, build one engine per variant, serve score / generate /
time / probe requests over the pipe, and release each engine's GPU memory before the next (see `vllm_backend`)."""

from __future__ import annotations

import os
import re
import sys
import time
import traceback

import torch

from . import vllm_expert_cache
from .vllm_outputs import (
    SPEC_PREFIX,
    TOKEN_ID_SCORING_SINCE,
    engine_step_s,
    gathered_logprobs,
    sequence_scores,
    summarise_decode_runs,
)

TASK_CHUNK = 1024  # lm-eval's requests handed to vLLM per generate call when no --batch-size is given


def _kernel_probe(model):
    """Runs inside vLLM's worker: which quantization method / scheme / kernel each layer got."""
    out = {}
    for name, module in model.named_modules():
        qm = getattr(module, "quant_method", None)
        if qm is None:
            continue
        parts = [type(qm).__name__]
        scheme = getattr(module, "scheme", None)
        if scheme is not None:
            parts.append(type(scheme).__name__)
            kernel = getattr(scheme, "kernel", None)
            if kernel is not None:
                parts.append(type(kernel).__name__)
        for attr in ("experts_cls", "moe_kernel", "wna16_backend", "backend"):
            v = getattr(qm, attr, None)
            if v is None or (callable(v) and not isinstance(v, type)):
                continue
            if isinstance(v, type):
                v = v.__name__
            elif not isinstance(v, (str, int, float, bool)):
                v = getattr(v, "name", None) or type(v).__name__  # enums by name, other objects by class
            parts.append(f"{attr}={v}")
        # Layer numbers folded into *; layers of one pattern that differ (a splice of some layers) keep every variant.
        out.setdefault(re.sub(r"\.\d+\.", ".*.", name), set()).add(" / ".join(parts))
    return {k: " | ".join(sorted(v)) for k, v in out.items()}


def _redirect_output(log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _die_with_parent() -> None:
    """Linux: end this worker (and free its GPU memory) if the parent dies, even by SIGKILL."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _release(holder: list) -> None:
    """Free the in-process engine in holder (the only reference left) so the next can start in this process.

    As vLLM's own tests do between engines: shut the engine core down, drop the last reference (vLLM 0.26's
    LLMEngine finalizer then removes the bytecode hooks that pin the compiled model), tear down the distributed
    state and give the memory back to the driver.
    """
    import gc

    llm = holder.pop()
    try:
        finalize = getattr(llm.llm_engine, "_finalizer", None)
        llm.llm_engine.engine_core.shutdown()
        if finalize is not None:
            finalize()
    except Exception:
        traceback.print_exc()
    del llm
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:
        traceback.print_exc()
    # Dynamo's caches may still hold the old model; the next engine compiles (or loads from vLLM's cache) afresh anyway.
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _drafter_probe(worker):
    """Runs inside vLLM's worker: _kernel_probe on the speculative drafter (e.g. the MTP head), if there is one."""
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    model = getattr(drafter, "model", None)
    return _kernel_probe(model) if model is not None else {}


def _runner_probe(worker):
    """Runs inside vLLM's worker: the model runner's class (vLLM 0.29 made its V2 runner the default for hybrid and MoE
    models, VLLM_USE_V2_MODEL_RUNNER), so that timings say which runner they measured."""
    runner = getattr(worker, "model_runner", None)
    return None if runner is None else f"{type(runner).__module__}.{type(runner).__qualname__}"


def _takes_prompt_logprob_token_ids(sampling_params) -> bool:
    """Whether this vLLM's SamplingParams has prompt_logprob_token_ids (vLLM 0.31, PR #56984: log-probs of given ids
    per prompt position); an older one refuses the keyword with a TypeError, as for any keyword it does not know."""
    try:
        sampling_params(max_tokens=1, prompt_logprob_token_ids=[[0]])
    except TypeError:
        return False
    except Exception:  # a known keyword whose value this release checks at once: the engine's probe decides
        return True
    return True


def _has_engine_arg(name: str) -> bool:
    """Whether this vLLM's EngineArgs has the field (an older release refuses an unknown one when the engine is built)."""
    try:
        import dataclasses

        from vllm.engine.arg_utils import EngineArgs

        return name in {f.name for f in dataclasses.fields(EngineArgs)}
    except Exception:
        return False


# vLLM 0.33: each finished sequence's own spec-decode counts (CompletionOutput.spec_decode_metrics), independent of the
# engine's cumulative counters and of disable_log_stats; "summary" is the histogram without per-step arrays.
PER_REQUEST_SPEC = "per_request_spec_decode_metrics"


def _token_id_scoring(llm, sampling_params, tokens_prompt) -> dict:
    """Whether this engine serves prompt_logprob_token_ids, asked with one two-token request: vLLM 0.33 also needs its
    V2 model runner and refuses the parameter with kv_sharing_fast_prefill (v1/engine/input_processor.py), so the
    engine, not the release, decides. {"served": bool, "why_not": vLLM's refusal or what came back, in one line}."""
    try:
        params = sampling_params(max_tokens=1, temperature=0.0, detokenize=False, prompt_logprob_token_ids=[[0]])
        res = llm.generate([tokens_prompt(prompt_token_ids=[0, 0])], params, use_tqdm=False)
        got = getattr(res[0], "prompt_token_id_logprobs", None)
        if got is None or tuple(getattr(got, "shape", ())) != (1, 1):
            shape = None if got is None else tuple(getattr(got, "shape", ()))
            return {"served": False, "why_not": f"asked for 1 row of 1 id, it returned prompt_token_id_logprobs {shape}"}
    except Exception as e:
        reason = (str(e).strip().splitlines() or [""])[0][:300]
        return {"served": False, "why_not": f"{e.__class__.__name__}: {reason}"}
    return {"served": True, "why_not": None}


def _engine_dtype(llm) -> str | None:
    """What the engine computes in: dtype="auto" takes the checkpoint's config (a GPTQ export's float16); the engine's
    own model_config, or its vllm_config's where it has none of its own. None where neither can be read (informative
    only)."""
    try:
        engine = llm.llm_engine
        config = getattr(engine, "model_config", None) or engine.vllm_config.model_config
        return str(config.dtype).replace("torch.", "")
    except Exception:
        return None


def child_worker(conn, env: dict, log_path: str) -> None:
    """Child process: import vLLM once, then load engines one after another and serve requests on each.

    Keeping one process for the whole run keeps what vLLM and Triton hold in memory (imports, autotuning
    results, compiled kernels) from one variant to the next; the caches on disk (env) survive a restart.
    """
    _redirect_output(log_path)
    _die_with_parent()
    os.environ.update(env)
    if env.get("SPLICER_CPUS") and hasattr(os, "sched_setaffinity"):
        # A run spread over GPUs gives each GPU's processes their own cores (inherited by vLLM's compile workers), so an
        # engine starting for one GPU does not take the CPU from an engine being timed on another.
        os.sched_setaffinity(0, {int(c) for c in env["SPLICER_CPUS"].split(",")})
    if env.get("OMP_NUM_THREADS"):  # torch was imported (with this module) before env applied
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    t0 = time.perf_counter()
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except BaseException as e:
        traceback.print_exc()
        conn.send(("error", f"{e.__class__.__name__}: {e}"))
        return
    import_s = time.perf_counter() - t0
    takes_token_ids = _takes_prompt_logprob_token_ids(SamplingParams)
    per_request_spec = _has_engine_arg(PER_REQUEST_SPEC)
    llm = None

    def load(folder, engine_args, variant_log, sleep_after=False):
        nonlocal llm
        _redirect_output(variant_log)
        try:  # vLLM logs many choices once per process; each engine's log should name its own
            from vllm import logger as vlogger

            for fn in ("_print_info_once", "_print_warning_once", "_print_debug_once"):
                getattr(vlogger, fn, None) and getattr(vlogger, fn).cache_clear()
        except Exception:
            pass
        spec_per_request = bool(engine_args.get("speculative_config")) and per_request_spec
        if spec_per_request and PER_REQUEST_SPEC not in engine_args:
            engine_args = {**engine_args, PER_REQUEST_SPEC: "summary"}
        expert_cache = engine_args.get("load_format") == vllm_expert_cache.LOAD_FORMAT
        if expert_cache:  # --expert-cache: splicer's loader, registered with this process's vLLM
            vllm_expert_cache.register()
            vllm_expert_cache.reset()
        t = time.perf_counter()
        llm = LLM(model=folder, **engine_args)
        startup = time.perf_counter() - t
        try:
            probe = llm.apply_model(_kernel_probe)
            layers = probe[0] if isinstance(probe, list) and probe else probe
        except Exception as e:  # the probe is informative only
            layers = {"error": f"{e.__class__.__name__}: {e}"}
        compile_s = None
        try:  # in-process engines share the config object the compiler adds its time to
            compile_s = float(llm.llm_engine.vllm_config.compilation_config.compilation_time)
        except Exception:
            pass
        try:
            runner = llm.collective_rpc(_runner_probe)
            runner = runner[0] if isinstance(runner, list) and runner else runner
        except Exception as e:  # informative only
            runner = f"unknown ({e.__class__.__name__})"
        if not takes_token_ids:
            scoring = {
                "served": False,
                "why_not": f"vLLM {vllm.__version__} has no prompt_logprob_token_ids ({TOKEN_ID_SCORING_SINCE} and later)",
            }
        elif engine_args.get("load_format") == "dummy":  # built to compile ahead, never served
            scoring = {"served": False, "why_not": "not asked: an engine with dummy weights"}
        else:
            scoring = _token_id_scoring(llm, SamplingParams, TokensPrompt)
        info = {
            "vllm": vllm.__version__,
            "dtype": _engine_dtype(llm),
            "model_runner": runner,
            "token_id_scoring": scoring,
            "spec_counts_per_request": spec_per_request and engine_args.get(PER_REQUEST_SPEC) != "none",
            "startup_s": startup,
            "import_s": import_s,
            "compile_time_s": compile_s,
            "layers": layers,
            "pid": os.getpid(),
            **({"expert_cache": vllm_expert_cache.last_outcome()} if expert_cache else {}),
        }
        if sleep_after:  # level 1: weights to CPU memory, KV cache dropped; the GPU is free for the engine serving now
            t = time.perf_counter()
            llm.sleep(level=1)
            info["sleep_s"] = time.perf_counter() - t
        return info

    def wake():
        t = time.perf_counter()
        if llm.wake_up() is False:  # vLLM 0.33 says whether the engine is fully awake (before, it returns None)
            raise RuntimeError("vLLM's engine did not wake fully from sleep (LLM.wake_up returned False)")
        return time.perf_counter() - t

    def sleep():
        t = time.perf_counter()
        llm.sleep(level=1)
        return time.perf_counter() - t

    def unload():
        nonlocal llm
        if llm is not None:
            holder, llm = [llm], None
            _release(holder)

    def score(seqs, top_k, chunk, gather=None):
        """Per sequence vLLM's own top-k and the actual next token (prompt_logprobs); with gather (per sequence the ids
        to score at each position, [T-1, g] int32: the base's top-k) also the engine's log-probs of those ids
        (prompt_logprob_token_ids), one SamplingParams per sequence since the rows are its own. The variant's top-k
        stays asked for: top-1 agreement reads its tied maxima (metrics.top1_agreement), and its log-prob of the actual
        token comes from the same computation as the base pass's (dNLL)."""
        kw = dict(max_tokens=1, prompt_logprobs=top_k, detokenize=False, temperature=0.0)
        try:  # flat lists instead of one dict of Logprob objects per position: far less Python work per position
            params = SamplingParams(**kw, flat_logprobs=True)
            kw["flat_logprobs"] = True
        except TypeError:  # a vLLM without flat logprobs
            params = SamplingParams(**kw)
        out = []
        for s in range(0, len(seqs), chunk):
            batch = seqs[s : s + chunk]
            prompts = [TokensPrompt(prompt_token_ids=q) for q in batch]
            if gather is None:
                res = llm.generate(prompts, params, use_tqdm=False)
                out += [sequence_scores(q, r.prompt_logprobs, top_k) for q, r in zip(batch, res)]
                continue
            ids = gather[s : s + chunk]
            # vLLM refuses an empty row array; a one-token sequence has no position to score
            per_seq = [SamplingParams(**kw, prompt_logprob_token_ids=g) if len(g) else params for g in ids]
            res = llm.generate(prompts, per_seq, use_tqdm=False)
            for q, g, r in zip(batch, ids, res):
                scores = sequence_scores(q, r.prompt_logprobs, top_k)
                got = getattr(r, "prompt_token_id_logprobs", None)
                scores.gathered = gathered_logprobs(got, g) if len(g) else torch.zeros(g.shape, dtype=torch.float32)
                out.append(scores)
        return out

    def generate(prompts, n, stop):
        params = SamplingParams(max_tokens=n, temperature=0.0, stop_token_ids=list(stop), detokenize=False)
        res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(r.outputs[0].token_ids) for r in res]

    def time_decode(prompt, n, warmup, runs):
        def once(k):
            """(wall seconds around generate, engine seconds per decode step or None)."""
            params = SamplingParams(max_tokens=k, min_tokens=k, ignore_eos=True, temperature=0.0, detokenize=False)
            sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
            sync()
            t = time.perf_counter()
            res = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            sync()
            wall = time.perf_counter() - t
            return wall, engine_step_s(getattr(res[0], "metrics", None))

        for _ in range(warmup):
            once(n)
        t1_s, tn_s, steps = [], [], []
        for _ in range(runs):
            (t1, _), (tn, step) = once(1), once(n)
            t1_s.append(t1)
            tn_s.append(tn)
            steps.append(step)
        return summarise_decode_runs(t1_s, tn_s, steps, new_tokens=n, warmup=warmup, prompt_tokens=len(prompt))

    def speculate(prompts, n):
        """Each prompt generated greedily on its own (n tokens, EOS ignored), with the spec-decode counters read
        before and after it (the counters are cumulative, so the difference is that request's drafts alone) and, where
        the engine gives them (vLLM 0.33), the sequence's own counts."""
        params = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0, detokenize=False)
        out = []
        for p in prompts:
            before = metrics(SPEC_PREFIX)
            res = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)
            seq = res[0].outputs[0]
            own = getattr(seq, "spec_decode_metrics", None)
            own = own.to_dict() if hasattr(own, "to_dict") else own
            out.append({"tokens": list(seq.token_ids), "before": before, "after": metrics(SPEC_PREFIX), "request": own})
        return out

    def lm_eval(folder, tokenizer, engine_args, variant_log, request):
        """lm-eval's VLLM model on folder (it builds the engine from engine_args), evaluated here; the engine is released
        before the answer goes back, so the GPU is free for the next row."""
        nonlocal llm
        _redirect_output(variant_log)
        from lm_eval.models.vllm_causallms import VLLM

        from .lm_eval_tasks import evaluate

        unload()
        # A number, never lm-eval's "auto": with "auto" lm-eval asks vLLM for its progress bar, and vLLM 0.26 divides by
        # that bar's elapsed time, which is 0 when tqdm is off (TQDM_DISABLE, as `-q` sets it): ZeroDivisionError in
        # LLM._run_engine. Requests go to vLLM in chunks of this many; its scheduler batches within each.
        batch = int(request.get("batch_size") or TASK_CHUNK)
        lm = VLLM(pretrained=folder, tokenizer=tokenizer, batch_size=batch, **engine_args)
        llm = lm.model  # released by unload(), here or when the worker stops
        try:
            return {**evaluate(lm, request), "engine": {"dtype": _engine_dtype(llm)}}
        finally:
            lm.model = None
            del lm
            unload()

    def drafter_layers():
        res = llm.collective_rpc(_drafter_probe)
        return res[0] if isinstance(res, list) and res else res

    def metrics(prefix):
        """Counters and gauges from vLLM's own metrics whose name starts with prefix (needs disable_log_stats=False)."""
        out = {}
        for m in llm.get_metrics():
            if not m.name.startswith(prefix):
                continue
            # one metric may come once per label set (engine index, ...): summed, as vLLM's own example does
            value = list(m.values) if hasattr(m, "values") else getattr(m, "value", None)
            old = out.get(m.name)
            if isinstance(value, list) and isinstance(old, list):
                value = [a + b for a, b in zip(old + [0] * (len(value) - len(old)), value + [0] * (len(old) - len(value)))]
            elif isinstance(value, (int, float)) and isinstance(old, (int, float)):
                value = old + value
            out[m.name] = value
        return out

    ops = {
        "load": load,
        "wake": wake,
        "sleep": sleep,
        "unload": unload,
        "score": score,
        "generate": generate,
        "time": time_decode,
        "drafter_layers": drafter_layers,
        "metrics": metrics,
        "speculate": speculate,
        "lm_eval": lm_eval,
    }
    conn.send(("started", {"import_s": import_s, "vllm": vllm.__version__, "prompt_logprob_token_ids": takes_token_ids}))
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        try:
            conn.send(("ok", ops[msg[0]](*msg[1:])))
        except BaseException as e:
            traceback.print_exc()
            conn.send(("error", f"{e.__class__.__name__}: {e}"))
            if msg[0] in ("load", "lm_eval"):  # a failed start can leave a half-built engine holding GPU memory: end the process
                break
    llm = None  # drop the engine before answering, so the GPU is free when the parent moves on
    conn.send(("stopped", None))
