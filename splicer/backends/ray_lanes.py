"""`--ray [ADDRESS]`: a run's rows on a Ray cluster, scheduled as `--gpus` schedules a host's GPUs (plans/spread.py).

Each lane is one Ray actor that holds, for the whole run, what one engine needs: the GPUs of tensor_parallel_size ×
pipeline_parallel_size (vLLM; the torch backend on CUDA: one), or one core where no GPU is asked for (the torch backend
on the CPU). So an engine is alone on its GPUs, and RowSchedule.measuring keeps every other lane's row from scoring or
being timed meanwhile, as with --gpus. The actor builds the backend the options describe (without --ray) and serves
its calls; RayLane is that backend as the driver sees it. The driver splices, writes the scores, results.json, the
table and the report into DIR itself; the lanes only load, score, generate and time. Each lane times the build first
and last, so every row's decode is compared with the build on its own lane's GPUs (row names `build-rayN`).

An engine bigger than one node's GPUs is refused for now: vLLM's Ray executor takes the placement group it is called
from (vllm/v1/executor/ray_utils.py initialize_ray_cluster: ray.util.get_current_placement_group(), read in 0.26.0 and
0.33.0), but splicer's vLLM backend runs the engine in a worker process of its own, outside the lane's Ray actor,
where there is no current placement group: vLLM would make another over the same GPUs and wait for it.

Storage: the lanes read the build, the base, the checkpoint rows and DIR (splices, the base pass's cache) at the paths
the driver sees, and write their engines' logs under DIR/logs/rayN. Before any row each lane reads a token the driver
wrote into DIR and opens every input's config.json (check_storage), so a worker without the shared storage fails the
run in one line.

Faults: a lane whose worker dies mid-row (a lost node, the OOM killer) fails that row (LaneLost); the lane starts a new
actor, and the row is tried once more (spread.run_rows_on_gpus; the retried row records `after_lost_worker`). A lane
that cannot be placed within PLACEMENT_TIMEOUT_S, or whose worker fails as it starts, refuses the run in one line. Finished
rows are in results.json as always, so an interrupted driver resumes.
"""

from __future__ import annotations

import functools
import os
import secrets
import socket
import time
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

    # Ray's own lines (joining, starting a local instance, its token warning) would break the one-line stderr of a
    # refused run
    kwargs = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.ERROR}
    _reachable(address)
    try:
        ray.init(**({} if address == DEFAULT_ADDRESS else {"address": address}), **kwargs)
    except Exception as e:
        raise SplicerError(
            f"--ray {'' if address == DEFAULT_ADDRESS else address}: cannot join a Ray cluster ({e.__class__.__name__}: "
            f"{_cause(e)}); start one (ray start --head) or give its address (--ray HOST:6379)"
        ) from None


def _reachable(address: str, timeout_s: float = 5.0) -> None:
    """A HOST:PORT address answers on its port, else one line now (ray.init retries an unreachable one for minutes)."""
    import re
    import socket as sock

    m = re.fullmatch(r"(?:ray://)?\[?([\w.:-]+?)\]?:(\d+)", address)
    if address in (DEFAULT_ADDRESS, "auto", "local") or m is None:
        return
    try:
        with sock.create_connection((m.group(1), int(m.group(2))), timeout=timeout_s):
            pass
    except OSError as e:
        raise SplicerError(
            f"--ray {address}: nothing answers there ({e.strerror or e.__class__.__name__}); start the cluster "
            "(ray start --head) or give its address (--ray=HOST:6379)"
        ) from None


def plan_lanes(per_engine: int, cap: int | None) -> tuple[int, bool]:
    """(how many lanes the cluster has room for now, whether one engine fits one node). A cluster with too few GPUs
    for one engine, or none free, is refused in one line."""
    ray = ray_module()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    gpus = [int(n.get("Resources", {}).get("GPU", 0)) for n in nodes]
    if per_engine and sum(gpus) < per_engine:
        raise SplicerError(
            f"--ray: the cluster has {sum(gpus)} GPU(s) and one engine needs {per_engine} "
            "(tensor_parallel_size × pipeline_parallel_size); add GPUs or lower the engine's parallelism"
        )
    need = "GPU" if per_engine else "CPU"
    # Workers of an earlier run in this process give their resources back a moment after they are killed: wait for all
    # of them, not for the first, or a run started right after another gets fewer lanes and drops the rows of the
    # lanes it no longer has (build-end-ray1, ...) that the earlier run finished.
    # Only for what was given back within FREE_WAIT_S (later, it is other work that holds it), and only up to the lanes
    # asked for (--ray-lanes) and the cluster's total.
    per_lane = max(per_engine, 1)
    recent = time.monotonic() - _GIVEN_BACK.get("at", -1e9) < FREE_WAIT_S
    want = max(per_lane, _GIVEN_BACK.get(need, 0) if recent else 0)
    total = sum(n.get("Resources", {}).get(need, 0) for n in nodes)
    want = min(want, total or want, cap * per_lane if cap else want)
    free = ray.available_resources()
    waited = time.monotonic()
    while free.get(need, 0) < want and time.monotonic() - waited < FREE_WAIT_S:
        time.sleep(0.5)
        free = ray.available_resources()
    _GIVEN_BACK.clear()
    if per_engine:
        fits = max(gpus) >= per_engine
        lanes = sum(g // per_engine for g in gpus) if fits else sum(gpus) // per_engine
        lanes = min(lanes, int(free.get("GPU", 0)) // per_engine)
        what = f"{per_engine} GPU(s) free for one engine"
    else:
        fits, lanes = True, int(free.get("CPU", 0))
        what = "CPU free"
    if lanes < 1:
        raise SplicerError(f"--ray: the cluster has no {what} now (other work holds them); try again when it is done")
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

    def __init__(self, label: str, options, device: str, log_dir: Path, per_engine: int):
        self.label, self.options, self.device, self.log_dir = label, options, device, Path(log_dir)
        self.per_engine = per_engine
        self.name = options.backend
        self.results_wording = options.backend_type().results_wording
        self._actor = None
        self._incarnation = 0
        self._closed = False  # after abort() or close() no new worker is started
        self._exact: bool | None = None  # hold_exact_gather's ruling, given again to a new worker
        self.where: dict = {}
        self._start()
        self.default_batch = self._get("default_batch")

    @property
    def _ray(self):
        return ray_module()

    def _start(self) -> None:
        """A new actor for this lane, holding the lane's GPUs (or one core)."""
        ray = self._ray
        worker = _worker_class().options(num_cpus=1, num_gpus=self.per_engine, **ACTOR_OPTIONS)
        self._actor = worker.remote(
            self.label, self.options, self.device, str(self.log_dir), dict(BACKEND_KWARGS), self._incarnation
        )
        try:  # placed and built: where it runs, and the backend's description, asked once (describe() never waits)
            self.where = ray.get(self._actor.where.remote(), timeout=PLACEMENT_TIMEOUT_S)
            self._description = ray.get(self._actor.call.remote("describe", (), {}))
        except ray.exceptions.GetTimeoutError:
            ray.kill(self._actor)
            self._actor = None
            raise SplicerError(
                f"--ray: lane {self.label} was not placed within {PLACEMENT_TIMEOUT_S} s (the cluster's resources are "
                "held by other work, or a worker cannot start); free them or lower --ray-lanes"
            ) from None
        except ray.exceptions.RayActorError as e:
            self._actor = None
            raise SplicerError(f"--ray: lane {self.label}'s worker could not start: {_cause(e)}") from None
        if self._exact is not None:
            self._call("hold_exact_gather", self._exact)

    def _lost(self, e: Exception):
        self._actor = None
        self._incarnation += 1
        return LaneLost(f"Ray lane {self.label} lost its worker (host {self.where.get('host', '?')}): {_cause(e)}")

    def _live(self):
        """The lane's worker, started again after a loss (never after abort() or close())."""
        if self._actor is None:
            if self._closed:
                raise LaneLost(f"Ray lane {self.label} was stopped")
            self._start()
        return self._actor

    def _ask(self, method: str, *args):
        """The answer of the lane's worker's `method` (call or get); a worker that dies meanwhile is LaneLost."""
        ray = self._ray
        try:
            return ray.get(getattr(self._live(), method).remote(*args))
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.ObjectLostError) as e:
            raise self._lost(e) from None

    def _call(self, method: str, *args, **kwargs):
        return self._ask("call", method, args, kwargs)

    def _get(self, name: str):
        return self._ask("get", name)

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
        # asked once per worker: results are written after every row while other lanes' workers are busy or lost
        return {**self._description, "ray_lane": {"lane": self.label, **self.where}}

    def close(self) -> None:
        ray = self._ray
        self._closed = True
        if self._actor is not None:
            try:
                ray.get(self._actor.call.remote("close", (), {}))
            except Exception:
                pass
            self._kill()

    def abort(self) -> None:
        self._closed = True
        if self._actor is not None:
            self._kill()

    def _kill(self) -> None:
        self._ray.kill(self._actor)
        self._actor = None
        # what the worker held (num_cpus=1, num_gpus=per_engine: _start), for plan_lanes to wait for
        _GIVEN_BACK["CPU"] = _GIVEN_BACK.get("CPU", 0) + 1
        if self.per_engine:
            _GIVEN_BACK["GPU"] = _GIVEN_BACK.get("GPU", 0) + self.per_engine
        _GIVEN_BACK["at"] = time.monotonic()

    def check_storage(self, out: Path, token: str, inputs: list[str]) -> None:
        problem = self._ray.get(self._actor.check_storage.remote(str(out / TOKEN_FILE), token, inputs, str(self.log_dir)))
        if problem:
            raise SplicerError(
                f"--ray: lane {self.label} on {self.where['host']}: {problem}; every worker must see the build, the base, "
                "the checkpoint rows and the output folder at the paths this machine sees (shared storage)"
            )


PLACEMENT_TIMEOUT_S = 300  # how long a lane may wait to be placed and built before the run is refused
FREE_WAIT_S = 30  # how long planning waits for resources an ending run is giving back
# what this process's killed lane workers held ("GPU", "CPU") and when the last was killed ("at", time.monotonic()),
# until lanes are planned again
_GIVEN_BACK: dict[str, float] = {}


def _cause(e: Exception) -> str:
    """The line of a Ray error that says what went wrong (the worker's own exception where Ray carries it), without
    Ray's colour codes."""
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception|Exit)\b.*:", ln)]
    return (errors[-1] if errors else (lines[0] if lines else e.__class__.__name__))[:300]


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
    lane_device, per_engine = options.ray_engine(device, bool(ray_module().cluster_resources().get("GPU", 0)))
    n, fits = plan_lanes(per_engine, cap)
    if not fits:
        raise SplicerError(
            f"--ray: one engine needs {per_engine} GPUs, more than any node of the cluster has; an engine across nodes "
            "is not supported yet (splicer's vLLM worker runs outside the lane's Ray actor, where vLLM's Ray executor "
            "cannot find the lane's placement group); lower tensor_parallel_size × pipeline_parallel_size to one node's GPUs"
        )
    return [RayLane(f"ray{k}", options, lane_device, log_dir / f"ray{k}", per_engine) for k in range(n)]


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
