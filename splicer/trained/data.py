"""Stage 1 of the trained qwen3_5_moe: real text from four Debian packages -> text splits + a BPE tokenizer.

    python -m splicer.trained.data OUT --debs DIR

DIR holds the four .deb files (PACKAGES below). Everything is read straight out of the .deb (an ar archive holding
data.tar.*) with the standard library, so no extraction tool is needed and nothing on disk is touched but OUT.
OUT (built in a hidden sibling, then renamed into place) holds:
  train.jsonl         {"text", "source"} per line, shuffled with random.Random(0); sources en-dict, en-kernel,
                      en-python, zh, chat
  calib.jsonl         512 documents of 1-4 KB from every source, for GPTQ/AWQ calibration
  heldout/            en-dict.txt en-kernel.txt en-python.txt zh.txt, and chat.jsonl ({"text", "messages"})
  tokenizer/          byte-level BPE (tokenizers, saved by transformers) with splicer.fixtures.core.CHAT_TEMPLATE
  licences/           each package's copyright file, as shipped
  manifest.json       packages (version, licence, sha256, files used, bytes), splits, tokenizer, recipe_version

Every document goes to exactly one split, decided by the sha256 of its text: each source's documents are taken in
hash order (held-out first, then calibration, then train up to its cap), so the split never depends on file order
and the same inputs always give byte-identical outputs.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import lzma
import os
import random
import re
import shutil
import sys
import tarfile
import textwrap
import time
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path, PurePosixPath

from ..errors import SplicerError, exit_code

RECIPE_VERSION = "trained-data-1"
SOURCES = ("en-dict", "en-kernel", "en-python", "zh")  # text sources; "chat" is built from en-dict and zh items


@dataclass(frozen=True)
class Package:
    name: str
    source: str  # the text source it feeds
    licence: str  # short name, read off usr/share/doc/NAME/copyright
    licence_marker: str  # a line of that copyright file that says so (checked, so a new version cannot slip by)


PACKAGES = (
    Package("dict-gcide", "en-dict", "GPL-2+", "either version 2, or (at your option)"),
    Package("linux-doc-6.1", "en-kernel", "GPL-2", "License: GPL-2"),
    Package("python3.11-doc", "en-python", "PSF-2.0", "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2"),
    Package("fortunes-zh", "zh", "GPL-3+", "License: GPL-3.0+"),
)


@dataclass(frozen=True)
class Recipe:
    """Sizes of everything; the defaults make the real data set, tests pass tiny ones."""

    train_bytes: dict = field(
        default_factory=lambda: {
            "en-dict": 12_000_000,
            "en-kernel": 12_000_000,
            "en-python": 10_000_000,
            "zh": None,
            "chat": 4_000_000,
        }
    )
    heldout_bytes: dict = field(
        default_factory=lambda: {"en-dict": 300_000, "en-kernel": 300_000, "en-python": 300_000, "zh": 150_000}
    )
    heldout_chat: int = 300
    calib_docs: dict = field(default_factory=lambda: {"en-dict": 128, "en-kernel": 128, "en-python": 128, "zh": 64, "chat": 64})
    doc_max_bytes: int = 4000  # documents are packed from paragraphs up to this size
    calib_min_bytes: int = 1000
    calib_max_bytes: int = 4096
    vocab_size: int = 8192


@dataclass
class Doc:
    text: str
    source: str
    items: list = field(default_factory=list)  # (kind, key, answer) a chat can ask about, whole inside this text

    @property
    def nbytes(self) -> int:
        return len(self.text.encode("utf-8"))

    @property
    def sha(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def log(msg: str) -> None:
    print(f"[data] {msg}", flush=True)


# --- reading a .deb --------------------------------------------------------------------------------------------------


def find_debs(folder: Path) -> dict[str, Path]:
    folder = Path(folder)
    if not folder.is_dir():
        raise SplicerError(
            f"--debs {folder}: no such folder; make it and fetch the packages there with "
            f"`apt-get download {' '.join(p.name for p in PACKAGES)}`"
        )
    found = {}
    for pkg in PACKAGES:
        hits = sorted(folder.glob(f"{pkg.name}_*.deb"))
        if not hits:
            raise SplicerError(
                f"{folder}: no {pkg.name}_*.deb (the {pkg.name} package); fetch it into that folder "
                f"with `apt-get download {pkg.name}`"
            )
        if len(hits) > 1:
            raise SplicerError(f"{folder}: several {pkg.name} packages ({', '.join(h.name for h in hits)}); keep only one")
        found[pkg.name] = hits[0]
    return found


def ar_members(blob: bytes, path: Path) -> dict[str, bytes]:
    """The members of an ar archive (a .deb is one): 8-byte magic, then 60-byte headers, data padded to even."""
    if not blob.startswith(b"!<arch>\n"):
        raise SplicerError(f"{path}: not a Debian package (no ar header); fetch it again with apt-get download")
    out, pos = {}, 8
    while pos + 60 <= len(blob):
        head = blob[pos : pos + 60]
        name = head[:16].decode("ascii", "replace").strip().rstrip("/")
        size = int(head[48:58].decode("ascii").strip())
        out[name] = blob[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size & 1)
    return out


def _tar_bytes(members: dict[str, bytes], stem: str, path: Path) -> bytes:
    for name, data in members.items():
        if name == stem + ".tar":
            return data
        if name == stem + ".tar.xz":
            return lzma.decompress(data)
        if name == stem + ".tar.gz":
            return gzip.decompress(data)
    raise SplicerError(
        f"{path}: no {stem}.tar, {stem}.tar.xz or {stem}.tar.gz inside (members: "
        f"{', '.join(members)}); fetch the package again with apt-get download"
    )


def read_deb(path: Path, wanted) -> tuple[dict, dict[str, bytes]]:
    """(control fields, {member path: bytes} for the data members wanted(path) accepts; regular files only)."""
    members = ar_members(path.read_bytes(), path)
    control = {}
    with tarfile.open(fileobj=io.BytesIO(_tar_bytes(members, "control", path))) as tar:
        for m in tar:
            if m.isfile() and PurePosixPath(m.name).name == "control":
                text = tar.extractfile(m).read().decode("utf-8", "replace")
                for line in text.splitlines():
                    key, sep, value = line.partition(":")
                    if sep and not line[:1].isspace():
                        control[key.strip()] = value.strip()
    files = {}
    with tarfile.open(fileobj=io.BytesIO(_tar_bytes(members, "data", path))) as tar:
        for m in tar:
            name = m.name[2:] if m.name.startswith("./") else m.name
            if m.isfile() and wanted(name):
                files[name] = tar.extractfile(m).read()
    return control, files


# --- GCIDE -----------------------------------------------------------------------------------------------------------

_B64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}
# GCIDE's ASCII codes for letters it cannot type; the common ones outside pronunciations (which are dropped).
_GCIDE_CHARS = {
    "[ae]": "æ",
    "[AE]": "Æ",
    "[oe]": "œ",
    "[OE]": "Œ",
    "['e]": "é",
    "['E]": "É",
    "[`e]": "è",
    "['a]": "á",
    "[`a]": "à",
    "['o]": "ó",
    "['i]": "í",
    "['u]": "ú",
    "[aum]": "ä",
    '["a]': "ä",
    '["o]': "ö",
    '["e]': "ë",
    '["u]': "ü",
    '["i]': "ï",
    "[~n]": "ñ",
    "[,c]": "ç",
    "[^a]": "â",
    "[^e]": "ê",
    "[^i]": "î",
    "[^o]": "ô",
    "[^u]": "û",
    "[=a]": "ā",
    "[=e]": "ē",
    "[imac]": "ī",
    "[=o]": "ō",
    "[=u]": "ū",
    "[a^]": "ă",
    "[e^]": "ĕ",
    "[i^]": "ĭ",
    "[o^]": "ŏ",
    "[u^]": "ŭ",
    "[deg]": "°",
    "[sect]": "§",
    "[root]": "√",
    "[eth]": "ð",
    "[thorn]": "þ",
    "[alpha]": "α",
    "[beta]": "β",
    "[yogh]": "ȝ",
}
_GCIDE_CHAR_RE = re.compile("|".join(re.escape(k) for k in sorted(_GCIDE_CHARS, key=len, reverse=True)))
_PRON_RE = re.compile(r"\s*\\[^\\\n]*\\(\s*\([^()\n]*\))?")  # \Ab"a*cus\ ([a^]b"[.a]*k[u^]s)
_SOURCE_TAG_RE = re.compile(r"\[[^\]\n]*(Webster|WordNet|PJC|Century|RDH)[^\]\n]*\]|\[AS\]")
_SUBSENSE_RE = re.compile(r"(\(\w\)|\d+\.|Syn:) ")


def _b64(s: str) -> int:
    n = 0
    for c in s:
        n = n * 64 + _B64[c]
    return n


def gcide_entry_text(raw: str) -> tuple[str, str]:
    """(headword, plain text) of one dictd entry: pronunciations and source tags dropped, {cross refs} unbraced,
    wrapped lines of a paragraph joined (a numbered sense or (a) sub-sense starts its own line)."""
    raw = raw.replace("\ufffd", "")
    first = raw.split("\n", 1)[0]
    headword = first.split(" \\", 1)[0].strip() if " \\" in first else first.split(",", 1)[0].strip()
    text = _PRON_RE.sub("", raw)
    text = _GCIDE_CHAR_RE.sub(lambda m: _GCIDE_CHARS[m.group(0)], text).replace("{", "").replace("}", "")
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = []
        for line in block.split("\n"):
            line = _SOURCE_TAG_RE.sub("", line).strip()
            if not line:
                continue
            if lines and not _SUBSENSE_RE.match(line):
                lines[-1] += " " + line
            else:
                lines.append(line)
        if lines:
            paragraphs.append("\n".join(re.sub(r"  +", " ", x) for x in lines))
    return headword, "\n\n".join(paragraphs)


def gcide_entries(dict_dz: bytes, index: bytes) -> list[tuple[str, str]]:
    """(headword, text) per entry, in dictionary order; one pass over the index (several headwords share an
    entry), so linear in the dictionary's size."""
    data = gzip.decompress(dict_dz)  # dictzip is gzip with a seek table in the header
    spans = set()
    for line in index.decode("utf-8", "replace").splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and not parts[0].startswith("00-"):
            spans.add((_b64(parts[1]), _b64(parts[2])))
    out = []
    for off, n in sorted(spans):
        raw = data[off : off + n].decode("utf-8", "replace")
        if "GNU General Public License" in raw and "GCIDE" in raw:  # the licence preamble entries
            continue
        headword, text = gcide_entry_text(raw)
        if text:
            out.append((headword, text))
    return out


# --- fortunes, kernel docs, python docs ------------------------------------------------------------------------------

_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def fortunes(raw: bytes) -> list[str]:
    """The entries of a fortune file (separated by lines holding only %), colour codes removed."""
    text = _ANSI_RE.sub("", raw.decode("utf-8", "replace").replace("\ufffd", "")).replace("\r\n", "\n")
    text = text.replace("\xa0", " ")  # the manual sections indent with no-break spaces, as a terminal shows them
    out = []
    for item in re.split(r"(?m)^%\s*$", text):
        item = "\n".join(line.rstrip() for line in item.strip("\n").split("\n")).strip()
        if item:
            out.append(item)
    return out


_MANUAL_TITLE_RE = re.compile(r"(\d+(?:\.\d+)*)\.\s+(\S.*)")


def zh_item(kind: str, text: str) -> tuple:
    """The chat item of one fortune: the "chinese" file also carries sections of the Debian reference manual
    (titled "2.7.11. 上传软件包的是谁？", signed by its author), which a chat asks about by title rather than
    handing out as a fortune."""
    lines = text.split("\n")
    title = _MANUAL_TITLE_RE.fullmatch(lines[0].strip())
    if kind == "fortune" and title and "Debian 参考手册" in lines[-1]:
        body = "\n".join(lines[1:-1]).strip("\n")
        return ("manual", title.group(2).strip(), textwrap.dedent(body).strip())
    return (kind, None, text)


class _MainText(HTMLParser):
    """The text of a Sphinx page's main body (div role=main): block elements become paragraph breaks, <pre> keeps
    its whitespace (code kept as written), permalink marks and scripts are skipped."""

    BLOCKS = {
        "p",
        "div",
        "section",
        "h1",
        "h2",
        "h3",
        "h4",
        "h5",
        "h6",
        "pre",
        "li",
        "dt",
        "dd",
        "table",
        "tr",
        "blockquote",
        "ul",
        "ol",
        "dl",
        "hr",
        "br",
        "figure",
        "aside",
        "caption",
        "th",
    }

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.depth = 0  # open divs inside the main div (0: outside it)
        self.pre = 0
        self.skip = 0  # open elements whose text is dropped
        self.parts: list[tuple[bool, str]] = []  # (inside <pre>, text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if not self.depth:
            if tag == "div" and a.get("role") == "main":
                self.depth = 1
            return
        if tag == "div":
            self.depth += 1
        if self.skip or tag in ("script", "style") or (tag == "a" and "headerlink" in (a.get("class") or "")):
            self.skip += tag not in ("br", "hr", "img")
            return
        if tag in self.BLOCKS:
            self.parts.append((False, "\n\n" if tag not in ("br", "li", "tr") else "\n"))
        if tag == "li":
            self.parts.append((False, "- "))
        if tag == "pre":
            self.pre += 1

    def handle_endtag(self, tag):
        if not self.depth:
            return
        if self.skip:
            self.skip -= 1
        elif tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag in self.BLOCKS:
            self.parts.append((False, "\n\n"))
        if tag == "div":
            self.depth -= 1

    def handle_data(self, data):
        if self.depth and not self.skip:
            self.parts.append((bool(self.pre), data))

    def text(self) -> str:
        out, run = [], []

        def flush():
            if run:
                s = re.sub(r"[ \t\r\f\v]+", " ", re.sub(r"\s*\n\s*\n\s*", "\0", "".join(run)).replace("\n", " "))
                out.append(re.sub(r" ?\0 ?", "\n\n", s).replace(" \n", "\n").replace("\n ", "\n"))
                run.clear()

        for in_pre, s in self.parts:
            if in_pre:
                flush()
                out.append(s)
            else:
                run.append(s)
        flush()
        text = "\n".join(line.rstrip() for line in "".join(out).split("\n"))
        return re.sub(r"\n{3,}", "\n\n", text).strip()


def html_text(raw: bytes) -> str:
    parser = _MainText()
    parser.feed(raw.decode("utf-8", "replace"))
    parser.close()
    return parser.text()


# --- documents -------------------------------------------------------------------------------------------------------


def _nbytes(s: str) -> int:
    return len(s.encode("utf-8"))


def _split_long(text: str, max_bytes: int) -> list[str]:
    """Pieces of at most max_bytes, cut at line ends where there are any."""
    if _nbytes(text) <= max_bytes:
        return [text]
    pieces, cur = [], ""
    for line in text.split("\n"):
        while _nbytes(line) > max_bytes:  # one huge line: cut by characters
            cut = len(line.encode("utf-8")[:max_bytes].decode("utf-8", "ignore"))
            if cur:
                pieces.append(cur)
                cur = ""
            pieces.append(line[:cut])
            line = line[cut:]
        if cur and _nbytes(cur) + 1 + _nbytes(line) > max_bytes:
            pieces.append(cur)
            cur = line
        else:
            cur = f"{cur}\n{line}" if cur else line
    if cur:
        pieces.append(cur)
    return [p for p in pieces if p.strip()]


def pack(units, source: str, max_bytes: int) -> list[Doc]:
    """Documents of up to max_bytes packed greedily from (text, item or None) units joined by blank lines; a unit
    too big for one document is cut into pieces (and no longer offered to chats)."""
    docs, cur, size = [], None, 0
    for text, item in units:
        pieces = _split_long(text, max_bytes)
        for piece in pieces:
            n = _nbytes(piece)
            if cur is not None and size + 2 + n > max_bytes:
                docs.append(cur)
                cur = None
            if cur is None:
                cur, size = Doc(piece, source), n
            else:
                cur.text += "\n\n" + piece
                size += 2 + n
            if item is not None and len(pieces) == 1:
                cur.items.append(item)
    if cur is not None:
        docs.append(cur)
    return docs


def paragraphs(text: str) -> list[tuple[str, None]]:
    return [(p.strip("\n"), None) for p in re.split(r"\n[ \t]*\n+", text) if p.strip()]


@dataclass
class Extracted:
    docs: list  # Doc
    files_used: list  # patterns of member paths
    file_count: int
    text_bytes: int
    control: dict
    copyright: bytes


def _copyright_path(pkg: Package) -> str:
    return f"usr/share/doc/{pkg.name}/copyright"


def extract(pkg: Package, path: Path, recipe: Recipe) -> Extracted:
    copyright_path = _copyright_path(pkg)
    mx = recipe.doc_max_bytes
    if pkg.source == "en-dict":
        used = ["usr/share/dictd/gcide.dict.dz", "usr/share/dictd/gcide.index"]
        control, files = read_deb(path, lambda n: n in used or n == copyright_path)
        _need(files, used, path)
        entries = gcide_entries(files[used[0]], files[used[1]])
        docs = pack(((t, ("word", h, t)) for h, t in entries), pkg.source, mx)
        text_bytes = sum(_nbytes(t) for _, t in entries)
    elif pkg.source == "zh":
        kinds = {"chinese": "fortune", "tang300": "tang", "song100": "song"}
        used = [f"usr/share/games/fortunes/{name}" for name in kinds]
        control, files = read_deb(path, lambda n: n in used or n == copyright_path)
        _need(files, used, path)
        docs, text_bytes = [], 0
        for name, kind in kinds.items():
            items = fortunes(files[f"usr/share/games/fortunes/{name}"])
            text_bytes += sum(_nbytes(t) for t in items)
            docs += pack(((t, zh_item(kind, t)) for t in items), pkg.source, mx)
    elif pkg.source == "en-kernel":
        root = f"usr/share/doc/{pkg.name}/Documentation/"
        used = [root + "**/*.rst[.gz]", root + "**/*.txt[.gz]"]
        control, files = read_deb(
            path, lambda n: n == copyright_path or (n.startswith(root) and n.endswith((".rst", ".rst.gz", ".txt", ".txt.gz")))
        )
        docs, text_bytes = [], 0
        for name in sorted(n for n in files if n != copyright_path):
            raw = files[name]
            text = (gzip.decompress(raw) if name.endswith(".gz") else raw).decode("utf-8", "replace")
            text = text.replace("\ufffd", "").replace("\r\n", "\n")
            text_bytes += _nbytes(text)
            docs += pack(paragraphs(text), pkg.source, mx)
    elif pkg.source == "en-python":
        root = f"usr/share/doc/{pkg.name.removesuffix('-doc')}/html/"
        skip = ("genindex", "search.html", "py-modindex.html", "contents.html", "_")
        used = [root + "**/*.html (not genindex*, search, py-modindex, contents, _*/)"]
        control, files = read_deb(
            path,
            lambda n: (
                n == copyright_path
                or (
                    n.startswith(root)
                    and n.endswith(".html")
                    and not any(part.startswith(skip) for part in n[len(root) :].split("/"))
                )
            ),
        )
        docs, text_bytes = [], 0
        for name in sorted(n for n in files if n != copyright_path):
            text = html_text(files[name])
            text_bytes += _nbytes(text)
            docs += pack(paragraphs(text), pkg.source, mx)
    else:  # pragma: no cover - PACKAGES and this function go together
        raise AssertionError(pkg.source)
    if copyright_path not in files:
        raise SplicerError(
            f"{path}: no {copyright_path} inside, so its licence is unknown; fetch the package "
            f"again with `apt-get download {pkg.name}`"
        )
    count = len(files) - 1
    if count == 0:
        raise SplicerError(
            f"{path}: none of the expected text files ({', '.join(used)}) inside; is this the "
            f"{pkg.name} package? Fetch it with `apt-get download {pkg.name}`"
        )
    return Extracted(docs, used, count, text_bytes, control, files[copyright_path])


def _need(files: dict, used: list, path: Path) -> None:
    missing = [u for u in used if u not in files]
    if missing:
        raise SplicerError(f"{path}: {', '.join(missing)} missing inside; fetch the package again with apt-get download")


# --- splits ----------------------------------------------------------------------------------------------------------


def split_source(docs: list[Doc], source: str, recipe: Recipe, seen: set) -> dict[str, list[Doc]]:
    """heldout, calib, train (and unused) of one source, taking documents in sha256 order; duplicates (by text) and
    texts already placed (seen) are dropped so that no text is in two splits."""
    ordered = []
    for d in sorted(docs, key=lambda d: d.sha):
        if d.sha not in seen:
            seen.add(d.sha)
            ordered.append(d)
    out = {"heldout": [], "calib": [], "train": [], "unused": []}
    held = 0
    rest = []
    for d in ordered:
        if held < recipe.heldout_bytes[source]:
            out["heldout"].append(d)
            held += d.nbytes
        else:
            rest.append(d)
    left = []
    for d in rest:
        fits = recipe.calib_min_bytes <= d.nbytes <= recipe.calib_max_bytes
        if fits and len(out["calib"]) < recipe.calib_docs[source]:
            out["calib"].append(d)
        else:
            left.append(d)
    cap, taken = recipe.train_bytes[source], 0
    for d in left:
        if cap is None or taken + d.nbytes <= cap:
            out["train"].append(d)
            taken += d.nbytes
        else:
            out["unused"].append(d)
    return out


# --- chats -----------------------------------------------------------------------------------------------------------

QUESTIONS = {
    "word": (
        'What does the word "{w}" mean?',
        'Define "{w}".',
        'What is the meaning of "{w}"?',
        'Look up "{w}" in the dictionary.',
        'Can you give me the dictionary definition of "{w}"?',
        '英文单词 "{w}" 是什么意思？',
    ),
    "fortune": (
        "Give me a fortune.",
        "Tell me a Chinese fortune.",
        "Say something wise, in Chinese.",
        "给我一条格言。",
        "说一段有意思的话。",
    ),
    "tang": ("Tell me a Tang poem.", "Recite a poem from the Three Hundred Tang Poems.", "给我背一首唐诗。", "来一首唐诗。"),
    "manual": (
        "Debian 参考手册里“{w}”这一节说了什么？",
        'What does the Debian reference manual (in Chinese) say about "{w}"?',
        "请讲讲 Debian 参考手册中的“{w}”。",
    ),
    "song": ("Tell me a Song dynasty poem.", "Recite a Song poem for me.", "给我背一首宋诗。", "来一首宋诗。"),
}


def _chat_items(docs: list[Doc], max_answer: int) -> list[tuple]:
    out = []
    for d in docs:
        for kind, key, answer in d.items:
            if kind in ("word", "manual") and not (
                key and len(key) <= 40 and '"' not in key and (kind == "manual" or re.search(r"[A-Za-z]", key))
            ):
                continue
            if 40 <= _nbytes(answer) <= max_answer:
                out.append((kind, key, answer))
    return out


def chat_renderer():
    """Renders messages exactly as the tokenizer's chat template does (transformers compiles chat templates with
    trim_blocks and lstrip_blocks; tests check the two agree)."""
    import jinja2

    from ..fixtures.core import CHAT_TEMPLATE

    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(CHAT_TEMPLATE)
    return lambda messages: template.render(messages=messages, add_generation_prompt=False)


def make_chats(
    items: list[tuple],
    rng: random.Random,
    render,
    *,
    count: int | None = None,
    total_bytes: int | None = None,
    turns=(1,),
    min_bytes: int = 0,
    max_bytes: int | None = None,
    seen: set,
) -> list[tuple[str, list]]:
    """Conversations (rendered text, messages) asking about items, until count of them or total_bytes of text;
    each has rng.choice(turns) exchanges (more while under min_bytes), under max_bytes; dictionary words and
    Chinese texts alternate at random, and each item is used once before any is reused."""
    by_kind = {"word": [i for i in items if i[0] == "word"], "zh": [i for i in items if i[0] != "word"]}
    pools = {k: [] for k in by_kind}

    def draw(kind):
        if not pools[kind]:
            pools[kind] = list(by_kind[kind])
            rng.shuffle(pools[kind])
        return pools[kind].pop()

    kinds = [k for k in by_kind if by_kind[k]]
    out, size, attempts = [], 0, 0
    while kinds and attempts < 20 * (count or 1) + 1000 + (total_bytes or 0) // 100:
        if (count is not None and len(out) >= count) or (total_bytes is not None and size >= total_bytes):
            break
        attempts += 1
        messages, n = [], rng.choice(turns)
        while len(messages) < 2 * n or _nbytes(render(messages)) < min_bytes:
            kind, key, answer = draw(rng.choice(kinds) if len(kinds) > 1 else kinds[0])
            question = rng.choice(QUESTIONS[kind]).format(w=key)
            trial = messages + [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            if max_bytes is not None and _nbytes(render(trial)) > max_bytes:
                break
            messages = trial
        if not messages or _nbytes(render(messages)) < min_bytes:
            continue
        text = render(messages)
        sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
        if sha in seen:
            continue
        seen.add(sha)
        out.append((text, messages))
        size += _nbytes(text)
    return out


# --- tokenizer -------------------------------------------------------------------------------------------------------


def train_tokenizer(folder: Path, texts: list[str], vocab_size: int) -> None:
    """Byte-level BPE like splicer.corpora.demo_tokenizer (same special tokens, saved through transformers), trained on
    texts (train.jsonl's, in its order)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ..corpora.demo_tokenizer import SPECIAL
    from ..fixtures.core import CHAT_TEMPLATE

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    # transformers 5 keeps the template in chat_template.jinja; older loaders (and vLLM's) read tokenizer_config
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


# --- the command -----------------------------------------------------------------------------------------------------


def _jsonl(path: Path, rows) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _stats(docs) -> dict:
    return {"documents": len(docs), "bytes": sum(_nbytes(t) for t in docs)}


def build(out: Path, debs: Path, recipe: Recipe | None = None) -> dict:
    """Write the whole data folder into out (which must not exist yet); returns the manifest."""
    recipe = recipe or Recipe()
    t0 = time.time()
    paths = find_debs(debs)
    rng_seeds = {"train": 1, "calib": 2, "heldout": 3}
    extracted, packages = {}, []
    for pkg in PACKAGES:
        path = paths[pkg.name]
        log(f"reading {path.name}")
        ex = extract(pkg, path, recipe)
        if pkg.licence_marker not in ex.copyright.decode("utf-8", "replace"):
            raise SplicerError(
                f"{path}: its copyright file no longer says {pkg.licence_marker!r}, so its licence "
                f"may not be {pkg.licence}; check usr/share/doc/{pkg.name}/copyright and update "
                "PACKAGES in splicer/trained/data.py"
            )
        extracted[pkg.source] = ex
        packages.append(
            {
                "name": ex.control.get("Package", pkg.name),
                "version": ex.control.get("Version", "?"),
                "licence": pkg.licence,
                "copyright_file": _copyright_path(pkg),
                "deb": path.name,
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                "files_used": ex.files_used,
                "file_count": ex.file_count,
                "text_bytes_extracted": ex.text_bytes,
                "source": pkg.source,
            }
        )
        log(
            f"  {pkg.source}: {ex.file_count} files, {ex.text_bytes / 1e6:.1f} MB of text, {len(ex.docs)} documents "
            f"({time.time() - t0:.0f} s)"
        )

    seen: set = set()
    splits = {s: split_source(extracted[s].docs, s, recipe, seen) for s in SOURCES}
    render = chat_renderer()
    chats = {}
    for split, seed in rng_seeds.items():
        items = _chat_items([d for s in ("en-dict", "zh") for d in splits[s][split]], 1500)
        rng = random.Random(seed)
        if split == "train":
            chats[split] = make_chats(items, rng, render, total_bytes=recipe.train_bytes["chat"], turns=(1, 1, 2, 3), seen=seen)
        elif split == "calib":
            chats[split] = make_chats(
                items,
                rng,
                render,
                count=recipe.calib_docs["chat"],
                turns=(2,),
                min_bytes=recipe.calib_min_bytes,
                max_bytes=recipe.calib_max_bytes,
                seen=seen,
            )
        else:
            chats[split] = make_chats(items, rng, render, count=recipe.heldout_chat, seen=seen)
    log(f"chats: {', '.join(f'{k} {len(v)}' for k, v in chats.items())}")

    train = [{"text": d.text, "source": s} for s in SOURCES for d in splits[s]["train"]]
    train += [{"text": text, "source": "chat"} for text, _ in chats["train"]]
    random.Random(0).shuffle(train)
    calib = [{"text": d.text, "source": s} for s in SOURCES for d in splits[s]["calib"]]
    calib += [{"text": text, "source": "chat"} for text, _ in chats["calib"]]
    random.Random(0).shuffle(calib)
    heldout = {s: "\n\n".join(d.text for d in splits[s]["heldout"]) + "\n" for s in SOURCES}

    out.mkdir(parents=True)
    _jsonl(out / "train.jsonl", train)
    _jsonl(out / "calib.jsonl", calib)
    (out / "heldout").mkdir()
    for s, text in heldout.items():
        (out / "heldout" / f"{s}.txt").write_text(text, encoding="utf-8", newline="\n")
    _jsonl(out / "heldout" / "chat.jsonl", ({"text": text, "messages": m} for text, m in chats["heldout"]))
    (out / "licences").mkdir()
    for pkg in PACKAGES:
        (out / "licences" / f"{pkg.name}.copyright").write_bytes(extracted[pkg.source].copyright)
    log(
        f"wrote train.jsonl ({len(train)} documents, {sum(_nbytes(r['text']) for r in train) / 1e6:.1f} MB), "
        f"calib.jsonl ({len(calib)}), heldout/ ({time.time() - t0:.0f} s)"
    )

    log(f"training the tokenizer (vocab {recipe.vocab_size})")
    train_tokenizer(out / "tokenizer", [r["text"] for r in train], recipe.vocab_size)
    tokenizer = tokenizer_report(out / "tokenizer", heldout, [t for t, _ in chats["heldout"]])
    log(
        f"tokenizer: vocab {tokenizer['vocab_size']}, tokens/byte "
        + ", ".join(f"{k} {v:.3f}" for k, v in tokenizer["tokens_per_byte"].items())
        + f" ({time.time() - t0:.0f} s)"
    )

    manifest = {
        "recipe_version": RECIPE_VERSION,
        "packages": packages,
        "splits": {
            "train": {**{s: _stats([r["text"] for r in train if r["source"] == s]) for s in (*SOURCES, "chat")}},
            "calib": {**{s: _stats([r["text"] for r in calib if r["source"] == s]) for s in (*SOURCES, "chat")}},
            "heldout": {
                **{s: _stats([d.text for d in splits[s]["heldout"]]) for s in SOURCES},
                "chat": _stats([t for t, _ in chats["heldout"]]),
            },
        },
        "unused_documents": {s: _stats([d.text for d in splits[s]["unused"]]) for s in SOURCES},
        "tokenizer": tokenizer,
        "recipe": {
            "train_bytes": recipe.train_bytes,
            "heldout_bytes": recipe.heldout_bytes,
            "heldout_chat": recipe.heldout_chat,
            "calib_docs": recipe.calib_docs,
            "doc_max_bytes": recipe.doc_max_bytes,
            "split": "sha256 order of each document's text: "
            "held-out, then calibration (1-4 KB documents), then train up to its cap",
            "shuffle": "random.Random(0)",
        },
    }
    for pkg in packages:
        s = pkg["source"]
        pkg["document_bytes_in_splits"] = sum(manifest["splits"][k][s]["bytes"] for k in ("train", "calib", "heldout"))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return manifest


def tokenizer_report(folder: Path, heldout: dict[str, str], chat_texts: list[str]) -> dict:
    """Vocab size, tokens per UTF-8 byte of each held-out source, and that every held-out text round-trips."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    texts = {**heldout, "chat": "".join(chat_texts)}
    per_byte, round_trip = {}, {}
    for s, text in texts.items():
        ids = tok.encode(text).ids
        per_byte[s] = round(len(ids) / max(1, _nbytes(text)), 4)
        round_trip[s] = tok.decode(ids, skip_special_tokens=False) == text
    if not round_trip.get("zh", True):
        raise AssertionError("the tokenizer does not round-trip the Chinese held-out text")
    return {"vocab_size": tok.get_vocab_size(with_added_tokens=True), "tokens_per_byte": per_byte, "round_trip": round_trip}


def write(out: Path, debs: Path, recipe: Recipe | None = None, force: bool = False) -> dict:
    """build() into a hidden sibling, then rename it to out: out appears whole or not at all."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        mine = (
            out.is_dir()
            and (out / "manifest.json").is_file()
            and "recipe_version" in (out / "manifest.json").read_text(encoding="utf-8", errors="replace")
        )
        if not (force and mine):
            raise SplicerError(
                f"{out} exists; choose another OUT"
                + (" or pass --force to replace it" if mine else " (it was not written by this command, so it is never replaced)")
            )
    if not out.parent.is_dir():
        raise SplicerError(f"{out.parent}: no such folder; make it first")
    tmp = out.parent / f".{out.name}.splicer-partial"
    old = out.parent / f".{out.name}.splicer-old"
    for stale in (tmp, old):
        if stale.exists():
            shutil.rmtree(stale)
    try:
        manifest = build(tmp, debs, recipe)
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
        if old.exists():
            shutil.rmtree(old)
    return manifest


def main(argv: list[str] | None = None, recipe: Recipe | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m splicer.trained.data", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="output folder (must not exist, unless --force and made by this)")
    parser.add_argument("--debs", type=Path, required=True, help="folder holding the four .deb files")
    parser.add_argument("--force", action="store_true", help="replace an OUT this command wrote before")
    args = parser.parse_args(argv)

    def run() -> int:
        m = write(args.out, args.debs, recipe, args.force)
        summary = ", ".join(f"{s} {v['bytes'] / 1e6:.1f} MB" for s, v in m["splits"]["train"].items())
        log(f"done: {args.out} (train: {summary})")
        return 0

    return exit_code(run)


if __name__ == "__main__":
    sys.exit(main())
