"""vLLM backend: the serving engine itself, in a child process that outlives the variants.

The child (multiprocessing "spawn": a script that uses this backend must keep its work under
`if __name__ == "__main__":`, since the child re-imports it) imports vLLM once and builds one
`vllm.LLM` per variant with the engine core in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`),
freeing it before the next. A crash, an out-of-memory error or a load refusal ends that child
(the variant is recorded as failed) and the next variant starts a fresh one, so one variant
cannot take `ablate` down. Compile, Triton and autotuning caches stay on disk (per-user folders, or
cache_dir), so later engines and later runs reuse them.

Scoring uses `SamplingParams(max_tokens=1, prompt_logprobs=k, detokenize=False)`: per
prompt position vLLM returns its own top-k plus the actual next token. Its top-k need not
contain the base's top-k ids, so KL over the base's top-k is filled in conservatively
(metrics.fill_missing). Timing runs batch-1 requests with CUDA graphs as configured.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import os
import re
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Iterator

import torch

from ..errors import SplicerError
from . import SequenceScores, decode_summary

PAD_LOGPROB = -1.0e4  # for a missing top-k slot: exp() is 0, and 0 * finite stays 0 in the KL sums

# Log lines that name the kernels and methods vLLM chose (vllm 0.26 - 0.33 wording).
KERNEL_LINE = re.compile(
    r"(Using \S+ for CompressedTensorsWNA16|Using \S*MoEMethod\S*|Using '\S+' WNA16 MoE backend|"
    r"Using \S+ Unquantized MoE backend|Using \S+ attention backend|Using .* GDN prefill kernel|"
    r"Using \S+LinearKernel\S*|Selected \S+ for|Using FlashAttention version \d)"
)


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
    return SequenceScores(topk_ids=ids[:, 1:].to(torch.int32).contiguous(), topk_logprobs=lps[:, 1:].contiguous(),
                          target_logprobs=lps[:, 0].contiguous())


def _scores(prompt_ids, prompt_logprobs, top_k) -> SequenceScores:
    if hasattr(prompt_logprobs, "start_indices"):
        return scores_from_flat_logprobs(prompt_ids, prompt_logprobs, top_k)
    return scores_from_prompt_logprobs(prompt_ids, prompt_logprobs, top_k)


def _arch_of(folder):
    from ..arch import get_architecture

    return get_architecture(json.loads((Path(folder) / "config.json").read_text()))


def kernels_by_class(layers: dict, arch) -> dict:
    """{class: sorted distinct 'method / scheme / kernel' strings} from the per-layer probe (vLLM layer names ->
    classes by the family's table)."""
    out: dict[str, set] = {}
    for name, desc in layers.items():
        if name == "error":
            continue
        cls = arch.kernel_class(name)
        if cls:
            out.setdefault(cls, set()).update(re.sub(r" at 0x[0-9a-f]+>", ">", d) for d in str(desc).split(" | "))
    return {c: sorted(v) for c, v in out.items()}


def _parse_engine_value(v: str):
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def default_engine_args() -> tuple[dict, dict]:
    """(engine kwargs, environment) that the GPU machine needs; see scripts/gpu/README.md."""
    # Stats on (as under `vllm serve`): each request then carries the engine's own first- and last-token times,
    # from which decode is timed without the prefill's jitter (see time_decode).
    args = {"enable_prefix_caching": False, "max_logprobs": 20, "disable_log_stats": False}
    env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # lets LLM.apply_model ship the kernel probe to the worker
    if importlib.util.find_spec("flashinfer") is None:
        # Without flashinfer, vLLM 0.26's FlashInfer sampler and its SM90 GDN prefill cannot start.
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
        args["gdn_prefill_backend"] = "triton"
    return args, env


def engine_step_s(metrics) -> float | None:
    """Seconds per decode step from a finished request's stats (vLLM's RequestStateStats), None without them."""
    first, last = getattr(metrics, "first_token_ts", 0.0), getattr(metrics, "last_token_ts", 0.0)
    n = getattr(metrics, "num_generation_tokens", 0)
    if not first or not last or n < 2 or last < first:
        return None
    return (last - first) / (n - 1)


ENGINE_METHOD = "engine: (last token time - first token time) / (n - 1), from vLLM's request stats (TPOT), batch 1"
WALL_METHOD = "wall: (t(n) - t(1)) / (n - 1), wall clock around LLM.generate, batch 1"


def summarise_decode_runs(t1_s: list[float], tn_s: list[float], engine_step_s_runs: list[float | None], *,
                          new_tokens: int, warmup: int, prompt_tokens: int) -> dict:
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
        method = (f"not resolved: {method} gave a median of {median}, which is no measurement (decode steps shorter "
                  "than the clock's noise); the per-run values are in per_run_ms")
    ttft = [t * 1000 for t in t1_s]
    out = {**summary, "ttft_ms": statistics.median(ttft) if ttft else None,
           "ttft_min_max": [min(ttft), max(ttft)] if ttft else None,
           "runs": runs, "warmup": warmup, "prompt_tokens": prompt_tokens, "new_tokens": n, "method": method}
    if use_engine:  # the old estimator beside it, from the same runs
        out["wall_diff"] = decode_summary(wall_diff)
    return out


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


# Lines of vLLM's own start-up log that split an engine's start into its parts (vllm 0.26 wording).
STARTUP_LINES = {
    "weights_load_s": re.compile(r"Loading weights took ([\d.]+) seconds"),
    "model_load_s": re.compile(r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) seconds"),
    "weight_memory_gib": re.compile(r"Model loading took ([\d.]+) GiB"),
    "compile_s": re.compile(r"torch\.compile took ([\d.]+) s in total"),
    "graph_capture_s": re.compile(r"Graph capturing finished in ([\d.]+) secs"),
    "init_engine_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
    "kv_cache_gib": re.compile(r"Available KV cache memory: ([\d.]+) GiB"),
}


def startup_breakdown(log_text: str) -> dict:
    """{part: seconds or GiB} from one engine's log (the last match of each line)."""
    out = {}
    for key, pat in STARTUP_LINES.items():
        found = pat.findall(log_text)
        if found:
            out[key] = float(found[-1])
    return out


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


def _worker(conn, env: dict, log_path: str) -> None:
    """Child process: import vLLM once, then load engines one after another and serve requests on each.

    Keeping one process for the whole run keeps what vLLM and Triton hold in memory (imports, autotuning
    results, compiled kernels) from one variant to the next; the caches on disk (env) survive a restart.
    """
    _redirect_output(log_path)
    _die_with_parent()
    os.environ.update(env)
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
        info = {"vllm": vllm.__version__, "startup_s": startup, "import_s": import_s, "compile_time_s": compile_s,
                "layers": layers, "pid": os.getpid()}
        if sleep_after:  # level 1: weights to CPU memory, KV cache dropped; the GPU is free for the engine serving now
            t = time.perf_counter()
            llm.sleep(level=1)
            info["sleep_s"] = time.perf_counter() - t
        return info

    def wake():
        t = time.perf_counter()
        llm.wake_up()
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

    def score(seqs, top_k, chunk):
        kw = dict(max_tokens=1, prompt_logprobs=top_k, detokenize=False, temperature=0.0)
        try:  # flat lists instead of one dict of Logprob objects per position: far less Python work per position
            params = SamplingParams(**kw, flat_logprobs=True)
        except TypeError:  # a vLLM without flat logprobs
            params = SamplingParams(**kw)
        out = []
        for s in range(0, len(seqs), chunk):
            batch = seqs[s:s + chunk]
            res = llm.generate([TokensPrompt(prompt_token_ids=q) for q in batch], params, use_tqdm=False)
            out += [_scores(q, r.prompt_logprobs, top_k) for q, r in zip(batch, res)]
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

    def drafter_layers():
        res = llm.collective_rpc(_drafter_probe)
        return res[0] if isinstance(res, list) and res else res

    def metrics(prefix):
        """Counters and gauges from vLLM's own metrics whose name starts with prefix (needs disable_log_stats=False)."""
        out = {}
        for m in llm.get_metrics():
            if m.name.startswith(prefix):
                out[m.name] = getattr(m, "value", None) if not hasattr(m, "values") else list(m.values)
        return out

    ops = {"load": load, "wake": wake, "sleep": sleep, "unload": unload, "score": score, "generate": generate, "time": time_decode,
           "drafter_layers": drafter_layers, "metrics": metrics}
    conn.send(("started", {"import_s": import_s}))
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        try:
            conn.send(("ok", ops[msg[0]](*msg[1:])))
        except BaseException as e:
            traceback.print_exc()
            conn.send(("error", f"{e.__class__.__name__}: {e}"))
            if msg[0] == "load":  # a failed start can leave a half-built engine holding GPU memory: end the process
                break
    llm = None  # drop the engine before answering, so the GPU is free when the parent moves on
    conn.send(("stopped", None))


class _Worker:
    """One child process that serves vLLM engines (see _worker), and the pipe to it."""

    def __init__(self, backend: "VllmBackend"):
        self.backend = backend
        self._forget()

    def _forget(self, proc=None, conn=None) -> None:
        """Point at a new process (or none): nothing started, loaded or pending on it yet."""
        self.proc, self.conn = proc, conn
        self.started = False  # the child answered "started" (vLLM imported)
        self.loaded = False
        self.pending: tuple | None = None  # (folder, log_path, t0, worker_start_s): a load sent and not yet answered
        self.prefetched: dict | None = None  # {"folder", "info" or "error"}: a prefetched start, finished
        self.engines_started = 0  # engines this process has built (sleep mode allows one: see send_load)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def spawn(self) -> None:
        b = self.backend
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        # Not a daemon: with one_process=False vLLM starts its own engine-core process, which a daemon may not do.
        self.log = b._fresh_log("worker")
        proc = ctx.Process(target=_worker, args=(child, b.env, str(self.log)))
        proc.start()
        self._forget(proc, parent)
        b.worker_starts += 1

    def wait_started(self) -> float:
        t0 = time.perf_counter()
        if not self.started:
            kind, payload = self.recv(self.backend.start_timeout_s)
            if kind != "started":
                self.stop()
                raise RuntimeError(f"vLLM worker could not start: {payload}\n{self.log.read_text(errors='replace')[-3000:]}")
            self.started = True
        return time.perf_counter() - t0

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.is_alive():
                self.conn.send(("stop",))
            deadline = time.monotonic() + 60
            while self.proc.is_alive() and time.monotonic() < deadline:  # a worker that failed is already on its way out
                if self.conn.poll(0.2) and self.conn.recv()[0] == "stopped":
                    break
        except (BrokenPipeError, EOFError, OSError):
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self._forget()

    def recv(self, timeout: float):
        if not self.conn.poll(timeout):
            raise RuntimeError(f"vLLM worker gave no answer in {timeout:.0f} s")
        try:
            return self.conn.recv()
        except EOFError:
            code = self.proc.exitcode if self.proc else None
            self._forget()
            raise RuntimeError(f"vLLM worker died (exit code {code}); see its log in {self.backend.log_dir}") from None

    def call(self, *msg, timeout: float = 3600):
        if self.proc is None:
            raise RuntimeError("load() a checkpoint first")
        self.conn.send(msg)
        kind, payload = self.recv(timeout)
        if kind != "ok":
            raise RuntimeError(f"vLLM: {payload}")
        return payload

    def send_load(self, folder: Path, t0: float) -> None:
        """Start building an engine for folder (in a new process if none runs); finish_load collects it."""
        b = self.backend
        worker_start_s = 0.0
        # vLLM's sleep mode allows one engine per process ("CuMem allocator can only be used for one instance per
        # process", vllm/v1/worker/gpu_worker.py): on the H200 stand-in a second engine in a worker failed whenever
        # the first one's memory pool had not been released. With sleep mode every engine gets a fresh process.
        if not self.alive() or (b.sleep_between and self.engines_started):
            self.stop()
            t = time.perf_counter()
            self.spawn()
            worker_start_s = time.perf_counter() - t
        log_path = b._fresh_log(Path(folder).name)
        self.conn.send(("load", str(folder), b.engine_args, str(log_path), b.sleep_between))
        self.pending = (Path(folder), log_path, t0, worker_start_s)
        self.engines_started += 1

    def finish_load(self) -> dict:
        """Wait for the pending load; returns the engine info (raises RuntimeError with the log's tail on failure)."""
        folder, log_path, t0, worker_start_s = self.pending
        b = self.backend
        try:
            worker_start_s += self.wait_started()
            kind, payload = self.recv(b.start_timeout_s)
            if kind != "ok":
                raise RuntimeError(f"vLLM: {payload}")
        except RuntimeError as e:
            self.stop()  # the worker ends itself after a failed load; the next load starts a fresh one
            tail = log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"vLLM could not load {folder}: {e}\n{tail}") from None
        self.pending, self.loaded = None, True
        text = log_path.read_text(errors="replace")
        lines = [m.group(0) for line in text.splitlines() if (m := KERNEL_LINE.search(line))]
        breakdown = startup_breakdown(text)
        if payload.get("compile_time_s") is not None:
            breakdown.setdefault("compile_s", payload["compile_time_s"])
        return dict(payload, spawn_to_ready_s=time.perf_counter() - t0, worker_start_s=worker_start_s, log=str(log_path),
                    startup_breakdown=breakdown, kernel_log_lines=sorted(set(lines)), engine_args=b.engine_args,
                    one_process=b.one_process, kernels_by_class=kernels_by_class(payload.get("layers") or {}, _arch_of(folder)))

    def unload(self) -> None:
        if self.loaded:
            try:
                self.call("unload", timeout=300)
            except (RuntimeError, OSError):
                self.stop()  # a worker that cannot free its engine is replaced
            self.loaded = False


# With overlapped starts each engine gets a fixed KV cache instead of a profiled share of the GPU: vLLM's memory
# profiling assumes no other process changes its GPU memory meanwhile (gpu_worker.determine_available_memory skips
# it when kv_cache_memory_bytes is set). 12 GiB holds ~200 sequences of GDN state at Qwen3.6-35B-A3B's size, and three
# such engines (one serving, two starting) fit an H200 with their ~20 GiB of weights each. The utilization only gates
# vLLM's start-up check (free memory >= utilization x total) while other engines hold memory.
OVERLAP_DEFAULTS = {"kv_cache_memory_bytes": 12 << 30, "gpu_memory_utilization": 0.25}


class VllmBackend:
    """vLLM engines in a long-lived child process (in-process engine core), one engine per variant at a time.

    `one_process=False` starts a fresh child per variant instead (the engine core then runs in its own process,
    vLLM's default): slower, since every variant imports vLLM twice and redoes in-memory autotuning.
    `overlap_starts=N` keeps N more children that build the next variants' engines (`prefetch`) while the current
    one serves. Engine start-up is mostly single-threaded CPU work (loading ~92 k expert tensors, Dynamo, Inductor), so
    starts in parallel processes overlap, if imperfectly: on the H200 stand-in two starts together took 1.3-1.8x one
    alone. Decode is timed only while no engine is starting (`time_decode` waits).

    Every row must be timed in the same state with one engine awake on the GPU. An engine started ahead and left
    resident changed the others' decode by up to 6 % on the H200 stand-in, so with overlapped starts
    (`sleep_between`, on by default with overlap) every engine goes to sleep once it has started (vLLM's sleep mode,
    level 1: weights to CPU memory, KV cache dropped) and is woken at its turn; an engine loaded at its turn sleeps and
    wakes too. After a wake, decode repeats within 0.1 % but sits ~10 % below a never-slept engine's (shared device
    notes), so the state is the same for every row of a run and recorded with each timing; timings taken in the two
    states are not compared.
    """

    name = "vllm"
    exact_gather = False

    def __init__(self, device: str = "auto", engine_args: dict | None = None, log_dir: Path | None = None,
                 start_timeout_s: float = 1800, require_cuda: bool = True, cache_dir: Path | None = None,
                 one_process: bool = True, overlap_starts: int = 0, sleep_between: bool | None = None,
                 rewake_before_timing: bool = False):
        if importlib.util.find_spec("vllm") is None:
            raise SplicerError("the vLLM backend needs vllm (pip install 'splicer[vllm]' on a GPU machine); use --backend torch here")
        if require_cuda and not torch.cuda.is_available():
            raise SplicerError("the vLLM backend needs a CUDA GPU and torch sees none; use --backend torch")
        overlap_starts = int(overlap_starts)  # True (the old flag) means one
        if overlap_starts < 0:
            raise SplicerError(f"--overlap-starts {overlap_starts}: give the number of engines to start ahead (1 or more)")
        if overlap_starts and not one_process:
            raise SplicerError("--overlap-starts needs one worker per engine slot; drop --process-per-variant")
        defaults, self.env = default_engine_args()
        self.sleep_between = bool(overlap_starts) if sleep_between is None else bool(sleep_between)
        if rewake_before_timing and not self.sleep_between:
            raise SplicerError("--rewake-before-timing sleeps and wakes the engine once more before its decode timing; "
                               "it needs vLLM's sleep mode: add --overlap-starts")
        # On the H200 stand-in an engine timed right after its first wake sat at 4.10 or 4.38 ms/token from one engine
        # to the next, and one engine moved slow -> fast after a second sleep and wake (results/h200-fulldims,
        # engine-state): this option puts that second cycle before every timing.
        self.rewake_before_timing = bool(rewake_before_timing)
        self.engine_args = {**defaults, **(OVERLAP_DEFAULTS if overlap_starts else {}), **(engine_args or {})}
        if self.sleep_between:
            if self.engine_args.get("enable_sleep_mode") is False:
                raise SplicerError("--overlap-starts times every engine after a sleep and wake (vLLM's sleep mode): "
                                   "drop --engine-arg enable_sleep_mode=false, or time serially without --overlap-starts")
            self.engine_args["enable_sleep_mode"] = True
        if device.startswith("cuda:"):
            self.env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
        self.one_process = one_process
        self.overlap_starts = overlap_starts
        if one_process:
            self.env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in the worker itself: one import, shared caches
        if overlap_starts and "OMP_NUM_THREADS" not in os.environ:
            # 1+N engines start at once on one host: each worker gets its share of the cores for torch's CPU threads
            # instead of all of them (vLLM does the same for its own multi-process workers).
            self.env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // (1 + overlap_starts)))
        # Compiled graphs, Triton kernels and autotuning results (vLLM sets TRITON_CACHE_AUTOTUNING=1) live on disk.
        # By default they stay in vLLM's, Triton's and Inductor's per-user folders, so a later run on the machine skips
        # the first engine's autotuning (143 s on the H200 stand-in) and every compile it has seen; cache_dir moves
        # them, and a value the user set in the environment wins over both.
        self.cache_dir = cache_dir
        if cache_dir is not None:
            cache_dir = Path(cache_dir).resolve()
            for var, sub in (("VLLM_CACHE_ROOT", "vllm"), ("TRITON_CACHE_DIR", "triton"), ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
                if var not in os.environ:
                    self.env[var] = str(cache_dir / sub)
        self.log_dir = Path(log_dir) if log_dir else Path.cwd() / "vllm-logs"
        self.start_timeout_s = start_timeout_s
        self.workers = [_Worker(self) for _ in range(1 + overlap_starts)]
        self.active: _Worker | None = None
        self.worker_starts = 0
        self.info: dict = {}
        self.default_batch = 256

    @property
    def proc(self):
        """The serving worker's process (None when no worker is running)."""
        w = self.active or self.workers[0]
        return w.proc

    def _fresh_log(self, stem: str) -> Path:
        """DIR/stem.log, or stem-2.log, stem-3.log ... when a variant is loaded again or a run is resumed."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path, i = self.log_dir / f"{stem}.log", 1
        while path.exists():
            i += 1
            path = self.log_dir / f"{stem}-{i}.log"
        path.write_text("")
        return path

    def _free_worker(self) -> _Worker | None:
        """A worker with no engine and nothing starting (None when every one is busy)."""
        return next((w for w in self.workers if w is not self.active and w.pending is None and w.prefetched is None), None)

    def _worker_for(self, folder: Path) -> _Worker | None:
        """The worker starting, or holding a started engine, for folder."""
        for w in self.workers:
            if w is not self.active and folder in ((w.pending or (None,))[0], (w.prefetched or {}).get("folder")):
                return w
        return None

    def _settle(self, w: _Worker) -> None:
        """Wait for w's pending start; the outcome (engine info or error) is kept until load() asks for it."""
        folder = w.pending[0]
        try:
            w.prefetched = {"folder": folder, "info": w.finish_load(), "error": None}
        except RuntimeError as e:
            w.prefetched = {"folder": folder, "info": None, "error": e}

    # ------------------------------------------------------------ the Backend interface

    def prefetch(self, folder: Path) -> bool:
        """Start building folder's engine in a spare worker while others keep serving; False when none is spare."""
        folder = Path(folder)
        if not self.overlap_starts:
            return False
        if self._worker_for(folder) is not None:
            return True
        w = self._free_worker()
        if w is None:
            return False
        w.send_load(folder, time.perf_counter())
        return True

    def wait_prefetch(self) -> None:
        """Block until every prefetched engine has finished starting (or failed: that shows at its load())."""
        for w in self.workers:
            if w.pending is not None and w is not self.active:
                self._settle(w)

    def _fixed_kv_cache(self) -> bool:
        return bool(self.engine_args.get("kv_cache_memory_bytes"))

    @property
    def timing_state(self) -> str:
        """The state every engine of this backend is timed in (recorded with each timing)."""
        if self.sleep_between:
            woken = "slept and woken a second time just before timing" if self.rewake_before_timing else "woken"
            return f"{woken} from vLLM's sleep mode (level 1), no other engine awake or starting on the GPU"
        return "fresh engine, the only one on the GPU"

    def load(self, folder: Path) -> None:
        self._load_engine(folder)
        if self.sleep_between:  # every engine slept once it started: wake it for its turn
            self.info["wake_s"] = self._call("wake", timeout=600)
        self.info["timing_state"] = self.timing_state

    def _load_engine(self, folder: Path) -> None:
        self.unload()
        folder = Path(folder)
        t0 = time.perf_counter()
        ready = self._worker_for(folder)
        if ready is not None:
            if ready.pending is not None:
                self._settle(ready)
            done, ready.prefetched = ready.prefetched, None
            if done["info"] is not None:
                self.active, self.info = ready, dict(done["info"], prefetched=True, waited_s=time.perf_counter() - t0)
                return
            first = done["error"]  # the prefetched start failed: one more try in a fresh process, as below
            worker = ready
        else:
            worker = self._free_worker()
            if worker is None:  # every spare worker holds an engine for another folder (the plan changed course)
                self.wait_prefetch()
                worker = next(w for w in self.workers if w is not self.active)
                worker.prefetched = None
                worker.unload()
            reused = worker.alive()
            try:
                self.info = self._load_on(worker, folder, t0)
                return
            except RuntimeError as e:
                if not reused:
                    raise
                first = e
        # An engine that will not start in a worker that already served others may be short of memory the earlier
        # engines did not give back: try once more in a fresh process before calling it a failure.
        worker.stop()
        try:
            self.info = self._load_on(worker, folder, t0)
        except RuntimeError as second:
            raise second from first
        self.info["retried_in_fresh_worker"] = str(first)[:500]

    def _load_on(self, worker: _Worker, folder: Path, t0: float) -> dict:
        worker.send_load(folder, t0)
        info = worker.finish_load()
        self.active = worker
        return info

    def _call(self, *msg, timeout: float = 3600):
        if self.active is None:
            raise RuntimeError("load() a checkpoint first")
        return self.active.call(*msg, timeout=timeout)

    def score(self, sequences, top_k=20, gather_ids=None, want_full=False, batch_size=None) -> Iterator[SequenceScores]:
        yield from self._call("score", sequences, top_k, batch_size or self.default_batch)

    def generate(self, prompts, max_new_tokens, stop_ids):
        return self._call("generate", prompts, max_new_tokens, list(stop_ids))

    def time_decode(self, prompt, new_tokens, warmup, runs):
        self.wait_prefetch()  # decode is timed with no other engine starting on the GPU (started ones are asleep)
        cycle = {}
        if self.rewake_before_timing:
            cycle = {"rewake_sleep_s": self._call("sleep", timeout=600), "rewake_wake_s": self._call("wake", timeout=600)}
        return dict(self._call("time", prompt, new_tokens, warmup, runs), state=self.timing_state, **cycle)

    def load_info(self) -> dict:
        return self.info

    def drafter_layers(self) -> dict:
        """Per-layer quantization method of the speculative drafter (MTP head), as for the main model."""
        return self._call("drafter_layers")

    def engine_metrics(self, prefix: str = "vllm:spec_decode") -> dict:
        return self._call("metrics", prefix)

    def unload(self) -> None:
        w, self.active = self.active, None
        if w is None:
            return
        if not self.one_process or self.sleep_between:  # sleep mode: the process cannot build another engine
            w.stop()
            return
        if not self._fixed_kv_cache():
            # Never free GPU memory while another engine profiles memory: it would count the freed memory as its own.
            self.wait_prefetch()
        w.unload()

    def close(self) -> None:
        self.active = None
        for w in self.workers:
            w.stop()

    def describe(self) -> dict:
        try:
            import importlib.metadata as md

            version = md.version("vllm")
        except Exception:
            version = "unknown"
        return {"backend": "vllm", "engine": f"vllm {version}", "torch": torch.__version__,
                "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "engine_args": self.engine_args,
                "env": {k: v for k, v in self.env.items()}, "python": sys.version.split()[0], "one_process": self.one_process,
                "overlap_starts": self.overlap_starts, "worker_starts": self.worker_starts, "timing_state": self.timing_state,
                "rewake_before_timing": self.rewake_before_timing,
                "engine_cache_dir": str(self.cache_dir) if self.cache_dir is not None else "per-user defaults"}


def parse_engine_args(items: list[str] | None) -> dict:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SplicerError(f"--engine-arg {item!r} should be KEY=VALUE (VALUE as JSON where it is not a plain string)")
        out[key.replace("-", "_")] = _parse_engine_value(value)
    return out
