"""`splicer ablate --gpus 0,1` (or `--ray`): a plan's rows spread over several GPUs of one host (or a Ray cluster's
lanes, backends/ray_lanes.py: each lane's label stands where a GPU id stands below, `build-ray1`).

Decode differences of a few percent are only seen when every engine is timed alone on its GPU, and engines of one
variant on different GPUs differ by more than that: so each GPU times the build at its start and at its end (the rows
`build` / `build-gpuN` and `build-end-gpuN`), and each row's decode is compared with the build on its own GPU
(verdicts.decode_vs_build), the engine-to-engine spread pooled over GPUs. The plan's own extra engines of the build
(`repeat = true` rows of the build) are replaced by these and reported as skipped.

The first GPU runs the base pass while --precompile's processes compile every variant on the others (vLLM's compile
cache is on disk, shared by the GPUs). Then one thread per GPU takes rows in plan order, whichever is free next. A row
scores and is timed while no other GPU's row scores or is timed (RowSchedule.measuring), so what runs beside a timing
is at most another GPU's engine starting, on that GPU and on that GPU's share of the cores (each GPU's processes are
pinned to their own cores). The engines, one per GPU, are made by backends/gpus.py.
"""

from __future__ import annotations

import queue
import threading

from ..errors import SplicerError
from .plan import PlannedRow, Row

SPREAD_REPEAT_REASON = "spread over GPUs: the build is timed at the start and end of every GPU instead"
RAY_REPEAT_REASON = "spread over Ray lanes: the build is timed at the start and end of every lane instead"


def compile_targets(lanes: list[int]):
    """For each variant to compile ahead, in the order the rows need them, the index of the backend (GPU) that compiles
    it. The first round fills every compiling process, the other GPUs' first (their rows can start as soon as the base
    pass is done, and they need the first variants); later variants go to the first GPU's processes, whose rows wait
    for the base pass anyway (spread evenly over the others when it has none), so the other GPUs' processes end after
    one compile each."""
    yield from (k for k in (*range(1, len(lanes)), 0) for _ in range(lanes[k]))
    later = [0] if lanes[0] else [k for k in range(1, len(lanes)) if lanes[k]] or [0]
    while True:
        yield from later


def lane_labels(gpus: tuple, backends: list) -> tuple[str, ...]:
    """The lanes the rows are spread over: --gpus' ids, or each Ray lane's label when a run has more than one; () when
    the rows run one after another on one backend."""
    if gpus:
        return tuple(gpus)
    if len(backends) > 1:
        return tuple(b.label for b in backends)
    return ()


def _lane_row(name: str, lane: str, end: bool = False) -> str:
    """The build's row on a lane: build-gpu1 (a --gpus id), build-ray1 (a Ray lane); -end- for its last engine."""
    return f"{name}{'-end' if end else ''}-{'gpu' if lane.isdigit() else ''}{lane}"


def gpu_build_rows(
    todo: list[PlannedRow], gpus: tuple[str, ...], timed: bool = True
) -> tuple[list[PlannedRow | None], list[PlannedRow | None], list[PlannedRow], list[PlannedRow]]:
    """(each GPU's first engine of the build, each GPU's last, the other rows in plan order, the plan's own extra engines
    of the build, which these replace), from the rows resolve_rows gives. Without
    decode timing only the first GPU runs the build (its scores are every row's reference), and the plan's own extra
    engines of the build run as other rows."""
    build = next((it for it in todo if it.restored == [] and it.splice_name == it.row.name), None)
    if build is None:
        flag = "--gpus" if all(str(g).isdigit() for g in gpus) else "--ray"
        raise SplicerError(
            f"{flag} compares every row with the build on its own {'GPU' if flag == '--gpus' else 'Ray lane'}, and this "
            f"plan has no build row (restore = []); add one or leave {flag} out"
        )
    name = build.row.name
    if not timed:
        return [build, *[None] * (len(gpus) - 1)], [None] * len(gpus), [it for it in todo if it is not build], []
    firsts = [
        build if k == 0 else PlannedRow(Row(_lane_row(name, g), restore=[], repeat=True), [], name) for k, g in enumerate(gpus)
    ]
    lasts = [PlannedRow(Row(_lane_row(name, g, end=True), restore=[], repeat=True), [], name) for g in gpus]
    replaced = [it for it in todo if it is not build and it.restored == [] and it.splice_name == name]
    rows = [it for it in todo if it is not build and it not in replaced]
    return firsts, lasts, rows, replaced


def run_rows_on_gpus(
    lanes: list[tuple[str, object]],
    firsts: list[PlannedRow | None],
    lasts: list[PlannedRow | None],
    rows: list[PlannedRow],
    run_one,
    record,
    before_rows=None,
) -> None:
    """One thread per (gpu, backend) in lanes: before_rows(backend, gpu) (its compiling processes end), its first item,
    then rows from the shared queue while any is left, then its last item. run_one(item, backend, gpu) -> entry; a row
    whose lane lost its worker (entry `lane_lost`) goes back into the queue once; record(item, entry) writes it (under RowSchedule.measuring, by the caller). An interrupt (Ctrl-C) ends every lane:
    their backends are closed, which ends their engines, and what a lane was doing then is not recorded."""
    pending: queue.Queue = queue.Queue()
    for it in rows:
        pending.put(it)
    stop = threading.Event()
    failures: list[BaseException] = []
    retried: set[int] = set()
    lost: dict[int, str | None] = {}  # rows whose first try lost its lane's worker: that try's error

    def lane(k: int, gpu: str, backend) -> None:
        def items():
            if firsts[k] is not None:
                yield firsts[k]
            while not stop.is_set():
                try:
                    yield pending.get_nowait()
                except queue.Empty:
                    break
            if lasts[k] is not None:
                yield lasts[k]

        try:
            if before_rows is not None:
                before_rows(backend, gpu)
            for it in items():
                if stop.is_set():
                    return
                entry = run_one(it, backend, gpu)
                if stop.is_set():
                    return
                if entry.get("lane_lost") and id(it) not in retried:
                    # The lane's worker died during this row (a Ray lane: ray_lanes.LaneLost): the row is tried once
                    # more, on its new worker for the lane's own engines of the build, else by whichever lane is free
                    # next, this one included.
                    retried.add(id(it))
                    lost[id(it)] = entry.get("error")
                    if it is not firsts[k] and it is not lasts[k]:
                        pending.put(it)
                        continue
                    entry = run_one(it, backend, gpu)
                    if stop.is_set():
                        return
                if id(it) in lost:  # the row's first try ended with its lane's worker
                    entry["after_lost_worker"] = lost[id(it)]
                record(it, entry)
                if it is firsts[k] and entry.get("status") != "ok":
                    # This GPU cannot serve the build: it takes no rows (each would fail fast and empty the queue),
                    # the other GPUs run them.
                    return
        except BaseException as e:  # a failure outside a row (results.json cannot be written): end every lane
            failures.append(e)
            stop.set()

    threads = [threading.Thread(target=lane, args=(k, gpu, b), daemon=True, name=f"gpu{gpu}") for k, (gpu, b) in enumerate(lanes)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.5)
    except BaseException:
        stop.set()
        # End the engines' processes (not close(): the lanes' threads may be using the same workers); each lane's
        # pending call then fails, its row is not recorded, and the thread ends. The caller closes the backends.
        for _, b in lanes:
            b.abort()
        for t in threads:
            t.join(60)
        raise
    if failures:
        raise failures[0]
