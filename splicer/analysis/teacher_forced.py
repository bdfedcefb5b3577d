"""Teacher-forced MTP acceptance from DIR/mtp-teacher-forced.json (written by `splicer mtp DIR --teacher-forced`,
ablate.speculative.run_teacher_forced), beside vLLM's own figure from DIR/speculative.json where there is one.

The estimate: on each scored sequence x_0 .. x_{T-1}, at every position t = 0 .. T-3, the row's MTP head is given
the trunk's last hidden state h_t (after its final norm) and the true next token x_{t+1}; a hit when the argmax of
its logits equals the argmax of the trunk's own logits at t+1 (the token the row itself puts at t+2 after the true
prefix). That is whether the first draft token would be accepted under greedy verification, teacher-forced on the
text: the drafts follow the text, not the model's own greedy continuation (where vLLM measures), and only the first
draft position is estimated. acceptance = hits / positions, a ratio of sums over sequences whose interval resamples
sequences (chat: groups of conversations that share a prompt) within corpora, as speculative.ratio does for vLLM's
prompts; against the build, the paired difference on the same positions.

Agreement with the engine is reported, not assumed: where the same row has a k=1 engine in DIR/speculative.json,
its first-position acceptance is set beside the estimate, and estimate - engine is paired over the sequences both
measured (each engine prompt is the start of one scored sequence), each figure on those sequences alone, with
speculative.paired_ratio_difference's interval.

A row whose estimate falls outside the bounds vLLM's drafters are judged by (speculative.broken: a head built from
missing or random weights, or one not drafting) is flagged with the reason instead of tabulated, and compared with
nothing: not with the build, not with vLLM, and no row with a flagged build.
"""

from __future__ import annotations

from ..io import results_record
from .formatting import fmt_paired_clause, fmt_paired_pp, fmt_share
from .speculative import broken, flag_rule, paired_ratio_difference, prompt_clusters, ratio

FILE = "mtp-teacher-forced.json"
ENGINE_K = "1"  # the engine whose first draft position the estimate is compared with
UNIT = "sequences"  # what the intervals resample: DIR's scored sequences (chat: groups of them), not prompts

# A head whose drafts (almost) never match is one built from missing or random weights, one whose every draft matches
# is not drafting: the engine's bounds (speculative.broken), each position one first draft token.
FLAG_LOW = (
    "acceptance {rate:.1f} % over {n:,} positions: the MTP head's drafts almost never match the trunk's own next token, "
    "as from missing or random weights; not a result"
)
FLAG_HIGH = (
    "acceptance {rate:.1f} % over {n:,} positions: every draft matches the trunk's own next token, so the head is not "
    "drafting on its own; not a result"
)


def _rows(record: dict) -> dict:
    return {r: e for r, e in (record.get("rows") or {}).items() if e.get("status") == "ok"}


def flag(hits: list[int], positions: list[int]) -> str | None:
    """Why a row's estimate is no result (speculative.broken, as for vLLM's drafters), or None."""
    n = sum(positions)
    how = broken(sum(hits), n)
    if how is None:
        return None
    return (FLAG_LOW if how == "low" else FLAG_HIGH).format(rate=100 * sum(hits) / n, n=n)


def summarize(record: dict, reps: int = 2000) -> dict:
    """record: DIR/mtp-teacher-forced.json -> {row: {acceptance, positions, hits, vs_build}}, or for a row whose estimate
    is flagged {flagged, positions, hits}: no figure, and no row compared with a flagged build."""
    sequences = record.get("sequences") or []
    strata, cluster = prompt_clusters(sequences)
    positions = [s["positions"] for s in sequences]
    rows, build = _rows(record), record.get("build_row")
    flagged = {r: why for r, e in rows.items() if (why := flag(e["hits"], positions))}
    out = {}
    for row, entry in rows.items():
        fig = {"positions": sum(positions), "hits": sum(entry["hits"])}
        if row in flagged:
            out[row] = dict(fig, flagged=flagged[row])
            continue
        fig["acceptance"] = ratio(entry["hits"], positions, strata, reps, cluster=cluster, unit=UNIT)
        if row != build and build in rows and build not in flagged:
            fig["vs_build"] = paired_ratio_difference(
                (entry["hits"], positions), (rows[build]["hits"], positions), strata, reps, cluster=cluster, unit=UNIT
            )
        out[row] = fig
    return out


def engine_comparison(record: dict, engine: dict | None, reps: int = 2000) -> dict:
    """{row: vLLM's figure beside the estimate}: its first-position acceptance at k=1 ("engine", with its interval
    over all its prompts), or why there is none to compare ("flagged"); and estimate - engine paired over the
    sequences both measured ("vs_engine", with "sequences", "estimate_shared", "engine_shared": each figure on those
    sequences alone)."""
    if not engine:
        return {}
    erec, esum = engine["record"], engine["summary"]
    prompts = erec.get("prompts") or []
    sequences = record.get("sequences") or []
    where = {(s["corpus"], s["index"]): j for j, s in enumerate(sequences)}
    shared = [(i, where[(p["corpus"], p["index"])]) for i, p in enumerate(prompts) if (p["corpus"], p.get("index")) in where]
    strata, cluster = prompt_clusters([prompts[i] for i, _ in shared])
    positions = [s["positions"] for s in sequences]
    out = {}
    for row, entry in _rows(record).items():
        fig = (esum.get(row) or {}).get(ENGINE_K)
        if fig is None:
            continue
        if fig.get("flagged"):
            out[row] = {"flagged": fig["flagged"]}
            continue
        if flag(entry["hits"], positions):  # the estimate is no result: nothing of it to set against vLLM's
            if fig.get("per_position"):
                out[row] = {"engine": fig["per_position"][0], "estimate_flagged": True}
            continue
        first = next(
            (
                e
                for e in erec.get("engines", [])
                if e.get("status") == "ok" and e["row"] == row and str(e["k"]) == ENGINE_K and not e.get("repeat")
            ),
            None,
        )
        if first is None or not fig.get("per_position"):
            continue
        per = first["per_prompt"]
        a = ([entry["hits"][j] for _, j in shared], [sequences[j]["positions"] for _, j in shared])
        b = ([per[i]["accepted_per_pos"][0] for i, _ in shared], [per[i]["drafts"] for i, _ in shared])
        cmp = {"engine": fig["per_position"][0], "sequences": len(shared)}
        if sum(a[1]) > 0 and sum(b[1]) > 0:
            cmp["estimate_shared"] = sum(a[0]) / sum(a[1])
            cmp["engine_shared"] = sum(b[0]) / sum(b[1])
            cmp["vs_engine"] = paired_ratio_difference(a, b, strata, reps, cluster=cluster, unit=UNIT, against="vLLM's")
        out[row] = cmp
    return out


def load(out) -> dict | None:
    """DIR/mtp-teacher-forced.json summarised, with vLLM's figures of DIR/speculative.json beside it (None when DIR
    has no such file or it cannot be read)."""
    from pathlib import Path

    from . import speculative

    record = results_record.read_stage_record(Path(out) / FILE)
    if record is None:
        return None
    # Recomputed every time, as speculative.load does: the engine's file may have been written since
    return {"record": record, "summary": summarize(record), "engine": engine_comparison(record, speculative.load(out))}


HEADERS = [
    "variant",
    "teacher-forced acceptance [95 %]",
    "positions",
    "Δ vs build, pp",
    f"vLLM k={ENGINE_K} acceptance [95 %]",
    "teacher-forced − vLLM, pp [95 %]",
]


def _order(spec: dict, order: list[str]) -> list[str]:
    summary = spec["summary"]
    return [n for n in order if n in summary] + [n for n in summary if n not in order]


def _engine_cells(cmp: dict | None) -> list[str]:
    if not cmp:
        return ["", ""]
    if cmp.get("flagged"):
        return ["flagged", "no comparison"]
    if cmp.get("estimate_flagged"):
        return [fmt_share(cmp["engine"]), "no comparison: the estimate is flagged"]
    vs = cmp.get("vs_engine")
    # paired on the shared sequences alone: not the difference of the two columns beside it (all sequences, all prompts)
    return [fmt_share(cmp["engine"]), f"{fmt_paired_pp(vs)} (on the {cmp['sequences']} sequences both measured)" if vs else ""]


def table_rows(spec: dict, order: list[str]) -> list[list[str]]:
    """One row per variant of DIR/mtp-teacher-forced.json, in the results table's order."""
    build = spec["record"].get("build_row")
    rows = []
    for name in _order(spec, order):
        fig = spec["summary"][name]
        if fig.get("flagged"):
            rows.append(
                [name, f"flagged: {fig['flagged']}", f"{fig['positions']:,}", "", *_engine_cells(spec["engine"].get(name))]
            )
            continue
        rows.append(
            [
                name,
                fmt_share(fig["acceptance"]),
                f"{fig['positions']:,}",
                fmt_paired_pp(fig.get("vs_build")) if name != build else "",
                *_engine_cells(spec["engine"].get(name)),
            ]
        )
    return rows


def _state(record: dict) -> str:
    planned, rows = record.get("rows_planned"), record.get("rows") or {}
    done = [r for r, e in rows.items() if e.get("status") == "ok"]
    failed = {r: e for r, e in rows.items() if e.get("status") != "ok"}
    text = ""
    if planned and len(done) < planned:
        text += f" Incomplete: {len(done)} of the {planned} rows finished; rerun splicer mtp --teacher-forced to finish."
    if failed:
        text += " Failed: " + "; ".join(f"{r} ({str(e.get('error', ''))[:160]})" for r, e in failed.items()) + "."
    return text


def note(spec: dict) -> str:
    r = spec["record"]
    sequences = r.get("sequences") or []
    per: dict = {}
    for s in sequences:
        per[s["corpus"]] = per.get(s["corpus"], 0) + 1
    skipped = "; ".join(f"{x['row']}: {x['reason']}" for x in r.get("skipped") or [])
    device = (r.get("backend") or {}).get("device")
    engine = (
        f" Beside it, vLLM's acceptance at k={ENGINE_K} from `splicer mtp` (DIR/speculative.json: its own greedy "
        "continuations of the first tokens of the first sequences); teacher-forced − vLLM is paired over the sequences "
        "both measured (each figure on those sequences alone, so it need not equal the difference of the two columns "
        "beside it, which are over all sequences and all prompts), so n.s. says that no difference is resolved and the "
        "interval bounds the disagreement, not that the two agree."
        if spec["engine"]
        else f" No vLLM figure beside it: DIR/speculative.json holds no k={ENGINE_K} engine of these rows "
        "(splicer mtp DIR --tokens 1 on a --backend vllm folder)."
    )
    return (
        "MTP acceptance, teacher-forced, from `splicer mtp --teacher-forced`: the torch reference's model of each variant "
        f"with its own MTP head (quantized modules dequantized as the trunk's; {r.get('settings', {}).get('dtype')}"
        + (f" on {device}" if device else "")
        + f"), on {len(sequences)} scored sequences ("
        + ", ".join(f"{n} of {c}" for c, n in per.items())
        + "); at every position t ≤ T−3 a hit when the head's argmax given (h_t, x_{t+1}) equals the trunk's own argmax "
        "at t+1: the first draft token's acceptance under greedy verification, teacher-forced on the text (not on the "
        "model's own continuation; first draft position only). acceptance = hits / positions; intervals resample "
        "sequences (chat: groups of conversations that share a prompt) within corpora; Δ vs build is paired on the same "
        f"positions. An estimate {flag_rule('positions')} is flagged, not a result (the bounds vLLM's drafters are "
        "flagged by): no row is compared with a flagged build, nor a flagged row with vLLM."
        + engine
        + (f" Not measured: {skipped}." if skipped else "")
        + _state(r)
    )


def _agreement(cmp: dict) -> str:
    """One clause on how the estimate and vLLM's figure compare, claiming no more than the interval says."""
    if cmp.get("flagged"):
        return f"; vLLM's k={ENGINE_K} figure is flagged ({cmp['flagged']}), so there is nothing to compare it with"
    vs = cmp.get("vs_engine")
    if not vs or vs.get("diff") is None:
        return f"; vLLM's k={ENGINE_K} acceptance {fmt_share(cmp['engine'])}, on no sequence in common with it"
    text = (
        f"; vLLM's k={ENGINE_K} acceptance {fmt_share(cmp['engine'])}: on the {cmp['sequences']} sequences both measured "
        f"{100 * cmp['estimate_shared']:.1f} % against {100 * cmp['engine_shared']:.1f} %, teacher-forced − vLLM "
    )
    if vs.get("ci") is None:
        return text + fmt_paired_clause(vs, "") + ", no verdict on agreement"
    text += f"{fmt_paired_pp(vs).replace(' n.s.', '')} pp"
    lo, hi = (100 * x for x in vs["ci"])
    if vs.get("significant"):
        return text + f", a difference the interval resolves (the estimate reads {'high' if vs['diff'] > 0 else 'low'})"
    return text + f", no difference resolved (the estimate within {lo:+.1f} to {hi:+.1f} points of vLLM's)"


def sentences(spec: dict, order: list[str] | None = None) -> list[str]:
    """The report's sentences on teacher-forced acceptance, one per row, every figure from the summary."""
    out = []
    build = spec["record"].get("build_row")
    for name in _order(spec, order or []):
        fig = spec["summary"][name]
        if fig.get("flagged"):
            out.append(f"MTP teacher-forced, {name}: flagged, {fig['flagged']}.")
            continue
        acc = fig["acceptance"]
        if acc.get("value") is None:
            continue
        text = f"MTP teacher-forced, {name}: first-position acceptance {fmt_share(acc)} over {fig['positions']:,} positions"
        vs = fig.get("vs_build")
        if name != build and vs and vs.get("diff") is not None:
            text += f"; {fmt_paired_clause(vs)}"
        cmp = spec["engine"].get(name)
        if cmp:
            text += _agreement(cmp)
        out.append(text + ".")
    state = _state(spec["record"]).strip()
    if state:
        out.append(f"MTP teacher-forced: {state}")
    return out
