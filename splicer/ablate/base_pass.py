"""The base pass (DIR/cache/base-KEY/): the base's chat answers, its per-position top-k and target
log-probs per corpus, and a noise pass (the base scored again exactly as a row is). Keyed by the base's digest, the
corpora and the settings; done once, read by every row and every rerun."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from ..backends import BACKENDS
from ..backends.base import kl_support
from ..corpora.core import Corpus
from ..errors import SplicerError
from ..io.outputs import write_file
from ..plans.plan import Plan
from .common import AblateRun, AblateSettings, atomic_json, parts_digest, pick_batch_size, progress_bar

FULL_VOCAB_CACHE_LIMIT = 1 << 30  # keep the base's full log-softmax only while it fits in 1 GiB


BASE_PASS_VERSION = 2  # part of the base pass's cache key: 2 = noise pass scored exactly as the rows


def _save_scores(path: Path, scores: list, extra: dict | None = None) -> None:
    tensors = {
        "topk_ids": torch.cat([s.topk_ids for s in scores]).contiguous(),
        "topk_logprobs": torch.cat([s.topk_logprobs for s in scores]).contiguous(),
        "target_logprobs": torch.cat([s.target_logprobs for s in scores]).contiguous(),
        "lengths": torch.tensor([len(s.target_logprobs) for s in scores], dtype=torch.int64),
    }
    if scores and scores[0].full is not None:
        tensors["full"] = torch.cat([s.full for s in scores]).contiguous()
    tensors.update(extra or {})
    write_tensors(path, tensors)


def write_tensors(path: Path, tensors: dict) -> None:
    """A safetensors file put in place whole (written beside, then renamed) or not at all; a full disk is one line
    naming the file (outputs.write_file)."""
    from safetensors.torch import save_file

    write_file(path, lambda tmp: save_file(tensors, str(tmp)), tmp=path.with_suffix(".tmp"))


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def base_cache(plan: Plan, settings: AblateSettings, *, backend, out: Path, base_digest: str, corpora: list[Corpus]) -> Path:
    """The folder of the base pass for these inputs and settings (done when it holds done.json)."""
    key = parts_digest(
        BASE_PASS_VERSION,
        base_digest,
        [c.digest() for c in corpora],
        [c.spec for c in corpora],
        plan.top_k,
        backend.name,
        settings.device,
        settings.batch_size,
        *settings.backend_options.cache_key(),
    )
    return out / "cache" / f"base-{key}"


def base_pass(run: AblateRun, *, cache: Path, tok, corpora: list[Corpus]) -> list[Corpus]:
    """Generate the base's chat answers and score the base (and a noise pass) once into cache (see base_cache);
    returns the corpora with the chat answers in them. An answer ends at the tokenizer's EOS or at one of the family's
    chat_stop_tokens the tokenizer knows."""
    backend, base_root, plan, settings, stages = run.backend, run.base.root, run.plan, run.settings, run.stages
    chat_stop_tokens = run.base.arch.chat_stop_tokens
    done = cache / "done.json"
    if done.exists():
        stages.line("base pass: cached")
        return [Corpus.from_json(c) for c in json.loads((cache / "corpora.json").read_text())]
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    t0 = time.perf_counter()
    with stages.stage("base pass: engine start"):
        try:
            backend.load(base_root)
        except (SplicerError, MemoryError):  # already one line (the CLI says what to do about memory)
            shutil.rmtree(cache, ignore_errors=True)
            raise
        except Exception as e:  # the engine refuses the base (an unsupported layout, out of memory): nothing can be scored
            shutil.rmtree(cache, ignore_errors=True)
            raise SplicerError(_base_refused(e, backend.name)) from None
    load_s = time.perf_counter() - t0
    engine_info = backend.load_info() or None
    # Whether the base's engine gathers exact log-probs at given ids: the noise pass is scored as every row will be
    # (the rows are held to this: rows.run_rows), and done.json records it (base_pass_kl_support).
    exact = backend.exact_gather
    unk = tok.unk_token_id
    stop = sorted(
        {
            t
            for t in (tok.eos_token_id, *(tok.convert_tokens_to_ids(s) for s in chat_stop_tokens))
            if isinstance(t, int) and t >= 0 and t != unk
        }
    )
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
        if exact:
            vocab = vocab or _vocab_size(base_root)
            want_full = c.positions() * vocab * 4 <= FULL_VOCAB_CACHE_LIMIT
        batch = pick_batch_size(settings, backend)
        with stages.stage(f"base pass: scoring {c.name} ({c.positions()} positions, then the noise pass)"):
            scores = list(
                progress_bar(
                    backend.score(c.sequences, plan.top_k, want_full=want_full, batch_size=batch),
                    total=len(c.sequences),
                    desc=f"base {c.name}",
                    disable=not settings.progress or None,
                    leave=False,
                )
            )
            _save_scores(cache / f"{c.name}.safetensors", scores)
            # Noise floor: the base scored again exactly as every row is scored (same order and batch size), so it
            # measures what the engine's own nondeterminism costs a row and nothing else (a pass batched differently
            # sat 12 % above a row holding the base's own tensors). Deterministic backends give 0.
            noise = list(
                backend.score(
                    c.sequences,
                    plan.top_k,
                    batch_size=batch,
                    gather_ids=[s.topk_ids for s in scores] if exact else None,
                    want_full=want_full,
                )
            )
            _save_scores(
                cache / f"noise-{c.name}.safetensors",
                noise,
                {"gathered": torch.cat([n.gathered for n in noise])} if exact else None,
            )
        timings[f"score_{c.name}_s"] = time.perf_counter() - t0
    backend.unload()
    (cache / "corpora.json").write_text(json.dumps([c.to_json() for c in corpora]))
    atomic_json(done, {"timings": timings, "backend": backend.describe(), "engine": engine_info, "kl_support": kl_support(exact)})
    return corpora


def base_pass_kl_support(cache: Path, corpora: list[Corpus]) -> str:
    """How the finished base pass in cache scored its noise pass, and so how the run's rows must be scored
    (backends.base.KL_EXACT or KL_OWN_TOP_K): as done.json records it, or, in a cache written before it did, as the
    noise pass's file shows (it holds `gathered` exactly when the backend gathered exact log-probs)."""
    done = json.loads((cache / "done.json").read_text())
    if done.get("kl_support"):
        return done["kl_support"]
    from safetensors import safe_open

    for c in corpora[:1]:
        with safe_open(str(cache / f"noise-{c.name}.safetensors"), "pt") as f:
            return kl_support("gathered" in f.keys())
    return kl_support(False)  # nothing was scored


def _base_refused(e: Exception, backend: str) -> str:
    """The one line for a base the backend cannot load: the engine's own reason (the first line of its error; the
    engine's log tail follows it there) and what to do, since every row is scored against the base."""
    reason = (str(e).strip().splitlines() or [""])[0]
    if not isinstance(e, RuntimeError) or not reason:  # the engines' RuntimeErrors say what failed; others need their kind
        reason = f"{e.__class__.__name__}: {reason}".rstrip(": ")
    reason = reason if len(reason) <= 400 else reason[:397] + "..."
    other = " or ".join(f"--backend {b}" for b in BACKENDS if b != backend)
    return (
        f"the base pass could not start: {reason}; every row is scored against the base, so nothing was run: make "
        f"{backend} able to load it (another version or engine settings) or use {other}"
    )


def _vocab_size(folder: Path) -> int:
    cfg = json.loads((Path(folder) / "config.json").read_text())
    return int(cfg.get("text_config", cfg)["vocab_size"])
