"""The rows (DIR/variants/SPLICE/, DIR/scores/ROW/): each row's folder (the base, the build, or a splice), its scores
against the base pass and its decode timing, serially or spread over GPUs; RowSchedule decides what is spliced,
started or compiled ahead. Each finished row is written to results.json at once."""

from __future__ import annotations

import json
import threading
import time
import traceback
from pathlib import Path

from ..backends.base import KL_EXACT, KL_SUPPORT_WORDS, kl_support
from ..checkpoint import open_checkpoint
from ..corpora.core import Corpus
from ..errors import SplicerError
from ..formats.registry import checkpoint_format
from ..io import faults
from ..plans import spread
from ..plans.plan import PlannedRow
from .base_pass import base_pass, base_pass_kl_support
from .common import AblateRun, folder_bytes, progress_bar
from .results import finish_results, new_results
from .scores import score_variant


def timing_prompt_of(corpora: list[Corpus], n: int) -> list[int]:
    """A fixed prompt of n tokens: the first chat prompt (persona + history), repeated as needed."""
    src = next((c.sequences[0][: c.prompt_lens[0]] for c in corpora if c.prompt_lens), corpora[0].sequences[0])
    return (src * (n // max(len(src), 1) + 1))[:n]


class RowSchedule:
    """The folder each row runs on (the base, the build, or a splice made at the row's turn or ahead of it) and the
    engines the backend starts or compiles ahead of their turn.

    Serially each row is spliced at its turn. With --overlap-starts N every row is spliced at the start and the next N
    rows' engines are started while the current one scores, as a group: a new group starts only once every started
    engine has been timed, because decode is timed with no engine starting and a row timed behind a fresh start would
    wait for it. With --precompile every row is spliced at the start and its engine compiled while the base pass runs.
    """

    def __init__(self, run: AblateRun, run_list: list[PlannedRow]):
        self.run, self.run_list, self.backend = run, run_list, run.backend
        self.build, self.build_src, self.base_root, self.base_src, self.out = (
            run.build,
            run.build_src,
            run.base.root,
            run.base_src,
            run.out,
        )
        self.prepared: dict[str, tuple[Path, float]] = {}  # row -> (folder, seconds its splice took), made ahead
        self.started_ahead: set[int] = set()
        self.ahead = run.backend.overlap_starts  # engines the backend can start ahead (vLLM with --overlap-starts)
        # The backends whose processes compile ahead: the base pass's own, or with --gpus every GPU's (spread.py).
        self.compilers = run.backends
        self._preparing: threading.Thread | None = None  # splices and compile queueing, beside the base pass
        self._preparing_error: BaseException | None = None
        self._cancel = threading.Event()
        self.compile_ahead = True
        # Rows spread over GPUs score and time one at a time (spread.py): a row on one GPU is measured while the others
        # at most start engines, on their own GPUs and cores. With one GPU it is never contended.
        self.measuring = threading.Lock()

    def folder(self, item: PlannedRow) -> tuple[Path, float]:
        """The row's folder and the seconds its splice took now (0 when made ahead or not needed)."""
        row, restored, splice_name = item.row, item.restored, item.splice_name
        if row.name in self.prepared:
            return self.prepared.pop(row.name)
        from ..splice.core import splice

        t0 = time.perf_counter()
        if item.checkpoint:
            folder = self.run.checkpoints[row.name].root
        elif restored is None:
            folder = self.base_root
        elif not restored:
            folder = self.build.root
        else:
            folder = self.out / "variants" / splice_name
            folder.parent.mkdir(parents=True, exist_ok=True)
            if not _splice_is_current(folder, self.build, restored):
                with self.run.stages.stage(f"{row.name}: splice {','.join(restored)}"):
                    splice(
                        str(self.build_src),
                        str(self.base_src),
                        folder,
                        ",".join(restored),
                        force=True,
                        progress=False,
                        allow_quantized_base=self.run.settings.allow_quantized_base,
                    )
        return folder, time.perf_counter() - t0

    def prepare(self, item) -> bool:
        """Splice a row ahead of its turn (kept in prepared); False if it fails: the row tries again at its turn and
        records the failure there, as without splicing ahead (one row's failure must not end the plan)."""
        try:
            self.prepared[item.row.name] = self.folder(item)
            return True
        except Exception:
            return False

    def index(self, name: str) -> int:
        return next(k for k, it in enumerate(self.run_list) if it.row.name == name)

    def start_ahead(self, i: int) -> None:
        """Row i is loaded and timed: start the next group of engines unless one is already waiting its turn."""
        if not self.ahead or any(j > i for j in self.started_ahead):
            return
        for j in range(i + 1, min(i + 1 + self.ahead, len(self.run_list))):
            if not self.prepare(self.run_list[j]):
                continue
            if not self.backend.prefetch(self.prepared[self.run_list[j].row.name][0]):
                break
            self.started_ahead.add(j)

    def before_base_pass(self, base_pending: bool) -> None:
        """What starts before the base pass: with overlapped starts the base's engine and the first group's, then the
        other splices; with compiling ahead the splices and every row's compile."""
        if self.ahead:
            # The base's engine and the first group's start together. The first engine on a machine is the slowest
            # (Triton autotuning of the GDN kernels, 143 s on the H200 stand-in), and the group's engines autotune
            # in their own processes meanwhile instead of waiting for it: the cold run's largest serial cost.
            if base_pending:
                self.backend.prefetch(self.base_root)
            self.start_ahead(-1)
            # The later rows' splices too, while those engines start: done later, a group's splices would delay its starts.
            for item in self.run_list:
                if item.row.name not in self.prepared:
                    self.prepare(item)
        # Compiling ahead hides behind the base pass; with the base pass cached (a resumed run) it would only hold up
        # the rows (run 10's second call: 61.5 s), so the rows compile their own engines then.
        self.compile_ahead = base_pending
        if any(b.precompile_slots for b in self.compilers) or self.run.spread:
            # Every row's engine is compiled ahead while the base pass runs (which is never timed, so engines may share
            # the GPU then); the lanes end before the first row starts, so each row's engine still starts, scores and
            # is timed alone, and only reads its compiled graphs from the engine's cache. Spread over GPUs, every
            # splice is made now too: rows are then taken by whichever GPU is free, from threads. The splices are
            # made beside the base pass's engine start (25 s of the H200 stand-in's run 9 went before it).
            self._preparing = threading.Thread(target=self._prepare_all, daemon=True, name="splices")
            self._preparing.start()

    def _prepare_all(self) -> None:
        try:
            targets = spread.compile_targets([b.precompile_slots for b in self.compilers])
            queued: list[Path] = []
            for item in self.run_list:
                if self._cancel.is_set():  # the run was interrupted or failed: nothing more is spliced or compiled
                    return
                if self.prepare(item) and (folder := self.prepared[item.row.name][0]) != self.base_root and folder not in queued:
                    queued.append(folder)
                    if self.compile_ahead and not self._cancel.is_set():
                        self.compilers[next(targets)].precompile(folder)
        except BaseException as e:  # raised at wait_prepared(), in the main thread
            self._preparing_error = e

    def wait_prepared(self) -> None:
        """Wait for the splices made beside the base pass (and their compiles to be queued)."""
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None
        if self._preparing_error is not None:
            raise self._preparing_error

    def cancel(self) -> None:
        """The run ends early (interrupt, failure): stop the splices made beside the base pass and wait for the one in
        progress, so nothing writes into DIR after its lock is released and no compile starts after the backends close."""
        self._cancel.set()
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None


def _checkpoint_record(ckpt, row, build) -> dict:
    """What a `checkpoint` row ran: its source and format, as results.json and the table name it; for the build
    re-made without some classes, which (requantized_without); for splicer's own splice of this very build, the whole
    classes it restored (splice_of_build, from its splice.json), so that either can be paired with the other."""
    qc = ckpt.quantization_config or {}
    out = {
        "source": ckpt.label,
        "quant_method": qc.get("quant_method"),
        "format": checkpoint_format(qc),
        "header_digest": ckpt.header_digest(),
    }
    if row.requantized_without:
        out["requantized_without"] = list(row.requantized_without)
        try:  # which classes it quantizes, where splicer reads its format, so a mismatch with the declaration shows
            from ..splice.modules import list_modules

            modules = list_modules(ckpt)
            out["quantized_classes"] = [c for c in ckpt.arch.classes if any(m.quantized and m.cls == c for m in modules.values())]
        except SplicerError:
            pass
    restored = spliced_classes(ckpt.root, build.header_digest())
    if restored:
        out["splice_of_build"] = restored
    return out


def spliced_classes(folder: Path, build_digest: str) -> list[str] | None:
    """The whole classes a splice folder restored into the build of this digest (its splice.json), sorted; None for
    any other folder, or a splice of layers (gdn@0-2)."""
    try:
        record = json.loads((Path(folder) / "splice.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or (record.get("build") or {}).get("header_digest") != build_digest:
        return None
    restore = record.get("restore")
    classes = [c.strip() for c in restore.split(",")] if isinstance(restore, str) else []
    if not classes or any(not c or "@" in c for c in classes):
        return None
    return sorted(set(classes))


def run_row(
    item: PlannedRow,
    *,
    run: AblateRun,
    schedule: RowSchedule,
    backend,
    cache: Path,
    corpora: list[Corpus],
    gpu: str | None = None,
) -> dict:
    """One row: its folder, sizes, scores against the base pass and decode timing, as its results.json entry (status
    "error" with the reason when any step fails: one variant's failure must not end the plan). gpu: the CUDA id it
    ran on, in a run spread over GPUs."""
    plan, settings = run.plan, run.settings
    row, restored, splice_name = item.row, item.restored, item.splice_name
    entry = {
        "name": row.name,
        "restored": "checkpoint" if item.checkpoint else restored if restored is not None else "base",
        **({"checkpoint": _checkpoint_record(run.checkpoints[row.name], row, run.build)} if item.checkpoint else {}),
        **({"repeat_of": splice_name} if splice_name != row.name else {}),
        **({"gpu": gpu} if gpu is not None else {}),
        "status": "running",
        "elapsed": {},
    }
    ahead = schedule.ahead
    measuring = []  # holds schedule.measuring once this row's engine has started

    def start_measuring() -> None:
        t0 = time.perf_counter()
        schedule.measuring.acquire()
        measuring.append(schedule.measuring)
        if gpu is not None:
            entry["elapsed"]["waited_to_measure_s"] = time.perf_counter() - t0
        if ahead:
            time_then_start_ahead()

    try:
        folder, entry["elapsed"]["splice_s"] = schedule.folder(item)
        entry["size_bytes"] = folder_bytes(folder)
        entry["bytes_per_decode_step"] = _bytes_per_step(folder)
        index = schedule.index(row.name) if ahead else None
        entry["timing"] = None

        def time_then_start_ahead() -> None:
            # With overlapped starts a row is timed before it scores, so that the next group's engines can start
            # while it scores; without, after scoring, as in the serial H200 run whose noise band was ±1 %.
            if settings.time_decode and plan.timing:
                t0 = time.perf_counter()
                with run.stages.stage(f"{row.name}: timing"):
                    entry["timing"] = backend.time_decode(
                        timing_prompt_of(corpora, int(plan.timing["prompt_tokens"])),
                        int(plan.timing["new_tokens"]),
                        int(plan.timing["warmup"]),
                        int(plan.timing["runs"]),
                    )
                entry["elapsed"]["time_s"] = time.perf_counter() - t0
            schedule.start_ahead(index)

        metrics, timings = score_variant(
            run,
            backend,
            folder,
            cache=cache,
            corpora=corpora,
            score_dir=run.out / "scores" / row.name,
            before_scoring=start_measuring,
        )
        if not ahead:
            time_then_start_ahead()
        entry["metrics"] = metrics
        entry["kl_support"] = kl_support(backend.exact_gather)  # as the run's base pass (hold_base_pass_scoring)
        entry["engine"] = timings.pop("engine", None)
        entry["elapsed"].update(timings)
        entry["decode_ms_per_token"] = (entry["timing"] or {}).get("decode_ms_per_token")
        entry["status"] = "ok"
    except SplicerError as e:
        entry.update(status="error", error=str(e))
    except Exception as e:  # one variant's failure (engine error, OOM) must not end the plan
        entry.update(status="error", error=f"{e.__class__.__name__}: {e}", traceback=traceback.format_exc(limit=3))
        if getattr(e, "lane_lost", False):  # a Ray lane's worker died: spread.py tries the row once more
            entry["lane_lost"] = True
    finally:
        for lock in measuring:
            lock.release()
        backend.unload()
    return entry


def run_rows(
    run: AblateRun,
    *,
    schedule: RowSchedule,
    job: dict,
    done: dict,
    earlier_runs: list,
    cache: Path,
    tok,
    corpora: list[Corpus],
    started: str,
    t_start: float,
) -> dict:
    """run_ablate under DIR's lock, from the base pass on: the base pass (splices and compiles beside it), each row
    (serially, or with --gpus one thread per GPU), results.json, table.md and report.md after every row. job, done and
    earlier_runs: this invocation's job and what an earlier run of it left (write_job); started and t_start: when this
    invocation began."""
    backend, backends, settings, stages, out = run.backend, run.backends, run.settings, run.stages, run.out
    run_list = schedule.run_list
    if run.options.ray:  # every lane sees DIR and the inputs, before the base pass and any row
        from ..backends.ray_lanes import check_storage

        check_storage(backends, out, [str(p) for p in run.inputs])
    base_done = (cache / "done.json").exists()
    if base_done:  # a resumed run that cannot score as it began is refused before anything is spliced or started
        hold_base_pass_scoring(backends, cache, corpora, done, out)
    schedule.before_base_pass(base_pending=not base_done)
    with stages.stage("base pass"):
        corpora = base_pass(run, cache=cache, tok=tok, corpora=corpora)
    if not base_done:
        hold_base_pass_scoring(backends, cache, corpora, done, out)
    schedule.wait_prepared()
    results = new_results(run, job=job, corpora=corpora, cache=cache, earlier_runs=earlier_runs, started=started)
    results["class_layers"] = run.class_layers  # what a whole-class row restores, layer by layer (splicer budget)

    def finish_precompile(on_backend, gpu=None) -> None:
        # Spread over GPUs, each GPU's thread waits for its own compiling processes only.
        if on_backend.precompile_slots:
            where = f"gpu {gpu}: " if gpu is not None else ""
            with stages.stage(f"{where}compiling ahead: waiting for the last engines to compile"):
                records = on_backend.finish_precompile()
            with schedule.measuring:
                results["runs"][-1].setdefault("precompiled", []).extend(records)

    if not run.spread:
        finish_precompile(backend)
    # Finished in an earlier run of the same job: kept, chosen or not.
    results["variants"] += [done[it.row.name] for it in run.todo if it.row.name in done]
    bar = progress_bar(total=len(run_list), desc="ablate", disable=not settings.progress or None)
    order = {it.row.name: k for k, it in enumerate(run.todo)}

    def record(item, entry: dict) -> None:
        with schedule.measuring:  # spread over GPUs: not while another row is timed
            results["variants"].append(entry)
            results["variants"].sort(key=lambda v: order.get(v["name"], len(order)))  # plan order, however finished
            stages.line(
                f"{entry['name']}: {entry['status']}"
                + (f" ({entry['error']})" if entry.get("error") else "")
                + f", {len(results['runs'][-1]['rows_run']) + 1} of {len(run_list)} rows of this run"
            )
            results["runs"][-1]["rows_run"].append(entry["name"])
            results["runs"][-1]["elapsed_s"] = round(time.perf_counter() - t_start, 1)
            finish_results(results, out, backends, settings.bootstrap)
            bar.update(1)
        faults.point("ablate:row-done")

    def run_one(item, on_backend, gpu=None) -> dict:
        return run_row(item, run=run, schedule=schedule, backend=on_backend, cache=cache, corpora=corpora, gpu=gpu)

    names = {it.row.name for it in run_list}
    if run.spread:
        firsts, lasts, spread_rows, lanes = run.spread
        spread.run_rows_on_gpus(
            list(zip(lanes, backends)),
            [it if it is not None and it.row.name in names else None for it in firsts],
            [it if it is not None and it.row.name in names else None for it in lasts],
            [it for it in spread_rows if it.row.name in names],
            run_one,
            record,
            before_rows=lambda on_backend, gpu: finish_precompile(on_backend, gpu),
        )
    else:
        for item in run_list:
            record(item, run_one(item, backend))
    bar.close()
    results["elapsed_s"] = time.perf_counter() - t_start
    results["runs"][-1].update(elapsed_s=round(results["elapsed_s"], 1), finished=True)
    finish_results(results, out, backends, settings.bootstrap)
    return results


def hold_base_pass_scoring(backends, cache: Path, corpora: list[Corpus], done: dict, out: Path) -> None:
    """Every row of the run scored as its base pass (and noise pass) was: with exact log-probs at the base's top-k ids or
    bounded from the variant's own top-k (backends.base.kl_support), whatever a later engine could give, so that one
    results folder never mixes the two KLs (a resumed run included: its base pass is the cached one). A backend that
    cannot score so refuses in one line (Backend.hold_exact_gather), and so do finished rows (done) that recorded the
    other way, which only a base pass made again (its cache removed) can bring about."""
    support = base_pass_kl_support(cache, corpora)
    for b in backends:
        b.hold_exact_gather(support == KL_EXACT)
    other = sorted(name for name, v in done.items() if v.get("kl_support") not in (None, support))
    if other:
        was = KL_SUPPORT_WORDS.get(done[other[0]]["kl_support"], done[other[0]]["kl_support"])
        raise SplicerError(
            f"finished rows {', '.join(other)} in {out} were scored with {was}, and its base pass (made again) with "
            f"{KL_SUPPORT_WORDS.get(support, support)}: one folder holds one KL, so run the plan into a new folder"
        )


def _bytes_per_step(folder: Path) -> int:
    """Weight bytes one batch-1 decode step reads (inspect's figure: routed experts count top-k of E)."""
    from ..splice.inspect import bytes_per_decode_step

    return bytes_per_decode_step(open_checkpoint(folder, "variant"))


def _splice_is_current(folder: Path, build, restored: list[str]) -> bool:
    record = folder / "splice.json"
    if not record.exists():
        return False
    r = json.loads(record.read_text())
    if r.get("build", {}).get("header_digest") != build.header_digest():
        return False
    if "restore" not in r:  # written before per-layer restores: the classes only
        return r.get("restored_classes") == restored
    return r["restore"] == ",".join(restored)
