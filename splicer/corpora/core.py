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
Chat sequences are prompt + answer; only answer positions count for dNLL. Chat conversations come in groups that share
a prompt (chat.py); the corpus records each one's group, and intervals resample whole groups.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ..errors import SplicerError
from ..io.config_schema import MISSING, check_value, describe, expect
from .chat import HISTORY_TURNS, user_turns

KINDS = ("builtin", "text", "hub", "chat", "random")
CORPUS_KEYS = {
    "name",
    "kind",
    "text",
    "files",
    "field",
    "dataset",
    "config",
    "split",
    "chunk_tokens",
    "max_chunks",
    "conversations",
    "history_turns",
    "answer_tokens",
    "seed",
}


@dataclass
class Corpus:
    name: str
    kind: str
    sequences: list[list[int]]
    prompt_lens: list[int] | None = None  # chat: answer tokens start here
    spec: dict = field(default_factory=dict)
    # chat: each sequence's group (sequences that share a prompt and so their effect; chat.py); intervals resample
    # whole groups. None: every sequence is its own unit.
    groups: list[int] | None = None

    def digest(self) -> str:
        h = hashlib.sha256(
            json.dumps([self.name, self.sequences, self.prompt_lens, *([self.groups] if self.groups else [])]).encode()
        )
        return h.hexdigest()[:16]

    def positions(self) -> int:
        return sum(len(s) - 1 for s in self.sequences)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "sequences": self.sequences,
            "prompt_lens": self.prompt_lens,
            "spec": self.spec,
            **({"groups": self.groups} if self.groups is not None else {}),
        }

    @classmethod
    def from_json(cls, d: dict) -> Corpus:
        return cls(d["name"], d["kind"], d["sequences"], d.get("prompt_lens"), d.get("spec", {}), d.get("groups"))


CORPUS_FIX = "fix the plan file"
# Caps keep a typo from asking for more than any run could score (the random kind allocates its ids up front).
MAX_CHUNK_TOKENS = 1 << 20
MAX_RANDOM_TOKENS = 1 << 24
CORPUS_FIELDS = {
    "name": expect("str", required=True),
    "kind": expect("str", required=True, choices=KINDS),
    "text": expect("str"),
    "files": expect("list", items="str"),
    "field": expect("str"),
    "dataset": expect("str"),
    "config": expect("str|null"),
    "split": expect("str"),
    "chunk_tokens": expect("int", lo=2, hi=MAX_CHUNK_TOKENS),  # one token scores no position
    "max_chunks": expect("int", lo=1, hi=1 << 20),
    "conversations": expect("int", lo=1, hi=1 << 20),
    "history_turns": expect("int", lo=0, hi=HISTORY_TURNS),
    "answer_tokens": expect("int", lo=1, hi=1 << 16),
    "seed": expect("int", lo=0, hi=2**63 - 1),
}


# Names become folder and file names under DIR (variants/<row>, scores/<row>/<corpus>.safetensors): plain names only,
# never a path (`../x`), a hidden file or something a shell would mangle.
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,99}")


def check_name(name, where: str, what: str) -> None:
    check_value(expect("str", required=True), name, where, what, CORPUS_FIX)
    if not SAFE_NAME.fullmatch(name):
        raise SplicerError(
            f"{where}: {what} {name[:40]!r} is not a plain name (letters, digits, _ . + -, at most 100, "
            f"not starting with . or -); it names files under DIR, {CORPUS_FIX}"
        )


def validate_spec(spec: dict, where: str) -> None:
    unknown = sorted(set(spec) - CORPUS_KEYS)
    if unknown:
        raise SplicerError(f"{where}: unknown corpus key {unknown[0]!r}; allowed: {', '.join(sorted(CORPUS_KEYS))}")
    check_name(spec.get("name", MISSING), where, "a corpus's name")
    name = spec["name"]
    for key, f in CORPUS_FIELDS.items():
        check_value(f, spec.get(key, MISSING), where, f"corpus {name!r}: {key}", CORPUS_FIX)
    kind = spec["kind"]
    if kind == "builtin" and spec.get("text") not in ("wiki-en", "wiki-zh"):
        raise SplicerError(f"{where}: unknown built-in text {str(spec.get('text'))[:40]!r}; use wiki-en or wiki-zh")
    if kind == "text" and not spec.get("files"):
        raise SplicerError(f"{where}: corpus {name!r} of kind text needs files = [...]")
    if kind == "text" and any(not f or "\x00" in f for f in spec["files"]):
        raise SplicerError(f"{where}: corpus {name!r} has an empty file name or one with a NUL byte; {CORPUS_FIX}")
    if kind == "hub" and not spec.get("dataset"):
        raise SplicerError(f'{where}: corpus {name!r} of kind hub needs dataset = "owner/name"')
    if kind == "random":
        total = spec.get("max_chunks", 100) * spec.get("chunk_tokens", 1024)
        if total > MAX_RANDOM_TOKENS:
            raise SplicerError(
                f"{where}: corpus {name!r} asks for {total} random tokens (max_chunks x chunk_tokens), more than "
                f"{MAX_RANDOM_TOKENS}; lower max_chunks or chunk_tokens"
            )
    if kind == "chat":
        try:
            user_turns(spec.get("conversations", 8))
        except ValueError as e:  # the built-in set has a fixed number of user turns
            raise SplicerError(f"{where}: corpus {name!r}: conversations = {spec.get('conversations', 8)}, but {e}") from None


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
                    record = json.loads(line)
                except (json.JSONDecodeError, RecursionError):
                    record = None
                if not isinstance(record, dict) or fld not in record:
                    raise SplicerError(
                        f"corpus {spec['name']!r}: {path} line {i} is not a JSON object with {fld!r}; fix the file or set field"
                    )
                # str() of a number or a list would score its Python repr as if it were text.
                if not isinstance(record[fld], str):
                    raise SplicerError(
                        f"corpus {spec['name']!r}: {path} line {i}: {fld!r} is {describe(record[fld])}, not a "
                        "string of text; fix the file or set field to the text's key"
                    )
                if not _is_unicode(record[fld]):  # a JSON escape of half a surrogate pair: no tokenizer takes it
                    raise SplicerError(
                        f"corpus {spec['name']!r}: {path} line {i}: {fld!r} holds an unpaired surrogate "
                        "(\\ud800-\\udfff escape); fix the file"
                    )
                texts.append(record[fld])
        else:
            texts.append(text)
    if not any(t.strip() for t in texts):
        raise SplicerError(f"corpus {spec['name']!r}: its files hold no text; give non-empty files")
    return texts


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def hub_unreachable() -> str | None:
    """Why this process cannot read a Hub dataset, or None when it may (whether the network answers shows only when
    one is read). Said before a run starts: a plan's Hub corpus is otherwise read after the engine and the base load."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var}={os.environ[var]} is set"
    if "datasets" in sys.modules:  # imported already (or marked absent: None)
        installed = sys.modules["datasets"] is not None
    else:
        installed = importlib.util.find_spec("datasets") is not None
    if not installed:
        return "the datasets package is not installed (pip install datasets)"
    return None


def check_hub_corpora(specs: list[dict], where: str, instead: str) -> None:
    """Refuse, in one line, corpus specs of kind hub when hub_unreachable() says they cannot be read; instead: what to
    pass in their place."""
    hub = [s for s in specs if s.get("kind") == "hub"]
    why = hub_unreachable() if hub else None
    if why:
        names = ", ".join(f"{s['name']} ({s['dataset']})" for s in hub)
        raise SplicerError(
            f"{where} reads {'a corpus' if len(hub) == 1 else 'corpora'} from the Hub, {names}, but {why}; {instead}"
        )


def _hub_texts(spec: dict) -> list[str]:
    try:
        import datasets
    except ImportError:
        raise SplicerError(
            f'corpus {spec["name"]!r} reads a Hub dataset; pip install datasets, or use kind = "text" with local files'
        ) from None
    fld = spec.get("field", "text")
    try:
        ds = datasets.load_dataset(spec["dataset"], spec.get("config"), split=spec.get("split", "train"), streaming=True)
        want = int(spec.get("max_chunks", 100)) * 4
        rows = [row.get(fld, MISSING) for row, _ in zip(ds, range(want))]
    except Exception as e:  # datasets raises many types; all mean "could not get it"
        raise SplicerError(
            f"corpus {spec['name']!r}: could not load {spec['dataset']} ({e.__class__.__name__}); check the name or go online"
        ) from None
    bad = next((i for i, t in enumerate(rows) if not (isinstance(t, str) and _is_unicode(t))), None)
    if bad is not None:  # str() of anything else would score its Python repr as if it were text
        raise SplicerError(
            f"corpus {spec['name']!r}: row {bad} of {spec['dataset']} has no string field {fld!r}; set field to the text column"
        )
    return rows


def _chunk(texts: list[str], tokenizer, chunk_tokens: int, max_chunks: int) -> list[list[int]]:
    chunks = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for s in range(0, len(ids) - chunk_tokens + 1, chunk_tokens):
            chunks.append(ids[s : s + chunk_tokens])
            if len(chunks) >= max_chunks:
                return chunks
    return chunks


def build_corpus(spec: dict, tokenizer, max_positions: int | None, base_dir: Path) -> Corpus:
    """Tokenize a corpus spec (chat: prompts only; answers come from the base pass)."""
    kind = spec["kind"]
    if kind == "chat":
        from .chat import conversations, group

        prompts = []
        for conv in conversations(int(spec.get("conversations", 8)), int(spec.get("history_turns", 4))):
            ids = tokenizer.apply_chat_template(conv, add_generation_prompt=True, enable_thinking=False, tokenize=True)
            prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        corpus = Corpus(spec["name"], kind, prompts, [len(p) for p in prompts], spec, [group(i) for i in range(len(prompts))])
    elif kind == "random":
        import torch

        gen = torch.Generator().manual_seed(int(spec.get("seed", 0)))
        shape = (int(spec.get("max_chunks", 100)), int(spec.get("chunk_tokens", 1024)))
        # Ids below the special tokens' range would do too; the tokenizer's size keeps them valid for any base.
        seqs = torch.randint(0, len(tokenizer), shape, generator=gen).tolist()
        corpus = Corpus(spec["name"], kind, seqs, None, spec)
    else:
        if kind == "builtin":
            texts = [
                (resources.files("splicer") / "data" / f"demo_{spec['text'].replace('-', '_')}.txt").read_text(encoding="utf-8")
            ]
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
        raise SplicerError(
            f"corpus {spec['name']!r} has sequences of {longest} tokens but the model's context is {max_positions}; lower chunk_tokens"
        )
    return corpus
