"""Corpora: named lists of token sequences, declared as data in a plan.

Kinds:
  builtin  - the demo's own texts (`text = "wiki-en" | "wiki-zh"`), shipped in the package
  text     - the user's UTF-8 text or JSONL files (`files`, `field` for JSONL), cut into chunks
  hub      - a Hub dataset (`dataset`, `config`, `split`, `field`), only when online and `datasets` is installed
  chat     - the built-in synthetic chat set; the base's greedy answers are added in the base pass
  random   - `max_chunks` sequences of `chunk_tokens` token ids drawn uniformly (seeded) from the tokenizer's
             vocabulary: for stand-ins with random weights, where text means no more than noise and the
             built-in texts are too short for 100k positions
Text corpora are cut into `chunk_tokens`-token chunks (at most `max_chunks`); every position is scored.
Chat sequences are prompt + answer; only answer positions count for dNLL.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .errors import SplicerError

KINDS = ("builtin", "text", "hub", "chat", "random")
CORPUS_KEYS = {"name", "kind", "text", "files", "field", "dataset", "config", "split", "chunk_tokens", "max_chunks",
               "conversations", "history_turns", "answer_tokens", "seed"}


@dataclass
class Corpus:
    name: str
    kind: str
    sequences: list[list[int]]
    prompt_lens: list[int] | None = None  # chat: answer tokens start here
    spec: dict = field(default_factory=dict)

    def digest(self) -> str:
        h = hashlib.sha256(json.dumps([self.name, self.sequences, self.prompt_lens]).encode())
        return h.hexdigest()[:16]

    def positions(self) -> int:
        return sum(len(s) - 1 for s in self.sequences)

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind, "sequences": self.sequences, "prompt_lens": self.prompt_lens, "spec": self.spec}

    @classmethod
    def from_json(cls, d: dict) -> "Corpus":
        return cls(d["name"], d["kind"], d["sequences"], d.get("prompt_lens"), d.get("spec", {}))


def validate_spec(spec: dict, where: str) -> None:
    unknown = sorted(set(spec) - CORPUS_KEYS)
    if unknown:
        raise SplicerError(f"{where}: unknown corpus key {unknown[0]!r}; allowed: {', '.join(sorted(CORPUS_KEYS))}")
    if not spec.get("name"):
        raise SplicerError(f"{where}: a corpus needs a name")
    if spec.get("kind") not in KINDS:
        raise SplicerError(f"{where}: corpus {spec.get('name')!r} has kind {spec.get('kind')!r}; use one of {', '.join(KINDS)}")
    if spec["kind"] == "builtin" and spec.get("text") not in ("wiki-en", "wiki-zh"):
        raise SplicerError(f"{where}: unknown built-in text {spec.get('text')!r}; use wiki-en or wiki-zh")
    if spec["kind"] == "text" and not spec.get("files"):
        raise SplicerError(f"{where}: corpus {spec['name']!r} of kind text needs files = [...]")


def _read_texts(spec: dict, base_dir: Path) -> list[str]:
    texts = []
    for f in spec["files"]:
        path = (base_dir / f) if not Path(f).is_absolute() else Path(f)
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise SplicerError(f"corpus {spec['name']!r}: cannot read {path} ({e.strerror}); check the path") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise SplicerError(f"corpus {spec['name']!r}: {path} is not UTF-8; convert it (e.g. iconv -t utf-8)") from None
        if path.suffix == ".jsonl":
            fld = spec.get("field", "text")
            for i, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    texts.append(str(json.loads(line)[fld]))
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise SplicerError(f"corpus {spec['name']!r}: {path} line {i} is not a JSON object with {fld!r}; fix the file or set field") from None
        else:
            texts.append(text)
    if not any(t.strip() for t in texts):
        raise SplicerError(f"corpus {spec['name']!r}: its files hold no text; give non-empty files")
    return texts


def _hub_texts(spec: dict) -> list[str]:
    try:
        import datasets
    except ImportError:
        raise SplicerError(f"corpus {spec['name']!r} reads a Hub dataset; pip install datasets, or use kind = \"text\" with local files") from None
    try:
        ds = datasets.load_dataset(spec["dataset"], spec.get("config"), split=spec.get("split", "train"), streaming=True)
        want = int(spec.get("max_chunks", 100)) * 4
        return [row[spec.get("field", "text")] for row, _ in zip(ds, range(want))]
    except Exception as e:  # datasets raises many types; all mean "could not get it"
        raise SplicerError(f"corpus {spec['name']!r}: could not load {spec['dataset']} ({e.__class__.__name__}); check the name or go online") from None


def _chunk(texts: list[str], tokenizer, chunk_tokens: int, max_chunks: int) -> list[list[int]]:
    chunks = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for s in range(0, len(ids) - chunk_tokens + 1, chunk_tokens):
            chunks.append(ids[s:s + chunk_tokens])
            if len(chunks) >= max_chunks:
                return chunks
    return chunks


def build_corpus(spec: dict, tokenizer, max_positions: int | None, base_dir: Path) -> Corpus:
    """Tokenize a corpus spec (chat: prompts only; answers come from the base pass)."""
    kind = spec["kind"]
    if kind == "chat":
        from .chat import conversations

        prompts = []
        for conv in conversations(int(spec.get("conversations", 8)), int(spec.get("history_turns", 4))):
            ids = tokenizer.apply_chat_template(conv, add_generation_prompt=True, enable_thinking=False, tokenize=True)
            prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        corpus = Corpus(spec["name"], kind, prompts, [len(p) for p in prompts], spec)
    elif kind == "random":
        import torch

        gen = torch.Generator().manual_seed(int(spec.get("seed", 0)))
        shape = (int(spec.get("max_chunks", 100)), int(spec.get("chunk_tokens", 1024)))
        # Ids below the special tokens' range would do too; the tokenizer's size keeps them valid for any base.
        seqs = torch.randint(0, len(tokenizer), shape, generator=gen).tolist()
        corpus = Corpus(spec["name"], kind, seqs, None, spec)
    else:
        if kind == "builtin":
            texts = [(resources.files("splicer") / "data" / f"demo_{spec['text'].replace('-', '_')}.txt").read_text(encoding="utf-8")]
        elif kind == "text":
            texts = _read_texts(spec, base_dir)
        else:
            texts = _hub_texts(spec)
        n = int(spec.get("chunk_tokens", 1024))
        seqs = _chunk(texts, tokenizer, n, int(spec.get("max_chunks", 100)))
        if not seqs:
            raise SplicerError(f"corpus {spec['name']!r} gives no chunk of {n} tokens; lower chunk_tokens or add text")
        corpus = Corpus(spec["name"], kind, seqs, None, spec)
    longest = max(len(s) for s in corpus.sequences) + (int(spec.get("answer_tokens", 32)) if kind == "chat" else 0)
    if max_positions and longest > max_positions:
        raise SplicerError(f"corpus {spec['name']!r} has sequences of {longest} tokens but the model's context is {max_positions}; lower chunk_tokens")
    return corpus
