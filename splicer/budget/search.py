"""`splicer budget DIR`: the search over the model of analysis/budget.py under the limits, and `--verify N`.

`--verify N` picks N points of the front that no row measured (the lowest predicted KL first, the rest spread along
the front), adds them to DIR's job as plan rows (with one more engine of the build, so the decode intervals gain a
degree of freedom), runs them with DIR's own inputs and settings (`splicer ablate` into DIR: finished rows are kept),
and prints each point's prediction (made before it ran) against its measurement, the difference with its interval:
KL paired position by position, decode with both sides' engine spread. DIR/budget.json holds the search, the
predictions and the verification; `splicer plot DIR` draws the predicted front hollow. A build re-made by its quantizer
with some classes in BF16 (`--add-requantized`) is not in the fit; each is stated against the prediction for its
classes, its error's interval as a verified point's (analysis/budget.py: requantized).

A point's row is named after its restore unless DIR already has a row of that name defined otherwise (then `-2`, ...),
and a row counts as a prediction's measurement only when it restores the prediction's entries. A prediction stored
and not measured (its row failed, or the run was stopped, even before the row reached DIR's job) is finished by the
next --verify before anything new is chosen. Every refusal comes before budget writes anything, or (ablate's, made
once it compares DIR's job) puts back what it wrote; plain `budget DIR` answers on a folder it cannot write.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..analysis.budget import (
    Additivity,
    Model,
    PositionScores,
    Prediction,
    engine_half_width,
    finite_number,
    fit,
    front,
    intervals,
    kl_error,
    parse_entry,
    pick_verify,
    predictions,
    requantized,
    requantized_levels,
    requantized_verdict,
    variant_decode,
    variant_kl,
)
from ..analysis.formatting import decimals
from ..errors import SplicerError

BUDGET_JSON = "budget.json"
VERIFY_PLAN = "budget-plan.toml"


def _settings_from_job(job: dict, results: dict, progress: bool, own_inputs: tuple = ()):
    """DIR's own run settings, so that the verified rows are measured exactly as the rest."""
    from ..ablate import AblateSettings
    from ..backends import DEFAULT_BACKEND, options_type

    st = job.get("settings") or {}
    bw = results.get("bandwidth_bytes_per_s")
    backend = st.get("backend", DEFAULT_BACKEND)
    return AblateSettings(
        backend=backend,
        device=st.get("device", "auto"),
        time_decode=st.get("time_decode", True),
        corpus_overrides=st.get("corpus_overrides") or {},
        batch_size=st.get("batch_size"),
        allow_quantized_base=bool(st.get("allow_quantized_base")),
        bandwidth_gbs=bw / 1e9 if bw else None,
        progress=progress,
        extend_only=True,
        own_inputs=own_inputs,
        backend_options=options_type(backend).from_job(st),
    )


def verify_plan(folder: Path, results: dict, points: list[tuple[str, list[str]]]) -> tuple[Path, list[str]]:
    """DIR/budget-plan.toml: DIR's plan settings and every row of its job, plus a row per point to verify ((row name,
    restore entries): chosen now, or an interrupted verification's again) and one more engine of the build when the
    run is timed, checked by reading it back as any plan is read; and the rows to run (those points and that engine:
    other unfinished rows of DIR's plan stay as they are)."""
    from ..arch import all_classes
    from ..plans.plan import load_plan, write_plan

    job = results.get("job") or {}
    source = (results.get("plan") or {}).get("source")
    if not isinstance(job.get("rows"), dict) or not job.get("plan_settings_digest"):
        raise SplicerError(
            f"{folder} was written by an older splicer (its job does not list its rows); run its plan again "
            "into a new folder to verify there"
        )
    try:
        plan = load_plan(str(source), all_classes())
    except SplicerError as e:
        raise SplicerError(
            f"the plan {folder} was run with ({str(source)[:120]}, as splicer ablate was given it) cannot be "
            f"read: {str(e)[:160]}; --verify needs its corpora and timing: run it from the folder ablate ran in, "
            "with the plan in place"
        ) from None
    if plan.settings_digest != job["plan_settings_digest"]:
        raise SplicerError(
            f"the plan {source} has other corpora, top_k or timing than when {folder} was run; put them "
            "back, or run the plan into a new folder"
        )
    rows = [{"name": n, **d} for n, d in job["rows"].items()]
    new = [{"name": name, "restore": entries} for name, entries in points if name not in job["rows"]]
    timed = bool((job.get("settings") or {}).get("time_decode", True) and plan.timing)
    run = [name for name, _ in points]
    if new and timed:  # one more engine of the build, timed after the new rows: the decode spread gains a degree of freedom
        k = 1 + sum(1 for n in job["rows"] if n.startswith("build-verify-"))
        new.append({"name": f"build-verify-{k}", "restore": [], "repeat": True})
    elif timed:  # resumed: the engine an interrupted verification added
        run += [n for n in job["rows"] if n.startswith("build-verify-")][-1:]
    data = {
        "name": plan.name,
        "description": plan.description,
        "top_k": plan.top_k,
        "corpus": plan.corpora,
        **({"timing": plan.timing} if plan.timing else {}),
        "row": rows + new,
    }
    return write_plan(
        folder / VERIFY_PLAN,
        data,
        f"Written by `splicer budget --verify`: the plan of {source} with the "
        "rows of this folder's job and the budget's points to verify",
    ), run


def _valid_entry(e) -> bool:
    """A verified entry of budget.json that can be compared (written by budget; a hand edit may break one)."""
    return (
        isinstance(e, dict)
        and isinstance(e.get("row"), str)
        and finite_number(e.get("kl"))
        and isinstance(e.get("atoms"), list)
        and all(isinstance(a, str) for a in e["atoms"])
    )


STRIPPED = ("measured", "error_kl", "error_decode")  # what a verification adds to a stored prediction
DROPPED = "its row is no longer in this folder's results (a rerun of another plan dropped it)"


def _entries(e: dict) -> list[str]:
    """The restore a stored prediction's row was added with (for an entry written before they were stored: its atoms
    in one spelling, as Prediction.entries writes them)."""
    from ..splice.selection import canonical_entries

    entries = e.get("entries")
    if isinstance(entries, list) and entries and all(isinstance(x, str) for x in entries):
        return entries
    try:
        return canonical_entries(e["atoms"], "budget.json")
    except SplicerError:
        return e["atoms"]


def _restore_key(results: dict, entries) -> frozenset | None:
    """What a restore restores, spelling aside (`gdn` and `gdn@0-39`, or two groups and their union, are one restore):
    its (class, layer) pairs, (class, None) for a class without layers; None when it is not a list of entries (the
    base, a checkpoint row)."""
    if not isinstance(entries, list) or not all(isinstance(x, str) for x in entries):
        return None
    class_layers = results.get("class_layers") or {}
    out = set()
    try:
        for entry in entries:
            cls, layers = parse_entry(entry)
            layers = layers if layers is not None else class_layers.get(cls)
            out |= {(cls, None)} if layers is None else {(cls, n) for n in layers}
    except SplicerError:
        return None
    return frozenset(out)


def _restores(results: dict, row: dict, e: dict) -> bool:
    """Whether the results' row of a stored prediction's name restores that prediction's entries: a row of that name
    defined otherwise (the base, another restore) is not its measurement."""
    key = _restore_key(results, row.get("restored"))
    return key is not None and key == _restore_key(results, _entries(e))


def _name_rows(chosen: list[Prediction], results: dict, earlier: list[dict]) -> None:
    """Give each chosen point a plan row name no other row of DIR (its job, its results, an earlier prediction of
    budget.json) holds with another definition: `gdn.0+attention`, else `gdn.0+attention-2`, ... A row of that name
    restoring exactly these entries (one that failed) is the point's own row."""
    rows = (results.get("job") or {}).get("rows") or {}
    taken = set(rows) | {v.get("name") for v in results.get("variants", [])}
    for p in chosen:
        mine = _restore_key(results, p.entries)
        others = taken | {e["row"] for e in earlier if _restore_key(results, _entries(e)) != mine}
        stem = name = p.row_name
        k = 2
        while name in others and not (
            isinstance(rows.get(name), dict)
            and set(rows[name]) == {"restore"}
            and _restore_key(results, rows[name]["restore"]) == mine
        ):
            name, k = f"{stem}-{k}", k + 1
        p.name = name
        taken.add(name)


def _verification(model: Model, stored: dict, results: dict, scores: PositionScores, reps: int = 2000) -> dict:
    """A verified point's prediction (stored before it ran) against its measurement, with the differences' intervals:
    KL paired position by position (prediction from the atoms' rows, measurement from the point's row; without the
    rows' per-position scores, the difference of the two means and no interval), decode against the prediction's own
    change from the build, with the engine spread of the run (the point's engines, its atoms' and the build's).
    The model must be fitted on the corpus the prediction was made on. A row no longer in the results (a rerun of
    another plan dropped it) leaves the prediction alone, marked so."""
    out = {k: v for k, v in stored.items() if k not in STRIPPED and k != "missing"}
    row = next((v for v in results.get("variants", []) if v.get("name") == stored["row"] and v.get("status") == "ok"), None)
    if row is not None and not _restores(results, row, stored):
        out["missing"] = (
            f"the row {stored['row']} in this folder's results restores something else "
            f"({str(row.get('restored'))[:60]}), so it is not this prediction's measurement"
        )
        return out
    if row is None:
        if stored.get("measured") or stored.get("missing"):
            out["missing"] = DROPPED
        return out
    by_entry = {a.entry: a for a in model.atoms}
    atoms = [by_entry.get(e) for e in stored["atoms"]]
    measured_kl = variant_kl(row, model.corpus)
    out["measured"] = {
        "kl": measured_kl,
        "size_gb": (row.get("size_bytes") or 0) / 1e9,
        "decode": variant_decode(results, row)[0],
    }
    if any(a is None for a in atoms):  # the atoms changed since (rows rerun): no paired comparison
        return out
    saved = model.additivity
    model.additivity = Additivity.from_json(stored.get("additivity"))  # the prediction as it was made
    try:
        error, _ = kl_error(model, atoms, row["name"], stored["kl"], measured_kl, scores, reps)
    finally:
        model.additivity = saved
    if error is not None:
        out["error_kl"] = error  # measured - predicted
    m_v, n_v = variant_decode(results, row)
    if m_v is not None and model.build_decode is not None and all(a.d_decode is not None for a in atoms):
        rd = stored.get("decode_ratio") if finite_number(stored.get("decode_ratio")) else 1.0
        if finite_number(stored.get("decode")) and finite_number(stored.get("build_decode")) and stored["build_decode"] > 0:
            # The change from the build it predicted, against the change measured from the build's engines now (a
            # verification adds one): both relative to their own build, so that the added engine moves neither.
            predicted_rel = stored["decode"] / stored["build_decode"] - 1
            basis = "stored"
        else:  # a prediction stored before its build's decode was: the same model, on today's build engines
            predicted_rel = rd * sum(a.d_decode for a in atoms) / model.build_decode
            basis = "recomputed on this folder's build engines"
        measured_rel = m_v / model.build_decode - 1
        err = {
            "diff_ms": (measured_rel - predicted_rel) * model.build_decode,
            "measured_rel": measured_rel,
            "predicted_rel": predicted_rel,
            "predicted_basis": basis,
        }
        if model.engine_sd_ms is not None and model.engine_df:
            # measured - (build + rd * sum(atom - build)): the point's engines once, each atom's rd times, the build's
            # rd * k - 1 times
            half = engine_half_width(
                model.engine_sd_ms,
                model.engine_df,
                [(1, n_v), *((rd, a.engines) for a in atoms), (rd * len(atoms) - 1, model.build_engines)],
            )
            err["ci_ms"] = [err["diff_ms"] - half, err["diff_ms"] + half]
        out["error_decode"] = err
    return out


def _prediction_json(p: Prediction, model: Model) -> dict:
    return {
        "restore": p.label,
        "entries": p.entries,
        "row": p.row_name if p.atoms else None,
        "atoms": [a.entry for a in p.atoms],
        "corpus": model.corpus,
        "kl": p.kl,
        "kl_ci": p.kl_ci,
        "kl_by_corpus": p.kl_by_corpus,
        "kl_ci_by_corpus": p.kl_ci_by_corpus,
        "size_gb": p.size_gb,
        "decode": p.decode,
        "decode_ci": p.decode_ci,
        "build_decode": model.build_decode,
        "measured_row": (p.measured or {}).get("row"),
        "additivity": model.additivity.to_json(),
        "decode_ratio": 1.0 if model.timed else None,
    }


def _search(model: Model, scores: PositionScores, max_decode_ms, max_gb, max_kl):
    """Every combination predicted, those within the limits, their Pareto front (with intervals) and its cost axis."""
    preds = predictions(model)
    cost = "decode" if model.timed and (max_decode_ms is not None or max_gb is None) else "size_gb"
    feasible = [
        p
        for p in preds
        if (max_gb is None or p.size_gb <= max_gb)
        and (max_decode_ms is None or (p.decode is not None and p.decode <= max_decode_ms))
        and (max_kl is None or p.kl <= max_kl)
    ]
    best = front(feasible, cost)
    intervals(model, best, scores)
    return preds, feasible, best, cost


def _run_verification(
    folder: Path,
    results: dict,
    record: dict,
    record_path: Path,
    points: list,
    resumed: bool,
    job: dict,
    corpus,
    progress: bool,
    max_decode_ms,
    max_gb,
    max_kl,
    own: tuple,
):
    """--verify's run: the points' rows (chosen now, or an interrupted verification's again) added to DIR's job and
    measured by ablate with DIR's own inputs and settings; returns the results after it, the model refitted on them,
    its front and cost, and the rows it ran. The plan and the predictions are written before anything is measured;
    when ablate refuses before changing DIR (results.json untouched), both are put back as they were."""
    import sys

    from ..ablate import run_ablate
    from ..ablate.job import job_input
    from ..io import results_record
    from ..io.outputs import write_file, write_json

    if resumed and progress:
        print(f"resuming the verification an earlier --verify began: {', '.join(n for n, _ in points)}", file=sys.stderr)
    plan_path, results_path = folder / VERIFY_PLAN, results_record.path_of(folder)
    kept = {p: p.read_bytes() if p.exists() else None for p in (plan_path, record_path, results_path)}
    plan_path, to_run = verify_plan(folder, results, points)
    try:
        write_json(record_path, record)  # the predictions, written before anything is measured
        run_ablate(
            ",".join(to_run),
            job_input(folder, job.get("build")),
            job_input(folder, job.get("base")),
            folder,
            str(plan_path),
            _settings_from_job(job, results, progress, own),
        )
    except SplicerError:
        if (results_path.read_bytes() if results_path.exists() else None) == kept[results_path]:
            for path in (plan_path, record_path):  # refused before DIR changed: leave no trace of this --verify
                old = kept[path]
                if old is None:
                    path.unlink(missing_ok=True)
                else:
                    write_file(path, lambda tmp, old=old: tmp.write_bytes(old))
        raise
    results = results_record.load(folder)
    model = fit(results, corpus)  # the verified rows now measure the additivity too
    scores = PositionScores(folder, list(results.get("corpora") or {}))
    _, _, best, cost = _search(model, scores, max_decode_ms, max_gb, max_kl)
    record.update(cost=cost, model=model.to_json(), front=[_prediction_json(p, model) for p in best])
    return results, model, scores, best, cost, to_run


def _requantized_lines(entries: list[dict]) -> list[str]:
    """One line per re-made build (analysis.budget.requantized): its prediction, measurement and error, or why there
    is none; nothing for a folder without them."""
    if not entries:
        return []
    lines = [
        "Re-made builds (the build quantized again by its quantizer with these classes in BF16: not splices, so not "
        "in the fit) against the prediction for restoring the same classes (error = measured - predicted, 95 % "
        "interval, KL paired position by position, and as a share of the prediction; the prediction holds where the "
        "interval includes 0):"
    ]
    for e in entries:
        head = f"{e['row']} ({', '.join(e['classes'])})"
        if e.get("why"):
            note = f" (note: {e['note']})" if e.get("note") else ""
            lines.append(f"{head}: not compared: {e['why']}{note}.")
            continue
        fitted = f" (row {e['splice_row']}, which splices exactly these classes, is in the fit)" if e.get("splice_row") else ""
        predicted, measured = requantized_levels(e)
        lines.append(f"{head}: {predicted} predicted, {measured} measured, error {requantized_verdict(e)}{fitted}.")
    return lines


def _check_inputs(folder: Path, job: dict) -> tuple:
    """The build and base DIR's job names must still be there (by their real paths; a job written before splicer recorded
    real paths holds them as ablate was given them, a relative path relative to the folder ablate ran in), and DIR must be an output ablate may write to with them as inputs; checked before
    --verify writes anything. Returns the inputs DIR itself holds because splicer wrote them there (the demo's pair),
    which ablate is then told are its own."""
    from ..ablate.job import job_input
    from ..checkpoint import open_checkpoint
    from ..io.outputs import ABLATE, check_output, own_inputs_inside

    roots = []
    for role in ("build", "base"):
        source = job_input(folder, job.get(role))
        try:
            roots.append(open_checkpoint(source, role).root)
        except SplicerError as e:
            raise SplicerError(
                f"{folder}'s job names its {role} as {source[:120]!r} ({str(e)[:160]}); put the {role} "
                "back there (a relative path, as older splicers recorded it, is relative to the folder "
                "ablate ran in: run budget --verify from there)"
            ) from None
    own = own_inputs_inside(folder, roots)
    try:
        check_output(folder, roots, ABLATE, own=own)
    except SplicerError as e:
        raise SplicerError(f"budget --verify runs ablate into {folder}, and it refuses: {e}") from None
    return own


def budget_report(
    folder: str | Path,
    max_decode_ms: float | None = None,
    max_gb: float | None = None,
    max_kl: float | None = None,
    corpus: str | None = None,
    verify: int = 0,
    progress: bool = True,
) -> tuple[str, bool]:
    """The search's text, and False when a row --verify ran did not finish (the text names it)."""
    from tabulate import tabulate

    from ..io import results_record

    folder = Path(folder)
    results = results_record.load(folder)
    if verify < 0:
        raise SplicerError(f"--verify {verify}: give how many points of the front to splice and measure (1 or more)")
    for flag, value in (("--max-decode-ms", max_decode_ms), ("--max-gb", max_gb), ("--max-kl", max_kl)):
        if value is not None and not (finite_number(value) and value >= 0):
            raise SplicerError(f"{flag} {value}: give a finite number, 0 or more")
    known = list(results.get("corpora") or {})
    if corpus is not None and known and corpus not in known:
        raise SplicerError(
            f"--corpus {corpus[:40]!r}: this folder scored {', '.join(known)}; name one of them, or drop "
            "--corpus for KL pooled over them"
        )
    model = fit(results, corpus)
    if max_decode_ms is not None and model.unphysical_decode:
        raise SplicerError(f"--max-decode-ms: decode is not predicted, as {model.unphysical_decode}; or use --max-gb or --max-kl")
    if max_decode_ms is not None and not model.timed:
        raise SplicerError(
            "--max-decode-ms needs timed rows, and this run did not time every single-entry row and the build "
            "(was it run with --no-time?); use --max-gb or --max-kl, or run the plan with timing"
        )
    scores = PositionScores(folder, known)
    preds, feasible, best, cost = _search(model, scores, max_decode_ms, max_gb, max_kl)
    limits = {"max_gb": max_gb, "max_decode_ms": max_decode_ms, "max_kl": max_kl}
    record_path = folder / BUDGET_JSON
    try:
        stored = json.loads(record_path.read_text()) if record_path.exists() else {}
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise SplicerError(
            f"{record_path} cannot be read ({e.__class__.__name__}); it holds the predictions earlier "
            "verifications were made against: restore it, or move it away to start afresh"
        ) from None
    listed = stored.get("verified") if isinstance(stored, dict) else None
    earlier = [e for e in listed if _valid_entry(e)] if isinstance(listed, list) else []
    dropped = (len(listed) if isinstance(listed, list) else int(listed is not None)) - len(earlier)
    job = results.get("job") or {}
    finished = {v.get("name") for v in results.get("variants", []) if isinstance(v, dict) and v.get("status") == "ok"}
    # A verification an earlier --verify started and did not finish (its row failed, or the run was stopped before
    # the row was even added to DIR's job) is resumed as it was chosen, not chosen again.
    unfinished = [e for e in earlier if not e.get("measured") and not e.get("missing") and e["row"] not in finished]
    chosen = pick_verify(best, verify) if verify and not unfinished else []
    if verify and not chosen and not unfinished:
        if not best:
            raise SplicerError("no combination fits the limits, so there is nothing to verify; widen them")
        raise SplicerError(
            "every point of the front within the limits was measured already; nothing to verify "
            "(widen the limits, or run without --verify)"
        )
    own = _check_inputs(folder, job) if verify else ()  # before anything is written
    _name_rows(chosen, results, earlier)
    pending = [_prediction_json(p, model) for p in chosen]
    record = {
        "corpus": corpus,
        "cost": cost,
        "limits": limits,
        "model": model.to_json(),
        "front": [_prediction_json(p, model) for p in best],
        # a new prediction replaces an earlier one of its row, and one of its restore whose row went missing
        "verified": [
            e
            for e in earlier
            if e["row"] not in {p["row"] for p in pending}
            and not (
                e.get("missing") and _restore_key(results, _entries(e)) in [_restore_key(results, p["entries"]) for p in pending]
            )
        ]
        + pending,
    }
    from ..io.outputs import write_json

    if verify:
        from ..io.outputs import exclusive

        points = [(e["row"], _entries(e)) for e in unfinished] or [(p.row_name, p.entries) for p in chosen]
        # One verification per folder at a time: its plan file and predictions are written before ablate takes DIR's lock.
        with exclusive(
            folder / ".budget-lock",
            f"another splicer budget --verify is running on {folder}; wait for it to finish",
            in_place=True,
        ):
            results, model, scores, best, cost, to_run = _run_verification(
                folder,
                results,
                record,
                record_path,
                points,
                bool(unfinished),
                job,
                corpus,
                progress,
                max_decode_ms,
                max_gb,
                max_kl,
                own,
            )
    failed = []
    if verify:
        by_name = {v.get("name"): v for v in results.get("variants", []) if isinstance(v, dict)}
        failed = [
            (n, (by_name.get(n) or {}).get("error") or "not run") for n in to_run if (by_name.get(n) or {}).get("status") != "ok"
        ]
    models = {corpus: model}  # each prediction is compared on the corpus it was made on
    verified = []
    for e in record["verified"]:
        c = e.get("corpus") if e.get("corpus") in known else None
        if c not in models:
            models[c] = fit(results, c)
        verified.append(_verification(models[c], e, results, scores))
    record["verified"] = verified
    remade = requantized(model, results, scores)
    if remade:  # a folder without re-made builds keeps its budget.json as it was
        record["requantized"] = remade
    try:
        write_json(record_path, record)
        written = f"Written: {record_path}."
    except SplicerError as e:
        if verify:
            raise
        # Plain budget only reads DIR: a colleague's read-only results are answered all the same.
        written = f"Not written: {e}; the answer above is complete (budget --verify needs a writable folder)."
    else:
        from ..ablate.results import render_outputs

        # report.md quotes budget.json (the re-made builds against their predictions): rendered again with it, as
        # mtp and tasks render table.md and report.md after writing their files, so that DIR/report.md is what
        # `splicer report DIR` prints. Only where ablate wrote one: a folder without report.md has none to go stale,
        # and budget adds no files to it beside budget.json.
        if (folder / "report.md").exists():
            try:
                render_outputs(folder, results)
                written = f"Written: {record_path}, and {folder / 'report.md'} and {folder / 'table.md'} rendered again with it."
            except SplicerError as e:  # budget.json is whole: the answer stands, only the two renderings lag behind
                written = (
                    f"Written: {record_path}; not rendered again: {e}; report.md and table.md quote the earlier "
                    "budget.json until `splicer budget DIR` runs again."
                )

    # One scale for every KL of the answer, three significant digits of the smallest: with KLs near 0.002, four
    # decimals print neighbouring points of the front alike (0.0021 and 0.0021 for 0.00207 and 0.00209).
    d = decimals(
        [model.build_kl, *(c[k] for c in model.checks for k in ("predicted_kl", "measured_kl"))]
        + [p.kl for p in best]
        + [p.measured["kl"] for p in best if p.measured]
        + [x for v in record["verified"] if v.get("measured") for x in (v["kl"], v["measured"]["kl"])],
        3,
    )
    lines = [
        f"KL {'on ' + corpus if corpus else 'pooled over corpora'}; build {model.build_kl:.{d}f}, "
        f"{model.build_size / 1e9:.3f} GB"
        + (f", {model.build_decode:.3f} ms/token" if model.build_decode is not None else "")
        + f"; {len(model.atoms)} single-entry rows: {', '.join(a.entry for a in model.atoms)}."
    ]
    if model.checks:
        add = model.additivity
        within = ", ".join(f"within {c} {r:.2f}" for c, r in add.within.items())
        across = (
            f"across classes {add.across:.2f}"
            if add.across is not None
            else "across classes assumed 1.00 (no row restores atoms of several classes)"
        )
        lines.append(
            f"Additivity of KL reductions (least-squares slopes over the {len(model.checks)} "
            f"row{'s' if len(model.checks) != 1 else ''} restoring several single-entry rows' modules; 1.00 = additive): {', '.join(x for x in (within, across) if x)}."
        )
        errs = [c for c in model.checks if c["predicted_kl"] is not None]
        if errs:
            worst = max(errs, key=lambda c: abs(c["predicted_kl"] - c["measured_kl"]))
            lines.append(
                "The model's own error, each such row predicted from the others: "
                + ", ".join(f"{c['row']} {c['predicted_kl']:.{d}f} predicted, {c['measured_kl']:.{d}f} measured" for c in errs)
                + f"; largest |error| {abs(worst['predicted_kl'] - worst['measured_kl']):.{d}f} ({worst['row']})."
            )
        else:
            lines.append("The model's own error: one row restores several atoms, so none can be predicted from the others.")
    # A row restoring several entries, one of which no single-entry row measures (an all row restoring experts too),
    # is no union of atoms: the model cannot predict it, so it measures no additivity. Say so, or its absence from
    # the fit reads as a row overlooked.
    unfitted = "; ".join(
        f"row {n} also restores {', '.join(missing)}, which no single-entry row measures" for n, missing, _ in model.unfitted
    )
    if model.checks and unfitted:
        lines.append(f"Not in the fit: {unfitted}.")
    elif not model.checks and model.unfitted:
        n, missing, rest = model.unfitted[0]
        instead = (
            f"a row restoring the rest of row {n}'s classes, restore = {rest!r}"
            + (" (an experts-only row: every class but experts)" if missing == ["experts"] else "")
            + ", or leave-one-out rows"
            if len(rest) >= 2
            else "leave-one-out rows"
        )
        lines.append(
            "No row restores several of these and nothing else: additivity is assumed (1.00), not measured, and the "
            f"prediction error cannot be stated: {unfitted}, so "
            + ("it is" if len(model.unfitted) == 1 else "they are")
            + f" not predicted from them; add {instead}."
        )
    elif not model.checks:
        lines.append(
            "No row restores several of these together: additivity is assumed (1.00), not measured, and the "
            "prediction error cannot be stated; add an all row or leave-one-out rows."
        )
    if model.decode_checks:
        lines.append(
            "Decode is predicted as the build's plus each atom's change, with no correction fitted; rows "
            "restoring several atoms, measured against that prediction (the model holds where an error's "
            "interval includes 0; a wide interval tests it little): "
            + ", ".join(
                f"{c['row']} {c['predicted_ms']:.3f} predicted, {c['measured_ms']:.3f} measured"
                + (
                    ""
                    if not c.get("error_ci_ms")
                    else f" (error {c['measured_ms'] - c['predicted_ms']:+.3f} [{c['error_ci_ms'][0]:+.3f}, {c['error_ci_ms'][1]:+.3f}])"
                )
                for c in model.decode_checks
            )
            + " ms/token."
        )
    if model.left_out:
        lines.append(
            "Left out (a measurement is not a number): "
            + ", ".join(f"row {n} ({why})" for n, why in model.left_out)
            + "; rerun those rows."
        )
    if model.unphysical_decode:
        lines.append(f"Decode not predicted (no decode column or --max-decode-ms): {model.unphysical_decode}.")
    if model.timed and model.engine_sd_ms is None:
        lines.append("Decode intervals: none (the build was timed on one engine, so the engine-to-engine spread is unknown).")

    if model.additivity.unmeasurable:
        lines.append(
            "Not fitted, taken as 1.00: the additivity "
            + ", ".join("across classes" if c == "across" else f"within {c}" for c in model.additivity.unmeasurable)
            + " (every row that would measure it restores atoms whose KL changes are within noise; a slope from them "
            "would be a ratio of two noises)."
        )
    floored = [p.label for p in best if p.kl_floored]
    if floored:
        lines.append(
            "Predicted KL below 0, shown as 0 (KL is never negative; the additivity slopes over-predict the "
            "reductions there): " + ", ".join(floored) + "."
        )
    if any(ci and ci[0] == 0 for p in best for ci in (p.kl_ci, p.decode_ci)):
        lines.append("An interval's lower end at 0 was below 0 and is raised to 0: KL and decode time are never negative.")
    if best and any(p.atoms for p in best) and not any(p.kl_ci for p in best if p.atoms):
        why = next((p.kl_ci_why for p in best if p.atoms and p.kl_ci_why), None)
        missing = f"neither {folder / 'scores'} nor {folder / 'cluster-scores.safetensors'} holds the rows' scores"
        lines.append(f"KL intervals: none ({why or missing}).")
    if verify and chosen and len(chosen) < verify:
        lines.append(f"--verify {verify}: the front had {len(chosen)} point(s) no row measured; verified those.")
    if unfinished and verify:
        lines.append(
            "Resumed the verification an earlier --verify began ("
            + ", ".join(e["row"] for e in unfinished)
            + "); the limits and N given now apply once it has finished."
        )
    if dropped:
        lines.append(f"{record_path}: {dropped} verified entries could not be read and were left out.")

    def ci(x):
        return "" if not x else f" [{x[0]:.{d}f}, {x[1]:.{d}f}]"

    rows = [
        [
            p.label,
            f"{p.kl:.{d}f}{ci(p.kl_ci)}",
            f"{p.size_gb:.3f}",
            ""
            if p.decode is None
            else f"{p.decode:.3f}" + ("" if not p.decode_ci else f" [{p.decode_ci[0]:.3f}, {p.decode_ci[1]:.3f}]"),
            "" if p.measured is None else f"{p.measured['row']}: KL {p.measured['kl']:.{d}f}",
        ]
        for p in best
    ]
    text_limits = (
        ", ".join(
            x
            for x in (
                (f"size <= {max_gb:g} GB" if max_gb is not None else ""),
                (f"decode <= {max_decode_ms:g} ms/token" if max_decode_ms is not None else ""),
                (f"KL <= {max_kl:g}" if max_kl is not None else ""),
            )
            if x
        )
        or "no limit"
    )
    lines.append(
        f"Pareto front of predicted KL against {'decode ms/token' if cost == 'decode' else 'size on disk'} "
        f"({text_limits}; {len(feasible)} of {len(preds)} combinations within it; 95 % intervals, the "
        "additivity held fixed):"
    )
    if not rows:
        lines.append("no combination fits the limits.")
    else:
        lines.append(
            tabulate(
                rows,
                headers=["restore", "KL predicted", "size GB", "decode ms/tok predicted", "measured row"],
                tablefmt="github",
                disable_numparse=True,  # tabulate would reprint "0.130" as 0.13: the column keeps its three decimals
            )
        )
    done = [v for v in record["verified"] if v.get("measured")]
    if done:
        other = {v.get("corpus") for v in done} - {corpus}
        lines.append(
            "Verified (spliced and measured; predicted before measuring; error = measured - predicted, 95 % "
            "intervals, KL paired position by position"
            + (
                "; KL on the corpus each was predicted on: "
                + ", ".join(f"{v['row']} {v.get('corpus') or 'pooled'}" for v in done)
                if other
                else ""
            )
            + "):"
        )
        vrows = []
        # the KL errors to two significant digits of the largest: they are small differences of the KLs
        errors = [v.get("error_kl") or {} for v in done]
        de = decimals([x for ek in errors for x in [ek.get("diff"), *(ek.get("ci") or [])]], 2, of=max)
        for v in done:
            ek, ed = v.get("error_kl") or {}, v.get("error_decode") or {}
            vrows.append(
                [
                    v["restore"],
                    v["row"],
                    f"{v['kl']:.{d}f}",
                    f"{v['measured']['kl']:.{d}f}",
                    ""
                    if not ek
                    else f"{ek['diff']:+.{de}f}" + ("" if not ek["ci"] else f" [{ek['ci'][0]:+.{de}f}, {ek['ci'][1]:+.{de}f}]"),
                    "" if not ed else f"{100 * ed['predicted_rel']:+.2f} % / {100 * ed['measured_rel']:+.2f} %",
                    ""
                    if not ed
                    else f"{ed['diff_ms']:+.3f}"
                    + ("" if not ed.get("ci_ms") else f" [{ed['ci_ms'][0]:+.3f}, {ed['ci_ms'][1]:+.3f}]"),
                ]
            )
        lines.append(
            tabulate(
                vrows,
                headers=[
                    "restore",
                    "row",
                    "KL predicted",
                    "KL measured",
                    "KL error",
                    "decode vs build predicted / measured",
                    "decode error ms",
                ],
                tablefmt="github",
                disable_numparse=True,
            )
        )
    elif not verify:
        lines.append(
            "Splice and measure the chosen points with --verify N (rows added to this folder's job), or splice "
            "one with `splicer splice --restore ENTRIES BUILD BASE -o OUT`."
        )
    lines += _requantized_lines(remade)
    gone = [v for v in record["verified"] if v.get("missing") == DROPPED]
    if gone:
        lines.append(
            "Verified earlier, but "
            + DROPPED
            + ": "
            + ", ".join(v["row"] for v in gone)
            + "; rerun DIR with DIR/budget-plan.toml to keep them, or --verify measures them again."
        )
    for v in record["verified"]:
        if v.get("missing") and v["missing"] != DROPPED:
            lines.append(f"Not measured: {v['restore']} ({v['missing']}); --verify measures it under a free row name.")
    for name, why in failed:
        lines.append(
            f"Not measured: row {name} ({str(why).splitlines()[0][:200]}); see {folder / 'ablate.log'}, "
            "and run the same --verify again to resume it."
        )
    lines.append(written)
    return "\n".join(lines), not failed
