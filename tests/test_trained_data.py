"""splicer.trained.data on tiny fake Debian packages: the output layout, disjoint splits, byte-identical reruns,
the chat text matching the tokenizer's own template, GCIDE/HTML clean-up, and the one-line error for a missing
package."""

from __future__ import annotations

import gzip
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from splicer.trained import data as D

B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
ZH = "春眠不觉晓处处闻啼鸟夜来风雨声花落知多少白日依山尽黄河入海流欲穷千里目更上一层楼"


def _b64(n: int) -> str:
    s = ""
    while True:
        s = B64[n % 64] + s
        n //= 64
        if not n:
            return s


def _tar_xz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo("./" + name)
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def write_deb(path: Path, name: str, version: str, files: dict[str, bytes]) -> None:
    """A .deb as dpkg-deb makes one: an ar archive of debian-binary, control.tar.xz and data.tar.xz."""
    control = f"Package: {name}\nVersion: {version}\nArchitecture: all\nDescription: fake\n".encode()
    members = [("debian-binary", b"2.0\n"), ("control.tar.xz", _tar_xz({"control": control})), ("data.tar.xz", _tar_xz(files))]
    out = bytearray(b"!<arch>\n")
    for member, data in members:
        out += f"{member:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode()
        out += data + (b"\n" if len(data) % 2 else b"")
    path.write_bytes(bytes(out))


def fake_debs(folder: Path) -> Path:
    folder.mkdir()
    entries, index, pos = [], [], 0
    for i in range(80):
        word = f"Word{i:02d}x"
        entry = (
            f'{word} \\{word}"ish\\ (w[=o]rd), n. [AS. word{i}]\n   1. A thing numbered {i}; see {{Other{i}}}.\n'
            f"      [1913 Webster]\n\n   2. Something more about item {i}, a caf['e] of the {{sort}}\n"
            "      that wraps onto a second line.\n      [WordNet 1.5]\n\n"
        )
        data = entry.encode()
        entries.append(data)
        index.append(f"{word}\t{_b64(pos)}\t{_b64(len(data))}\n")
        pos += len(data)
    write_deb(
        folder / "dict-gcide_0.1_all.deb",
        "dict-gcide",
        "0.1",
        {
            "usr/share/dictd/gcide.dict.dz": gzip.compress(b"".join(entries), mtime=0),
            "usr/share/dictd/gcide.index": "".join(index).encode(),
            "usr/share/doc/dict-gcide/copyright": b"GPL, either version 2, or (at your option) any later version\n",
        },
    )
    fortunes = {}
    for name, n in (("chinese", 40), ("tang300", 25), ("song100", 15)):
        items = [
            f"\x1b[32m《{name}{i}》\x1b[m\n{ZH[i % 20 : i % 20 + 12]}，{ZH[(i * 7) % 30 : (i * 7) % 30 + 10]}。{i}"
            for i in range(n)
        ]
        fortunes[f"usr/share/games/fortunes/{name}"] = ("\n%\n".join(items) + "\n%\n").encode()
    fortunes["usr/share/games/fortunes/chinese"] += (
        "1.4.2. 定制bash\n\n    你可以通过“~/.bashrc”来定制bash。\n\n"
        "    -- Osamu Aoki (青木修), Debian 参考手册（版本 2.73）\n%\n"
    ).encode()
    fortunes["usr/share/doc/fortunes-zh/copyright"] = b"License: GPL-3.0+\n"
    write_deb(folder / "fortunes-zh_0.2_all.deb", "fortunes-zh", "0.2", fortunes)
    rst = "\n\n".join(
        f"Section {i}\n==========\n\nThe kernel paragraph {i} explains device {i * 3} and its "
        f"driver, with enough words to make a paragraph of text."
        for i in range(60)
    )
    write_deb(
        folder / "linux-doc-6.1_0.3_all.deb",
        "linux-doc-6.1",
        "0.3",
        {
            "usr/share/doc/linux-doc-6.1/Documentation/a/intro.rst.gz": gzip.compress(rst.encode(), mtime=0),
            "usr/share/doc/linux-doc-6.1/Documentation/b/notes.txt": rst.replace("kernel", "notes").encode(),
            "usr/share/doc/linux-doc-6.1/copyright": b"Files: *\nLicense: GPL-2\n",
        },
    )
    body = "".join(
        f'<section><h2>Topic {i}<a class="headerlink" href="#t{i}">\u00b6</a></h2><p>The '
        f"<code>mod{i}</code> module &amp; friends do thing {i}.\n Wrapped text.</p>"
        f'<div class="highlight"><pre>def f{i}(x):\n    return x + {i}\n</pre></div></section>'
        for i in range(40)
    )
    page = (
        f'<html><head><script>var x = 1;</script></head><body><div class="related">nav junk</div>'
        f'<div class="body" role="main">{body}</div><div class="footer">footer junk</div></body></html>'
    )
    write_deb(
        folder / "python3.11-doc_0.4_all.deb",
        "python3.11-doc",
        "0.4",
        {
            "usr/share/doc/python3.11/html/library/mod.html": page.encode(),
            "usr/share/doc/python3.11/html/genindex-A.html": b'<div role="main"><p>INDEXJUNK</p></div>',
            "usr/share/doc/python3.11-doc/copyright": b"PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2\n",
        },
    )
    return folder


TINY = D.Recipe(
    train_bytes={"en-dict": 4000, "en-kernel": 3000, "en-python": 2500, "zh": None, "chat": 3000},
    heldout_bytes={"en-dict": 600, "en-kernel": 600, "en-python": 600, "zh": 400},
    heldout_chat=6,
    calib_docs={"en-dict": 3, "en-kernel": 3, "en-python": 3, "zh": 2, "chat": 2},
    doc_max_bytes=400,
    calib_min_bytes=100,
    calib_max_bytes=1200,
    vocab_size=400,
)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained-data")
    debs = fake_debs(root / "debs")
    for name in ("a", "b"):
        assert D.main([str(root / name), "--debs", str(debs)], recipe=TINY) == 0
    return root


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_layout_and_manifest(built):
    out = built / "a"
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    for need in (
        "train.jsonl",
        "calib.jsonl",
        "manifest.json",
        "heldout/chat.jsonl",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
        *(f"heldout/{s}.txt" for s in D.SOURCES),
    ):
        assert need in names
    train = _jsonl(out / "train.jsonl")
    assert {r["source"] for r in train} == {*D.SOURCES, "chat"}
    assert all(set(r) == {"text", "source"} for r in train)
    calib = _jsonl(out / "calib.jsonl")
    assert len(calib) == sum(TINY.calib_docs.values())
    assert all(TINY.calib_min_bytes <= len(r["text"].encode()) <= TINY.calib_max_bytes for r in calib)
    m = json.loads((out / "manifest.json").read_text())
    assert m["recipe_version"] == D.RECIPE_VERSION
    assert [p["version"] for p in m["packages"]] == ["0.1", "0.3", "0.4", "0.2"]
    assert {p["name"]: p["licence"] for p in m["packages"]}["fortunes-zh"] == "GPL-3+"
    assert m["splits"]["train"]["en-dict"]["bytes"] <= 4000 and m["splits"]["calib"]["chat"]["documents"] == 2
    assert m["tokenizer"]["vocab_size"] == TINY.vocab_size and m["tokenizer"]["round_trip"]["zh"]
    assert len(_jsonl(out / "heldout" / "chat.jsonl")) == TINY.heldout_chat


def test_splits_are_disjoint(built):
    out = built / "a"
    train = {r["text"] for r in _jsonl(out / "train.jsonl")}
    calib = {r["text"] for r in _jsonl(out / "calib.jsonl")}
    held_chat = {r["text"] for r in _jsonl(out / "heldout" / "chat.jsonl")}
    held = "".join((out / "heldout" / f"{s}.txt").read_text(encoding="utf-8") for s in D.SOURCES)
    assert not train & calib and not held_chat & (train | calib)
    assert not any(t in held for t in train | calib)
    assert all(len(t) > 0 for t in train)


def test_reruns_are_byte_identical(built):
    a, b = built / "a", built / "b"
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_chat_matches_the_tokenizers_template_and_chinese_round_trips(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(built / "a" / "tokenizer"))
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and len(tok) == TINY.vocab_size
    rows = _jsonl(built / "a" / "heldout" / "chat.jsonl")
    for row in rows:
        assert tok.apply_chat_template(row["messages"], tokenize=False) == row["text"]
    zh = (built / "a" / "heldout" / "zh.txt").read_text(encoding="utf-8")
    assert tok.decode(tok.encode(zh, add_special_tokens=False)) == zh
    config = json.loads((built / "a" / "tokenizer" / "tokenizer_config.json").read_text())
    from splicer.fixtures.core import CHAT_TEMPLATE

    assert config["chat_template"] == CHAT_TEMPLATE


def test_text_is_clean(built):
    out = built / "a"
    by_source = {}
    for r in _jsonl(out / "train.jsonl") + _jsonl(out / "calib.jsonl"):
        by_source.setdefault(r["source"], []).append(r["text"])
    words = "\n".join(by_source["en-dict"])
    assert "Webster" not in words and "{" not in words and '"ish' not in words and "café" in words
    assert "n. [AS. word" in words and "\n2. Something more" in words and "sort that wraps" in words
    python = "\n".join(by_source["en-python"])
    assert "    return x +" in python  # code keeps its indentation
    assert not any(junk in python for junk in ("nav junk", "footer junk", "INDEXJUNK", "var x", "\u00b6", "&amp;"))
    assert "mod1 module & friends" in python
    assert "\x1b" not in "\n".join(by_source["zh"])
    chats = "\n".join(by_source["chat"])
    assert "<|im_start|>user\n" in chats and "<|im_end|>\n<|im_start|>assistant\n" in chats


def test_manual_sections_are_asked_by_title():
    item = D.zh_item(
        "fortune", "1.4.2. 定制bash\n\n    你可以定制bash。\n\n    -- Osamu Aoki (青木修), Debian 参考手册（版本 2.73）"
    )
    assert item == ("manual", "定制bash", "你可以定制bash。")


def test_missing_package_is_one_line_and_leaves_nothing(tmp_path):
    debs = tmp_path / "debs"
    debs.mkdir()
    (debs / "dict-gcide_0.1_all.deb").write_bytes(b"!<arch>\n")
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "splicer.trained.data", str(out), "--debs", str(debs)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert "linux-doc-6.1" in lines[0] and "apt-get download linux-doc-6.1" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["debs"]
