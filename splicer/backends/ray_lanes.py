"""`--ray [ADDRESS]`: a run's rows on a Ray cluster, scheduled as `--gpus` schedules a host's GPUs (plans/spread.py).

Each lane is one Ray actor that holds, for the whole run, what one engine needs: the GPUs of tensor_parallel_size ×
pipeline_parallel_size (vLLM; the torch backend on CUDA: one), or one core where no GPU is asked for (the torch backend
on the CPU). So an engine is alone on its GPUs, and RowSchedule.measuring keeps every other lane's row from scoring or
being timed meanwhile, as with --gpus. The actor builds the backend the options describe (without --ray) and serves
its calls; RayLane is that backend as the driver sees it. The driver splices, writes the scores, results.json, the
table and the report into DIR itself; the lanes only load, score, generate and time. Each lane times the build first
and last, so every row's decode is compared with the build on its own lane's GPUs (row names `build-rayN`).

An engine bigger than one node's GPUs: the lane is a placement group of one-GPU bundles (PACK) with the actor in the
first bundle holding no GPU, and the engine runs with vLLM's Ray executor (distributed_executor_backend="ray"), which
takes the placement group it is called from: vllm/v1/executor/ray_utils.py initialize_ray_cluster reads
ray.util.get_current_placement_group() and wants bundles of at most one GPU (read in 0.26.0 and 0.33.0; 0.26's
RayDistributedExecutor also wants a bundle on the driver's node, which the first bundle is). Not run: no machine here
has more than one node.

Storage: the lanes read the build, the base, the checkpoint rows and DIR (splices, the base pass's cache) at the paths
the driver sees, and write their engines' logs under DIR/logs/rayN. Before any row each lane reads a token the driver
wrote into DIR and opens every input's config.json (check_storage), so a worker without the shared storage fails the
run in one line.

Faults: a lane whose worker dies mid-row (a lost node, the OOM killer) fails that row (LaneLost); the lane starts a new
actor for its next row, and the row is tried once more by whichever lane is free (spread.run_rows_on_gpus). Finished
rows are in results.json as always, so an interrupted driver resumes.
"""

from __future__ import annotations

import functools
import os
import secrets
import socket
from pathlib import Path

from ..errors import SplicerError
from ..io import faults
from .base import OneEngineAtATime

DEFAULT_ADDRESS = "default"  # --ray without ADDRESS: ray.init()'s own choice (RAY_ADDRESS, a running local cluster, or a new one)
TOKEN_FILE = ".ray-storage-check"
# Test hooks, set in the driver and handed to each actor: keyword arguments for the backend's constructor (the stand-in
# engine's tests: require_cuda=False) and Ray options for the actor (a runtime_env with the stand-in on its path).
BACKEND_KWARGS: dict = {}
ACTOR_OPTIONS: dict = {}


class LaneLost(RuntimeError):
    """A lane's worker died during a call (its row fails; the lane starts a new worker for the next)."""

    lane_lost = True


def ray_module():
    try:
        import ray
    except ImportError:
        raise SplicerError("--ray needs Ray on this machine and every worker: pip install 'splicer[ray]'") from None
    return ray


def connect(address: str) -> None:
    """Join the Ray cluster at address (DEFAULT_ADDRESS: ray.init's own choice), once per process."""
    ray = ray_module()
    if ray.is_initialized():
        return
    import logging

    # Ray's own lines (joining, starting a local instance) would break the one-line stderr of a refused run
    kwargs = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.WARNING}
    try:
        ray.init(**({} if address == DEFAULT_ADDRESS else {"address": address}), **kwargs)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise SplicerError(
            f"--ray {'' if address == DEFAULT_ADDRESS else address}: cannot join a Ray cluster ({e.__class__.__name__}: "
            f"{first}); start one (ray start --head) or give its address (--ray HOST:6379)"
        ) from None


def engine_gpus(options, device: str) -> int:
    """The GPUs one engine of these options needs: tensor × pipeline parallel size for vLLM, one for the torch backend
    on CUDA, none on the CPU."""
    args = getattr(options, "engine_args", None)
    if args is not None and options.backend == "vllm":
        return int(args.get("tensor_parallel_size") or 1) * int(args.get("pipeline_parallel_size") or 1)
    return 0 if device == "cpu" else 1


def plan_lanes(per_engine: int, cap: int | None) -> tuple[int, bool]:
    """(how many lanes the cluster holds, whether one engine fits one node). A cluster with too few GPUs for one engine
    is refused in one line."""
    ray = ray_module()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if per_engine:
        gpus = [int(n.get("Resources", {}).get("GPU", 0)) for n in nodes]
        if sum(gpus) < per_engine:
            raise SplicerError(
                f"--ray: the cluster has {sum(gpus)} GPU(s) and one engine needs {per_engine} "
                "(tensor_parallel_size × pipeline_parallel_size); add GPUs or lower the engine's parallelism"
            )
        fits = max(gpus) >= per_engine
        lanes = sum(g // per_engine for g in gpus) if fits else sum(gpus) // per_engine
    else:
        fits, lanes = True, sum(int(n.get("Resources", {}).get("CPU", 0)) for n in nodes)
        if lanes < 1:
            raise SplicerError("--ray: the cluster has no CPU to run the torch backend on; add a worker")
    return (min(lanes, cap) if cap else lanes), fits


@functools.lru_cache(maxsize=1)
def _worker_class():
    ray = ray_module()

    @ray.remote(max_restarts=0, max_task_retries=0)
    class LaneWorker:
        """One lane's backend, in the Ray worker that holds the lane's resources."""

        def __init__(self, label: str, options, device: str, log_dir: str, backend_kwargs: dict, incarnation: int):
            self.fault = f"ray:lane-call:{label}:{incarnation}"  # SPLICER_FAULT names one worker of one lane
            cls = options.backend_type()
            if backend_kwargs:  # the tests' hook (BACKEND_KWARGS)
                init = cls.__init__
                cls.__init__ = lambda s, *a, **k: init(s, *a, **{**k, **backend_kwargs})
            self.backend = options.make_backends(device, Path(log_dir))[0]

        def call(self, method: str, args: tuple, kwargs: dict):
            faults.point(self.fault)
            out = getattr(self.backend, method)(*args, **kwargs)
            return list(out) if method == "score" else out

        def get(self, name: str):
            return getattr(self.backend, name)

        def where(self) -> dict:
            return {
                "host": socket.gethostname(),
                "node": ray.get_runtime_context().get_node_id(),
                "gpus": [str(g) for g in ray.get_gpu_ids()],
                "pid": os.getpid(),
            }

        def check_storage(self, token_path: str, token: str, inputs: list[str], log_dir: str) -> str | None:
            """None when this worker sees DIR (the driver's token) and every input folder; else what it cannot see."""
            try:
                if Path(token_path).read_text().strip() != token:
                    return f"{token_path} holds another run's token (DIR is another folder on this worker)"
            except OSError as e:
                return f"cannot read {token_path} ({e.strerror or e})"
            for folder in inputs:
                if not (Path(folder) / "config.json").is_file():
                    return f"cannot read {folder}/config.json"
            try:
                Path(log_dir).mkdir(parents=True, exist_ok=True)
                probe = Path(log_dir) / f".write-check-{os.getpid()}"
                probe.write_text("ok")
                probe.unlink()
            except OSError as e:
                return f"cannot write into {log_dir} ({e.strerror or e})"
            return None

    return LaneWorker


class RayLane(OneEngineAtATime):
    """A backend on one Ray lane, as the driver sees it (base.Backend): each call runs in the lane's actor. Engines are
    started one at a time on the lane (nothing ahead, nothing precompiled)."""

    def __init__(self, label: str, options, device: str, log_dir: Path, per_engine: int, fits_node: bool):
        self.label, self.options, self.device, self.log_dir = label, options, device, Path(log_dir)
        self.per_engine, self.fits_node = per_engine, fits_node
        self.name = options.backend
        self.results_wording = options.backend_type().results_wording
        self._actor = self._group = None
        self._incarnation = 0
        self._exact: bool | None = None  # hold_exact_gather's ruling, given again to a new worker
        self._start()
        self.default_batch = self._get("default_batch")
        self.where = self._ray.get(self._actor.where.remote())

    @property
    def _ray(self):
        return ray_module()

    def _start(self) -> None:
        """A new actor (and placement group) for this lane."""
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts = {"num_cpus": 1, "num_gpus": 0}
        if self.per_engine and self.fits_node:
            opts["num_gpus"] = self.per_engine
        elif self.per_engine:  # bigger than a node: one-GPU bundles for vLLM's Ray executor, the actor in the first
            self._group = placement_group([{"GPU": 1, "CPU": 1}] + [{"GPU": 1}] * (self.per_engine - 1), strategy="PACK")
            ray.get(self._group.ready())
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self._group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
            )
        options = self.options
        if self.per_engine and not self.fits_node:
            options = _with_engine_args(options, distributed_executor_backend="ray")
        worker = _worker_class().options(**opts, **ACTOR_OPTIONS)
        self._actor = worker.remote(self.label, options, self.device, str(self.log_dir), dict(BACKEND_KWARGS), self._incarnation)
        if self._exact is not None:
            self._call("hold_exact_gather", self._exact)

    def _lost(self, e: Exception):
        self._actor = None
        self._incarnation += 1
        where = self.__dict__.get("where") or {}
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return LaneLost(f"Ray lane {self.label} lost its worker (host {where.get('host', '?')}): {first}")

    def _call(self, method: str, *args, **kwargs):
        ray = self._ray
        if self._actor is None:
            self._start()
        try:
            return ray.get(self._actor.call.remote(method, args, kwargs))
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.ObjectLostError) as e:
            raise self._lost(e) from None

    def _get(self, name: str):
        ray = self._ray
        if self._actor is None:
            self._start()
        try:
            return ray.get(self._actor.get.remote(name))
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as e:
            raise self._lost(e) from None

    # base.Backend
    @property
    def exact_gather(self) -> bool:
        return bool(self._get("exact_gather"))

    def load(self, folder: Path) -> None:
        self._call("load", Path(folder))

    def load_info(self) -> dict:
        if self._actor is None:
            return {}
        info = self._call("load_info")
        return dict(info, ray_lane={"lane": self.label, **self.where}) if info else info

    def score(self, sequences, top_k=20, gather_ids=None, want_full=False, batch_size=4):
        yield from self._call("score", sequences, top_k, gather_ids, want_full, batch_size)

    def generate(self, prompts, max_new_tokens, stop_ids):
        return self._call("generate", prompts, max_new_tokens, stop_ids)

    def time_decode(self, prompt, new_tokens, warmup, runs):
        return self._call("time_decode", prompt, new_tokens, warmup, runs)

    def unload(self) -> None:
        if self._actor is not None:
            self._call("unload")

    def hold_exact_gather(self, exact: bool) -> None:
        self._exact = bool(exact)
        self._call("hold_exact_gather", self._exact)

    def describe(self) -> dict:
        return {**self._call("describe"), "ray_lane": self.label}

    def close(self) -> None:
        ray = self._ray
        if self._actor is not None:
            try:
                ray.get(self._actor.call.remote("close", (), {}))
            except Exception:
                pass
            ray.kill(self._actor)
            self._actor = None
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._group)
            self._group = None

    def abort(self) -> None:
        if self._actor is not None:
            self._ray.kill(self._actor)
            self._actor = None

    def check_storage(self, out: Path, token: str, inputs: list[str]) -> None:
        problem = self._ray.get(self._actor.check_storage.remote(str(out / TOKEN_FILE), token, inputs, str(self.log_dir)))
        if problem:
            raise SplicerError(
                f"--ray: lane {self.label} on {self.where['host']}: {problem}; every worker must see the build, the base, "
                "the checkpoint rows and the output folder at the paths this machine sees (shared storage)"
            )


def _with_engine_args(options, **args):
    from dataclasses import replace

    return replace(options, engine_args={**options.engine_args, **args})


def check_options(ray: str | None, lanes: int | None, **local) -> None:
    """What --ray cannot go with: the options of one host's scheduling (--gpus, --overlap-starts, --precompile), given
    as name -> value; --ray-lanes without --ray."""
    if lanes is not None and not ray:
        raise SplicerError("--ray-lanes caps the lanes of a --ray run; add --ray or drop --ray-lanes")
    if lanes is not None and lanes < 1:
        raise SplicerError(f"--ray-lanes {lanes}: give 1 or more")
    given = [f"--{k.replace('_', '-')}" for k, v in local.items() if v]
    if ray and given:
        raise SplicerError(
            f"--ray and {', '.join(given)}: on a Ray cluster each lane starts one engine at a time on the GPUs Ray gives "
            f"it; drop {', '.join(given)}"
        )


def make_lanes(options, device: str, log_dir: Path, address: str, cap: int | None) -> list[RayLane]:
    """One RayLane per engine's worth of the cluster's resources (at most cap), labelled ray0, ray1, ...; the first runs
    the base pass. options: the backend's options without --ray."""
    connect(address)
    per_engine = engine_gpus(options, device)
    n, fits = plan_lanes(per_engine, cap)
    lane_device = "cpu" if not per_engine else ("auto" if options.backend == "vllm" else "cuda")
    return [RayLane(f"ray{k}", options, lane_device, log_dir / f"ray{k}", per_engine, fits) for k in range(n)]


def check_storage(lanes: list, out: Path, inputs: list[str]) -> None:
    """Each lane sees DIR (a token written here now) and every input folder, and can write its logs; else one line."""
    token = secrets.token_hex(8)
    path = Path(out) / TOKEN_FILE
    path.write_text(token + "\n")
    try:
        for lane in lanes:
            lane.check_storage(Path(out), token, inputs)
    finally:
        path.unlink(missing_ok=True)
