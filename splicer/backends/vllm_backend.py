"""vLLM backend: the serving engine itself, in a child process that outlives the variants.

The child (multiprocessing "spawn": a script that uses this backend must keep its work under
`if __name__ == "__main__":`, since the child re-imports it) imports vLLM once and builds one
`vllm.LLM` per variant with the engine core in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`),
freeing it before the next. A crash, an out-of-memory error or a load refusal ends that child
(the variant is recorded as failed) and the next variant starts a fresh one, so one variant
cannot take `ablate` down. Compile, Triton and autotuning caches stay on disk (per-user folders, or
cache_dir), so later engines and later runs reuse them.

Scoring uses `SamplingParams(max_tokens=1, prompt_logprobs=k, detokenize=False)`: per
prompt position vLLM returns its own top-k plus the actual next token. Where the engine serves
`prompt_logprob_token_ids` (vLLM 0.31 and later, on its V2 model runner), a row is also asked for its
log-probs at the base's top-k ids, and the KL over the base's top-k is the torch backend's (exact_gather).
Elsewhere its top-k need not contain the base's top-k ids, so a missing one gets the k-th log-prob
(metrics.fill_missing), which bounds nothing (results_wording.kl_bound says why). One run keeps the base pass's way (hold_exact_gather). Timing runs batch-1
requests with CUDA graphs as configured.

Split at the process boundary: this module is the parent's side (the worker pool and the Backend interface);
`vllm_child` is what runs in the child process; `vllm_outputs` turns vLLM's outputs into splicer's records;
`vllm_logs` reads the engine log and the kernel probe; `vllm_engine_args` holds the engine arguments.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

from ..errors import SplicerError
from . import ray_lanes, vllm_expert_cache
from .base import ResultsWording, SequenceScores, kl_support
from .gpus import check_gpus, one_per_gpu
from .vllm_child import child_worker
from .vllm_engine_args import OVERLAP_DEFAULTS, default_engine_args, parse_engine_args, parse_engine_env
from .vllm_logs import KERNEL_LINE, arch_of, kernels_by_class, startup_breakdown
from .vllm_outputs import TOKEN_ID_SCORING_SINCE, spec_counts

__all__ = [
    "VllmBackend",
    "VllmOptions",
    "OVERLAP_DEFAULTS",
    "default_engine_args",
    "parse_engine_args",
    "parse_engine_env",
    "kernels_by_class",
]


class _Worker:
    """One child process that serves vLLM engines (see child_worker), and the pipe to it."""

    def __init__(self, backend: VllmBackend, env: dict | None = None):
        self.backend = backend
        self.env = env  # this worker's environment (None: the backend's)
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
        proc = ctx.Process(target=child_worker, args=(child, self.env or b.env, str(self.log)))
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
            self.backend.installed = payload  # every worker imports the same vLLM: what it offers, for the backend
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

    def send_load(self, folder: Path, t0: float, engine_args: dict | None = None) -> None:
        """Start building an engine for folder (in a new process if none runs); finish_load collects it."""
        b = self.backend
        engine_args = b.engine_args if engine_args is None else engine_args
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
        self.conn.send(("load", str(folder), engine_args, str(log_path), b.sleep_between))
        self.pending = (Path(folder), log_path, t0, worker_start_s, engine_args)
        self.engines_started += 1

    def finish_load(self) -> dict:
        """Wait for the pending load; returns the engine info (raises RuntimeError with the log's tail on failure)."""
        folder, log_path, t0, worker_start_s, engine_args = self.pending
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
        return dict(
            payload,
            spawn_to_ready_s=time.perf_counter() - t0,
            worker_start_s=worker_start_s,
            log=str(log_path),
            startup_breakdown=breakdown,
            kernel_log_lines=sorted(set(lines)),
            engine_args=engine_args,
            one_process=b.one_process,
            kernels_by_class=kernels_by_class(payload.get("layers") or {}, arch_of(folder)),
        )

    def unload(self) -> None:
        if self.loaded:
            try:
                self.call("unload", timeout=300)
            except (RuntimeError, OSError):
                self.stop()  # a worker that cannot free its engine is replaced
            self.loaded = False


def check_engine_options(
    *, overlap_starts: int, one_process: bool, precompile: int, rewake_before_timing: bool, sleep_between: bool, engine_args: dict
) -> None:
    """The combinations of the vLLM backend's options it refuses, each in one line: checked where its options are made
    (VllmOptions) and where a backend is made from them."""
    if overlap_starts < 0:
        raise SplicerError(f"--overlap-starts {overlap_starts}: give the number of engines to start ahead (1 or more)")
    if overlap_starts and not one_process:
        raise SplicerError("--overlap-starts needs one worker per engine slot; drop --process-per-variant")
    if precompile < 0:
        raise SplicerError(f"--precompile {precompile}: give the number of processes that compile ahead (1 or more)")
    if precompile and overlap_starts:
        raise SplicerError(
            "--precompile and --overlap-starts are two ways to start engines ahead: choose one "
            "(--precompile keeps every timed engine alone on the GPU)"
        )
    if rewake_before_timing and not sleep_between:
        raise SplicerError(
            "--rewake-before-timing sleeps and wakes the engine once more before its decode timing; "
            "it needs vLLM's sleep mode: add --overlap-starts"
        )
    if sleep_between and engine_args.get("enable_sleep_mode") is False:
        raise SplicerError(
            "--overlap-starts times every engine after a sleep and wake (vLLM's sleep mode): "
            "drop --engine-arg enable_sleep_mode=false, or time serially without --overlap-starts"
        )


# Options that only schedule the vLLM backend's engines (the others are the engines' own arguments and environment).
_SCHEDULING = (
    "gpus",
    "overlap_starts",
    "precompile",
    "rewake_before_timing",
    "process_per_variant",
    "engine_cache_dir",
    "expert_cache",
)
# both backends take --ray and --ray-lanes (ray_lanes.py)


@dataclass(frozen=True)
class VllmOptions:
    """The vLLM backend's options (backends.BackendOptions), checked as they are made: the engine arguments and
    environment (--engine-arg and its shorthands, --engine-env), its caches (--engine-cache-dir, --expert-cache), how engines are
    started (--process-per-variant, --overlap-starts, --rewake-before-timing, --precompile) and the GPUs the rows are
    spread over (--gpus, spread.py)."""

    engine_args: dict = field(default_factory=dict)
    engine_env: dict = field(default_factory=dict)
    engine_cache_dir: Path | None = None
    expert_cache: Path | None = None  # --expert-cache DIR: routed experts saved once, copied into later engines
    process_per_variant: bool = False
    overlap_starts: int = 0
    rewake_before_timing: bool = False
    precompile: int = 0
    gpus: tuple | None = None  # None or (): one GPU
    ray: str | None = None  # --ray [ADDRESS]: rows on a Ray cluster's lanes (ray_lanes.py)
    ray_lanes: int | None = None  # at most this many lanes

    backend = "vllm"

    def __post_init__(self):
        ray_lanes.check_options(
            self.ray, self.ray_lanes, gpus=self.gpus, overlap_starts=self.overlap_starts, precompile=self.precompile
        )
        if self.gpus is not None:  # given, even empty (--gpus ,): two or more ids
            check_gpus(tuple(self.gpus), self.overlap_starts)
        object.__setattr__(self, "gpus", tuple(self.gpus or ()))
        self._check_expert_cache()
        check_engine_options(
            overlap_starts=int(self.overlap_starts),
            one_process=not self.process_per_variant,
            precompile=int(self.precompile),
            rewake_before_timing=self.rewake_before_timing,
            sleep_between=bool(self.overlap_starts),
            engine_args=self.engine_args,
        )

    def _check_expert_cache(self) -> None:
        """--expert-cache DIR: what it cannot go with, in one line each. The backend applies it (VllmBackend): it is
        kept out of the job's settings and the base pass's cache key, like --engine-cache-dir, since it changes how
        weights reach the GPU and not the weights."""
        fmt = self.engine_args.get("load_format")
        if self.expert_cache is None:
            if fmt == vllm_expert_cache.LOAD_FORMAT:
                raise SplicerError(f"--engine-arg load_format={fmt}: give --expert-cache DIR instead")
            return
        if not str(self.expert_cache).strip():
            raise SplicerError("--expert-cache: give a folder for the saved experts")
        path = Path(self.expert_cache).expanduser()
        if path.exists() and not path.is_dir():
            raise SplicerError(f"--expert-cache {path}: not a folder; give a folder for the saved experts")
        if fmt not in (None, vllm_expert_cache.LOAD_FORMAT):
            raise SplicerError(
                f"--expert-cache loads with its own load format, and --engine-arg load_format={fmt} asks for another: "
                "drop one of them"
            )
        if self.process_per_variant:
            raise SplicerError(
                "--expert-cache needs the engine core in splicer's worker, where its loader is registered; "
                "drop --process-per-variant"
            )
        for arg in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if int(self.engine_args.get(arg) or 1) > 1:
                raise SplicerError(
                    f"--expert-cache builds the model in splicer's worker only, and {arg}={self.engine_args[arg]} builds "
                    "it in vLLM's own workers: drop one of them"
                )
        if self.engine_args.get("enable_expert_parallel"):
            raise SplicerError("--expert-cache and enable_expert_parallel: expert parallelism is not supported; drop one")

    @classmethod
    def option_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @classmethod
    def refused_elsewhere(cls, given: dict) -> str:
        if any(k in given for k in _SCHEDULING):
            return (
                "--gpus, --overlap-starts, --precompile, --rewake-before-timing, --process-per-variant, "
                "--engine-cache-dir and --expert-cache apply to --backend vllm only"
            )
        return "engine options (--engine-arg, --engine-env, --max-model-len, ...) apply to --backend vllm only"

    @classmethod
    def from_job(cls, settings: dict) -> VllmOptions:
        return cls(
            engine_args=settings.get("engine_args") or {},
            engine_env=settings.get("engine_env") or {},
            overlap_starts=settings.get("overlap_starts") or 0,
            rewake_before_timing=bool(settings.get("rewake_before_timing")),
            gpus=tuple(settings["gpus"]) if settings.get("gpus") else None,
            # a run on Ray lanes is extended on Ray lanes (budget --verify): ray.init's own choice, e.g. RAY_ADDRESS
            ray=ray_lanes.DEFAULT_ADDRESS if settings.get("ray") else None,
        )

    @classmethod
    def backend_type(cls) -> type:
        return VllmBackend

    def check_device(self, device: str) -> None:
        if self.gpus and device != "auto":
            raise SplicerError(f"--gpus {','.join(self.gpus)} and --device {device}: --gpus names the GPUs; drop --device")

    def job_settings(self) -> dict:
        return {
            "engine_args": self.engine_args,
            **({"engine_env": self.engine_env} if self.engine_env else {}),
            "overlap_starts": self.overlap_starts,
            "rewake_before_timing": self.rewake_before_timing,
            # Rows spread over GPUs are named and compared per GPU: another spread is another job.
            **({"gpus": list(self.gpus)} if self.gpus else {}),
            **({"ray": True} if self.ray else {}),
        }

    def cache_key(self) -> list:
        # The environment only when set, so that caches made before --engine-env existed keep their key.
        return [self.engine_args, *([self.engine_env] if self.engine_env else [])]

    def context_length(self) -> int | None:
        return self.engine_args.get("max_model_len")

    def ray_engine(self, device: str, cluster_has_gpus: bool) -> tuple[str, int]:
        # vLLM picks the GPUs Ray gives the lane; one engine holds tensor × pipeline parallel size of them
        args = self.engine_args
        return "auto", int(args.get("tensor_parallel_size") or 1) * int(args.get("pipeline_parallel_size") or 1)

    def speculative(self) -> VllmOptions:
        """One engine at a time, alone on the GPU: the speculative engines are timed, so none starts ahead."""
        return replace(self, overlap_starts=0, rewake_before_timing=False, precompile=0, gpus=None, ray=None, ray_lanes=None)

    def tasks(self) -> VllmOptions:
        """One engine at a time: lm-eval builds its own engine from these arguments, so none starts ahead (and with
        vLLM's own loader: lm-eval's engine is not built in splicer's worker)."""
        return replace(
            self,
            expert_cache=None,
            overlap_starts=0,
            rewake_before_timing=False,
            precompile=0,
            gpus=None,
            ray=None,
            ray_lanes=None,
        )

    def check_loadable(self, ckpt, modules: dict | None = None) -> None:
        pass  # vLLM loads a format or refuses it when the row's engine starts: that row fails, the others run

    def make_backends(self, device: str, log_dir: Path) -> list:
        if self.ray:  # one lane per engine's worth of the cluster's GPUs, each with these options but --ray
            lane = replace(self, ray=None, ray_lanes=None, gpus=None)
            return ray_lanes.make_lanes(lane, device, log_dir, self.ray, self.ray_lanes)
        options = {
            "engine_args": self.engine_args,
            "log_dir": log_dir,
            "cache_dir": self.engine_cache_dir,
            "one_process": not self.process_per_variant,
            "overlap_starts": self.overlap_starts,
            "rewake_before_timing": self.rewake_before_timing,
            "precompile": self.precompile,
            "engine_env": self.engine_env,
            "expert_cache": self.expert_cache,
        }
        if not self.gpus:
            return [VllmBackend(device=device, **options)]
        # One backend per GPU (gpus.py), each logging into its own folder.
        return one_per_gpu(
            self.gpus,
            self.precompile,
            lambda cuda, gpu, precompile, cpus: VllmBackend(
                device=cuda, **dict(options, log_dir=log_dir / f"gpu{gpu}", precompile=precompile, cpus=cpus)
            ),
        )


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
    LANE_JOIN_S = 30  # close() waits this long for each compiling lane to end its engine, then leaves it behind
    results_wording = ResultsWording(
        # Without prompt_logprob_token_ids it sees the variant's own top-k only: an id of the base's top-k missing there
        # gets the k-th log-prob, an upper bound on its own. That lowers its term but shrinks the lumped rest, which
        # raises the rest's term, so the sum bounds nothing: e.g. base p(A) = 0.4, p(B) = 0.6, variant q(B) = 0.9,
        # q(A) = q(C) = 0.05, top-1: 0.751 against the full KL's 0.589.
        kl_bound=(
            "KL = KL(base ‖ variant) over the base's {top} with the rest lumped, the variant's log-probs taken from its "
            "own top-{k} (an id missing there gets {kth}, at least its own): an approximation that bounds neither the "
            "full KL nor the torch backend's exact figure, so KLs of the two backends are not comparable"
        ),
        kl_exact=(
            "KL = KL(base ‖ variant) over the base's {top} with the rest lumped, the variant's exact log-probs at those "
            "ids (vLLM's prompt_logprob_token_ids): a lower bound on the full KL (data-processing inequality), the "
            "quantity the torch backend measures"
        ),
        engine_in_caption=True,  # kernels, and so the figures, change with vLLM's version
        start_up_heading="Speed per variant (engine start, weight memory and compile time as vLLM logged them):",
    )

    def __init__(
        self,
        device: str = "auto",
        engine_args: dict | None = None,
        log_dir: Path | None = None,
        start_timeout_s: float = 1800,
        require_cuda: bool = True,
        cache_dir: Path | None = None,
        one_process: bool = True,
        overlap_starts: int = 0,
        sleep_between: bool | None = None,
        rewake_before_timing: bool = False,
        precompile: int = 0,
        cpus: list[int] | None = None,
        engine_env: dict | None = None,
        expert_cache: Path | None = None,
    ):
        if importlib.util.find_spec("vllm") is None:
            raise SplicerError(
                "the vLLM backend needs vllm (pip install 'splicer[vllm]' on a GPU machine); use --backend torch here"
            )
        if require_cuda and not torch.cuda.is_available():
            raise SplicerError("the vLLM backend needs a CUDA GPU and torch sees none; use --backend torch")
        overlap_starts = int(overlap_starts)  # True (the old flag) means one
        precompile = int(precompile)
        self.sleep_between = bool(overlap_starts) if sleep_between is None else bool(sleep_between)
        check_engine_options(
            overlap_starts=overlap_starts,
            one_process=one_process,
            precompile=precompile,
            rewake_before_timing=rewake_before_timing,
            sleep_between=self.sleep_between,
            engine_args=engine_args or {},
        )
        defaults, self.env = default_engine_args()
        # On the H200 stand-in an engine timed right after its first wake sat at 4.10 or 4.38 ms/token from one engine
        # to the next, and one engine moved slow -> fast after a second sleep and wake (results/h200-fulldims,
        # engine-state): this option puts that second cycle before every timing.
        self.rewake_before_timing = bool(rewake_before_timing)
        self.engine_args = {**defaults, **(OVERLAP_DEFAULTS if overlap_starts else {}), **(engine_args or {})}
        if self.sleep_between:
            self.engine_args["enable_sleep_mode"] = True
        if device.startswith("cuda:"):
            self.env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
        self.one_process = one_process
        self.overlap_starts = overlap_starts
        if one_process:
            self.env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in the worker itself: one import, shared caches
        # cpus: the cores this backend's processes may use (a run spread over GPUs gives each GPU its share).
        self.cpus = sorted(cpus) if cpus else None
        ncpu = len(self.cpus) if self.cpus else (os.cpu_count() or 1)
        if self.cpus:
            self.env["SPLICER_CPUS"] = ",".join(str(c) for c in self.cpus)
            if "OMP_NUM_THREADS" not in os.environ:
                self.env["OMP_NUM_THREADS"] = str(ncpu)
        if overlap_starts and "OMP_NUM_THREADS" not in os.environ:
            # 1+N engines start at once on one host: each worker gets its share of the cores for torch's CPU threads
            # instead of all of them (vLLM does the same for its own multi-process workers).
            self.env["OMP_NUM_THREADS"] = str(max(1, ncpu // (1 + overlap_starts)))
        # Compiled graphs, Triton kernels and autotuning results (vLLM sets TRITON_CACHE_AUTOTUNING=1) live on disk.
        # By default they stay in vLLM's, Triton's and Inductor's per-user folders, so a later run on the machine skips
        # the first engine's autotuning (143 s on the H200 stand-in) and every compile it has seen; cache_dir moves
        # them, and a value the user set in the environment wins over both.
        self.cache_dir = cache_dir
        if cache_dir is not None:
            cache_dir = Path(cache_dir).resolve()
            for var, sub in (
                ("VLLM_CACHE_ROOT", "vllm"),
                ("TRITON_CACHE_DIR", "triton"),
                ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
            ):
                if var not in os.environ:
                    self.env[var] = str(cache_dir / sub)
        # --engine-env: the user's variables for every engine process (its compiling lanes too), over splicer's.
        self.engine_env = dict(engine_env or {})
        self.env.update(self.engine_env)
        # --expert-cache DIR: splicer's loader (vllm_expert_cache), which the worker registers before each engine, told
        # by the environment where the saved experts are.
        self.expert_cache = Path(expert_cache).expanduser().resolve() if expert_cache is not None else None
        if self.expert_cache is not None:
            self.engine_args["load_format"] = vllm_expert_cache.LOAD_FORMAT
            self.env[vllm_expert_cache.ENV] = str(self.expert_cache)
        self.device = device
        self.log_dir = Path(log_dir) if log_dir else Path.cwd() / "vllm-logs"
        self.start_timeout_s = start_timeout_s
        self.workers = [_Worker(self) for _ in range(1 + overlap_starts)]
        # --precompile N: N more workers that build each variant's engine once with dummy weights while the base pass
        # runs, and end before any row is timed. Every engine then starts alone on the GPU and reads its compiled graphs
        # from vLLM's cache (its key leaves out the load format and the KV cache size: vllm/config/load.py and
        # cache.py compute_hash), instead of compiling them itself (26 s of a 70 s start on the H200 stand-in).
        self.precompile_slots = precompile
        lane_env = dict(self.env)
        if precompile and "OMP_NUM_THREADS" not in os.environ:
            lane_env["OMP_NUM_THREADS"] = str(max(1, ncpu // (1 + precompile)))
        self._lane_env = lane_env
        self._lanes = [_Worker(self, lane_env) for _ in range(precompile)]
        self.lanes_added = 0  # lanes started in the base pass's engine's place once it ended
        self._lane_threads: list = []
        # From here until finish_precompile() the lanes may be compiling beside this backend's engine, even before
        # their first folder is queued (splices are made while the base pass starts): engines get a fixed KV cache.
        self._lanes_open = bool(precompile)
        self._closed = False
        self._lane_queue = None
        self._lane_seen: set[Path] = set()
        self.precompiled: list[dict] = []  # one record per folder compiled ahead (or refused)
        self._log_lock = threading.Lock()
        self.active: _Worker | None = None
        self.worker_starts = 0
        self.info: dict = {}
        self.default_batch = 256
        # What a worker said once it had imported vLLM (its version; whether SamplingParams takes
        # prompt_logprob_token_ids); None until one has.
        self.installed: dict | None = None
        self._held_exact: bool | None = None  # the run's way of scoring, once hold_exact_gather() fixed it

    @property
    def proc(self):
        """The serving worker's process (None when no worker is running)."""
        w = self.active or self.workers[0]
        return w.proc

    def _fresh_log(self, stem: str) -> Path:
        """DIR/stem.log, or stem-2.log, stem-3.log ... when a variant is loaded again or a run is resumed."""
        with self._log_lock:  # compiling lanes name their logs from their own threads
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

    def precompile(self, folder: Path) -> bool:
        """Queue folder's engine to be built once with dummy weights in a compiling lane; False without lanes."""
        folder = Path(folder)
        if not self._lanes or self._closed:  # no compile starts once the run is ending
            return False
        if folder in self._lane_seen:
            return True
        if self._lane_queue is None:
            self._lane_queue = queue.Queue()
            for w in self._lanes:
                self._start_lane(w, self._lane_queue)
        self._lane_seen.add(folder)
        self._lane_queue.put(folder)
        return True

    def _start_lane(self, w: _Worker, jobs: queue.Queue) -> None:
        t = threading.Thread(target=self._lane_loop, args=(w, jobs), daemon=True)
        self._lane_threads.append(t)
        t.start()

    def _lane_loop(self, w: _Worker, jobs: queue.Queue) -> None:
        # The engine is only built (Dynamo, Inductor, CUDA graph capture, Triton autotuning), never served: dummy
        # weights skip the 25 s weight load, and the fixed KV cache lets it start beside the base pass's engine.
        args = {**self.engine_args, **OVERLAP_DEFAULTS, "load_format": "dummy"}
        # vLLM 0.26's dummy loader refuses any model_loader_extra_config (dummy_loader.py), e.g. multithreaded weight
        # loading; the load config does not enter the compile cache's key (config/load.py compute_hash hashes nothing).
        args.pop("model_loader_extra_config", None)
        lane = self._lanes.index(w)
        # jobs, not self._lane_queue: close() drops that once it stops waiting for a lane still ending its engine.
        while (folder := jobs.get()) is not None:
            if self._closed:  # abort() killed this lane's engine: start no other
                break
            t0 = time.perf_counter()
            try:
                w.send_load(folder, t0, args)
                info = w.finish_load()
                w.unload()
                rec = {
                    "folder": str(folder),
                    "lane": lane,
                    "startup_s": round(info["spawn_to_ready_s"], 1),
                    "compile_s": info["startup_breakdown"].get("compile_s"),
                    "log": info["log"],
                    "error": None,
                }
            except Exception as e:  # a variant that cannot compile ahead compiles at its own start, as without lanes
                w.stop()
                rec = {
                    "folder": str(folder),
                    "lane": lane,
                    "startup_s": round(time.perf_counter() - t0, 1),
                    "error": str(e)[:500],
                }
                if lane >= self.precompile_slots:
                    # A lane added in the served engine's place that cannot start (its memory was not enough after
                    # all) would fail every variant it takes: it hands this one back to the first lanes and ends.
                    rec["requeued"] = True
            self.precompiled.append(rec)
            if rec.get("requeued"):
                jobs.put(folder)
                break
        w.stop()

    def finish_precompile(self) -> list[dict]:
        """Wait for every queued folder to be compiled and end the lanes' processes: from here on, one engine at a time."""
        self._lanes_open = False
        if self._lane_queue is not None:
            for _ in self._lane_threads:
                self._lane_queue.put(None)
            for t in self._lane_threads:
                t.join()
            self._lane_queue, self._lane_threads = None, []
        return list(self.precompiled)

    def _sharing_gpu(self) -> bool:
        """Engines may be compiling in the lanes now (finish_precompile() not yet called)."""
        return self._lanes_open or bool(self._lane_threads)

    def _fixed_kv_cache(self) -> bool:
        return bool(self.engine_args.get("kv_cache_memory_bytes"))

    @property
    def timing_state(self) -> str:
        """The state every engine of this backend is timed in (recorded with each timing)."""
        if self.sleep_between:
            woken = "slept and woken a second time just before timing" if self.rewake_before_timing else "woken"
            return f"{woken} from vLLM's sleep mode (level 1), no other engine awake or starting on the GPU"
        return "fresh engine, the only one on the GPU"

    def load(self, folder: Path, engine_args: dict | None = None) -> None:
        """Start folder's engine (one started ahead for it, when there is one); engine_args: arguments over the
        backend's own for this engine alone (e.g. a speculative decoder), which never takes one started ahead. An
        engine that cannot score as the run holds it to (hold_exact_gather) is refused in one line."""
        self._load_engine(folder, engine_args)
        if self._held_exact and not self._serves_token_ids():
            why = (self.info.get("token_id_scoring") or {}).get("why_not") or "no probe recorded"
            raise SplicerError(
                f"this engine cannot score exact log-probs at the base's top-k ids ({why}), as the run's base pass "
                "was scored: start every engine of the run as the base's (the same vLLM, model runner and "
                "--kv-sharing-fast-prefill), or run the plan into a new folder"
            )
        if self.sleep_between:  # every engine slept once it started: wake it for its turn
            self.info["wake_s"] = self._call("wake", timeout=600)
        self.info["timing_state"] = self.timing_state

    def _serves_token_ids(self) -> bool:
        """The loaded engine answered prompt_logprob_token_ids (the child's probe at its start)."""
        return bool((self.info.get("token_id_scoring") or {}).get("served"))

    @property
    def exact_gather(self) -> bool:
        """score() gathers the loaded engine's exact log-probs at gather_ids: the engine serves
        prompt_logprob_token_ids and the run was not held to bounded scores (hold_exact_gather)."""
        return self._serves_token_ids() if self._held_exact is None else self._held_exact

    def hold_exact_gather(self, exact: bool) -> None:
        """Score every later engine as the run's base pass was scored, so that one run never mixes two KLs: bounded
        from the variant's own top-k whatever the engine offers, or exact, which a vLLM without
        prompt_logprob_token_ids (before TOKEN_ID_SCORING_SINCE) cannot give: refused in one line, before any row
        runs, when the run was begun on another vLLM."""
        self._held_exact = bool(exact)
        if not exact:
            return
        offered = self._installed_vllm()
        if offered is not None and not offered.get("prompt_logprob_token_ids"):
            raise SplicerError(
                "this run's base pass was scored with exact log-probs at the base's top-k ids (vLLM's "
                f"prompt_logprob_token_ids, {TOKEN_ID_SCORING_SINCE} and later), and vLLM "
                f"{offered.get('vllm', '(unknown version)')} here has no prompt_logprob_token_ids, so its rows would get a "
                f"bounded KL: resume it with vLLM {TOKEN_ID_SCORING_SINCE} or later, or run the plan into a new folder"
            )

    def _installed_vllm(self) -> dict | None:
        """What the installed vLLM offers, from a worker's start (one is started, and reused by the next load, when
        none has been); None when no worker can start (each row's load then fails and says why)."""
        if self.installed is None:
            try:
                self._started(next((w for w in self.workers if w.proc is not None), self.workers[0]))
            except RuntimeError:
                return None
        return self.installed

    @staticmethod
    def _started(worker: _Worker) -> _Worker:
        """worker with its process running and vLLM imported there: a fresh process where it had none, or it died."""
        if not worker.alive():
            worker.stop()
            worker.spawn()
        worker.wait_started()
        return worker

    def _load_engine(self, folder: Path, extra_args: dict | None = None) -> None:
        self.unload()
        folder = Path(folder)
        t0 = time.perf_counter()
        ready = self._worker_for(folder) if not extra_args else None
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
                self.info = self._load_on(worker, folder, t0, extra_args)
                return
            except RuntimeError as e:
                if not reused:
                    raise
                first = e
        # An engine that will not start in a worker that already served others may be short of memory the earlier
        # engines did not give back: try once more in a fresh process before calling it a failure.
        worker.stop()
        try:
            self.info = self._load_on(worker, folder, t0, extra_args)
        except RuntimeError as second:
            raise second from first
        self.info["retried_in_fresh_worker"] = str(first)[:500]

    def _load_on(self, worker: _Worker, folder: Path, t0: float, extra_args: dict | None = None) -> dict:
        # Beside compiling lanes (the base pass) an engine gets a fixed KV cache: vLLM's memory profiling assumes no
        # other process changes the GPU's memory meanwhile. Such an engine is never timed (time_decode refuses).
        args = {**self.engine_args, **OVERLAP_DEFAULTS} if self._sharing_gpu() else None
        if extra_args:
            args = {**(args or self.engine_args), **extra_args}
        worker.send_load(folder, t0, args)
        info = worker.finish_load()
        self.active = worker
        return info

    def _call(self, *msg, timeout: float = 3600):
        if self.active is None:
            raise RuntimeError("load() a checkpoint first")
        return self.active.call(*msg, timeout=timeout)

    def score(self, sequences, top_k=20, gather_ids=None, want_full=False, batch_size=None) -> Iterator[SequenceScores]:
        # The ids go as plain int32 arrays (vLLM takes them so); without exact_gather they are not asked for, and the
        # KL is bounded from the variant's own top-k (metrics.fill_missing).
        import numpy as np

        gather = None
        if gather_ids is not None and self.exact_gather:
            gather = [np.ascontiguousarray(np.asarray(g), dtype=np.int32) for g in gather_ids]
        yield from self._call("score", sequences, top_k, batch_size or self.default_batch, gather)

    def generate(self, prompts, max_new_tokens, stop_ids):
        return self._call("generate", prompts, max_new_tokens, list(stop_ids))

    def time_decode(self, prompt, new_tokens, warmup, runs):
        if self._sharing_gpu():
            raise RuntimeError("decode timed while engines compile ahead: call finish_precompile() first")
        self.wait_prefetch()  # decode is timed with no other engine starting on the GPU (started ones are asleep)
        cycle = {}
        if self.rewake_before_timing:
            cycle = {"rewake_sleep_s": self._call("sleep", timeout=600), "rewake_wake_s": self._call("wake", timeout=600)}
        return dict(self._call("time", prompt, new_tokens, warmup, runs), state=self.timing_state, **cycle)

    def load_info(self) -> dict:
        return self.info

    def speculate(self, prompts: list[list[int]], new_tokens: int, k: int) -> list[dict]:
        """Per prompt, generated greedily on its own on the loaded engine: the tokens, and the drafts vLLM counted for
        it, from the sequence's own counts where the engine gives them (0.33), else from its spec-decode counters
        (vllm_outputs.spec_counts; all 0 on an engine without a drafter)."""
        answers = self._call("speculate", [list(p) for p in prompts], int(new_tokens))
        return [{"tokens": a["tokens"], **spec_counts(a, k)} for a in answers]

    # What `splicer tasks` records as the model lm-eval scored (tasks.json's settings: another model is another run).
    task_model = "vLLM engine with DIR's engine arguments through lm-eval's VLLM model"
    task_models_before = ()  # none recorded before by this backend (TorchBackend.task_models_before)

    def evaluate_tasks(self, folder: Path, tokenizer_folder: Path, request: dict, log_name: str | None = None) -> dict:
        """lm-eval's tasks on folder through lm-eval's own VLLM model, built in the worker process with this backend's
        engine arguments and environment (lm-eval's VLLM hands its keyword arguments to vllm.LLM) and released after,
        as an engine of a row is; lm_eval_tasks.evaluate says what comes back. The engine's log is LOG_NAME-tasks.log
        (the row's name: the build's folder is named after its checkpoint, not its row; default the folder's name). A
        failure is a RuntimeError of one line naming that log (which holds the traceback), and the worker is replaced."""
        self.unload()
        worker = self._started(self.workers[0])
        log = self._fresh_log(f"{log_name or Path(folder).name}-tasks")
        # lm-eval gives the engine the tokenizer it reads itself (the base's): one tokenizer for both sides
        args = {k: v for k, v in self.engine_args.items() if k not in ("tokenizer", "skip_tokenizer_init")}
        self.active = worker
        try:
            return worker.call(
                "lm_eval", str(folder), str(tokenizer_folder), args, str(log), request, timeout=self.start_timeout_s + 7200
            )
        except RuntimeError as e:
            worker.stop()  # the worker ends itself after a failed evaluation; the next row starts a fresh one
            raise RuntimeError(f"{str(e).splitlines()[0] if str(e) else e!r} (the engine's log: {log})") from None
        finally:
            self.active = None

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
            self._lane_in_the_served_engines_place()
            return
        if not self._fixed_kv_cache():
            # Never free GPU memory while another engine profiles memory: it would count the freed memory as its own.
            self.wait_prefetch()
        w.unload()
        self._lane_in_the_served_engines_place()

    def _lane_in_the_served_engines_place(self) -> None:
        """An engine served beside the compiling lanes has ended (only the base pass's is: rows start after
        finish_precompile()): while variants still wait in the queue, one more lane takes from it in that engine's
        memory. The served engine held its weights and a KV cache of a share of the card; a lane holds a variant's
        dummy weights and a 12 GiB KV cache, so on the stand-in one fits where the other was, while on an 80 GB card
        only one lane fits beside the base pass and the rest of the variants would wait for it. One lane, not as many
        as the freed memory might hold; an added lane that cannot start hands its variant back and ends (_lane_loop).
        Called on the main thread only (the base pass's unload), as finish_precompile() is, so the lanes' list is
        never changed while it is read; variants queued after this moment get no added lane."""
        jobs = self._lane_queue
        if self._closed or not self._lanes_open or jobs is None or jobs.empty() or self.lanes_added:
            return
        w = _Worker(self, self._lane_env)
        self._lanes.append(w)
        self.lanes_added += 1
        self._start_lane(w, jobs)

    def abort(self) -> None:
        """Kill every worker and compiling process now. Safe from another thread while one uses the workers: only the
        processes are killed (their pipes then fail where they are waited on); close() tidies up after."""
        self._closed = True
        for w in (*self.workers, *self._lanes):
            proc = w.proc
            if proc is not None and proc.is_alive():
                proc.kill()

    def close(self) -> None:
        self._closed = True
        self.active = None
        self._lanes_open = False
        if self._lane_queue is not None:  # interrupted while compiling ahead: drop what is queued, end the lanes now
            try:
                while True:
                    self._lane_queue.get_nowait()
            except queue.Empty:
                pass
            for _ in self._lane_threads:
                self._lane_queue.put(None)
            for w in self._lanes:  # a lane waiting for its engine sees the pipe close, records it, and ends
                if w.proc is not None and w.proc.is_alive():
                    w.proc.kill()
            for t in self._lane_threads:
                t.join(self.LANE_JOIN_S)
            self._lane_queue, self._lane_threads = None, []
        for w in self.workers:
            w.stop()

    def describe(self) -> dict:
        try:
            import importlib.metadata as md

            version = md.version("vllm")
        except Exception:
            version = "unknown"
        return {
            "backend": "vllm",
            "engine": f"vllm {version}",
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "engine_args": self.engine_args,
            "cuda_device": self.device,
            "cpus": self.cpus,
            "env": {k: v for k, v in self.env.items()},
            "engine_env": self.engine_env,
            "python": sys.version.split()[0],
            "one_process": self.one_process,
            "overlap_starts": self.overlap_starts,
            "worker_starts": self.worker_starts,
            "timing_state": self.timing_state,
            "rewake_before_timing": self.rewake_before_timing,
            "precompile": self.precompile_slots,
            "precompile_lanes_added": self.lanes_added,
            "engine_cache_dir": str(self.cache_dir) if self.cache_dir is not None else "per-user defaults",
            "expert_cache": str(self.expert_cache) if self.expert_cache is not None else None,
            # how its engines score (held for the run by hold_exact_gather, else the last engine's; None before either)
            "kl_support": kl_support(self.exact_gather) if self._held_exact is not None or self.info else None,
        }
