"""Every figure a reader sees in a results README, README.md or docs/*.md is tied to raw data a test can read.

1. Generated blocks (`splicer.readme_blocks`): `<!-- splicer:begin report . -->` ... `<!-- splicer:end -->` holds exactly
   what that splicer command prints on the folder's committed data; the test regenerates every block and compares byte
   for byte. `splicer readme-blocks --update FILE...` rewrites them after a change to report or table.
2. A number outside blocks must match a raw value in a source cited in its own unit (a list item, table row or
   paragraph) or in the paragraph that leads its list or table (the nearest plain paragraph above it in the section):
   a backticked file of the folder, `results.json`, optionally narrowed to a JSON key path (`results.json:runs.*.elapsed_s`,
   `*` any key or entry, a name selects the entry of a list with that "name"), or a Markdown link to a file or
   results folder (a folder: its raw files, and only where no file is cited beside it). A number with no source in
   scope fails, whatever the folder holds.
   README.md and docs/*.md: units that cite a results folder or file are checked so; other numbers there are the
   tool's own settings (95 % intervals, top-20), not measurements.
   A folder's HISTORY.md (a run history moved out of its README) is checked the same way. LEGACY files (run histories
   written before this check) are still checked only against every raw file of their folder (the old rule); they are
   listed below. Markdown outside results/ (scripts/gpu/README.md, docs/) is instructions, never a source.
   README.md and HISTORY.md are prose: never a raw source within their own folder (not for themselves, not for each
   other); README.md and docs/*.md may cite a results folder's README or history, itself checked.

A README number with d decimals matches a raw value v when v rounds to it at d decimals (|v - x| <= half a unit of its
last digit): "4.34" matches 4.3449, "241" matches 241.0 but not 246. For a percentage (a "%" follows the number or the
range it ends) v * 100 is tried as well: "48.9 %" matches 0.489.
A number written with an explicit sign (+, −) must match the raw value with its sign; other numbers match |v|.
"102,400" is read as 102400. Raw numbers are read from the text the same way (thousands separators included).

Not checked (the only exemptions):
  * fenced code blocks, inline `code`, HTML comments and link targets: commands, paths, hashes, placeholders;
  * dates (2026-11-30) and clock times (12:34:56);
  * version strings: x.y.z with any suffix (0.26.0, 2.11.0+cu130, 580.159.04), and a number right after a software
    name (vLLM 0.26, transformers 5.17, Python 3.11, ...);
  * labels, a number right after one of: run(s), Run(s), issue(s), seed(s), call(s), Call(s), # ("run 1", "runs 1–3",
    "Run 3", "seed 000", "call 2", "build #1");
  * digits that are part of a name (adjacent to a letter or "_": H200, INT4, g128, Qwen3.6, x86_64, 6th; joined by a
    hyphen to a word: gdn-1, top-1, build-verify-1), layer lists after "@" (gdn@0-2,4-6), bracketed labels ([1]),
    labels after point(s), group(s), layer(s), session(s), "4-bit", and the null in "includes 0" / "excludes 0".

What the citation rule buys is measured by test_mutations_are_caught: every number's last digit changed, and seven
made-up sentences inserted, in each checked README. On the READMEs of this commit the new rules let 90 of 767 digit
changes and 2 of 42 made-up sentences pass, the old rule (a number anywhere in the folder's raw files) 362 of 767 and
15 of 42; on the READMEs before this change the old rule let 1,219 of 1,659 digit changes pass. What still passes: a
changed number that equals another value of the cited file (small whole numbers, neighbouring values in one table), and
a sentence whose numbers are all in the cited data but whose verdict is not; those still need reading, or a key path.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parent.parent / "results"
RAW_SUFFIXES = {".json", ".csv", ".txt", ".log", ".md"}

SOFTWARE = r"(?:vLLM|vllm|torch|Python|python|transformers|compressed-tensors|safetensors|driver|pip)"
LABELS = r"(?:\b(?:[Rr]uns?|issues?|seeds?|[Cc]alls?|[Pp]oints?|[Gg]roups?|[Ll]ayers?|[Ss]essions?)|#)"
_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
# a README number: optional sign, digits (thousands separators allowed), not part of a name or a longer token
README_NUM = re.compile(r"(?<![\w.,/])([+−±]|(?<![\w)])-(?=\d))?(" + _NUM + r")(?![\w]|\.\d|,\d{3})")
RAW_NUM = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?")
# what may sit between a number and the unit of the range it belongs to ("−12 … +15 %", "0.4–0.9 ms")
_RANGE_TAIL = r"(?:\s*(?:–|-|…|to|and|,|/|\+|−|±|\d|\.|\s)*)"
PERCENT_AFTER = re.compile(_RANGE_TAIL + r"\s*%")


def _strip(text: str) -> str:
    """The prose and tables of a README, without what the module docstring exempts (replaced by spaces)."""
    blank = lambda m: re.sub(r"[^\n]", " ", m.group(0))  # noqa: E731  keep line numbers
    text = re.sub(r"```.*?```", blank, text, flags=re.S)
    text = re.sub(r"<!--.*?-->", blank, text, flags=re.S)
    text = re.sub(r"`(?:[^`\n]|\n(?![ \t]*\n))*`", blank, text)  # inline code may wrap a line, not a paragraph
    text = re.sub(r"\]\([^)\s]*\)", blank, text)
    text = re.sub(r"https?://\S+", blank, text)
    text = re.sub(r"\b\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2})?Z?)?\b", blank, text)
    text = re.sub(r"\b\d{1,2}:\d{2}(?::\d{2})?\b", blank, text)
    text = re.sub(r"\b\d+\.\d+\.\d+[\w.+-]*", blank, text)
    text = re.sub(r"\b" + SOFTWARE + r" \d+(?:\.\d+)*", blank, text)
    text = re.sub(LABELS + r"[ ]?\d+(?:[ ]?(?:–|-|and|,)[ ]?\d+)*\b", blank, text)
    text = re.sub(r"@[\w,.-]+|\[\d+\]|\b[A-Za-z_]+(?:-[A-Za-z_]+)*-\d+\b", blank, text)  # gdn@0-9, [1], gdn-1, top-1
    text = re.sub(r"\b\d+-bit\b", blank, text)  # 4-bit, 8-bit: a format's name
    text = re.sub(r"\b(?:include|exclude)s? 0\b", blank, text)  # "the interval includes 0": the null, not a figure
    text = re.sub(r"(?m)^[ \t]*\d+\.(?=\s)", blank, text)  # ordered-list item numbers
    return text


def readme_numbers(text: str) -> list[dict]:
    """Every checked number of a README: value, decimals, signed, unit scales to try, line and context."""
    stripped = _strip(text)
    out = []
    for m in README_NUM.finditer(stripped):
        sign, digits = m.group(1) or "", m.group(2)
        value = float(digits.replace(",", ""))
        if sign in ("−", "-"):
            value = -value
        decimals = len(digits.split(".")[1]) if "." in digits else 0
        after = stripped[m.end() : m.end() + 60]
        scales = [1.0]
        if PERCENT_AFTER.match(after):
            scales.append(100.0)
        line = stripped.count("\n", 0, m.start()) + 1
        ctx = text.splitlines()[line - 1].strip()
        out.append(
            {
                "text": sign + digits,
                "value": value,
                "decimals": decimals,
                "signed": sign in ("+", "−", "-"),
                "scales": scales,
                "line": line,
                "context": ctx[:160],
                "end": m.end(2),
            }
        )
    return out


class RawValues:
    """The numbers of a folder's raw files, sorted, with and without sign, for lookups by rounding."""

    def __init__(self, texts):
        vals = set()
        for t in texts:
            for s in RAW_NUM.findall(t):
                try:
                    v = float(s.replace(",", ""))
                except ValueError:
                    continue
                if math.isfinite(v):
                    vals.add(v)
        self.signed = sorted(vals)
        self.unsigned = sorted({abs(v) for v in vals})

    def has(self, n: dict) -> bool:
        half = 0.5 * 10 ** (-n["decimals"]) * (1 + 1e-9) + 1e-12
        arr = self.signed if n["signed"] else self.unsigned
        x = n["value"] if n["signed"] else abs(n["value"])
        for s in n["scales"]:
            lo, hi = (x - half) / s, (x + half) / s
            i = bisect.bisect_left(arr, lo - 1e-12 * max(1.0, abs(lo)))
            if i < len(arr) and arr[i] <= hi + 1e-12 * max(1.0, abs(hi)):
                return True
        return False


PROSE = {"README.md", "HISTORY.md"}  # written about the data, not data: never a source for a figure


def is_raw(p: Path) -> bool:
    return p.is_file() and p.suffix in RAW_SUFFIXES and p.name not in PROSE


def raw_texts(folder: Path) -> list[str]:
    return [p.read_text(errors="replace") for p in sorted(folder.rglob("*")) if is_raw(p)]


def missing_numbers(readme_text: str, raw: list[str]) -> list[dict]:
    """The old rule, kept for LEGACY folders: numbers in none of the folder's raw files."""
    values = RawValues(raw)
    return [n for n in readme_numbers(readme_text) if not values.has(n)]


ROOT = RESULTS.parent
READMES = sorted(RESULTS.glob("*/README.md"))
HISTORIES = sorted(RESULTS.glob("*/HISTORY.md"))
CHECKED = READMES + HISTORIES
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Run histories written before the citation rule (folder/file under results/): still checked against every raw file
# of their folder.
LEGACY = {"h200-fulldims/HISTORY.md"}


def _name(md: Path) -> str:
    return md.relative_to(RESULTS).as_posix()


BLOCK = re.compile(r"<!-- splicer:begin .*?<!-- splicer:end -->", re.S)
CITE = re.compile(r"`([\w./*-]+\.(?:json|csv|txt|log|md))(?::([\w.*-]+))?`|\]\(([^)\s#]+)(?:#[^)\s]*)?\)")
LIST_OR_ROW = re.compile(r"(?:[-*+]|\d+\.)\s|\|")


def blank_blocks(text: str) -> str:
    """TEXT with every generated block's content replaced by spaces (line numbers kept)."""
    return BLOCK.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def units(text: str) -> list[list[int]]:
    """[first line, last line] of each unit: a list item, table row, heading or paragraph, with its continuation lines."""
    out, cur = [], None
    for i, line in enumerate(text.split("\n"), 1):
        s = line.strip()
        if not s:
            cur = None
        elif cur is None or LIST_OR_ROW.match(s) or s.startswith("#"):
            cur = [i, i]
            out.append(cur)
            if s.startswith("#"):
                cur = None  # a heading is one line
        else:
            cur[1] = i
    return out


def _json_under(data, path: str):
    nodes = [data]
    for key in path.split("."):
        nxt = []
        for n in nodes:
            if key == "*":
                nxt += list(n.values()) if isinstance(n, dict) else list(n) if isinstance(n, list) else []
            elif isinstance(n, dict) and key in n:
                nxt.append(n[key])
            elif isinstance(n, list):
                nxt += (
                    [n[int(key)]]
                    if key.isdigit() and int(key) < len(n)
                    else [e for e in n if isinstance(e, dict) and e.get("name") == key]
                )
        nodes = nxt
    return nodes


def _resolve(md: Path, target: str) -> Path | None:
    for base in (md.parent, ROOT):
        p = (base / target).resolve()
        if p.exists():
            return p
    return None


def cited_text(md: Path, target: str, key: str | None) -> str | None:
    """The raw text a citation names (a key path: the values under it), None when it names nothing readable."""
    if "*" in target:
        texts = [cited_text(md, str(p.relative_to(md.parent)), key) for p in sorted(md.parent.glob(target))]
        return "\n".join(t for t in texts if t is not None) or None
    p = _resolve(md, target)
    if p is None:
        return None
    if p.is_dir():
        return "\n".join(raw_texts(p))
    if p.suffix not in RAW_SUFFIXES or (p.name in PROSE and p.parent == md.resolve().parent):
        return None  # a README or history is no source for itself or its folder's other prose (docs may cite one)
    if p.suffix == ".md" and (ROOT / "results").resolve() not in p.parents:
        return None  # instructions and docs outside results/ (scripts/gpu/README.md): prose, no raw data
    text = p.read_text(errors="replace")
    if key:
        try:
            found = _json_under(json.loads(text), key)
        except ValueError:
            return None
        return json.dumps(found) if found else None
    return text


def _scope(lines: list[str], us: list[list[int]], line: int) -> str:
    """The text whose citations a number on LINE may use: its unit and the paragraph leading its list or table."""
    i = next(k for k, u in enumerate(us) if u[0] <= line <= u[1])
    parts = ["\n".join(lines[us[i][0] - 1 : us[i][1]])]
    if not LIST_OR_ROW.match(lines[us[i][0] - 1].strip()):
        return parts[0]  # a paragraph stands on its own citations
    for u in reversed(us[:i]):
        first = lines[u[0] - 1].strip()
        if first.startswith("#"):
            break
        if not LIST_OR_ROW.match(first):
            parts.append("\n".join(lines[u[0] - 1 : u[1]]))
            break
    return "\n".join(parts)


_CITED: dict = {}  # (file, citations) -> RawValues: the committed files do not change during a test session


def _tied(md: Path, lines: list[str], us: list[list[int]], n: dict, docs: bool) -> tuple[bool, list]:
    """Whether number N matches a raw value of a source cited in its scope, and those citations (docs: a unit citing
    nothing under results/ is not checked, and counts as tied)."""
    scope = _scope(lines, us, n["line"])
    cites = [(m.group(1) or m.group(3), m.group(2)) for m in CITE.finditer(scope)]
    if docs:
        cites = [c for c in cites if "results/" in c[0]]
        if not cites:
            return True, cites
    # A folder (all its raw files) is a source only where nothing more precise is cited beside it.
    files = [c for c in cites if "*" in c[0] or (_resolve(md, c[0]) or md.parent).is_file()]
    cites = files or cites
    key = (md, tuple(cites))
    if key not in _CITED:
        texts = [t for t in (cited_text(md, *c) for c in cites) if t is not None]
        _CITED[key] = RawValues(texts) if texts else None
    return _CITED[key] is not None and _CITED[key].has(n), cites


def uncited_numbers(md: Path, text: str, docs: bool = False) -> list[dict]:
    """Numbers outside generated blocks that match no raw value of a source cited in their scope (docs: only numbers
    in a unit that cites something under results/)."""
    lines, us, out = text.split("\n"), units(text), []
    for n in readme_numbers(blank_blocks(text)):
        ok, cites = _tied(md, lines, us, n, docs)
        if not ok:
            out.append({**n, "cited": [c[0] + (f":{c[1]}" if c[1] else "") for c in cites]})
    return out


def _listing(found: list[dict]) -> str:
    return "\n".join(
        f"  line {n['line']}: {n['text']}  cited: {', '.join(n['cited']) or 'nothing'}  ({n['context']})" for n in found
    )


@pytest.mark.parametrize("md", CHECKED + DOCS, ids=[str(p.relative_to(ROOT)) for p in CHECKED + DOCS])
def test_every_generated_block_is_what_its_command_prints(md):
    from splicer.cli import main
    from splicer.readme_blocks import stale_blocks

    stale = stale_blocks(md, main)
    assert not stale, "\n".join(stale) + "\n(run: splicer readme-blocks --update FILE)"


@pytest.mark.parametrize("readme", CHECKED, ids=[_name(p) for p in CHECKED])
def test_every_readme_number_is_in_a_cited_raw_file(readme):
    text = readme.read_text()
    if _name(readme) in LEGACY:
        missing = missing_numbers(text, raw_texts(readme.parent))
        assert not missing, f"{len(missing)} numbers of {readme.relative_to(ROOT)} are in none of its raw files:\n" + "\n".join(
            f"  line {n['line']}: {n['text']}  ({n['context']})" for n in missing
        )
        return
    found = uncited_numbers(readme, text)
    assert not found, (
        f"{len(found)} numbers of {readme.relative_to(ROOT)} outside generated blocks match no raw value "
        f"of a source cited beside them (cite the file, or move the figure into a block):\n" + _listing(found)
    )


@pytest.mark.parametrize("md", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_docs_figures_match_the_results_they_cite(md):
    found = uncited_numbers(md, md.read_text(), docs=True)
    assert not found, f"{len(found)} numbers of {md.relative_to(ROOT)} match nothing in the results they cite:\n" + _listing(
        found
    )


# What the rules catch: every number of the checked READMEs with its last digit changed, and made-up sentences.


def _made_up(folder: Path) -> list[str]:
    """Made-up sentences in the README's own style, each citing the folder's largest raw file: five with invented
    figures, and two whose figures are real raw values of the folder that the cited file does not hold (a number that
    "matches some unrelated raw value", which the old rule let pass)."""
    raws = sorted((p for p in folder.rglob("*") if is_raw(p)), key=lambda p: (p.stat().st_size, str(p)))
    f = raws[-1].relative_to(folder).as_posix()
    cited = RawValues([raws[-1].read_text(errors="replace")])
    elsewhere = [
        v
        for v in RawValues([p.read_text(errors="replace") for p in raws[:-1]]).unsigned
        if 1 < v < 1e4 and not cited.has({"value": round(v, 2), "decimals": 2, "signed": False, "scales": [1.0]})
    ]
    a, b = (elsewhere[len(elsewhere) // 3], elsewhere[2 * len(elsewhere) // 3]) if len(elsewhere) > 2 else (7.31, 8.42)
    return [
        "The build decoded at 4.217 ms/token on its second engine, 0.61 % slower than on its first.",
        f"Restoring attention lowered KL by 3.4 % of the build's [−4.1, −2.7] (`{f}`).",
        f"- The rows took 612 s in all, the base pass 187.3 s of it (`{f}`).",
        f"From `{f}`:\n\n| row | KL | top-1 |\n|---|---|---|\n| extra | 0.2231 | 51.2 % |",
        f"Each engine started in 47 to 83 s and loaded its weights in 21.6 s (`{f}`).",
        f"The slowest row decoded at {a:.2f} ms/token (`{f}`).",
        f"- Its engine took {b:.2f} s to start (`{f}`).",
    ]


def mutation_rates(readmes: list[Path]) -> dict:
    """Share of last-digit changes and of made-up sentences each rule lets pass: the citation rule with generated
    blocks (new) and the old rule (a number anywhere in the folder's raw files)."""
    from splicer.readme_blocks import blocks

    digits = {"new": 0, "old": 0, "n": 0}
    sentences = {"new": 0, "old": 0, "n": 0}
    for md in readmes:
        text = md.read_text()
        spans = [(b["start"], b["end"]) for b in blocks(text, str(md))]  # the blocks are current (tested above)
        old_raw = RawValues(raw_texts(md.parent))
        lines, us = text.split("\n"), units(text)
        for n in readme_numbers(text):
            d = n["end"] - 1
            token = n["text"][:-1] + str((int(n["text"][-1]) + 1) % 10)
            value = float(token.lstrip("+−±-").replace(",", ""))
            m = dict(n, text=token, value=-value if n["value"] < 0 else value)  # the number with its last digit changed
            inside = any(a <= d < b for a, b in spans)
            digits["n"] += 1
            # a change inside a block differs from the command's output byte for byte; outside, the citation rule
            digits["new"] += (not inside) and _tied(md, lines, us, m, False)[0]
            digits["old"] += old_raw.has(m)
        for sentence in _made_up(md.parent):
            added = text.rstrip("\n") + "\n\n" + sentence + "\n"
            sentences["n"] += 1
            sentences["new"] += not uncited_numbers(md, added)
            sentences["old"] += all(old_raw.has(x) for x in readme_numbers(sentence))
    return {"digits": digits, "sentences": sentences}


def test_mutations_are_caught():
    checked = [p for p in CHECKED if _name(p) not in LEGACY]
    r = mutation_rates(checked)
    d, s = r["digits"], r["sentences"]
    report = (
        f"last-digit changes passing: new {d['new']}/{d['n']}, old {d['old']}/{d['n']}; "
        f"made-up sentences passing: new {s['new']}/{s['n']}, old {s['old']}/{s['n']}"
    )
    assert d["n"] > 200 and s["n"] == 7 * len(checked), report
    assert d["new"] <= 0.12 * d["n"] and d["old"] >= 3 * d["new"], report
    assert s["new"] <= 0.05 * s["n"], report
    print(report)


def test_there_are_results_readmes():
    assert len(READMES) >= 4 and len(set(_name(p) for p in READMES) - LEGACY) >= 4
    assert set(LEGACY) <= set(_name(p) for p in CHECKED), "a LEGACY entry names no README.md or HISTORY.md"


def test_every_moved_history_is_checked():
    """Text moved out of a README into HISTORY.md keeps its figures under a rule, and in no folder is a source."""
    assert HISTORIES, "results/h200-fulldims/HISTORY.md holds that folder's run history"
    assert sorted(RESULTS.rglob("HISTORY.md")) == HISTORIES


# the checker itself


def _nums(text):
    return [n["text"] for n in readme_numbers(text)]


def test_checker_finds_a_made_up_number():
    raw = ['{"decode_ms": 4.344, "wall_s": 241.0, "kl": 0.18384, "top1": 0.489, "positions": 107146}']
    good = "Decode 4.34 ms/token, wall 241 s, KL 0.1838, top-1 48.9 %, 107,146 positions."
    assert missing_numbers(good, raw) == []
    bad = "Decode 4.34 ms/token in 246 s (+1.81 %)."
    assert [n["text"] for n in missing_numbers(bad, raw)] == ["246", "+1.81"]


def test_checker_rounding_sign_and_percent():
    raw = ['{"d": -0.0184, "t": 4.09, "n": 12}', "wall 1,500 tokens"]
    assert missing_numbers("−1.84 % and 1.84 %", raw) == []  # ×100, unsigned matches |v|
    assert [n["text"] for n in missing_numbers("+1.84 %", raw)] == ["+1.84"]  # an explicit sign must match
    assert [n["text"] for n in missing_numbers("1.84 s", raw)] == ["1.84"]  # ×100 only for percentages
    assert missing_numbers("4.09 ms, 4.1 ms, 1,500 and 1500 tokens", raw) == []  # fewer decimals, separators
    assert [n["text"] for n in missing_numbers("4.10 ms", raw)] == ["4.10"]  # 4.09 is not 4.10
    assert [n["text"] for n in missing_numbers("12 s or 13 s", raw)] == ["13"]
    assert [n["text"] for n in missing_numbers("−12 … +15 %", raw)] == ["−12", "+15"]


def test_checker_exemptions():
    text = (
        "# Run 3\nvLLM 0.26.0, torch 2.11.0+cu130, vLLM 0.31, transformers 5.17, on 2026-11-30 at 12:00, commit `7549721`.\n"
        "Runs 1–3, seed 000, call 2, build #1, H200, INT4 g128, Qwen3.6-35B-A3B, x86_64, the 6th test.\n"
        "```bash\nsplicer ablate --reps 99\n```\n[a link](https://example.com/42)\n<!-- run 4 goes here -->\n"
    )
    assert _nums(text) == []
    assert _nums("1,500-token prompt, 5.7–7.7 s, ±0.98 %, (−12 … +15 %), 3-D") == [
        "1,500",
        "5.7",
        "7.7",
        "±0.98",
        "−12",
        "+15",
        "3",
    ]


def test_checker_reads_a_folder_recursively_without_its_readme(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "results.json").write_text('{"elapsed_s": 241.02}')
    (tmp_path / "logs" / "engine.log").write_text("Loading weights took 24.70 seconds")
    (tmp_path / "notes.toml").write_text("wall = 246")  # not a raw suffix
    (tmp_path / "README.md").write_text("241 s in all, weights 24.7 s; 246 s was hand-typed.\n")
    missing = missing_numbers((tmp_path / "README.md").read_text(), raw_texts(tmp_path))
    assert [(n["text"], n["line"]) for n in missing] == [("246", 1)]


def test_a_history_is_no_source_for_its_readme_nor_for_itself(tmp_path):
    (tmp_path / "results.json").write_text('{"elapsed_s": 241.02}')
    (tmp_path / "HISTORY.md").write_text("Run 1 took 241 s; the base pass 187 s.\n")
    readme = tmp_path / "README.md"
    readme.write_text("The run took 241 s, the base pass 187 s ([HISTORY.md](HISTORY.md), `results.json`).\n")
    assert [n["text"] for n in missing_numbers((tmp_path / "HISTORY.md").read_text(), raw_texts(tmp_path))] == ["187"]
    assert [n["text"] for n in uncited_numbers(readme, readme.read_text())] == ["187"]
    readme.write_text("The base pass took 187 s ([HISTORY.md](HISTORY.md)).\n")
    assert [n["text"] for n in uncited_numbers(readme, readme.read_text())] == ["187"]


def test_instructions_outside_results_are_no_source(tmp_path):
    """A results README citing the GPU scripts' README (instructions, with figures of earlier runs in prose) cannot tie
    a number to it; the same number in a cited raw file can."""
    text = (ROOT / "scripts" / "gpu" / "README.md").read_text()
    assert " 176 s" in text  # a figure that prose holds
    (tmp_path / "results.json").write_text('{"init_s": 176.2}')
    readme = tmp_path / "README.md"
    readme.write_text("The base engine started in 176 s (`scripts/gpu/README.md`).\n")
    assert [n["text"] for n in uncited_numbers(readme, readme.read_text())] == ["176"]
    readme.write_text("The base engine started in 176 s (`scripts/gpu/README.md`, `results.json`).\n")
    assert uncited_numbers(readme, readme.read_text()) == []
