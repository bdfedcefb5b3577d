"""MTP acceptance (`splicer mtp DIR`, DIR/speculative.json): the rows an ablate (or score) run finished in vLLM,
each started again with the model's own MTP head as vLLM's speculative decoder (k = 1, 2, ... draft tokens, one
engine each) and once without it, every engine alone on the GPU. From fixed prompts (the first tokens of the first
sequences of each of DIR's corpora, read from its base-pass cache) each prompt is generated greedily on its own, and
vLLM's spec-decode counters read before and after it give that prompt's drafts and accepted tokens
(analysis.speculative turns them into rates with intervals). Batch-1 decode is timed on every engine, so the same row
with and without the drafter are compared; the build is measured first and again last, which gives the engine-to-engine
spread of decode and checks that acceptance repeats. The file is rewritten after every engine and a rerun with the
same settings keeps what is finished.

`splicer mtp DIR --teacher-forced` (run_teacher_forced, DIR/mtp-teacher-forced.json) starts no engine: the same rows,
each in the torch reference with its own MTP head, on every sequence DIR scored, give a teacher-forced estimate of
the first draft position's acceptance (analysis.teacher_forced), on any folder. It has a file of its own: its
settings and resuming are its own, a rerun of the engines with other settings (which starts speculative.json afresh)
leaves it alone, and a torch-backend folder gets no engine file whose note would speak of engines that never ran."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..analysis import speculative as figures
from ..analysis import teacher_forced as tf_figures
from ..errors import SplicerError
from ..io import results_record
from ..io.outputs import exclusive
from ..io.progress import Stages
from .common import atomic_json, check_rows_finished, parts_digest, row_folder
from .rows import timing_prompt_of

SCHEMA = 1
DEFAULT_TIMING = {"prompt_tokens": 1024, "new_tokens": 32, "warmup": 3, "runs": 5}


def _has_drafter(folder: Path) -> bool:
    from ..checkpoint import open_checkpoint
    from ..splice.modules import list_modules
    from ..splice.selection import DRAFTER_CLASS

    return any(m.cls == DRAFTER_CLASS for m in list_modules(open_checkpoint(folder, "variant")).values())


def cached_corpora(out: Path, results: dict) -> list:
    """The corpora DIR scored, as its base-pass cache holds them (cache/base-*/corpora.json: the one whose corpora
    and sequence counts are those results.json names)."""
    from ..corpora.core import Corpus

    wanted = {n: c.get("sequences") for n, c in (results.get("corpora") or {}).items()}
    for cache in sorted(Path(out).glob("cache/base-*/corpora.json")):
        try:
            corpora = [Corpus.from_json(c) for c in json.loads(cache.read_text(encoding="utf-8"))]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if {c.name: len(c.sequences) for c in corpora} == wanted:
            return corpora
    raise SplicerError(
        f"{out} has no base-pass cache of the corpora its results.json names (cache/base-*/corpora.json); "
        "run its ablate or score command again to remake it"
    )


def sequence_entries(corpora: list, per_corpus: int | None, prompt_tokens: int | None = None) -> list[dict]:
    """The first per_corpus sequences of each corpus (None: all) as [{"corpus", "index", "group" (chat), "ids"}]: whole,
    or cut to prompt_tokens (a chat sequence to its prompt first)."""
    out = []
    for c in corpora:
        for i, seq in enumerate(c.sequences[:per_corpus]):
            if prompt_tokens is not None:
                seq = seq[: min(c.prompt_lens[i] if c.prompt_lens else len(seq), prompt_tokens)]
            entry = {"corpus": c.name, "index": i, "ids": list(seq)}
            if c.groups is not None:  # conversations that share a prompt are one unit of the intervals
                entry["group"] = c.groups[i]
            out.append(entry)
    return out


def prompts_from_cache(out: Path, results: dict, per_corpus: int, prompt_tokens: int) -> tuple[list[dict], list]:
    """The first per_corpus sequences of each corpus DIR scored (its base-pass cache), cut to prompt_tokens (a chat
    sequence to its prompt): [{"corpus", "index", "group" (chat), "ids"}], and the corpora themselves."""
    corpora = cached_corpora(out, results)
    return sequence_entries(corpora, per_corpus, prompt_tokens), corpora


def _engine_plan(rows: list[str], build: str, tokens: list[int]) -> list[tuple[str, int, bool]]:
    """(row, k, repeat) in the order the engines run: the build first (without, then with each k), every other row
    likewise, and the build again last (repeat)."""
    order = [build, *(r for r in rows if r != build)]
    plan = [(r, k, False) for r in order for k in (0, *tokens)]
    return plan + [(build, k, True) for k in (0, *tokens)]


def _rows_to_measure(out: Path, results: dict, rows: list[str] | None) -> tuple[str, list[str], list[dict]]:
    """(the build row, the rows to measure, build first, and the rows skipped with why): every finished row (default:
    all but repeats and the base) whose checkpoint has an MTP layer; refused when the build has none."""
    ok = {v["name"]: v for v in results.get("variants", []) if v.get("status") == "ok"}
    build = next((n for n, v in ok.items() if v.get("restored") == [] and not v.get("repeat_of")), None)
    if build is None:
        raise SplicerError(f"{out} has no finished build row to measure against; finish its ablate run first")
    if rows is None:
        rows = [n for n, v in ok.items() if not v.get("repeat_of") and v.get("restored") != "base"]
    check_rows_finished(out, results, rows)
    repeats = [r for r in rows if ok[r].get("repeat_of")]
    if repeats:
        raise SplicerError(
            f"--rows {repeats[0]}: a repeat of {ok[repeats[0]]['repeat_of']}, which is measured anyway (the engines measure "
            "the build first and again last); drop it"
        )
    skipped, measured = [], []
    for r in dict.fromkeys([build, *rows]):
        folder = row_folder(out, results, ok[r])
        if not folder.is_dir():
            skipped.append({"row": r, "reason": f"its folder {folder} is gone"})
        elif not _has_drafter(folder):
            skipped.append({"row": r, "reason": "no MTP layer in its checkpoint"})
        else:
            measured.append(r)
    if build not in measured:
        reason = next(s["reason"] for s in skipped if s["row"] == build)
        raise SplicerError(
            f"the build row of {out} cannot be measured ({reason}); MTP acceptance needs the build's drafter: "
            "give it one (splicer splice --restore mtp BUILD BASE -o NEW) and run ablate or score on NEW"
        )
    return build, measured, skipped


def run_mtp(
    out: Path,
    *,
    rows: list[str] | None = None,
    tokens: tuple[int, ...] = (1, 2),
    prompts_per_corpus: int = 8,
    prompt_tokens: int = 128,
    new_tokens: int = 64,
    time_decode: bool = True,
    timing: dict | None = None,
    method: str = "mtp",
    progress: bool = True,
) -> dict:
    """Measure MTP acceptance for rows of DIR (default: every finished row with an MTP layer, repeats and the base
    left out) and write DIR/speculative.json; returns the record."""
    out = Path(out)
    results = results_record.load(out)
    options = _options(results)
    if options is None:
        raise SplicerError(
            f"{out} was scored with the {results.get('backend')} backend; MTP acceptance is counted by vLLM's "
            "speculative decoding: run ablate (or score) with --backend vllm on a GPU machine, then splicer mtp "
            "(splicer mtp DIR --teacher-forced estimates it on any folder)"
        )
    if not tokens or any(k < 1 or k > 8 for k in tokens) or len(set(tokens)) != len(tokens):
        raise SplicerError(f"--tokens {','.join(map(str, tokens))}: give distinct draft-token counts from 1 to 8, e.g. 1,2")
    build, measured, skipped = _rows_to_measure(out, results, rows)
    # Decode is timed as DIR's rows were (its plan's [timing]), else with the default plan's settings.
    timing = dict(timing or results.get("timing_settings") or DEFAULT_TIMING) if time_decode else None
    settings = {
        "method": method,
        "tokens": list(tokens),
        "prompts_per_corpus": prompts_per_corpus,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "timing": timing,
    }
    prompts, corpora = prompts_from_cache(out, results, prompts_per_corpus, prompt_tokens)
    digest = parts_digest(SCHEMA, settings, [p["ids"] for p in prompts], results["inputs"]["build"].get("header_digest"))
    # Decode is timed after the prompt ablate timed its rows with, so the columns without a drafter compare.
    timing_prompt = timing_prompt_of(corpora, int(timing["prompt_tokens"])) if timing else None
    path = out / figures.FILE
    stages = Stages(quiet=not progress, log_path=out / "speculative.log")
    busy = f"another splicer command is writing to {out}; wait for it to finish"
    with exclusive(out / ".lock", busy, in_place=True):
        record = {"engines": results_record.finished_entries(path, digest, "engines")}
        record.update(
            schema=SCHEMA,
            settings=settings,
            settings_digest=digest,
            build_row=build,
            prompts=[{k: p[k] for k in ("corpus", "index", "group") if k in p} | {"tokens": len(p["ids"])} for p in prompts],
            skipped=skipped,
            engines_planned=len(_engine_plan(measured, build, list(tokens))),
        )
        job_settings = (results.get("job") or {}).get("settings") or {}
        backend = options.make_backends(job_settings.get("device", "auto"), out / "mtp-logs")[0]
        try:
            _run_engines(out, results, record, path, backend, prompts, measured, build, stages, timing_prompt)
        finally:
            backend.close()
        record["summary"] = figures.summarize(record)
        atomic_json(path, record)
        _rerender(out, results)
    return record


def _options(results: dict):
    """DIR's backend options as its job recorded them, for speculative engines (None: its backend runs none)."""
    from ..backends import options_type

    try:
        kind = options_type(results.get("backend") or "")
    except SplicerError:
        return None
    return kind.from_job((results.get("job") or {}).get("settings") or {}).speculative()


def _run_engines(out, results, record, path, backend, prompts, rows, build, stages, timing_prompt) -> None:
    settings = record["settings"]
    ids = [p["ids"] for p in prompts]
    plan = _engine_plan(rows, build, settings["tokens"])
    done = {(e["row"], e["k"], e.get("repeat", False)) for e in record["engines"]}
    if any(key not in done for key in plan if not key[2]):
        # rows still to run: the build's closing engines run again after them, so that the build stays timed last
        record["engines"] = [e for e in record["engines"] if not e.get("repeat")]
        done = {key for key in done if not key[2]}
    ok = {v["name"]: v for v in results["variants"] if v.get("status") == "ok"}
    timing = settings["timing"]
    for n, (row, k, repeat) in enumerate(plan, 1):
        if (row, k, repeat) in done:
            continue
        folder = row_folder(out, results, ok[row])
        what = f"{row}{' (again)' if repeat else ''}, " + (f"MTP k={k}" if k else "no drafter")
        entry = {"row": row, "k": k, "repeat": repeat, "folder": str(folder), "status": "running"}
        t0 = time.perf_counter()
        # one line as each engine starts and one as it ends (an error is one line; the engine's log holds the rest)
        stages.line(f"engine {n} of {len(plan)}: {what}: started")
        try:
            extra = {"speculative_config": {"method": settings["method"], "num_speculative_tokens": k}} if k else None
            backend.load(folder, extra)
            entry["startup_s"] = round(time.perf_counter() - t0, 2)
            answers = backend.speculate(ids, settings["new_tokens"], k)
            plain = next((e for e in record["engines"] if e["row"] == row and e["k"] == 0 and e.get("repeat") == repeat), None)
            per_prompt = []
            for i, a in enumerate(answers):
                rec = {kk: a[kk] for kk in ("drafts", "draft_tokens", "accepted", "accepted_per_pos")}
                if plain is not None and "tokens" in plain:
                    rec["same_as_plain"] = a["tokens"] == plain["tokens"][i]
                per_prompt.append(rec)
            if k == 0:
                entry["tokens"] = [a["tokens"] for a in answers]
            else:
                entry["per_prompt"] = per_prompt
                entry["drafter_layers"] = backend.drafter_layers()
                # which counts vLLM gave (the sequence's own from 0.33, else its engine counters), and whether both agree
                entry["counted_by"] = sorted({a.get("counted_by", "engine counters") for a in answers})
                agree = [a["counters_agree"] for a in answers if "counters_agree" in a]
                if agree:
                    entry["counters_agree"] = all(agree)
            if timing:
                entry["timing"] = backend.time_decode(
                    timing_prompt,
                    int(timing["new_tokens"]),
                    int(timing["warmup"]),
                    int(timing["runs"]),
                )
            entry["status"] = "ok"
        except SplicerError as e:
            entry.update(status="error", error=str(e))
        except Exception as e:  # one engine's failure (a refused speculative config, OOM) must not end the run
            # the first line (vLLM's reason); the engine's log, in DIR/mtp-logs, holds the rest
            entry.update(status="error", error=f"{e.__class__.__name__}: {(str(e).strip().splitlines() or [''])[0][:500]}")
        finally:
            backend.unload()
        entry["elapsed_s"] = round(time.perf_counter() - t0, 2)
        record["engines"] = [e for e in record["engines"] if (e["row"], e["k"], e.get("repeat", False)) != (row, k, repeat)]
        record["engines"].append(entry)
        record["summary"] = figures.summarize(record)
        atomic_json(path, record)
        stages.line(
            f"engine {n} of {len(plan)}: {what}: {entry['status']} in {entry['elapsed_s']:.1f} s"
            + (f" ({entry['error'][:300]})" if entry.get("error") else "")
        )


def _rerender(out: Path, results: dict) -> None:
    """table.md and report.md again, now with the MTP columns and sentences."""
    from .results import render_outputs

    render_outputs(out, results)


TF_SCHEMA = 1


def run_teacher_forced(
    out: Path,
    *,
    rows: list[str] | None = None,
    sequences_per_corpus: int | None = None,
    device: str = "auto",
    batch_size: int = 4,
    progress: bool = True,
    force: bool = False,
) -> dict:
    """The teacher-forced estimate of MTP acceptance (analysis.teacher_forced says what it is) for the rows `run_mtp`
    would measure, on every sequence DIR scored (or the first sequences_per_corpus of each corpus), with the torch
    reference's model of each row on any folder; writes DIR/mtp-teacher-forced.json after every row and returns the
    record. A rerun with the same settings and sequences keeps finished rows (other --rows are added to them); a file
    of other settings is refused in one line unless force replaces it."""
    out = Path(out)
    results = results_record.load(out)
    if sequences_per_corpus is not None and sequences_per_corpus < 1:
        raise SplicerError(f"--sequences-per-corpus {sequences_per_corpus}: give 1 or more (leave it out for every sequence)")
    build, measured, skipped = _rows_to_measure(out, results, rows)
    ok = {v["name"]: v for v in results["variants"] if v.get("status") == "ok"}
    from ..backends import drafter_backend
    from ..checkpoint import open_checkpoint

    backend = drafter_backend(device, out / "mtp-logs")
    # A family whose drafter the backend does not run is refused before any row is loaded.
    backend.check_drafter(open_checkpoint(row_folder(out, results, ok[build]), "variant"))
    sequences = sequence_entries(cached_corpora(out, results), sequences_per_corpus)
    settings = {"sequences_per_corpus": sequences_per_corpus, "dtype": str(backend.dtype).replace("torch.", "")}
    ids = [s["ids"] for s in sequences]
    digest = parts_digest(TF_SCHEMA, settings, ids, results["inputs"]["build"].get("header_digest"))
    path = out / tf_figures.FILE
    stages = Stages(quiet=not progress, log_path=out / "speculative.log")
    busy = f"another splicer command is writing to {out}; wait for it to finish"
    with exclusive(out / ".lock", busy, in_place=True):
        conflict = _tf_settings_conflict(path, settings, digest)
        if conflict and not force:
            backend.close()
            change, same = conflict
            raise SplicerError(
                f"{path} holds teacher-forced estimates of other settings ({change}); pass --force to replace them"
                + (f", or run with the same {same}" if same else "")
            )
        record = {"rows": results_record.finished_entries(path, digest, "rows")}
        # the rows this file is to hold: those it holds, finished, and those asked for now
        planned = list(dict.fromkeys([*record["rows"], *measured]))
        record.update(
            schema=TF_SCHEMA,
            settings=settings,
            settings_digest=digest,
            build_row=build,
            backend=backend.describe(),
            sequences=[
                {k: s[k] for k in ("corpus", "index", "group") if k in s} | {"positions": max(len(s["ids"]) - 2, 0)}
                for s in sequences
            ],
            skipped=skipped,
            rows_planned=len(planned),
        )
        try:
            for n, row in enumerate(measured, 1):
                if (record["rows"].get(row) or {}).get("status") == "ok":
                    continue
                folder = row_folder(out, results, ok[row])
                entry = {"status": "running", "folder": str(folder)}
                t0 = time.perf_counter()
                stages.line(f"teacher-forced {n} of {len(measured)}: {row}: started")
                try:
                    backend.load(folder)
                    backend.load_drafter()
                    entry["hits"] = [int(h.sum()) for h in backend.draft_hits(ids, batch_size)]
                    entry["device"] = backend.describe()["device"]  # kept rows may have run elsewhere than this run
                    entry["status"] = "ok"
                except SplicerError as e:
                    entry.update(status="error", error=str(e))
                except Exception as e:  # one row's failure (out of memory, a checkpoint torch cannot read) must not end the run
                    entry.update(
                        status="error", error=f"{e.__class__.__name__}: {(str(e).strip().splitlines() or [''])[0][:500]}"
                    )
                finally:
                    backend.unload()
                entry["elapsed_s"] = round(time.perf_counter() - t0, 2)
                record["rows"][row] = entry
                record["summary"] = tf_figures.summarize(record)
                atomic_json(path, record)
                stages.line(
                    f"teacher-forced {n} of {len(measured)}: {row}: {entry['status']} in {entry['elapsed_s']:.1f} s"
                    + (f" ({entry['error'][:300]})" if entry.get("error") else "")
                )
        finally:
            backend.close()
        record["summary"] = tf_figures.summarize(record)
        atomic_json(path, record)
        _rerender(out, results)
    return record


# Each recorded setting of DIR/mtp-teacher-forced.json: its name in the refusal, and the option that sets it (None: the
# torch backend's own dtype, no option of this command).
TF_SETTING_FLAGS = {"sequences_per_corpus": ("--sequences-per-corpus", "--sequences-per-corpus"), "dtype": ("dtype", None)}


def _tf_settings_conflict(path: Path, settings: dict, digest: str) -> tuple[str, str | None] | None:
    """Which recorded setting of the teacher-forced file differs from these, as ('FLAG: old -> new', FLAG) (None: no
    file, none of its rows finished, or the same settings and sequences): what a rerun would otherwise silently start
    afresh over."""
    old = results_record.read_stage_record(path)
    if old is None or old.get("settings_digest") == digest:
        return None
    if not any(isinstance(e, dict) and e.get("status") == "ok" for e in (old.get("rows") or {}).values()):
        return None  # nothing finished to lose
    before = old.get("settings") or {}
    for field, (label, flag) in TF_SETTING_FLAGS.items():
        was, now = before.get(field), settings.get(field)
        if was != now:
            shown = ("all" if v is None and field == "sequences_per_corpus" else v for v in (was, now))
            return f"{label}: {' -> '.join(map(str, shown))}", flag
    return "the sequences DIR scored, or its build, changed since it was written", None
