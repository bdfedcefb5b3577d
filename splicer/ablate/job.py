"""The job (DIR/job.json): which rows of which plan, on which corpora, for which inputs and settings.

A rerun keeps the finished rows of the same job only; the tokenized corpora belong to it."""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import sys
from pathlib import Path

from .. import __version__
from ..corpora.core import Corpus, build_corpus
from ..errors import SplicerError
from ..io import results_record
from ..plans.plan import Plan
from .common import AblateSettings, atomic_json, parts_digest


def override_corpora(plan: Plan, overrides: dict[str, str]) -> list[dict]:
    specs = {c["name"]: dict(c) for c in plan.corpora}
    for name, path in overrides.items():
        if name not in specs:
            raise SplicerError(f"--corpus {name}=...: the plan has no corpus {name!r}; its corpora: {', '.join(specs)}")
        spec = {k: v for k, v in specs[name].items() if k in ("name", "chunk_tokens", "max_chunks", "field")}
        specs[name] = dict(spec, kind="text", files=[str(Path(path).resolve())])
    return list(specs.values())


def _generic_config_warning(record: logging.LogRecord) -> bool:
    """A logging filter: loading the tokenizer of a model type transformers has no config class for (kimi_k2), it
    warns that the checkpoint instantiates a generic config; the tokenizer does not depend on it."""
    return "to instantiate a model of type ``" not in record.getMessage()


def _tokenizer(folder: Path):
    from transformers import AutoTokenizer

    log = logging.getLogger("transformers.configuration_utils")
    log.addFilter(_generic_config_warning)
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # transformers raises OSError/ValueError/...: all mean "no usable tokenizer"
        raise SplicerError(
            f"cannot load a tokenizer from {folder} ({e.__class__.__name__}); the base needs tokenizer files"
        ) from None
    finally:
        log.removeFilter(_generic_config_warning)


def prepare_corpora(base_root: Path, plan: Plan, settings: AblateSettings):
    """Tokenize every corpus (chat: prompts only) before anything is written, so bad corpora fail early."""
    specs = override_corpora(plan, settings.corpus_overrides)
    tok = _tokenizer(base_root)
    cfg = json.loads((Path(base_root) / "config.json").read_text())
    context = settings.backend_options.context_length() or cfg.get("text_config", cfg).get("max_position_embeddings")
    return tok, [build_corpus(s, tok, context, Path.cwd()) for s in specs]


def input_source(source) -> str:
    """An input as the job records it: a local folder by its real path, so that the same folder named from another
    folder, absolutely or through a link is the same input (and `budget --verify` finds it from anywhere); a Hub id as
    given."""
    p = Path(str(source)).expanduser()
    return str(p.resolve()) if p.exists() else str(source)


def input_entry(source, out: Path | None, **fields) -> dict:
    """A job's record of one input: its source (input_source), and, for a folder inside the results folder itself
    (the demo's pair), its path relative to that folder (`in_dir`), so that a results folder moved or copied whole
    still names the same input and keeps its rows."""
    entry = {"source": input_source(source), **fields}
    if out is not None:
        real, p = Path(out).resolve(), Path(entry["source"])
        if p.is_absolute() and real in p.parents:
            entry["in_dir"] = p.relative_to(real).as_posix()
    return entry


def job_input(folder: Path, entry: dict | None) -> str:
    """Where a job's input is now: inside FOLDER when it was recorded there (`in_dir`) and is still there, else its
    recorded source."""
    entry = entry or {}
    inside = entry.get("in_dir")
    if isinstance(inside, str) and (Path(folder) / inside).exists():
        return str(Path(folder) / inside)
    return str(entry.get("source"))


def _row_definition(definition: dict) -> dict:
    """A row's definition with the checkpoint a `checkpoint` row scores named as input_source names it."""
    return dict(definition, checkpoint=input_source(definition["checkpoint"])) if definition.get("checkpoint") else definition


# The order of job.json's settings (those of the backend's options among them, backends.BackendOptions.job_settings).
_SETTINGS_ORDER = (
    "backend",
    "device",
    "batch_size",
    "engine_args",
    "engine_env",
    "allow_quantized_base",
    "overlap_starts",
    "rewake_before_timing",
    "time_decode",
    "corpus_overrides",
    "gpus",
)


def make_job(
    plan: Plan,
    settings: AblateSettings,
    *,
    corpora: list[Corpus],
    build_src: str,
    build,
    base_src: str,
    base_digest: str,
    out: Path | None = None,
) -> dict:
    """What a results folder was made from (DIR/job.json): finished rows are kept on a rerun only under the same job.

    The tokenized corpora belong to it: rows scored on other positions (a corpus file edited, a new chat set) would
    otherwise be paired with the new ones."""
    fields = {
        "backend": settings.backend,
        "device": settings.device,
        "batch_size": settings.batch_size,
        "allow_quantized_base": settings.allow_quantized_base,
        "time_decode": settings.time_decode,
        "corpus_overrides": {k: input_source(v) for k, v in settings.corpus_overrides.items()},
        **settings.backend_options.job_settings(),
    }
    order = {k: i for i, k in enumerate(_SETTINGS_ORDER)}
    return {
        "tool": f"splicer {__version__}",
        "plan": plan.name,
        "plan_digest": plan.digest,
        "plan_settings_digest": plan.settings_digest,
        "rows": {r.name: _row_definition(r.definition()) for r in plan.rows},
        "corpora_digest": parts_digest([c.digest() for c in corpora]),
        "build": input_entry(build_src, out, header_digest=build.header_digest()),
        "base": input_entry(base_src, out, digest=base_digest),
        "settings": dict(sorted(fields.items(), key=lambda kv: order.get(kv[0], len(order)))),
    }


def select_rows(plan: Plan, rows_spec: str, quantized: list[str]) -> set[str]:
    """The plan's rows `ablate ROWS` asks for ("all" or a comma list); the build and its repeats always come along."""
    names = {r.name for r in plan.rows}
    if rows_spec == "all":
        return names
    wanted = [r.strip() for r in rows_spec.split(",") if r.strip()]
    bad = [w for w in wanted if w not in names]
    if bad or not wanted:
        raise SplicerError(
            f"row {bad[0] if bad else '(none)'!r} is not in plan {plan.name}; its rows: {', '.join(r.name for r in plan.rows)}"
        )
    # The build row is every other row's reference, and its repeats (more engines of it) set the decode intervals.
    return {"build", *wanted, *(r.name for r in plan.rows if r.repeat and r.restored(quantized) == [])}


def started_from_cli() -> bool:
    """True when the splicer command line is running (then sys.argv is the command to record)."""
    return Path(sys.argv[0]).name in ("splicer", "__main__.py") or sys.argv[0].endswith("splicer/__main__.py")


def host_info() -> dict:
    """The CPU side of the machine: engine start-up and batch-1 decode depend on it, and a resumed run may be on another."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = None
    try:
        kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal"))
        memory_gib = round(kib / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    return {"cpu": cpu, "logical_cores": os.cpu_count(), "memory_gib": memory_gib}


ROW_KEYS_OF_JOB = ("plan", "plan_digest", "rows")  # what may differ between two runs of one job: the plan's rows


def _canonical(job: dict) -> dict:
    """The job with its inputs named as input_source names them, so that a job.json written before sources were
    recorded by their real paths (or from the same folder with another spelling) compares by what the inputs are."""
    out = dict(job)
    for role in ("build", "base"):
        if isinstance(out.get(role), dict) and isinstance(out[role].get("in_dir"), str):
            # inside the results folder: the same input wherever the folder now is
            out[role] = dict(out[role], source="DIR/" + out[role]["in_dir"])
        elif isinstance(out.get(role), dict) and out[role].get("source") is not None:
            out[role] = dict(out[role], source=input_source(out[role]["source"]))
    settings = out.get("settings")
    if isinstance(settings, dict) and isinstance(settings.get("corpus_overrides"), dict):
        out["settings"] = dict(settings, corpus_overrides={k: input_source(v) for k, v in settings["corpus_overrides"].items()})
    return out


def same_measurements(a: dict | None, b: dict | None) -> bool:
    """Whether two jobs measure alike (inputs, corpora, plan settings, backend settings, splicer's version), so that
    a row finished under one is a result of the other when the row itself is unchanged; a job written before rows
    were recorded one by one never is."""
    if not isinstance(a, dict) or not isinstance(b, dict) or "rows" not in a or "rows" not in b:
        return False
    a, b = _canonical(a), _canonical(b)
    return {k: v for k, v in a.items() if k not in ROW_KEYS_OF_JOB} == {k: v for k, v in b.items() if k not in ROW_KEYS_OF_JOB}


def _shown(value) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def job_differences(a: dict, b: dict) -> list[str]:
    """How two jobs differ, field by field ("settings.batch_size: null -> 2"), for a message: nested objects (the
    inputs, the settings) are compared one level down, so the line names the field that changed."""
    a, b = _canonical(a), _canonical(b)
    out = []
    for k in sorted((set(a) | set(b)) - set(ROW_KEYS_OF_JOB)):
        old, new = a.get(k), b.get(k)
        if old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            out += [
                f"{k}.{f}: {_shown(old.get(f))} -> {_shown(new.get(f))}"
                for f in sorted(set(old) | set(new))
                if old.get(f) != new.get(f)
            ]
        else:
            out.append(f"{k}: {_shown(old)} -> {_shown(new)}")
    return out


def _same_inputs(a: dict | None, b: dict) -> bool:
    """Whether two jobs splice the same build from the same base (splices made for one serve the other)."""
    a, b = _canonical(a or {}), _canonical(b)
    return (a.get("build"), a.get("base")) == (b.get("build"), b.get("base"))


def write_job(out: Path, job: dict, stages, extend_only: bool = False) -> tuple[dict[str, dict], list[dict]]:
    """DIR/job.json for this invocation, and what an earlier run of DIR left that this one keeps: its finished rows
    whose definition is unchanged, and its run records, both only when the two jobs measure alike (same_measurements):
    rows may be added to a plan, or changed, and only those run. Splices made from another build or base are removed.
    extend_only (`splicer budget --verify`): refuse, before anything changes, a job that does not measure as DIR's."""
    previous = results_record.read(out) if results_record.path_of(out).exists() else None
    before = (previous or {}).get("job")
    alike = same_measurements(before, job)
    if extend_only and not alike:
        what = "; ".join(job_differences(before, job)) if isinstance(before, dict) else "no earlier job"
        raise SplicerError(
            f"{out} was measured under another job ({what or 'written by an older splicer'}); rows added "
            "to it would not be comparable: run the plan again into a new folder"
        )
    if previous and not _same_inputs(before if isinstance(before, dict) else None, job):
        shutil.rmtree(out / "variants", ignore_errors=True)  # another build or base: every splice is stale
    atomic_json(out / "job.json", job)
    if not alike:
        if previous and previous.get("variants"):
            what = "; ".join(job_differences(before, job)) if isinstance(before, dict) else "no job recorded"
            stages.notice(
                f"the job differs from the one in {out} ({what or 'written by an older splicer'}): its "
                "finished rows are run again",
            )
        return {}, []
    was = {name: _row_definition(d) if isinstance(d, dict) else d for name, d in (before.get("rows") or {}).items()}
    kept = {
        v["name"]: v
        for v in previous.get("variants", [])
        if v.get("status") == "ok" and v["name"] in job["rows"] and was.get(v["name"]) == job["rows"][v["name"]]
    }
    changed = [v["name"] for v in previous.get("variants", []) if v.get("status") == "ok" and v["name"] not in kept]
    if changed:
        stages.notice(
            f"rows changed or no longer in the plan, not kept: {', '.join(changed)} (a row added with --add or "
            "--add-requantized stays only while the flag is given again)",
        )
    return kept, previous.get("runs", [])
