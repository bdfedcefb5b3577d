"""`splicer ablate`: splice each row of a plan, score it against the base, time it, write results.json.

Resumable stages under DIR, each reading the previous stage's files:
  job.json                      inputs (with header digests), plan, backend settings
  cache/base-<key>/             the base pass: corpora (with the base's chat answers), per-corpus
                                top-k / target log-probs, and the noise pass (keyed by base digest,
                                corpora and settings; reused by every variant and every rerun)
  variants/<row>/               spliced checkpoints (reused while splice.json matches the inputs)
  scores/<row>/<corpus>.safetensors   per-position records (top1, KL, dlogp) for paired statistics
  results.json, table.md        rewritten after every finished row
A rerun skips rows whose results match the current inputs and settings.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import shutil
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import __version__, faults, spread
from .checkpoint import open_checkpoint
from .corpora import Corpus, build_corpus
from .errors import SplicerError
from .metrics import fill_missing, kl_full, kl_top_lumped, summarize
from .outputs import ABLATE, check_output, exclusive, local_folder
from .plan import Plan, load_plan, resolve_rows
from .progress import SILENT, Stages

RESULTS = "results.json"
FULL_VOCAB_CACHE_LIMIT = 1 << 30
BASE_PASS_VERSION = 2  # part of the base pass's cache key: 2 = noise pass scored exactly as the rows  # keep the base's full log-softmax only while it fits in 1 GiB


@dataclass
class AblateSettings:
    backend: str = "torch"
    device: str = "auto"
    time_decode: bool = True
    corpus_overrides: dict[str, str] = field(default_factory=dict)
    batch_size: int | None = None  # sequences per forward / per engine call; None: the backend's default
    engine_args: dict = field(default_factory=dict)
    engine_env: dict = field(default_factory=dict)  # vllm: environment variables for every engine process (--engine-env)
    bandwidth_gbs: float | None = None  # memory bandwidth for the decode floor column (H200: 4800)
    bootstrap: int = 1000
    progress: bool = True
    process_per_variant: bool = False  # vllm: a fresh worker process per variant instead of one for the run
    overlap_starts: int = 0  # vllm: engines started ahead (in spare workers) while the current one scores
    rewake_before_timing: bool = False  # vllm with overlap: one more sleep and wake right before each decode timing
    precompile: int = 0  # vllm: processes that compile every variant's engine while the base pass runs (rows stay serial)
    gpus: tuple = ()  # vllm: CUDA ids to spread the rows over (two or more); () = one GPU
    allow_quantized_base: bool = False  # a stand-in reference that keeps some classes quantized (see validate_base)
    engine_cache_dir: Path | None = None  # vllm: compile/Triton/Inductor caches; None: their per-user defaults
    own_inputs: tuple = ()  # input folders this run wrote inside DIR itself (the demo's pair), which DIR may hold
    stages: Stages = field(default=SILENT, repr=False)  # stage lines (stderr off a terminal, and DIR/ablate.log)


def _atomic_json(path: Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")
    os.replace(tmp, path)


def _jsonable(o):
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, float) and (o != o):
        return None
    raise TypeError(type(o))


@contextmanager
def _closing(*backends):
    """End the backends' worker processes however the run ends (finished, failed, interrupted)."""
    try:
        yield backends
    finally:
        for backend in backends:
            backend.close()


def _pbar(iterable=None, **kw):
    from tqdm.auto import tqdm

    return tqdm(iterable, **kw)


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))


def _digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- corpora and the base pass


def _override_corpora(plan: Plan, overrides: dict[str, str]) -> list[dict]:
    specs = {c["name"]: dict(c) for c in plan.corpora}
    for name, path in overrides.items():
        if name not in specs:
            raise SplicerError(f"--corpus {name}=...: the plan has no corpus {name!r}; its corpora: {', '.join(specs)}")
        spec = {k: v for k, v in specs[name].items() if k in ("name", "chunk_tokens", "max_chunks", "field")}
        specs[name] = dict(spec, kind="text", files=[str(Path(path).resolve())])
    return list(specs.values())


def _tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # transformers raises OSError/ValueError/...: all mean "no usable tokenizer"
        raise SplicerError(f"cannot load a tokenizer from {folder} ({e.__class__.__name__}); the base needs tokenizer files") from None


def _save_scores(path: Path, scores: list, extra: dict | None = None) -> None:
    from safetensors.torch import save_file

    tensors = {
        "topk_ids": torch.cat([s.topk_ids for s in scores]).contiguous(),
        "topk_logprobs": torch.cat([s.topk_logprobs for s in scores]).contiguous(),
        "target_logprobs": torch.cat([s.target_logprobs for s in scores]).contiguous(),
        "lengths": torch.tensor([len(s.target_logprobs) for s in scores], dtype=torch.int64),
    }
    if scores and scores[0].full is not None:
        tensors["full"] = torch.cat([s.full for s in scores]).contiguous()
    tensors.update(extra or {})
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def prepare_corpora(base_root: Path, plan: Plan, settings: AblateSettings):
    """Tokenize every corpus (chat: prompts only) before anything is written, so bad corpora fail early."""
    specs = _override_corpora(plan, settings.corpus_overrides)
    tok = _tokenizer(base_root)
    cfg = json.loads((Path(base_root) / "config.json").read_text())
    context = settings.engine_args.get("max_model_len") or cfg.get("text_config", cfg).get("max_position_embeddings")
    return tok, [build_corpus(s, tok, context, Path.cwd()) for s in specs]


def base_cache(backend, plan: Plan, settings: AblateSettings, out: Path, base_digest: str, corpora: list[Corpus]) -> Path:
    """The folder of the base pass for these inputs and settings (done when it holds done.json)."""
    key = _digest(BASE_PASS_VERSION, base_digest, [c.digest() for c in corpora], [c.spec for c in corpora], plan.top_k, backend.name,
                  settings.device, settings.batch_size, settings.engine_args,
                  # Only when set, so that caches made before --engine-env existed keep their key.
                  *([settings.engine_env] if settings.engine_env else []))
    return out / "cache" / f"base-{key}"


def base_pass(backend, base_root: Path, plan: Plan, settings: AblateSettings, cache: Path,
              tok, corpora: list[Corpus], chat_stop_tokens: tuple[str, ...] = ()) -> list[Corpus]:
    """Generate the base's chat answers and score the base (and a noise pass) once into cache (see base_cache);
    returns the corpora with the chat answers in them. An answer ends at the tokenizer's EOS or at one of the family's
    chat_stop_tokens the tokenizer knows."""
    done = cache / "done.json"
    stages = settings.stages
    if done.exists():
        stages.line("base pass: cached")
        return [Corpus.from_json(c) for c in json.loads((cache / "corpora.json").read_text())]
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    t0 = time.perf_counter()
    with stages.stage("base pass: engine start"):
        backend.load(base_root)
    load_s = time.perf_counter() - t0
    engine_info = backend.load_info() or None
    unk = tok.unk_token_id
    stop = sorted({t for t in (tok.eos_token_id, *(tok.convert_tokens_to_ids(s) for s in chat_stop_tokens))
                   if isinstance(t, int) and t >= 0 and t != unk})
    for c in corpora:
        if c.kind == "chat":
            with stages.stage(f"base pass: chat answers {c.name} ({len(c.sequences)} conversations)"):
                answers = backend.generate(c.sequences, int(c.spec.get("answer_tokens", 32)), stop)
            c.sequences = [p + a for p, a in zip(c.sequences, answers)]
    vocab = None
    timings = {"load_s": load_s}
    for c in corpora:
        t0 = time.perf_counter()
        want_full = False
        if backend.exact_gather:
            vocab = vocab or _vocab_size(base_root)
            want_full = c.positions() * vocab * 4 <= FULL_VOCAB_CACHE_LIMIT
        batch = _batch_size(settings, backend)
        with stages.stage(f"base pass: scoring {c.name} ({c.positions()} positions, then the noise pass)"):
            scores = list(_pbar(backend.score(c.sequences, plan.top_k, want_full=want_full, batch_size=batch),
                                total=len(c.sequences), desc=f"base {c.name}", disable=not settings.progress or None, leave=False))
            _save_scores(cache / f"{c.name}.safetensors", scores)
            # Noise floor: the base scored again exactly as every row is scored (same order and batch size), so it
            # measures what the engine's own nondeterminism costs a row and nothing else (a pass batched differently
            # sat 12 % above a row holding the base's own tensors). Deterministic backends give 0.
            noise = list(backend.score(c.sequences, plan.top_k, batch_size=batch,
                                       gather_ids=[s.topk_ids for s in scores] if backend.exact_gather else None,
                                       want_full=want_full))
            _save_scores(cache / f"noise-{c.name}.safetensors", noise,
                         {"gathered": torch.cat([n.gathered for n in noise])} if backend.exact_gather else None)
        timings[f"score_{c.name}_s"] = time.perf_counter() - t0
    backend.unload()
    (cache / "corpora.json").write_text(json.dumps([c.to_json() for c in corpora]))
    _atomic_json(done, {"timings": timings, "backend": backend.describe(), "engine": engine_info})
    return corpora


def _batch_size(settings: AblateSettings, backend) -> int:
    return settings.batch_size or backend.default_batch


def _vocab_size(folder: Path) -> int:
    cfg = json.loads((Path(folder) / "config.json").read_text())
    return int(cfg.get("text_config", cfg)["vocab_size"])


# ---------------------------------------------------------------- per-position records


def first_occurrence_weights(sequences: list[list[int]], lengths: torch.Tensor) -> torch.Tensor:
    """1 for a position whose context and next token appear here for the first time, 0 for a repeat.

    Chat conversations share a system prompt and history: a position inside the prefix a sequence shares with an
    earlier one sees the same context and predicts the same token, so it is the same measurement again (87 % of the
    demo's chat positions were). Counting it once keeps such a prefix from outweighing the answers, and keeps
    intervals from treating copies as independent evidence.
    """
    weights = torch.ones(int(lengths.sum()), dtype=torch.float32)
    start, seen = 0, []
    for seq, n in zip(sequences, lengths.tolist()):
        shared = max((_common_prefix(seq, other) for other in seen), default=0)
        # position t (context seq[:t+1], target seq[t+1]) repeats an earlier one while t + 1 < shared
        weights[start:start + max(0, min(shared - 1, n))] = 0
        seen.append(seq)
        start += n
    return weights


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def position_records(base: dict, var: dict, corpus: Corpus, gathered: torch.Tensor | None) -> dict[str, torch.Tensor]:
    lengths = base["lengths"]
    seq_index = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    if gathered is None:
        gathered = fill_missing(base["topk_ids"], var["topk_ids"], var["topk_logprobs"])
    # A tie among the base's largest log-probs (BF16 logits tie often: 3.7 % of the demo's positions) makes its top-1
    # an accident of the sort order: the variant agrees when its choice is any of the base's tied maxima.
    tied = base["topk_logprobs"] == base["topk_logprobs"][:, :1]
    rec = {
        "seq_index": seq_index.int(),
        "top1": ((base["topk_ids"] == var["topk_ids"][:, :1]) & tied).any(-1),
        "base_tie": tied[:, 1:].any(-1),
        "weight": first_occurrence_weights(corpus.sequences, lengths),
        "kl_top": kl_top_lumped(base["topk_logprobs"], gathered),
        "tail": (1 - base["topk_logprobs"].double().exp().sum(-1)).clamp_min(0).float(),
        "dlogp": base["target_logprobs"] - var["target_logprobs"],
    }
    if "full" in base and "full" in var:
        rec["kl_full"] = kl_full(base["full"], var["full"])
    if corpus.prompt_lens is not None:
        mask = torch.zeros(int(lengths.sum()), dtype=torch.bool)
        start = 0
        for n, p in zip(lengths.tolist(), corpus.prompt_lens):
            # position t predicts token t+1: answer tokens sit at p .. len-1, predicted from p-1 .. len-2
            mask[start + p - 1:start + n] = True
            start += n
        rec["answer_mask"] = mask
    return rec


def score_variant(backend, folder: Path, cache: Path, corpora: list[Corpus], plan: Plan, settings: AblateSettings,
                  score_dir: Path, before_scoring=None) -> tuple[dict, dict]:
    """Load folder's model and score it against the cached base pass; before_scoring runs once it is loaded."""
    from safetensors.torch import save_file

    metrics, timings = {}, {}
    stages = settings.stages
    t0 = time.perf_counter()
    with stages.stage(f"{score_dir.name}: engine start"):
        backend.load(folder)
    timings["load_s"] = time.perf_counter() - t0
    if info := backend.load_info():
        timings["engine"] = info
    if before_scoring:
        before_scoring()
    score_dir.mkdir(parents=True, exist_ok=True)
    for c in corpora:
        t0 = time.perf_counter()
        base = _load_tensors(cache / f"{c.name}.safetensors")
        offsets = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), base["lengths"]]), 0)
        gather = [base["topk_ids"][offsets[i]:offsets[i + 1]] for i in range(len(c.sequences))] if backend.exact_gather else None
        with stages.stage(f"{score_dir.name}: scoring {c.name} ({c.positions()} positions)"):
            scores = list(_pbar(backend.score(c.sequences, plan.top_k, gather_ids=gather, want_full="full" in base,
                                              batch_size=_batch_size(settings, backend)),
                                total=len(c.sequences), desc=f"  {folder.name} {c.name}", disable=not settings.progress or None,
                                leave=False))
        var = {
            "topk_ids": torch.cat([s.topk_ids for s in scores]), "topk_logprobs": torch.cat([s.topk_logprobs for s in scores]),
            "target_logprobs": torch.cat([s.target_logprobs for s in scores]),
        }
        if "full" in base:
            var["full"] = torch.cat([s.full for s in scores])
        gathered = torch.cat([s.gathered for s in scores]) if backend.exact_gather else None
        rec = position_records(base, var, c, gathered)
        save_file({k: v.contiguous() for k, v in rec.items()}, str(score_dir / f"{c.name}.safetensors"))
        metrics[c.name] = summarize(rec, settings.bootstrap)
        timings[f"score_{c.name}_s"] = time.perf_counter() - t0
        timings[f"positions_per_s_{c.name}"] = c.positions() / max(timings[f"score_{c.name}_s"], 1e-9)
    return metrics, timings


def noise_floor(cache: Path, corpora: list[Corpus], bootstrap: int) -> dict:
    out = {}
    for c in corpora:
        base = _load_tensors(cache / f"{c.name}.safetensors")
        noise = _load_tensors(cache / f"noise-{c.name}.safetensors")
        rec = position_records(base, noise, c, noise.get("gathered"))
        out[c.name] = summarize(rec, bootstrap)
    return out


# ---------------------------------------------------------------- the plan


def _timing_prompt(corpora: list[Corpus], n: int) -> list[int]:
    """A fixed prompt of n tokens: the first chat prompt (persona + history), repeated as needed."""
    src = next((c.sequences[0][: c.prompt_lens[0]] for c in corpora if c.prompt_lens), corpora[0].sequences[0])
    return (src * (n // max(len(src), 1) + 1))[:n]


def make_job(plan: Plan, corpora: list[Corpus], build_src: str, build, base_src: str, base_digest: str,
             settings: AblateSettings) -> dict:
    """What a results folder was made from (DIR/job.json): finished rows are kept on a rerun only under the same job.

    The tokenized corpora belong to it: rows scored on other positions (a corpus file edited, a new chat set) would
    otherwise be paired with the new ones."""
    return {"tool": f"splicer {__version__}", "plan": plan.name, "plan_digest": plan.digest,
            "corpora_digest": _digest([c.digest() for c in corpora]),
            "build": {"source": str(build_src), "header_digest": build.header_digest()},
            "base": {"source": str(base_src), "digest": base_digest},
            "settings": {"backend": settings.backend, "device": settings.device, "batch_size": settings.batch_size,
                         "engine_args": settings.engine_args, **({"engine_env": settings.engine_env} if settings.engine_env else {}),
                         "allow_quantized_base": settings.allow_quantized_base,
                         "overlap_starts": settings.overlap_starts, "rewake_before_timing": settings.rewake_before_timing,
                         "time_decode": settings.time_decode, "corpus_overrides": settings.corpus_overrides,
                         # Rows spread over GPUs are named and compared per GPU: another spread is another job.
                         **({"gpus": list(settings.gpus)} if settings.gpus else {})}}


def new_results(job: dict, plan: Plan, corpora: list[Corpus], cache: Path, quantized: list[str], frozen: list[str],
                skipped: list[dict], settings: AblateSettings, earlier_runs: list[dict], started: str) -> dict:
    """results.json as a run starts: the base pass (read from its cache), the corpora, the rows skipped, and one entry
    per invocation that worked on this job (a resumed job has several), the rows still to come."""
    return {
        "schema": 1, "base_pass": json.loads((cache / "done.json").read_text()), "job": job,
        "plan": {"name": plan.name, "description": plan.description, "source": plan.source},
        "backend": None, "engine_version": None, "device": None,
        "inputs": {"build": job["build"], "base": job["base"]},
        "corpora": {c.name: {"kind": c.kind, "sequences": len(c.sequences), "positions": c.positions(),
                             "answer_tokens": (sum(len(s) - p for s, p in zip(c.sequences, c.prompt_lens)) if c.prompt_lens else None)}
                    for c in corpora},
        "quantized_classes": quantized, "base_quantized_classes": frozen, "noise_floor": noise_floor(cache, corpora, settings.bootstrap),
        "timing_settings": plan.timing if settings.time_decode else None,
        "bandwidth_bytes_per_s": settings.bandwidth_gbs * 1e9 if settings.bandwidth_gbs else None,
        "variants": [], "skipped": skipped,
        "runs": [*earlier_runs,
                 {"started": started, "rows_run": [], "finished": False,
                  "host": host_info(),
                  "command": " ".join(shlex.quote(a) for a in ["splicer", *sys.argv[1:]]) if _from_cli() else None}],
    }


def select_rows(plan: Plan, rows_spec: str, quantized: list[str]) -> set[str]:
    """The plan's rows `ablate ROWS` asks for ("all" or a comma list); the build and its repeats always come along."""
    names = {r.name for r in plan.rows}
    if rows_spec == "all":
        return names
    wanted = [r.strip() for r in rows_spec.split(",") if r.strip()]
    bad = [w for w in wanted if w not in names]
    if bad or not wanted:
        raise SplicerError(f"row {bad[0] if bad else '(none)'!r} is not in plan {plan.name}; its rows: {', '.join(r.name for r in plan.rows)}")
    # The build row is every other row's reference, and its repeats (more engines of it) set the decode intervals.
    return {"build", *wanted, *(r.name for r in plan.rows if r.repeat and r.restored(quantized) == [])}


class RowSchedule:
    """The folder each row runs on (the base, the build, or a splice made at the row's turn or ahead of it) and the
    engines the backend starts or compiles ahead of their turn.

    Serially each row is spliced at its turn. With --overlap-starts N every row is spliced at the start and the next N
    rows' engines are started while the current one scores, as a group: a new group starts only once every started
    engine has been timed, because decode is timed with no engine starting and a row timed behind a fresh start would
    wait for it. With --precompile every row is spliced at the start and its engine compiled while the base pass runs.
    """

    def __init__(self, run_list: list[tuple], backend, build, build_src: str, base_root: Path, base_src: str, out: Path,
                 settings: AblateSettings, compilers: list | None = None):
        self.run_list, self.backend, self.settings = run_list, backend, settings
        self.build, self.build_src, self.base_root, self.base_src, self.out = build, build_src, base_root, base_src, out
        self.prepared: dict[str, tuple[Path, float]] = {}  # row -> (folder, seconds its splice took), made ahead
        self.started_ahead: set[int] = set()
        self.ahead = backend.overlap_starts  # engines the backend can start ahead (vLLM with --overlap-starts)
        # The backends whose processes compile ahead: the base pass's own, or with --gpus every GPU's (spread.py).
        self.compilers = compilers or [backend]
        self._preparing: threading.Thread | None = None  # splices and compile queueing, beside the base pass
        self._preparing_error: BaseException | None = None
        self._cancel = threading.Event()
        self.compile_ahead = True
        # Rows spread over GPUs score and time one at a time (spread.py): a row on one GPU is measured while the others
        # at most start engines, on their own GPUs and cores. With one GPU it is never contended.
        self.measuring = threading.Lock()

    def folder(self, row, restored, splice_name) -> tuple[Path, float]:
        """The row's folder and the seconds its splice took now (0 when made ahead or not needed)."""
        if row.name in self.prepared:
            return self.prepared.pop(row.name)
        from .splice import splice

        t0 = time.perf_counter()
        if restored is None:
            folder = self.base_root
        elif not restored:
            folder = self.build.root
        else:
            folder = self.out / "variants" / splice_name
            folder.parent.mkdir(parents=True, exist_ok=True)
            if not _splice_is_current(folder, self.build, restored):
                with self.settings.stages.stage(f"{row.name}: splice {','.join(restored)}"):
                    splice(str(self.build_src), str(self.base_src), folder, ",".join(restored), force=True, progress=False,
                           allow_quantized_base=self.settings.allow_quantized_base)
        return folder, time.perf_counter() - t0

    def prepare(self, item) -> bool:
        """Splice a row ahead of its turn (kept in prepared); False if it fails: the row tries again at its turn and
        records the failure there, as without splicing ahead (one row's failure must not end the plan)."""
        try:
            self.prepared[item[0].name] = self.folder(*item)
            return True
        except Exception:
            return False

    def index(self, name: str) -> int:
        return next(k for k, r in enumerate(self.run_list) if r[0].name == name)

    def start_ahead(self, i: int) -> None:
        """Row i is loaded and timed: start the next group of engines unless one is already waiting its turn."""
        if not self.ahead or any(j > i for j in self.started_ahead):
            return
        for j in range(i + 1, min(i + 1 + self.ahead, len(self.run_list))):
            if not self.prepare(self.run_list[j]):
                continue
            if not self.backend.prefetch(self.prepared[self.run_list[j][0].name][0]):
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
                if item[0].name not in self.prepared:
                    self.prepare(item)
        # Compiling ahead hides behind the base pass; with the base pass cached (a resumed run) it would only hold up
        # the rows (run 10's second call: 61.5 s), so the rows compile their own engines then.
        self.compile_ahead = base_pending
        if any(b.precompile_slots for b in self.compilers) or self.settings.gpus:
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
                if self.prepare(item) and (folder := self.prepared[item[0].name][0]) != self.base_root and folder not in queued:
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


def run_row(row, restored, splice_name, schedule: RowSchedule, backend, cache: Path, corpora: list[Corpus], plan: Plan,
            settings: AblateSettings, out: Path, gpu: str | None = None) -> dict:
    """One row: its folder, sizes, scores against the base pass and decode timing, as its results.json entry (status
    "error" with the reason when any step fails: one variant's failure must not end the plan). gpu: the CUDA id it
    ran on, in a run spread over GPUs."""
    entry = {"name": row.name, "restored": restored if restored is not None else "base",
             **({"repeat_of": splice_name} if splice_name != row.name else {}),
             **({"gpu": gpu} if gpu is not None else {}),
             "status": "running", "elapsed": {}}
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
        folder, entry["elapsed"]["splice_s"] = schedule.folder(row, restored, splice_name)
        entry["size_bytes"] = _folder_bytes(folder)
        entry["bytes_per_decode_step"] = _bytes_per_step(folder)
        index = schedule.index(row.name) if ahead else None
        entry["timing"] = None

        def time_then_start_ahead() -> None:
            # With overlapped starts a row is timed before it scores, so that the next group's engines can start
            # while it scores; without, after scoring, as in the serial H200 run whose noise band was ±1 %.
            if settings.time_decode and plan.timing:
                t0 = time.perf_counter()
                with settings.stages.stage(f"{row.name}: timing"):
                    entry["timing"] = backend.time_decode(_timing_prompt(corpora, int(plan.timing["prompt_tokens"])),
                                                          int(plan.timing["new_tokens"]), int(plan.timing["warmup"]),
                                                          int(plan.timing["runs"]))
                entry["elapsed"]["time_s"] = time.perf_counter() - t0
            schedule.start_ahead(index)

        metrics, timings = score_variant(backend, folder, cache, corpora, plan, settings, out / "scores" / row.name,
                                         before_scoring=start_measuring)
        if not ahead:
            time_then_start_ahead()
        entry["metrics"] = metrics
        entry["engine"] = timings.pop("engine", None)
        entry["elapsed"].update(timings)
        entry["decode_ms_per_token"] = (entry["timing"] or {}).get("decode_ms_per_token")
        entry["status"] = "ok"
    except SplicerError as e:
        entry.update(status="error", error=str(e))
    except Exception as e:  # one variant's failure (engine error, OOM) must not end the plan
        entry.update(status="error", error=f"{e.__class__.__name__}: {e}", traceback=traceback.format_exc(limit=3))
    finally:
        for lock in measuring:
            lock.release()
        backend.unload()
    return entry


def run_ablate(rows_spec: str, build_src: str, base_src: str, out: Path, plan_name: str, settings: AblateSettings) -> dict:
    """`splicer ablate`: validate the inputs and DIR, resolve the plan's rows for this family, then under DIR's lock:
    the job record, the base pass (cached in DIR/cache), each row (run_row: its folder from RowSchedule, scores in
    DIR/scores/ROW, timing), results.json, table.md and report.md rewritten after every row. A rerun of the same job
    keeps the finished rows."""
    from .backends import make_backend

    build = open_checkpoint(build_src, "build")
    from .modules import list_modules
    from .validate import validate_build

    validate_build(build)
    # Before the base is read (or downloaded).
    out = check_output(out, [build.root, *local_folder(base_src)], ABLATE, own=settings.own_inputs)
    modules = list_modules(build)
    quantized = [c for c in build.arch.classes if any(m.quantized and m.cls == c for m in modules.values())]
    from .arch import all_classes

    plan = load_plan(plan_name, all_classes())  # a plan may name any family's classes; rows this one lacks are skipped
    selected = select_rows(plan, rows_spec, quantized)
    options = ({"engine_args": settings.engine_args, "log_dir": out / "logs", "cache_dir": settings.engine_cache_dir,
                "one_process": not settings.process_per_variant, "overlap_starts": settings.overlap_starts,
                "rewake_before_timing": settings.rewake_before_timing, "precompile": settings.precompile,
                "engine_env": settings.engine_env}
               if settings.backend == "vllm" else {})
    if settings.gpus and settings.backend != "vllm":
        raise SplicerError("--gpus spreads rows over GPUs with the vLLM backend; add --backend vllm or drop --gpus")
    if settings.gpus:
        spread.check_gpus(settings.gpus, settings.overlap_starts)
    # One backend per GPU with --gpus (spread.py); the first runs the base pass.
    backends = (spread.make_backends(settings, options, out / "logs") if settings.gpus
                else [make_backend(settings.backend, settings.device, **options)])
    backend = backends[0]
    base = open_checkpoint(base_src, "base")
    from .validate import validate_base

    frozen = validate_base(base, build, settings.allow_quantized_base)
    family = build.config.get("model_type") or build.arch.name
    planned, skipped = resolve_rows(plan, family, build.arch.classes, quantized, frozen)
    todo = [(p.row, p.restored, p.splice_name) for p in planned]
    if settings.gpus:  # each GPU's own engines of the build replace the plan's extra ones (spread.py); refused before DIR changes
        firsts, lasts, spread_rows, replaced = spread.gpu_build_rows(todo, settings.gpus,
                                                                     timed=bool(settings.time_decode and plan.timing))
        todo = [firsts[0], *spread_rows, *(it for it in (*firsts[1:], *lasts) if it is not None)]
        skipped += [{"name": it[0].name, "reason": spread.SPREAD_REPEAT_REASON} for it in replaced]
        selected |= {it[0].name for it in (*firsts, *lasts) if it is not None}
    skipped = [s for s in skipped if s["name"] in selected]  # a row not asked for is not reported as skipped
    inputs = [build.root, base.root]
    check_output(out, inputs, ABLATE, own=settings.own_inputs)
    base_digest = base.header_digest()
    base_root = base.root
    tok, corpora = prepare_corpora(base_root, plan, settings)
    out.mkdir(parents=True, exist_ok=True)
    busy = f"another splicer ablate is writing to {out}; wait for it to finish or use another -o"
    with exclusive(out / ".lock", busy), _closing(*backends):
        check_output(out, inputs, ABLATE, own=settings.own_inputs)  # again under the lock: DIR may have changed
        # Set per run: a settings object reused for another DIR must not keep logging into the first one's log.
        settings.stages = Stages(quiet=not settings.progress, log_path=out / "ablate.log")
        settings.stages.line(f"ablate {rows_spec} of plan {plan.name}: {build_src} against {base_src} into {out}")
        job = make_job(plan, corpora, build_src, build, base_src, base_digest, settings)
        results_path = out / RESULTS
        previous = json.loads(results_path.read_text()) if results_path.exists() else None
        if previous and (previous.get("job", {}).get("build") != job["build"] or previous.get("job", {}).get("base") != job["base"]):
            shutil.rmtree(out / "variants", ignore_errors=True)  # another build or base: every splice is stale
        same_job = previous is not None and previous.get("job") == job
        _atomic_json(out / "job.json", job)
        t_start = time.perf_counter()
        # When this invocation began (before its splices and base pass), as its elapsed_s counts from then.
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        done = {v["name"]: v for v in (previous or {}).get("variants", []) if same_job and v.get("status") == "ok"}
        if previous and not same_job and previous.get("variants"):
            settings.stages.line("the job differs from the one in DIR (inputs, plan, corpora or settings such as --gpus): "
                                 "its finished rows are run again")
        # Rows this invocation runs, in order (RowSchedule says how their splices and engines are scheduled).
        run_list = [(r, rs, sn) for r, rs, sn in todo if r.name not in done and r.name in selected]
        cache = base_cache(backend, plan, settings, out, base_digest, corpora)
        schedule = RowSchedule(run_list, backend, build, build_src, base_root, base_src, out, settings, compilers=backends)
        try:
            return _run_rows(schedule, backends, todo, run_list, done, cache, corpora, tok, plan, settings, out, base, job,
                             quantized, frozen, skipped, (previous or {}).get("runs", []) if same_job else [], started,
                             t_start, (firsts, lasts, spread_rows) if settings.gpus else None)
        except BaseException:
            schedule.cancel()  # nothing is spliced or compiled into DIR once its lock is released
            raise


def _run_rows(schedule: RowSchedule, backends: list, todo: list, run_list: list, done: dict, cache: Path, corpora, tok,
              plan: Plan, settings: AblateSettings, out: Path, base, job: dict, quantized, frozen, skipped, earlier_runs,
              started: str, t_start: float, spread_plan) -> dict:
    """run_ablate under DIR's lock, from the base pass on: the base pass (splices and compiles beside it), each row
    (serially, or with --gpus one thread per GPU), results.json, table.md and report.md after every row."""
    backend = backends[0]
    schedule.before_base_pass(base_pending=not (cache / "done.json").exists())
    with settings.stages.stage("base pass"):
        corpora = base_pass(backend, base.root, plan, settings, cache, tok, corpora, base.arch.chat_stop_tokens)
    schedule.wait_prepared()
    results = new_results(job, plan, corpora, cache, quantized, frozen, skipped, settings, earlier_runs, started)

    def finish_precompile(on_backend, gpu=None) -> None:
        # Spread over GPUs, each GPU's thread waits for its own compiling processes only.
        if on_backend.precompile_slots:
            where = f"gpu {gpu}: " if gpu is not None else ""
            with settings.stages.stage(f"{where}compiling ahead: waiting for the last engines to compile"):
                records = on_backend.finish_precompile()
            with schedule.measuring:
                results["runs"][-1].setdefault("precompiled", []).extend(records)

    if not settings.gpus:
        finish_precompile(backend)
    # Finished in an earlier run of the same job: kept, chosen or not.
    results["variants"] += [done[r.name] for r, _, _ in todo if r.name in done]
    bar = _pbar(total=len(run_list), desc="ablate", disable=not settings.progress or None)
    order = {r.name: k for k, (r, _, _) in enumerate(todo)}

    def record(item, entry: dict) -> None:
        with schedule.measuring:  # spread over GPUs: not while another row is timed
            results["variants"].append(entry)
            results["variants"].sort(key=lambda v: order.get(v["name"], len(order)))  # plan order, however finished
            settings.stages.line(f"{entry['name']}: {entry['status']}" + (f" ({entry['error']})" if entry.get("error") else "")
                                 + f", {len(results['runs'][-1]['rows_run']) + 1} of {len(run_list)} rows of this run")
            results["runs"][-1]["rows_run"].append(entry["name"])
            results["runs"][-1]["elapsed_s"] = round(time.perf_counter() - t_start, 1)
            _finish(results, out, backends, settings.bootstrap)
            bar.update(1)
        faults.point("ablate:row-done")

    def run_one(item, on_backend, gpu=None) -> dict:
        return run_row(*item, schedule, on_backend, cache, corpora, plan, settings, out, gpu=gpu)

    names = {r.name for r, _, _ in run_list}
    if spread_plan:
        firsts, lasts, spread_rows = spread_plan
        spread.run_rows_on_gpus(list(zip(settings.gpus, backends)),
                                [it if it is not None and it[0].name in names else None for it in firsts],
                                [it if it is not None and it[0].name in names else None for it in lasts],
                                [it for it in spread_rows if it[0].name in names], run_one, record,
                                before_rows=lambda on_backend, gpu: finish_precompile(on_backend, gpu))
    else:
        for item in run_list:
            record(item, run_one(item, backend))
    bar.close()
    results["elapsed_s"] = time.perf_counter() - t_start
    results["runs"][-1].update(elapsed_s=round(results["elapsed_s"], 1), finished=True)
    _finish(results, out, backends, settings.bootstrap)
    return results


def _bytes_per_step(folder: Path) -> int:
    """Weight bytes one batch-1 decode step reads (inspect's figure: routed experts count top-k of E)."""
    from .inspect import bytes_per_decode_step

    return bytes_per_decode_step(open_checkpoint(folder, "variant"))


def _splice_is_current(folder: Path, build, restored: list[str]) -> bool:
    record = folder / "splice.json"
    if not record.exists():
        return False
    r = json.loads(record.read_text())
    return r.get("build", {}).get("header_digest") == build.header_digest() and r.get("restored_classes") == restored


def _from_cli() -> bool:
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


def _finish(results: dict, out: Path, backends, reps: int = 2000) -> None:
    from .report import render_report
    from .table import render_markdown
    from .verdicts import attach

    info = backends[0].describe()
    if len(backends) > 1:  # spread over GPUs: what differs per GPU
        info["per_gpu"] = [{k: d.get(k) for k in ("cuda_device", "cpus", "precompile", "worker_starts")}
                           for d in (b.describe() for b in backends)]
    results["backend"] = info.get("backend")
    results["engine_version"] = info.get("engine")
    results["device"] = info.get("device")
    results["backend_info"] = info
    from .breakdown import time_breakdown

    results["time_breakdown"] = time_breakdown(results)
    attach(results, out, reps)
    _atomic_json(out / RESULTS, results)
    (out / "table.md").write_text(render_markdown(results) + "\n")
    (out / "report.md").write_text(render_report(results))
