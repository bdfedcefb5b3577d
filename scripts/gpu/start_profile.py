"""On the GPU machine (vLLM bundle, the full-size stand-in): where does ONE vLLM engine start go, and what do the cuts
vLLM offers change? Issue 34 ("Engine starts"): each start of the Qwen3.6-35B-A3B-shaped INT4 stand-in (compressed-tensors
W4A16, 18 GiB, 40 layers x 256 experts stored one tensor per expert) took >= 46 s, ~30 s of it "loading weights" from the
page cache; a cProfile run put 37 of load_weights' 39 s under the MoE layer's load_weights (92,200 calls: cProfile counts
each resume of that generator, one per expert tensor), 4.2 s in get_tensor and 2.6 s in the Marlin repacking. cProfile
inflates per-call Python; this script times the same start with plain wall clocks instead. (By vLLM 0.26's code,
RoutedExperts.load_weights scans its whole expert mapping, 3 + 3 x 256 entries, with a substring test per entry for every
expert tensor, then calls the parameter's weight_loader: its exclusive time below is that scan.)

usage: python3 scripts/gpu/start_profile.py WORK OUT [--model DIR] [--cuts auto,sharded_state,...] [--budget-s 540]
       [--detail fine|coarse] [--no-warmup] [--keep-saved] [--cache-root DIR] [--engine-env K=V] [--cpu-smoke-test]

On the device, after the bundle's install and `mkdir -p /tmp/fulldims && python3 -m splicer fixture /tmp/fulldims/pair --full-dims`:
    source scripts/gpu/env.sh && python3 scripts/gpu/start_profile.py /tmp/fulldims $OUT --cuts auto,mtload
(scripts/gpu/README.md, "Engine start profile", splits the cuts over device calls of 600 s.) The model defaults to
WORK/pair/build. Writes OUT/start-profile.json (every start's record and the comparison), OUT/start-profile.md (the
tables) and OUT/start-profile-starts.tgz (one JSON and the engine log per start); WORK/start-profile/ keeps them too.

How one start is measured. Every start is a fresh Python process (this script with --child), so no import, allocator,
autotuning result or CUDA context carries over from the one before; the engine core runs in that process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, as splicer's vLLM backend runs it), so the functions below can be wrapped. Each wrapper
reads time.perf_counter on entry and exit (torch.cuda.synchronize first where the work is launched on the GPU and left
running: the coarse phases only, never per tensor) and counts calls; generators are timed per resume. The timers keep a
stack: each phase records its inclusive time under its nesting path ("LLM() > EngineCore.__init__ > ..."), and its
exclusive time is what is left after its wrapped children, so nothing is counted twice. The split by category gives each
path's exclusive time to the innermost enclosing phase that has a category (torch.compile inside the profiling run goes to
compile, the rest of the profiling run to KV-cache profiling); the categories add up to LLM()'s wall time, and "rest of
LLM()" is the time outside every wrapped phase. A phase that is missing in the installed vLLM is skipped with a note, not
an error. The per-tensor timers cost about a microsecond each (measured at the start of every process and reported with an
estimate of their total); `auto_coarse` (the auto start with only the coarse phases wrapped) measures what they add.
The warm-up, saving and priming starts, which are not compared, run with the coarse phases only.

Every start goes through one symlink, WORK/start-profile/model, pointed at the checkpoint (or at a saved sharded_state
folder): vLLM's compile-cache key and its startup-plan fingerprint contain the model path, so a start from another folder
would recompile from scratch instead of timing its load. The first start of a call ("warmup", not compared) fills the
page cache, the compile caches and the Triton autotuning cache; every start after it reads the checkpoint from the page
cache, as the issue's did. Every start generates 8 greedy tokens from one fixed prompt of 32 tokens, with the prompt's
log-probs, and the summary says whether each cut gave the auto start's tokens and log-probs (bit for bit, or the
largest difference).

The cuts (--cuts, comma-separated; `auto` always runs first, as the reference of the call):
  auto          splicer's engine for the stand-in (backends/vllm_engine_args.py defaults, language_model_only, gpu
                memory 0.5, CUDA graphs for batch sizes 1-32, as scripts/gpu/fulldims.sh) and vLLM's default loader.
  auto_coarse   auto with only the coarse phases wrapped: the difference to auto is what the per-tensor timers cost.
  mtload        model_loader_extra_config enable_multithread_load (8 threads): the files are read in threads; the
                92k weight_loader calls stay in the main thread, so it cannot cut the Python (no gain in run 11).
  eager_read    safetensors_load_strategy="eager": each file read whole (one read()) and parsed, instead of one
                get_tensor per tensor on an mmap; cuts at most the ~4 s of reading; the weight_loader calls stay.
  prefetch      safetensors_load_strategy="prefetch": vLLM reads every file once ahead in threads (for network file
                systems); from a warm page cache it can only add time.
  fastsafetensors / runai_streamer / instanttensor
                load_format of that name: another reader (to the GPU by GDS or a bounce buffer; Run:ai's threaded C++
                reader; InstantTensor). Each needs its package (fastsafetensors, runai_model_streamer, instanttensor),
                which the bundle does not carry: without it the cut is reported "not installed" and not started. All
                three only replace the reading; every tensor still goes through the model's load_weights.
  sharded_state vLLM's own path for repeated engines of one variant: the saving start runs the auto engine, then
                LLM -> engine core -> Worker.save_sharded_state -> ShardedStateLoader.save_model writes the model's
                state_dict; the cut starts with load_format="sharded_state" from that folder. vLLM 0.26 saves the model
                AFTER process_weights_after_loading (Marlin-repacked tensors of other shapes, and aliases such as the
                experts' w13_weight next to w13_weight_packed), while its loader (BaseModelLoader.load_model) builds a
                fresh model in the checkpoint's layout, copies each saved tensor into the parameter of the same name and
                runs process_weights_after_loading again. For this compressed-tensors MoE the names and shapes differ, so
                the code predicts a KeyError or a shape error (and, were it loaded, a second repacking of repacked
                weights): the cut records what vLLM says. On the CPU, vLLM 0.26's own save_model and load_weights on a
                toy layer with the Marlin MoE method's parameters, processed the way its process_weights_after_loading
                does, stop at KeyError: 'experts.w13_weight' (the alias is saved, w13_weight_packed dropped as its
                duplicate); saved before processing, the same toy loads and matches the normal path after processing.
  sharded_state_unprocessed
                the same loader, from a folder saved by vLLM's ShardedStateLoader.save_model called by this script from
                a hook just BEFORE process_weights_after_loading: the state_dict in vLLM's parameter layout (the experts
                fused per layer: ~10 tensors per layer instead of 2,304), which a fresh model's state_dict matches name
                for name and shape for shape. The start skips the model's load_weights and all 92k weight_loader calls
                (one copy_ per saved tensor) and still repacks for Marlin. Not a path vLLM offers (the hook is ours;
                vLLM saves after processing); one folder per variant (~18 GB), written once.
  expert_cache  splicer's own loader (--expert-cache, splicer/backends/vllm_expert_cache.py, registered with vLLM's
                register_model_loader): a priming start loads normally and saves the routed experts' state before
                process_weights_after_loading (what sharded_state_unprocessed saves, the experts only); the timed start
                loads every other tensor through the model's load_weights, skips the checkpoint's expert tensors
                unread, and copies the saved experts in. Unlike sharded_state_unprocessed it serves every variant
                whose experts are the build's bytes (the key is a hash of them), not only the folder that saved it.
  startup_plan  VLLM_ENABLE_STARTUP_PLAN=1 (vLLM 0.26, v1/worker/startup_plan.py): a priming start records the
                profiled KV-cache size, the timed start reuses it and skips the CUDA-graph memory estimation pass; the
                profiling run itself (which compiles and autotunes) still runs.
  kv_fixed      kv_cache_memory_bytes=12 GiB (what splicer's --overlap-starts engines get): the same skip without a
                plan file; the KV cache is not the auto start's size.
  no_autotune   VLLM_TRITON_FORCE_FIRST_CONFIG=1: Triton's first valid config instead of autotuning; with a warm
                autotuning cache it should change nothing; the prefill kernels then run untuned.
  no_compile    compilation_config mode 0, CUDA graphs for decode only: no torch.compile; decode and prefill speeds change,
                so it is a measure of what compile costs, not a cut for timing runs.
  enforce_eager no compile and no CUDA graphs at all (much slower decode): what both cost together.
The sharded cuts need disk for one or two ~18 GB folders: both are saved by one start when the disk holds both, else one
after the other; each folder is removed once its cut has run (--keep-saved keeps them).

Not measured here: what a cold page cache or a cold compile cache costs (the warm-up start absorbs both; its record says
what it took), and engines in splicer's long-lived worker process (the second engine of a process skips the imports).

--cpu-smoke-test runs the protocol (subprocesses, wrappers, accounting, summary) against the stand-in vLLM of tests/
(PYTHONPATH=tests/fake_vllm:.) on a tiny fixture: every vLLM function is missing there and is recorded as skipped; a few
functions of the stand-in itself are wrapped so that the nesting and the split are exercised. Nothing it times says
anything about vLLM.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

# --------------------------------------------------------------------------------------------------------------------
# Timers


@dataclass
class _Frame:
    path: tuple
    t0: float
    child: float = 0.0


@dataclass
class _Node:
    calls: int = 0
    inclusive: float = 0.0
    child: float = 0.0


class PhaseClock:
    """Nested wall-clock timers: enter/exit (or a wrapper) per phase, one stack per thread. Each node is a nesting path;
    it keeps its calls, its inclusive time and the inclusive time of its direct wrapped children (exclusive = the
    difference). Paths of threads other than the one that made the clock start with "[thread NAME]", so their time is
    never subtracted from the main thread's phases."""

    def __init__(self, clock=time.perf_counter, sync=None):
        self.clock = clock
        self.sync = sync or (lambda: None)
        self.nodes: dict[tuple, _Node] = {}
        self.meta: dict[str, dict] = {}  # label -> where, category, kind
        self._local = threading.local()
        self._lock = threading.Lock()
        self._main = threading.get_ident()

    def _stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
            main = threading.get_ident() == self._main
            self._local.root = () if main else (f"[thread {threading.current_thread().name}]",)
        return stack

    def enter(self, label: str, sync: bool = False) -> None:
        if sync:
            self.sync()  # work launched before the phase is not the phase's
        stack = self._stack()
        path = (stack[-1].path if stack else self._local.root) + (label,)
        if path not in self.nodes:  # made on entry, so that the rows come in the order the phases began
            with self._lock:
                self.nodes.setdefault(path, _Node())
        stack.append(_Frame(path, self.clock()))

    def exit(self, sync: bool = False) -> None:
        if sync:
            self.sync()  # the phase's own GPU work, finished
        t = self.clock()
        stack = self._local.stack
        frame = stack.pop()
        dt = t - frame.t0
        if stack:
            stack[-1].child += dt
        with self._lock:
            node = self.nodes[frame.path]
            node.calls += 1
            node.inclusive += dt
            node.child += frame.child

    @contextlib.contextmanager
    def phase(self, label: str, sync: bool = False):
        self.enter(label, sync)
        try:
            yield
        except BaseException:
            self.exit()  # no sync on the way out of an error: a CUDA error would hide the first
            raise
        self.exit(sync)

    def wrap_call(self, fn, label: str, sync: bool = False, pre=None, post=None):
        """fn timed per call; pre(args, kwargs) runs before the timer starts, post(result, args, kwargs) after it ends."""

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if pre is not None:
                pre(args, kwargs)
            self.enter(label, sync)
            try:
                result = fn(*args, **kwargs)
            except BaseException:
                self.exit()
                raise
            self.exit(sync)
            if post is not None:
                post(result, args, kwargs)
            return result

        timed._start_profile_wrapped = True
        return timed

    def timed_iter(self, iterable, label: str):
        """iterable's items, each resume timed (one call per item and one for the end)."""
        it = iter(iterable)
        try:
            while True:
                self.enter(label)
                try:
                    item = next(it)
                except StopIteration:
                    self.exit()
                    return
                except BaseException:
                    self.exit()
                    raise
                self.exit()
                yield item
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def wrap_gen(self, fn, label: str):
        """A function that returns an iterable (a generator function, or one that returns a generator): its iteration
        timed per resume."""

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            return self.timed_iter(fn(*args, **kwargs), label)

        timed._start_profile_wrapped = True
        return timed

    def wrap_cm(self, fn, label: str, sync: bool = False):
        """A function that returns a context manager: the time from its __enter__ to its __exit__."""
        clock = self

        class _Timed:
            def __init__(self, inner):
                self.inner = inner

            def __enter__(self):
                clock.enter(label, sync)
                try:
                    return self.inner.__enter__()
                except BaseException:
                    clock.exit()
                    raise

            def __exit__(self, *exc):
                try:
                    return self.inner.__exit__(*exc)
                finally:
                    clock.exit(sync and exc[0] is None)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            return _Timed(fn(*args, **kwargs))

        timed._start_profile_wrapped = True
        return timed

    def calibrate(self, n: int = 20000) -> float:
        """Seconds one timed call adds to a call (a wrapped no-op against a bare one); resets the nodes."""

        def noop():
            return None

        timed = self.wrap_call(noop, "__calibration__")
        t = time.perf_counter()
        for _ in range(n):
            noop()
        bare = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(n):
            timed()
        wrapped = time.perf_counter() - t
        self.nodes.clear()
        return max(wrapped - bare, 0.0) / n

    # ---- reading the nodes

    def rows(self) -> list[dict]:
        """Every nesting path in the order it was first entered: calls, inclusive and exclusive seconds."""
        out = []
        for path, node in list(self.nodes.items()):
            meta = self.meta.get(path[-1], {})
            out.append(
                {
                    "path": " > ".join(path),
                    "label": path[-1],
                    "depth": len(path) - 1,
                    "calls": node.calls,
                    "inclusive_s": round(node.inclusive, 6),
                    "exclusive_s": round(node.inclusive - node.child, 6),
                    "where": meta.get("where"),
                    "category": meta.get("category"),
                }
            )
        return out

    def by_label(self) -> dict[str, dict]:
        """Per label over all its paths: calls, inclusive seconds (only where it is not nested in itself, so recursion is
        not counted twice) and exclusive seconds."""
        out: dict[str, dict] = {}
        for path, node in list(self.nodes.items()):
            label = path[-1]
            agg = out.setdefault(label, {"calls": 0, "inclusive_s": 0.0, "exclusive_s": 0.0, **self.meta.get(label, {})})
            agg["calls"] += node.calls
            agg["exclusive_s"] += node.inclusive - node.child
            if label not in path[:-1]:
                agg["inclusive_s"] += node.inclusive
        for agg in out.values():
            agg["inclusive_s"] = round(agg["inclusive_s"], 6)
            agg["exclusive_s"] = round(agg["exclusive_s"], 6)
        return out

    def group(self, labels) -> tuple[int, float]:
        """(calls, inclusive seconds) of a set of labels, counting only calls not nested in another of the set (a
        parameter's weight_loader that calls default_weight_loader is one tensor load, not two)."""
        labels = set(labels)
        calls, total = 0, 0.0
        for path, node in list(self.nodes.items()):
            if path[-1] in labels and not labels.intersection(path[:-1]):
                calls += node.calls
                total += node.inclusive
        return calls, total

    def split(self, root: str, default: str = "outside") -> dict[str, float]:
        """The root phase's wall time by category: each path's exclusive time goes to the innermost phase on it that has
        a category (the root's own to `default`). The parts add up to the root's inclusive time."""
        out: dict[str, float] = {}
        for path, node in list(self.nodes.items()):
            if path[0] != root:
                continue
            cat = next(
                (
                    self.meta.get(label, {}).get("category")
                    for label in reversed(path[1:])
                    if self.meta.get(label, {}).get("category")
                ),
                None,
            )
            cat = cat or default
            out[cat] = out.get(cat, 0.0) + node.inclusive - node.child
        return out


# --------------------------------------------------------------------------------------------------------------------
# What is wrapped


@dataclass(frozen=True)
class Target:
    module: str
    attr: str  # "function" or "Class.method"
    label: str
    where: str  # file:line of the def in vLLM 0.26.0 (vllm/...)
    category: str | None = None
    kind: str = "call"  # call | gen (timed per resume) | cm (a context manager, enter to exit)
    sync: bool = False
    fine: bool = False  # per tensor: only with --detail fine
    pre: str | None = None  # hook names (the child's hooks dict)
    post: str | None = None


# The split's categories, in the issue's order; each label below names one. Their sum is LLM()'s wall time.
CATEGORIES = {
    "engine_config": "engine configuration (EngineArgs.create_engine_config: HF config, model inspection)",
    "device_init": "device and distributed init (Worker.init_device)",
    "model_init": "model construction on the GPU (initialize_model)",
    "read": "reading safetensors (the weights iterator's resumes)",
    "weight_loader": "per-tensor weight_loader calls (for sharded_state: the loader's own copy_ per tensor)",
    "load_python": "load_weights' Python around them (name mapping, expert matching, generator chain)",
    "process_weights": "process_weights_after_loading (Marlin/Machete repacking)",
    "load_other": "rest of model loading (GPUModelRunner/Worker.load_model, BaseModelLoader.load_model)",
    "compile": "torch.compile or compile-cache load",
    "kv_profile": "KV-cache profiling (determine_available_memory: profile_run, CUDA-graph memory estimate)",
    "kv_alloc": "KV-cache allocation (initialize_from_config)",
    "graph_capture": "CUDA graph capture (capture_model)",
    "warmup": "warm-up besides graph capture (compile_or_warm_up_model: kernel warm-up, sampler run)",
    "engine_other": "rest of the engine's set-up (LLMEngine, EngineCore, executor: tokenizer, scheduler, KV config)",
    "outside": "rest of LLM(), outside every wrapped phase",
}
LOADING = ("model_init", "read", "weight_loader", "load_python", "process_weights", "load_other")

EXPERT_LOADER = "weight_loader: routed experts (RoutedExperts.weight_loader)"
OTHER_LOADER = "weight_loader: other parameters"
DEFAULT_LOADER = "default_weight_loader (parameters without their own)"
PER_TENSOR_LOADERS = (EXPERT_LOADER, OTHER_LOADER, DEFAULT_LOADER)


def T(category: str | None, target: str, where: str, label: str | None = None, **kw) -> Target:
    """Target from "module:Attr.path"; the label is the attribute path unless given."""
    module, attr = target.split(":")
    return Target(module, attr, label or attr, where, category, **kw)


_W, _MR = "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner"
_MR2 = "vllm.v1.worker.gpu.model_runner"  # the V2 runner (not the default for hybrid models like this one in 0.26)
_ML, _MU = "vllm.model_executor.model_loader", "vllm.model_executor.models.utils"
_CT = "vllm.model_executor.layers.quantization.compressed_tensors"
_CTF = "model_executor/layers/quantization/compressed_tensors"  # its folder, for the file:line notes
_Q = "vllm.model_executor.models.qwen3_5"
_WU = "model_executor/model_loader/weight_utils.py"
# the files, for the file:line notes
_MLF, _MUF, _QF = "model_executor/model_loader", "model_executor/models/utils.py", "model_executor/models/qwen3_5.py"
_WF, _MRF, _MR2F = "v1/worker/gpu_worker.py", "v1/worker/gpu_model_runner.py", "v1/worker/gpu/model_runner.py"

# The functions timed, read from vLLM 0.26.0's wheel (file:line of each def under vllm/; the record also says where each
# was found in the installed vLLM).
VLLM_TARGETS = (
    # engine set-up
    T("engine_config", "vllm.engine.arg_utils:EngineArgs.create_engine_config", "engine/arg_utils.py:1847"),
    T("engine_other", "vllm.v1.engine.llm_engine:LLMEngine.__init__", "v1/engine/llm_engine.py:51"),
    T("engine_other", "vllm.v1.engine.core:EngineCore.__init__", "v1/engine/core.py:101"),
    T("engine_other", "vllm.v1.executor.uniproc_executor:UniProcExecutor._init_executor", "v1/executor/uniproc_executor.py:46"),
    T("device_init", f"{_W}:Worker.init_device", f"{_WF}:297", sync=True),
    # model loading
    T("load_other", f"{_W}:Worker.load_model", f"{_WF}:424", sync=True),
    T("load_other", f"{_MR}:GPUModelRunner.load_model", f"{_MRF}:5245", sync=True),
    T(
        "load_other",
        f"{_MR2}:GPUModelRunner.load_model",
        f"{_MR2F}:276",
        "GPUModelRunner.load_model (V2)",
        sync=True,
    ),
    T("load_other", f"{_ML}.base_loader:BaseModelLoader.load_model", f"{_MLF}/base_loader.py:43", sync=True),
    T(
        "model_init",
        f"{_ML}.utils:initialize_model",
        f"{_MLF}/utils.py:42",
        sync=True,
        post="instrument_params",
    ),
    T(
        "load_python",
        f"{_ML}.default_loader:DefaultModelLoader.load_weights",
        f"{_MLF}/default_loader.py:415",
        sync=True,
    ),
    # sharded_state's loader copies each saved tensor itself: its own time stands in the weight_loader row
    T(
        "weight_loader",
        f"{_ML}.sharded_state_loader:ShardedStateLoader.load_weights",
        f"{_MLF}/sharded_state_loader.py:110",
        sync=True,
    ),
    T(
        "load_python",
        f"{_ML}.runai_streamer_loader:RunaiModelStreamerLoader.load_weights",
        f"{_MLF}/runai_streamer_loader.py:133",
        sync=True,
    ),
    # the model's load_weights: Qwen3_5MoeForConditionalGeneration inherits the first; its language model is a
    # Qwen3_5MoeForCausalLM, whose load_weights is Qwen3_5ForCausalLMBase's, around the text model Qwen3_5Model's
    T("load_python", f"{_Q}:Qwen3_5ForConditionalGeneration.load_weights", f"{_QF}:515"),
    T("load_python", f"{_Q}:Qwen3_5ForCausalLMBase.load_weights", f"{_QF}:369"),
    T("load_python", f"{_Q}:Qwen3_5Model.load_weights", f"{_QF}:264"),
    # per tensor (--detail fine): the readers, the name mapping, the experts' matching and the weight loaders. The
    # parameters' own weight_loader attributes (RoutedExperts.weight_loader, model_executor/layers/fused_moe/
    # routed_experts.py:585, for the experts) are wrapped when initialize_model returns (hook instrument_params).
    T("read", f"{_ML}.weight_utils:safetensors_weights_iterator", f"{_WU}:840", kind="gen", fine=True),
    T("read", f"{_ML}.weight_utils:multi_thread_safetensors_weights_iterator", f"{_WU}:977", kind="gen", fine=True),
    T("read", f"{_ML}.weight_utils:fastsafetensors_weights_iterator", f"{_WU}:1044", kind="gen", fine=True),
    T("read", f"{_ML}.weight_utils:runai_safetensors_weights_iterator", f"{_WU}:1007", kind="gen", fine=True),
    T("read", f"{_ML}.weight_utils:instanttensor_weights_iterator", f"{_WU}:1113", kind="gen", fine=True),
    T(
        "read",
        f"{_ML}.sharded_state_loader:ShardedStateLoader.iterate_over_files",
        f"{_MLF}/sharded_state_loader.py:164",
        kind="gen",
        fine=True,
    ),
    T("weight_loader", f"{_ML}.weight_utils:default_weight_loader", f"{_WU}:1233", DEFAULT_LOADER, fine=True),
    T("load_python", f"{_MU}:maybe_fuse_shared_experts", f"{_MUF}:428", kind="gen", fine=True),
    T("load_python", f"{_MU}:WeightsMapper.apply", f"{_MUF}:137", kind="gen", fine=True),
    T("load_python", f"{_MU}:WeightsMapper._map_name_with_shard", f"{_MUF}:81", fine=True),
    T("load_python", f"{_MU}:AutoWeightsLoader._load_param", f"{_MUF}:255", kind="gen", fine=True),
    T(
        "load_python",
        "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts.load_weights",
        "model_executor/layers/fused_moe/routed_experts.py:869",
        kind="gen",
        fine=True,
    ),
    # repacking (the hook saves the unprocessed state for sharded_state_unprocessed's saving start)
    T(
        "process_weights",
        f"{_ML}.utils:process_weights_after_loading",
        f"{_MLF}/utils.py:101",
        sync=True,
        pre="save_unprocessed",
    ),
    T(
        "process_weights",
        f"{_CT}.compressed_tensors_moe.compressed_tensors_moe_wna16_marlin:CompressedTensorsWNA16MarlinMoEMethod.process_weights_after_loading",
        f"{_CTF}/compressed_tensors_moe/compressed_tensors_moe_wna16_marlin.py:416",
        "Marlin MoE repack (CompressedTensorsWNA16MarlinMoEMethod)",
        sync=True,
    ),
    T(
        "process_weights",
        f"{_CT}.compressed_tensors_moe.compressed_tensors_moe_wna16:CompressedTensorsWNA16MoEMethod.process_weights_after_loading",
        f"{_CTF}/compressed_tensors_moe/compressed_tensors_moe_wna16.py:198",
        "WNA16 MoE (CompressedTensorsWNA16MoEMethod)",
        sync=True,
    ),
    T(
        "process_weights",
        f"{_CT}.schemes.compressed_tensors_wNa16:CompressedTensorsWNA16.process_weights_after_loading",
        f"{_CTF}/schemes/compressed_tensors_wNa16.py:251",
        "WNA16 linear repack (CompressedTensorsWNA16)",
        sync=True,
    ),
    # KV-cache profiling and allocation, compile, warm-up, CUDA graphs
    T("engine_other", "vllm.v1.engine.core:EngineCore._initialize_kv_caches", "v1/engine/core.py:243", sync=True),
    T("kv_profile", f"{_W}:Worker.determine_available_memory", f"{_WF}:448", sync=True),
    T("kv_profile", f"{_MR}:GPUModelRunner.profile_run", f"{_MRF}:6364", sync=True),
    T("kv_profile", f"{_MR}:GPUModelRunner.profile_cudagraph_memory", f"{_MRF}:6576", sync=True),
    T(
        "kv_profile",
        f"{_MR2}:GPUModelRunner.profile_run",
        f"{_MR2F}:673",
        "GPUModelRunner.profile_run (V2)",
        sync=True,
    ),
    T(
        "kv_profile",
        f"{_MR2}:GPUModelRunner.profile_cudagraph_memory",
        f"{_MR2F}:705",
        "GPUModelRunner.profile_cudagraph_memory (V2)",
        sync=True,
    ),
    T("kv_alloc", f"{_W}:Worker.initialize_from_config", f"{_WF}:717", sync=True),
    T("kv_alloc", f"{_MR}:GPUModelRunner.initialize_kv_cache", f"{_MRF}:7562", sync=True),
    T(
        "kv_alloc",
        f"{_MR2}:GPUModelRunner.initialize_kv_cache",
        f"{_MR2F}:411",
        "GPUModelRunner.initialize_kv_cache (V2)",
        sync=True,
    ),
    T("warmup", f"{_W}:Worker.compile_or_warm_up_model", f"{_WF}:746", sync=True),
    T("warmup", "vllm.model_executor.warmup.kernel_warmup:kernel_warmup", "model_executor/warmup/kernel_warmup.py:72", sync=True),
    T("graph_capture", f"{_MR}:GPUModelRunner.capture_model", f"{_MRF}:6745", sync=True),
    T(
        "graph_capture",
        f"{_MR2}:GPUModelRunner.capture_model",
        f"{_MR2F}:710",
        "GPUModelRunner.capture_model (V2)",
        sync=True,
    ),
    # no category: their time goes to whichever phase ran them (profiling, warm-up or capture)
    T(None, f"{_MR}:GPUModelRunner._dummy_run", f"{_MRF}:5767", sync=True),
    T(
        None,
        "vllm.compilation.monitor:monitor_profiling_run",
        "compilation/monitor.py:63",
        "first run after compile (monitor_profiling_run)",
        kind="cm",
        sync=True,
    ),
    T(
        "compile",
        "vllm.compilation.monitor:monitor_torch_compile",
        "compilation/monitor.py:18",
        "compile or AOT cache load (monitor_torch_compile)",
        kind="cm",
        sync=True,
    ),
    T("compile", "vllm.compilation.decorators:_try_load_aot_compiled_fn", "compilation/decorators.py:284", sync=True),
    T(
        "compile",
        "vllm.compilation.backends:VllmBackend.__call__",
        "compilation/backends.py:1020",
        "VllmBackend.__call__ (split and compile)",
    ),
    T("compile", "vllm.compilation.backends:CompilerManager.compile", "compilation/backends.py:264"),
    T("compile", "vllm.compilation.backends:CompilerManager.load", "compilation/backends.py:223"),
)

# With --cpu-smoke-test: functions of the stand-in vLLM (tests/fake_vllm) and of the torch reference it loads with, so
# that the wrappers' nesting and the split run on the CPU.
_TR, _TRF = "splicer.backends.torch_ref", "splicer/backends/torch_ref.py"
# A start stopped at the call's budget is asked to stop (SIGTERM) and given STOP_GRACE_S to write its record with the
# phases timed so far before its process group is killed; RESERVE_S stays for the summary and packing after the last
# start, and a start with less than MIN_START_S left is not begun.
STOP_GRACE_S = 20
RESERVE_S = 25
MIN_START_S = 60


class BudgetStop(Exception):
    """Raised in a start's main thread by SIGTERM: the call's budget is spent; the record keeps what was timed."""


def _stop_on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the record is being written
    raise BudgetStop("stopped at the call's budget (SIGTERM from the parent) before the start finished")


SMOKE_TARGETS = (
    T("compile", "vllm:_compile", "tests/fake_vllm/vllm/__init__.py", "fake vLLM: _compile"),
    T("load_other", f"{_TR}:TorchBackend.load", _TRF, "fake vLLM: TorchBackend.load"),
    T("read", f"{_TR}:_read_tensors", _TRF, "fake vLLM: _read_tensors", fine=True),
    T("process_weights", f"{_TR}:TorchBackend._dequantize", _TRF, "fake vLLM: TorchBackend._dequantize"),
)

_MISSING = object()


def _first_line(e: BaseException) -> str:
    return f"{e.__class__.__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def source_where(fn) -> str | None:
    """file:line of fn's def (the path from its package folder on), as installed."""
    try:
        fn = inspect.unwrap(fn)
        lines, start = inspect.getsourcelines(fn)
        offset = next((i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "async def "))), 0)
        path = Path(inspect.getsourcefile(fn) or "?").as_posix()
        if "/tests/" in path or "/splicer/" in path:  # this repository's files (the smoke test's targets)
            anchor = "/tests/" if "/tests/" in path else "/splicer/"
            path = anchor.lstrip("/") + path.rsplit(anchor, 1)[1]
        elif "/vllm/" in path:  # vLLM's, as its own file:line notes name them
            path = path.split("/vllm/", 1)[1]
        return f"{path}:{start + offset}"
    except (OSError, TypeError, StopIteration):
        return None


def install(clock: PhaseClock, targets, hooks: dict | None = None, fine: bool = True) -> tuple[list[dict], list[str]]:
    """Wrap every target that exists; (what was wrapped, notes on what was not). A module-level function is also
    rebound in every loaded module that imported it by name (vLLM imports most of these with `from ... import`)."""
    hooks = hooks or {}
    wrapped, notes = [], []
    for t in targets:
        if t.fine and not fine:
            continue
        clock.meta[t.label] = {"where": t.where, "category": t.category, "kind": t.kind}
        try:
            module = importlib.import_module(t.module)
        except Exception as e:
            notes.append(f"{t.label}: not wrapped: module {t.module} not importable ({_first_line(e)})")
            continue
        owner, parts = module, t.attr.split(".")
        try:
            for part in parts[:-1]:
                owner = getattr(owner, part)
        except AttributeError:
            notes.append(f"{t.label}: not wrapped: {t.module} has no {'.'.join(parts[:-1])}")
            continue
        name = parts[-1]
        if isinstance(owner, type):
            raw = owner.__dict__.get(name, _MISSING)
            if raw is _MISSING:
                raw = inspect.getattr_static(owner, name, _MISSING)
        else:
            raw = getattr(owner, name, _MISSING)
        if raw is _MISSING:
            notes.append(f"{t.label}: not wrapped: {t.module}.{t.attr} does not exist")
            continue
        fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
        if not callable(fn):
            notes.append(f"{t.label}: not wrapped: {t.module}.{t.attr} is not a function ({type(raw).__name__})")
            continue
        if getattr(fn, "_start_profile_wrapped", False):
            notes.append(f"{t.label}: already wrapped")
            continue
        if t.kind == "gen":
            new = clock.wrap_gen(fn, t.label)
        elif t.kind == "cm":
            new = clock.wrap_cm(fn, t.label, t.sync)
        else:
            new = clock.wrap_call(fn, t.label, t.sync, pre=hooks.get(t.pre), post=hooks.get(t.post))
        if isinstance(raw, staticmethod):
            new = staticmethod(new)
        elif isinstance(raw, classmethod):
            new = classmethod(new)
        setattr(owner, name, new)
        rebound = []
        if not isinstance(owner, type):
            for mod in list(sys.modules.values()):
                try:
                    if mod is not owner and vars(mod).get(name) is raw:
                        setattr(mod, name, new)
                        rebound.append(mod.__name__)
                except TypeError:  # an object without __dict__ in sys.modules
                    continue
        wrapped.append(
            {
                "label": t.label,
                "target": f"{t.module}:{t.attr}",
                "where_0_26": t.where,
                "found_at": source_where(fn),
                "kind": t.kind,
                "rebound_in": rebound,
            }
        )
    return wrapped, notes


def instrument_param_loaders(clock: PhaseClock, model) -> dict:
    """Wrap each parameter's own weight_loader (the bound loaders vLLM's layers attach at construction), named by whether
    it is the routed experts' loader; {label: parameters wrapped}."""
    clock.meta.setdefault(
        EXPERT_LOADER,
        {"where": "model_executor/layers/fused_moe/routed_experts.py:585", "category": "weight_loader", "kind": "call"},
    )
    clock.meta.setdefault(
        OTHER_LOADER, {"where": "each layer's weight_loader (linear.py, ...)", "category": "weight_loader", "kind": "call"}
    )
    counts = {EXPERT_LOADER: 0, OTHER_LOADER: 0, "not wrappable": 0}
    for _, param in model.named_parameters():
        loader = getattr(param, "weight_loader", None)
        if loader is None or getattr(loader, "_start_profile_wrapped", False):
            continue
        owner = getattr(loader, "__self__", None)
        expert = owner is not None and any(c.__name__ == "RoutedExperts" for c in type(owner).__mro__)
        label = EXPERT_LOADER if expert else OTHER_LOADER
        try:
            param.weight_loader = clock.wrap_call(loader, label)
            counts[label] += 1
        except Exception:
            counts["not wrappable"] += 1
    return counts


# --------------------------------------------------------------------------------------------------------------------
# The cuts


@dataclass(frozen=True)
class Cut:
    name: str
    what: str
    args: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    requires: str | None = None  # a Python module the load format needs
    prime: bool = False  # a start before the timed one, same settings (e.g. one that writes the startup plan)
    save: str | None = None  # "processed" | "unprocessed": starts from a folder saved by a saving start
    detail: str | None = None  # overrides --detail


CUTS = {
    c.name: c
    for c in (
        Cut("auto", "splicer's engine for the stand-in, vLLM's default loader"),
        Cut(
            "auto_coarse",
            "auto with only the coarse phases wrapped (the per-tensor timers' cost, by difference)",
            detail="coarse",
        ),
        Cut(
            "mtload",
            "multithreaded reading (8 threads)",
            {"model_loader_extra_config": {"enable_multithread_load": True, "num_threads": 8}},
        ),
        Cut("eager_read", "each safetensors file read whole", {"safetensors_load_strategy": "eager"}),
        Cut("prefetch", "files read ahead into the page cache", {"safetensors_load_strategy": "prefetch"}),
        Cut("fastsafetensors", "fastsafetensors reader", {"load_format": "fastsafetensors"}, requires="fastsafetensors"),
        Cut("runai_streamer", "Run:ai Model Streamer reader", {"load_format": "runai_streamer"}, requires="runai_model_streamer"),
        Cut("instanttensor", "InstantTensor reader", {"load_format": "instanttensor"}, requires="instanttensor"),
        Cut(
            "sharded_state",
            "vLLM's sharded_state, saved by vLLM after the engine started",
            {"load_format": "sharded_state"},
            save="processed",
        ),
        Cut(
            "sharded_state_unprocessed",
            "sharded_state loader, saved before process_weights_after_loading",
            {"load_format": "sharded_state"},
            save="unprocessed",
        ),
        Cut(
            "startup_plan",
            "VLLM_ENABLE_STARTUP_PLAN=1 (after a priming start)",
            env={"VLLM_ENABLE_STARTUP_PLAN": "1"},
            prime=True,
        ),
        Cut(
            "expert_cache",
            "splicer's --expert-cache loader: the routed experts saved by a priming start, copied into this one",
            {"load_format": "splicer_expert_cache"},
            env={"SPLICER_EXPERT_CACHE": "{root}/expert-cache"},
            prime=True,
        ),
        Cut("kv_fixed", "kv_cache_memory_bytes=12 GiB (no CUDA-graph memory estimate)", {"kv_cache_memory_bytes": 12 << 30}),
        Cut("no_autotune", "VLLM_TRITON_FORCE_FIRST_CONFIG=1", env={"VLLM_TRITON_FORCE_FIRST_CONFIG": "1"}),
        Cut(
            "no_compile",
            "no torch.compile, decode CUDA graphs only (changes run-time speed)",
            {
                "compilation_config": {
                    "mode": 0,
                    "cudagraph_mode": "FULL_DECODE_ONLY",
                    "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32],
                }
            },
        ),
        Cut("enforce_eager", "no compile, no CUDA graphs (changes run-time speed)", {"enforce_eager": True}),
    )
}
# The warm-up and saving starts: auto's engine, not compared, so without the per-tensor timers.
UNCOMPARED = replace(CUTS["auto"], detail="coarse")
DEFAULT_CUTS = "auto,sharded_state_unprocessed,sharded_state,mtload,eager_read,startup_plan,fastsafetensors,runai_streamer"
SAVED_PATTERN = "model-rank-0-part-*.safetensors"  # ShardedStateLoader.DEFAULT_PATTERN for rank 0
SAVE_MAX_BYTES = 5 << 30  # parts of at most 5 GiB, as vLLM's example save script writes them


def stand_in_engine() -> tuple[dict, dict]:
    """(engine kwargs, environment) of splicer's engines for the stand-in: the backend's defaults and fulldims.sh's
    settings without --overlap-starts."""
    from splicer.backends.vllm_engine_args import default_engine_args

    args, env = default_engine_args()
    args = {
        **args,
        "language_model_only": True,
        "gpu_memory_utilization": 0.5,
        "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]},
    }
    return args, {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


# --------------------------------------------------------------------------------------------------------------------
# One start (the child process)

PROMPT_LEN, NEW_TOKENS = 32, 8


def _cuda_sync() -> None:
    import torch

    # Never the first CUDA call (vLLM decides when CUDA starts), and never inside a CUDA graph capture, where a
    # synchronize is an error (the coarse phases are all outside one, as far as vLLM 0.26's code goes).
    if torch.cuda.is_initialized() and not torch.cuda.is_current_stream_capturing():
        torch.cuda.synchronize()


def _versions() -> dict:
    # a module the start imported gives its own version; the others come from their package metadata, so that a start
    # stopped early does not spend its grace importing transformers or triton for a version string
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for name, dist in (
        ("vllm", "vllm"),
        ("torch", "torch"),
        ("transformers", "transformers"),
        ("compressed_tensors", "compressed-tensors"),
        ("safetensors", "safetensors"),
        ("triton", "triton"),
    ):
        try:
            module = sys.modules.get(name)
            out[name] = module.__version__ if module is not None else metadata.version(dist)
        except Exception:
            out[name] = None
    try:
        import torch

        out["cuda"] = torch.version.cuda
        out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)"
    except Exception as e:
        out["gpu"] = _first_line(e)
    return out


def _copy_metadata(model: Path, dest: Path) -> list[str]:
    """The model folder's files other than weights, as vLLM's example save script copies them (config, tokenizer,
    generation config), less the safetensors index, which would name files the saved folder does not have."""
    copied = []
    for p in sorted(model.iterdir()):
        if p.suffix in (".safetensors", ".bin", ".pt") or p.name.endswith(".safetensors.index.json"):
            continue
        if p.is_dir():
            shutil.copytree(p, dest / p.name, dirs_exist_ok=True)
        else:
            shutil.copy2(p, dest / p.name)
        copied.append(p.name)
    return copied


def _checkpoint_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))


def _prompt_logprobs(per_position) -> list | None:
    """The prompt's log-probs (each position's own token and the top one), as [[token, logprob], ...] per position:
    a start that loaded the same weights gives the same numbers, bit for bit, where the engine repeats itself."""
    out = []
    try:
        for d in per_position or []:
            if d:
                out.append(sorted([int(t), float(getattr(lp, "logprob", lp))] for t, lp in d.items()))
    except (AttributeError, TypeError, ValueError):  # another layout (flat log-probs): not compared
        return None
    return out


def _logprob_gap(mine, ref) -> str | None:
    """ "same" when the prompt's log-probs equal the reference start's bit for bit, else the largest difference."""
    if not mine or not ref:
        return None
    if mine == ref:
        return "same"
    flat = [(a[0], a[1], b[0], b[1]) for x, y in zip(mine, ref) for a, b in zip(x, y)]
    if len(mine) != len(ref) or any(t != u for t, _, u, _ in flat):
        return "other tokens"
    return f"max |diff| {max(abs(p - q) for _, p, _, q in flat):.3g}"


def child_main(spec_path: Path) -> int:
    spec = json.loads(Path(spec_path).read_text())
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    record = {k: spec[k] for k in ("name", "role", "cut", "what", "engine_args", "env", "model", "model_target", "detail")}
    record.update(ok=False, error=None, notes=[], saved={})
    clock = PhaseClock(sync=_cuda_sync)
    record["instrumentation"] = {"detail": spec["detail"], "timer_cost_us": round(clock.calibrate() * 1e6, 3)}
    fine = spec["detail"] == "fine"
    save = spec.get("save") or {}
    model_target = Path(spec["model_target"])

    def save_state(kind: str, model, how) -> None:
        dest = Path(save[kind])
        need, free = _checkpoint_bytes(model_target), shutil.disk_usage(dest.parent).free
        if free < need * 1.1:
            record["saved"][kind] = {"skipped": f"{free / 2**30:.1f} GiB free, the checkpoint is {need / 2**30:.1f} GiB"}
            return
        dest.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        try:
            with clock.phase(f"save ({kind})", sync=True):
                how(model, dest)
        except Exception as e:
            record["saved"][kind] = {"error": _first_line(e), "traceback": traceback.format_exc()[-3000:]}
            return
        save_s = time.perf_counter() - t
        files = sorted(dest.glob("*.safetensors"))
        record["saved"][kind] = {
            "save_s": round(save_s, 3),
            "files": len(files),
            "gib": round(sum(f.stat().st_size for f in files) / 2**30, 3),
            "metadata_copied": _copy_metadata(model_target, dest),
        }

    def save_unprocessed(args, kwargs) -> None:
        # before process_weights_after_loading(model, model_config, target_device): the state_dict in vLLM's own
        # parameter layout, saved once (the first model processed is the target model; a drafter would come later)
        if "unprocessed" not in save or "unprocessed" in record["saved"]:
            return
        from vllm.model_executor.model_loader import ShardedStateLoader

        model = args[0] if args else kwargs.get("model")
        save_state("unprocessed", model, lambda m, d: ShardedStateLoader.save_model(m, str(d), max_size=SAVE_MAX_BYTES))

    param_counts: dict = {}

    def instrument_params(result, args, kwargs) -> None:
        if fine and result is not None:
            for k, v in instrument_param_loaders(clock, result).items():
                param_counts[k] = param_counts.get(k, 0) + v

    t_process = time.perf_counter()
    try:
        with clock.phase("import vllm"):
            import vllm
            from vllm import LLM, SamplingParams
        with clock.phase("import the wrapped modules and wrap them"):
            targets = VLLM_TARGETS + (SMOKE_TARGETS if spec["smoke"] else ())
            wrapped, notes = install(
                clock, targets, {"instrument_params": instrument_params, "save_unprocessed": save_unprocessed}, fine
            )
        record["wrapped"], record["notes"] = wrapped, notes
        expert_cache = spec["engine_args"].get("load_format") == "splicer_expert_cache"
        if expert_cache:  # splicer's loader (--expert-cache), registered as splicer's worker registers it
            from splicer.backends import vllm_expert_cache

            vllm_expert_cache.register()
        with clock.phase("LLM()", sync=True):
            llm = LLM(model=spec["model"], **spec["engine_args"])
        if expert_cache:
            record["expert_cache"] = vllm_expert_cache.last_outcome()
        record["llm_ready_after_process_start_s"] = round(time.perf_counter() - t_process, 3)
        vocab = spec["vocab"]
        import random

        rng = random.Random(0)
        prompt = [rng.randrange(vocab // 100, vocab - 1) for _ in range(PROMPT_LEN)]
        with clock.phase("generate", sync=True):
            params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        record["tokens"] = list(out[0].outputs[0].token_ids)
        scored = llm.generate(
            [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), use_tqdm=False
        )
        record["prompt_logprobs"] = _prompt_logprobs(scored[0].prompt_logprobs)
        try:
            from splicer.backends.vllm_child import _kernel_probe, _runner_probe

            layers = llm.apply_model(_kernel_probe)
            layers = layers[0] if isinstance(layers, list) and layers else layers
            kernels: dict = {}
            for desc in (layers or {}).values():
                kernels[str(desc)] = kernels.get(str(desc), 0) + 1
            record["kernels"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:12])
            runner = llm.collective_rpc(_runner_probe)
            record["model_runner"] = runner[0] if isinstance(runner, list) and runner else runner
        except Exception as e:  # informative only
            record["kernels"] = {"error": _first_line(e)}
        if "processed" in save:
            # vLLM's own path: LLM -> engine core client -> EngineCore.save_sharded_state -> executor -> Worker
            def how(_model, dest):
                client = getattr(llm.llm_engine, "engine_core", None)
                if hasattr(client, "save_sharded_state"):
                    client.save_sharded_state(str(dest), None, SAVE_MAX_BYTES)
                else:
                    llm.collective_rpc("save_sharded_state", kwargs={"path": str(dest), "max_size": SAVE_MAX_BYTES})

            save_state("processed", None, how)
        record["ok"] = True
        record["vllm_version"] = vllm.__version__
    except BaseException as e:
        record["error"] = _first_line(e)
        record["traceback"] = traceback.format_exc()[-4000:]
        record["stopped_at_budget"] = isinstance(e, BudgetStop)
    finally:
        record["param_loaders_wrapped"] = param_counts
        record.update(account(clock))
        record["versions"] = _versions()
        record["torch_peak_gib"] = _peak_gib()
        sys.stdout.flush()
        sys.stderr.flush()
        Path(spec["record_path"]).write_text(json.dumps(record, indent=1, default=str) + "\n")
    sys.stdout.flush()
    # Skip the interpreter's teardown (and the engine's shutdown at exit): the process ends here, its GPU memory with it.
    os._exit(0 if record["ok"] else 1)


def _peak_gib():
    try:
        import torch

        return round(torch.cuda.max_memory_allocated() / 2**30, 3) if torch.cuda.is_initialized() else None
    except Exception:
        return None


def account(clock: PhaseClock) -> dict:
    """The start's figures from its timers: the split of LLM() by category, its phases, the per-tensor loaders."""
    labels = clock.by_label()
    root = labels.get("LLM()", {})
    split = clock.split("LLM()")
    wl_calls, wl_s = clock.group(PER_TENSOR_LOADERS)
    # wrapped calls made inside LLM() (the root's own call aside): what the timers' cost estimate multiplies
    calls = sum(n.calls for path, n in clock.nodes.items() if path[0] == "LLM()") - (1 if root else 0)
    return {
        "times": {
            "import_s": round(
                sum(
                    labels.get(k, {}).get("inclusive_s", 0.0) for k in ("import vllm", "import the wrapped modules and wrap them")
                ),
                4,
            ),
            "llm_init_s": round(root.get("inclusive_s", 0.0), 4) if root else None,
            "generate_s": labels.get("generate", {}).get("inclusive_s"),
        },
        "split": {k: round(split.get(k, 0.0), 4) for k in CATEGORIES if k in split},
        "outside_wrapped_s": round(split.get("outside", 0.0), 4) if root else None,
        "weight_loader_calls": wl_calls,
        "weight_loader_s": round(wl_s, 4),
        "wrapped_calls_in_llm": calls,
        "phases": clock.rows(),
        "by_label": labels,
    }


# --------------------------------------------------------------------------------------------------------------------
# The call (the parent process)


def _meminfo_gib() -> dict:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable", "Cached"):
                out[key] = round(int(rest.split()[0]) / 2**20, 1)
    except OSError:
        pass
    return out


def _point_link(link: Path, target: Path) -> None:
    if link.is_symlink():
        link.unlink()
    elif link.exists():
        raise SystemExit(f"{link} exists and is not the symlink this script makes; move it away")
    link.symlink_to(target.resolve(), target_is_directory=True)


def _vocab(model: Path) -> int:
    cfg = json.loads((model / "config.json").read_text())
    return int(cfg.get("text_config", cfg)["vocab_size"])


def compile_cache_lines(log_text: str) -> dict:
    """What vLLM 0.26's log says about its compile cache in one start (compilation/decorators.py:312, backends.py:293
    and 394): AOT artifacts loaded, graphs loaded from the cache, graphs compiled. A start that compiled is no measure of
    a cut's load time; the compile category says what it cost."""
    return {
        "aot_loaded": log_text.count("Directly load AOT compilation from path"),
        "graphs_loaded": log_text.count("Directly load the compiled graph(s) for compile range"),
        "graphs_compiled": log_text.count("Compiling a graph for compile range"),
    }


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


@dataclass
class Call:
    root: Path
    model: Path
    link: Path
    base_args: dict
    base_env: dict
    detail: str
    smoke: bool
    budget_s: float
    cache_root: str | None
    t0: float = field(default_factory=time.perf_counter)
    records: list = field(default_factory=list)

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def start(self, name: str, role: str, cut: Cut, target: Path | None = None, save: dict | None = None) -> dict:
        starts = self.root / "starts"
        starts.mkdir(parents=True, exist_ok=True)
        target = target or self.model
        log, rec_path = starts / f"{name}.log", starts / f"{name}.json"
        rec_path.unlink(missing_ok=True)
        log.unlink(missing_ok=True)
        # A start needs its import and its engine: less than MIN_START_S left is not worth starting.
        timeout = self.left() - RESERVE_S - STOP_GRACE_S
        if timeout < MIN_START_S:
            rec = {"name": name, "role": role, "cut": cut.name, "ok": False, "skipped": "not run: the call's --budget-s is spent"}
            self.records.append(rec)
            print(f"{name}: skipped (budget)", flush=True)
            return rec
        _point_link(self.link, target)
        env = {**self.base_env, **{k: v.replace("{root}", str(self.root)) for k, v in cut.env.items()}}
        if self.cache_root:
            env["VLLM_CACHE_ROOT"] = self.cache_root
        spec = {
            "name": name,
            "role": role,
            "cut": cut.name,
            "what": cut.what,
            "engine_args": {**self.base_args, **cut.args},
            "env": env,
            "model": str(self.link),
            "model_target": str(target.resolve()),
            "detail": cut.detail or self.detail,
            "smoke": self.smoke,
            "save": save or {},
            "vocab": _vocab(target),
            "record_path": str(rec_path),
        }
        spec_path = starts / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec, indent=1) + "\n")
        mem = _meminfo_gib()
        t = time.perf_counter()
        timed_out = False
        with open(log, "ab") as fh:
            proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)],
                env={**os.environ, **env},
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: a timeout ends the start and its compile workers
            )
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                # asked first, so that the record keeps the phases timed so far; then its whole group (compile workers)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
                try:
                    rc = proc.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    rc = None
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait() if rc is None else rc
        wall = time.perf_counter() - t
        try:
            rec = json.loads(rec_path.read_text())
        except (OSError, json.JSONDecodeError):
            rec = {k: spec[k] for k in ("name", "role", "cut", "what", "engine_args", "env", "model", "model_target")}
            rec.update(ok=False, error=f"the start left no record (exit {rc}{', killed at the budget' if timed_out else ''})")
            rec["log_tail"] = _tail(log)
        rec.update(process_wall_s=round(wall, 3), exit_code=rc, timed_out=timed_out, host_memory_gib_before=mem)
        if not rec.get("ok") and "log_tail" not in rec:
            rec["log_tail"] = _tail(log)
        try:
            from splicer.backends.vllm_logs import startup_breakdown

            text = log.read_text(errors="replace")
            rec["vllm_log"] = startup_breakdown(text)
            rec["compile_cache"] = compile_cache_lines(text)
        except Exception as e:
            rec["vllm_log"] = {"error": _first_line(e)}
        rec_path.write_text(json.dumps(rec, indent=1, default=str) + "\n")
        self.records.append(rec)
        llm = (rec.get("times") or {}).get("llm_init_s")
        print(
            f"{name}: "
            + (
                f"LLM() {llm:.1f} s, process {wall:.1f} s" if rec.get("ok") and llm is not None else f"failed: {rec.get('error')}"
            ),
            flush=True,
        )
        return rec

    def skip(self, name: str, cut: Cut, why: str) -> None:
        self.records.append({"name": name, "role": "cut", "cut": cut.name, "what": cut.what, "ok": False, "skipped": why})
        print(f"{name}: skipped ({why})", flush=True)


def run_sharded(call: Call, cuts: list[Cut], keep: bool) -> None:
    """One saving start for the sharded cuts when the disk holds all their folders, else one per cut; each cut's start
    right after its save, then its folder removed."""
    saved_root = call.root / "saved"
    saved_root.mkdir(parents=True, exist_ok=True)
    need = _checkpoint_bytes(call.model) * 1.1 + (2 << 30)
    free = shutil.disk_usage(saved_root).free
    groups = [cuts] if free >= need * len(cuts) else [[c] for c in cuts]
    for group in groups:
        dirs = {c.save: saved_root / c.save for c in group}
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
        name = "save-" + "-".join(c.save for c in group)
        rec = call.start(name, "save", UNCOMPARED, save={k: str(v) for k, v in dirs.items()})
        for c in group:
            info = (rec.get("saved") or {}).get(c.save) or {}
            made = sorted(dirs[c.save].glob(SAVED_PATTERN))
            if not made or "save_s" not in info:  # nothing, or a save that broke off part-way
                why = info.get("error") or info.get("skipped") or rec.get("skipped") or rec.get("error")
                if not why and c.save == "unprocessed":
                    hooked = any(w.get("label") == "process_weights_after_loading" for w in rec.get("wrapped") or [])
                    why = (
                        "the hook on process_weights_after_loading never ran"
                        if hooked
                        else "process_weights_after_loading is not wrapped"
                    )
                why = why or "nothing saved"
                call.skip(c.name, c, f"no complete saved folder ({SAVED_PATTERN}): {why}")
                continue
            call.start(c.name, "cut", c, target=dirs[c.save])
        if not keep:
            for d in dirs.values():
                shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------------------------------------------------
# The comparison


def _fmt(v, digits=2) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def summarize(records: list[dict]) -> dict:
    """The starts side by side against the call's auto start: LLM() and the start (import + LLM()), the split, the
    per-tensor loader calls, vLLM's own log figures, whether the tokens match."""
    ref = next((r for r in records if r.get("name") == "auto" and r.get("ok")), None)
    rows = []
    for r in records:
        times = r.get("times") or {}
        split = r.get("split") or {}
        llm = times.get("llm_init_s")
        row = {
            "name": r.get("name"),
            "role": r.get("role"),
            "cut": r.get("cut"),
            "ok": bool(r.get("ok")),
            "why_not": r.get("skipped") or r.get("error"),
            "llm_init_s": llm,
            "start_s": round(llm + times.get("import_s", 0.0), 4) if llm is not None else None,
            "model_loading_s": round(sum(split.get(k, 0.0) for k in LOADING), 4) if split else None,
            "split": split,
            "weight_loader_calls": r.get("weight_loader_calls"),
            "weight_loader_s": r.get("weight_loader_s"),
            "vllm_log": r.get("vllm_log") or {},
            "same_tokens_as_auto": (r.get("tokens") == ref.get("tokens")) if (ref and r.get("tokens") is not None) else None,
            "prompt_logprobs_vs_auto": _logprob_gap(r.get("prompt_logprobs"), (ref or {}).get("prompt_logprobs")),
            "compile_cache": r.get("compile_cache") or {},
            "timer_cost_us": (r.get("instrumentation") or {}).get("timer_cost_us"),
            "wrapped_calls_in_llm": r.get("wrapped_calls_in_llm"),
        }
        if row["timer_cost_us"] is not None and row["wrapped_calls_in_llm"] is not None:
            row["timer_cost_estimate_s"] = round(row["timer_cost_us"] * 1e-6 * row["wrapped_calls_in_llm"], 3)
        rows.append(row)
    base = next((row for row in rows if ref is not None and row["name"] == ref["name"]), None)
    for row in rows:
        for key in ("llm_init_s", "start_s", "model_loading_s"):
            if base and row["ok"] and base[key] and row[key] is not None:
                row[f"{key}_ratio"] = round(row[key] / base[key], 3)
    return {"reference": ref.get("name") if ref else None, "rows": rows}


LOG_ROWS = (
    ("weights_load_s", "vLLM log: Loading weights took"),
    ("model_load_s", "vLLM log: Model loading took"),
    ("compile_s", "vLLM log: torch.compile"),
    ("profiling_warmup_s", "vLLM log: initial profiling/warm-up run"),
    ("graph_capture_s", "vLLM log: graph capturing"),
    ("init_engine_s", "vLLM log: init engine (profile, KV cache, warm-up)"),
)


def markdown(summary: dict, records: list[dict], header: str = "") -> str:
    rows = [r for r in summary["rows"] if r["role"] in ("reference", "cut", "warmup")]
    names = [r["name"] for r in rows]
    out = [header] if header else []
    out += ["| seconds | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]

    def line(label, values):
        out.append(f"| {label} | " + " | ".join(values) + " |")

    def ratio(r, key):
        v, q = r.get(key), r.get(f"{key}_ratio")
        return f"{_fmt(v)} ({q:.2f}x)" if v is not None and q is not None else _fmt(v)

    line("start (import + LLM())", [ratio(r, "start_s") for r in rows])
    line("LLM()", [ratio(r, "llm_init_s") for r in rows])
    line("model loading (the six loading categories)", [ratio(r, "model_loading_s") for r in rows])
    for key, desc in CATEGORIES.items():
        if any(key in r["split"] for r in rows):
            line(desc, [_fmt(r["split"].get(key)) if r["ok"] else "" for r in rows])
    line(
        "per-tensor weight_loader calls",
        [str(r["weight_loader_calls"]) if r["ok"] and r["weight_loader_calls"] is not None else "" for r in rows],
    )
    line("their inclusive seconds", [_fmt(r["weight_loader_s"]) if r["ok"] else "" for r in rows])
    line("timers' own cost (estimate)", [_fmt(r.get("timer_cost_estimate_s")) if r["ok"] else "" for r in rows])
    for key, desc in LOG_ROWS:
        if any(key in r["vllm_log"] for r in rows):
            line(desc, [_fmt(r["vllm_log"].get(key)) for r in rows])
    line(
        "compile cache: AOT loads / graphs compiled",
        [
            f"{r['compile_cache']['aot_loaded']} / {r['compile_cache']['graphs_compiled']}" if r["compile_cache"] else ""
            for r in rows
        ],
    )
    line(
        "prompt log-probs against auto (32 positions)",
        ["–" if r.get("prompt_logprobs_vs_auto") is None else r["prompt_logprobs_vs_auto"] for r in rows],
    )
    line(
        "same 8 greedy tokens as auto",
        ["–" if r["same_tokens_as_auto"] is None else ("yes" if r["same_tokens_as_auto"] else "NO") for r in rows],
    )
    line("outcome", ["ok" if r["ok"] else (r["why_not"] or "failed")[:160].replace("|", "/") for r in rows])
    others = [r for r in summary["rows"] if r["role"] in ("save", "prime")]
    if others:
        out += ["", "Saving and priming starts (not compared):", ""]
        for r in others:
            rec = next(x for x in records if x.get("name") == r["name"])
            saved = "; ".join(
                f"{k}: "
                + (
                    f"{v['save_s']:.1f} s, {v['gib']:.1f} GiB in {v['files']} files"
                    if "save_s" in v
                    else str(v.get("error") or v.get("skipped"))
                )
                for k, v in (rec.get("saved") or {}).items()
            )
            out.append(
                f"- {r['name']}: LLM() {_fmt(r['llm_init_s'])} s"
                + (f"; saved {saved}" if saved else "")
                + ("" if r["ok"] else f"; {r['why_not']}")
            )
    cached = [x for x in records if x.get("expert_cache")]
    if cached:  # what splicer's expert-cache loader said it did, per start
        out += ["", "Expert cache (splicer's loader; seconds as it measured them):", ""]
        for x in cached:
            out.append(f"- {x['name']}: " + ", ".join(f"{k} {v}" for k, v in x["expert_cache"].items()))
    ref = next((x for x in records if x.get("name") == summary["reference"]), None)
    if ref:
        out += ["", f"Phases of the {ref['name']} start (inclusive and exclusive seconds, calls; >= 0.05 s):", ""]
        out += ["| phase | calls | inclusive | exclusive |", "|---|---:|---:|---:|"]
        for p in ref.get("phases") or []:
            if p["inclusive_s"] >= 0.05:
                out.append(
                    f"| {'&nbsp;&nbsp;' * p['depth']}{p['label']} | {p['calls']} | {p['inclusive_s']:.2f} | {p['exclusive_s']:.2f} |"
                )
    notes = sorted({n for r in records for n in (r.get("notes") or [])})
    if notes:
        out += ["", f"Not wrapped ({len(notes)}):", ""] + [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------------------------------


def _smoke_model(root: Path) -> Path:
    """A tiny per-expert fixture for --cpu-smoke-test (written once under WORK)."""
    from splicer.fixtures.core import FixtureSpec, write_pair

    pair = root / "tiny-pair"
    if not (pair / "lowlatency" / "config.json").exists():
        shutil.rmtree(pair, ignore_errors=True)
        write_pair(pair, FixtureSpec(experts_layout="per_expert"), kinds=("lowlatency",))
    return pair / "lowlatency"


def parse_cuts(text: str) -> list[Cut]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in CUTS]
    if bad:
        raise SystemExit(f"--cuts: unknown {', '.join(bad)}; choose from {', '.join(CUTS)}")
    names = ["auto"] + [n for n in dict.fromkeys(names) if n != "auto"]
    return [CUTS[n] for n in names]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child_main(Path(argv[1]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", type=Path, help="the checkpoint (default WORK/pair/build)")
    ap.add_argument("--cuts", default=DEFAULT_CUTS, help=f"comma-separated, from: {', '.join(CUTS)} (default {DEFAULT_CUTS})")
    ap.add_argument("--budget-s", type=float, default=540, help="no start begins after this many seconds of the call")
    ap.add_argument("--detail", choices=("fine", "coarse"), default="fine")
    ap.add_argument("--no-warmup", action="store_true", help="no warm-up start first (caches known warm)")
    ap.add_argument("--keep-saved", action="store_true", help="keep the sharded_state folders under WORK/start-profile/saved")
    ap.add_argument("--cache-root", help="VLLM_CACHE_ROOT for every start (default: vLLM's per-user folder)")
    ap.add_argument("--cpu-smoke-test", action="store_true", help="the stand-in vLLM of tests/ on a tiny fixture")
    ap.add_argument(
        "--engine-env",
        action="append",
        default=[],
        metavar="K=V",
        help="an environment variable for every start, as ablate's --engine-env (fulldims.sh's NOAUTOTUNE=1 is "
        "VLLM_TRITON_FORCE_FIRST_CONFIG=1); recorded in base_env",
    )
    a = ap.parse_args(argv)
    from splicer.backends.vllm_engine_args import parse_engine_env
    from splicer.errors import SplicerError

    try:  # ablate's own check: a variable's name, none that splicer sets itself
        given_env = parse_engine_env(a.engine_env)
    except SplicerError as e:
        ap.error(str(e))
    cuts = parse_cuts(a.cuts)
    owned = sorted({k for c in cuts for k in c.env} & set(given_env))
    if owned:  # the cut would compare against itself
        ap.error(f"--engine-env {owned[0]}: a cut of --cuts sets it; leave it to the cut")
    root = a.work / "start-profile"
    root.mkdir(parents=True, exist_ok=True)
    model = a.model or a.work / "pair" / "build"
    if a.cpu_smoke_test and a.model is None and not (model / "config.json").exists():
        model = _smoke_model(root)
    if not (model / "config.json").exists():
        raise SystemExit(f"no checkpoint at {model}: make the stand-in first (python3 -m splicer fixture WORK/pair --full-dims)")
    args, env = stand_in_engine()
    env = {**env, **given_env}
    call = Call(root, model.resolve(), root / "model", args, env, a.detail, a.cpu_smoke_test, a.budget_s, a.cache_root)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if not a.no_warmup:
        call.start("warmup", "warmup", UNCOMPARED)
    sharded = [c for c in cuts if c.save]
    for c in cuts:
        if c.save:
            if c is sharded[0]:
                run_sharded(call, sharded, a.keep_saved)
            continue
        if c.requires and importlib.util.find_spec(c.requires) is None:
            call.skip(c.name, c, f"not installed: {c.requires} (load_format {c.args.get('load_format')} needs it)")
            continue
        if c.prime:  # not compared either: without the per-tensor timers
            call.start(f"{c.name}-prime", "prime", replace(c, detail="coarse"))
        call.start(c.name, "reference" if c.name == "auto" else "cut", c)
    if not a.keep_saved:  # the expert cache holds a copy of the experts (18 GB for the stand-in)
        shutil.rmtree(root / "expert-cache", ignore_errors=True)
    summary = summarize(call.records)
    result = {
        "started": started,
        "wall_s": round(time.perf_counter() - call.t0, 1),
        "model": str(model.resolve()),
        "checkpoint_gib": round(_checkpoint_bytes(model) / 2**30, 3),
        "cuts": {c.name: {"what": c.what, "engine_args": c.args, "env": c.env} for c in cuts},
        "base_engine_args": args,
        "base_env": env,
        "host": {"cpus": os.cpu_count(), **_meminfo_gib()},
        "smoke": a.cpu_smoke_test,
        "summary": summary,
        "starts": call.records,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "start-profile.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    vers = next((r.get("versions") for r in call.records if r.get("versions")), {}) or {}
    header = (
        f"Engine start profile, {started}: {model.name}, vLLM {vers.get('vllm')}, torch {vers.get('torch')}, "
        f"GPU {vers.get('gpu')}; ratios to the auto start of the same call."
        + (f" Every start's --engine-env: {' '.join(f'{k}={v}' for k, v in given_env.items())}." if given_env else "")
        + "\n"
    )
    (a.out / "start-profile.md").write_text(markdown(summary, call.records, header))
    with tarfile.open(a.out / "start-profile-starts.tgz", "w:gz") as tar:
        for r in call.records:
            for suffix in (".json", ".log"):
                p = root / "starts" / f"{r['name']}{suffix}"
                if p.exists():
                    tar.add(p, arcname=f"starts/{p.name}")
    print((a.out / "start-profile.md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
