"""Multiple-choice cloze items cut from text, as an lm-evaluation-harness task that runs offline.

    python -m splicer.tasks.cloze TEXT... -o FOLDER [--name NAME] [--items N] [--context-words W] [--seed S]

Each item is a passage of W words from one of the texts, ending where a word of four letters or more follows; the
choices are that word and three others of the same texts, of about its length and not the word itself. FOLDER gets
NAME.jsonl (context, choices, label, source) and NAME.yaml, the task as lm-eval reads it (`--include-path FOLDER`):
multiple choice scored by log-likelihood, accuracy and length-normalised accuracy. Items are spaced over each text
so that no two passages overlap, and the same inputs and seed give the same items.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

from ..errors import SplicerError, exit_code

WORD = re.compile(r"[A-Za-z][A-Za-z'-]*[A-Za-z]|[A-Za-z]")
ANSWER = re.compile(r"[a-z]{4,}")  # lower-case whole words: not names, numbers or code

YAML = """\
# Written by python -m splicer.tasks.cloze: {items} multiple-choice cloze items cut from {sources}.{none}
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def items_from_texts(texts: dict[str, str], n: int, context_words: int = 48, seed: int = 0) -> list[dict]:
    """Up to n items, shared out over the texts (source name -> text) in turn."""
    rng = random.Random(seed)
    per_source = {}
    vocab: dict[int, list[str]] = {}
    for name, text in texts.items():
        spans = [(m.start(), m.group(0)) for m in WORD.finditer(text)]
        per_source[name] = (text, spans)
        for _, w in spans:
            if ANSWER.fullmatch(w):
                vocab.setdefault(len(w), []).append(w)
    vocab = {k: sorted(set(v)) for k, v in vocab.items()}
    out: list[dict] = []
    per_source = {k: v for k, v in per_source.items() if len(v[1]) > context_words}  # an empty text takes no share
    for j, (name, (text, spans)) in enumerate(per_source.items()):
        want = (n - len(out)) // (len(per_source) - j)  # what the texts before left, shared out over the rest
        i, made = context_words, 0
        step = max(context_words + 1, (len(spans) - context_words) // max(want, 1))
        while i < len(spans) and made < want:
            start, word = spans[i]
            if ANSWER.fullmatch(word):
                pool = [w for k in range(len(word) - 1, len(word) + 2) for w in vocab.get(k, []) if w != word]
                if len(set(pool)) >= 3:
                    others = rng.sample(sorted(set(pool)), 3)
                    choices = [word, *others]
                    rng.shuffle(choices)
                    context = text[spans[i - context_words][0] : start].rstrip()
                    context = " ".join(context.split())  # one line, as lm-eval joins context and choice with a space
                    out.append({"context": context, "choices": choices, "label": choices.index(word), "source": name})
                    made += 1
                    i += step
                    continue
            i += 1
    return out


def why_no_items(texts: dict[str, str], items: list[dict], context_words: int) -> dict[str, str]:
    """For each text (source name -> text) that gave no item, why: words are runs of Latin letters between spaces, so a
    text without them (Chinese, Japanese) gives none; nor does one shorter than a passage and its answer."""
    gave = {it["source"] for it in items}
    out = {}
    for name, text in texts.items():
        if name in gave:
            continue
        words = [m.group(0) for m in WORD.finditer(text)]
        if not any(ANSWER.fullmatch(w) for w in words):
            out[name] = "no words of four letters or more separated by spaces"
        elif len(words) <= context_words:
            out[name] = f"{len(words)} words, fewer than a passage of {context_words} and its answer"
        else:
            out[name] = "no passage of it ended where an item could be cut, or --items left it no share"
    return out


def write_task(
    folder: Path, name: str, items: list[dict], sources: list[str], none: dict[str, str] | None = None
) -> tuple[Path, Path]:
    """FOLDER/NAME.jsonl and FOLDER/NAME.yaml (the data file named by its absolute path, which lm-eval needs); sources:
    the files the items came from, none: the files given that gave none, with why (named in the YAML's header)."""
    from ..io.outputs import write_file

    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):
        raise SplicerError(f"--name {name!r}: a task name is letters, digits, '.', '_' and '-'")
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SplicerError(
            f"-o {folder}: cannot make that folder ({e.strerror or e.__class__.__name__}); give a folder path"
        ) from None
    data, yaml = folder / f"{name}.jsonl", folder / f"{name}.yaml"
    text = "".join(json.dumps(it, ensure_ascii=False) + "\n" for it in items)
    write_file(data, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    gave_none = "".join(f"\n# None from {src}: {why}." for src, why in (none or {}).items())
    body = YAML.format(
        name=name, data=json.dumps(str(data.resolve())), items=len(items), sources=", ".join(sources), none=gave_none
    )
    write_file(yaml, lambda tmp: tmp.write_text(body, encoding="utf-8"))
    return data, yaml


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m splicer.tasks.cloze", description=__doc__.split("\n\n")[0])
    p.add_argument("texts", nargs="+", metavar="TEXT", type=Path, help="text files (UTF-8); each one's stem names its items")
    p.add_argument("-o", "--out", required=True, type=Path, help="folder for NAME.jsonl and NAME.yaml")
    p.add_argument("--name", default="cloze", help="the task's name (default cloze)")
    p.add_argument("--items", type=int, default=200, help="items in all (default 200)")
    p.add_argument("--context-words", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    def run() -> int:
        texts, paths = {}, {}
        if len({t.resolve() for t in args.texts}) != len(args.texts):
            raise SplicerError("the same text is given twice; give each file once")
        for t in args.texts:
            try:
                text = t.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise SplicerError(f"cannot read {t} ({e.__class__.__name__}); give UTF-8 text files") from None
            name, k = t.stem, 2
            while name in texts:  # two files of one stem (a/notes.txt, b/notes.txt) stay two sources
                name, k = f"{t.stem}-{k}", k + 1
            texts[name], paths[name] = text, str(t)
        if args.items < 1 or args.context_words < 1:
            raise SplicerError("--items and --context-words must be 1 or more")
        items = items_from_texts(texts, args.items, args.context_words, args.seed)
        none = {paths[n]: why for n, why in why_no_items(texts, items, args.context_words).items()}
        given_none = ", ".join(f"{p} ({why})" for p, why in none.items())
        if not items:
            raise SplicerError(
                f"no cloze item could be cut from {given_none}; the items are cloze items of words separated by spaces, "
                "as in English"
            )
        gave = [paths[n] for n in dict.fromkeys(it["source"] for it in items)]
        data, yaml = write_task(args.out, args.name, items, gave, none)
        short = f" (of {args.items} asked: the texts hold no more passages of that length)" if len(items) < args.items else ""
        print(
            f"wrote {yaml} and {data}: {len(items)} items{short}"
            + (f"; none from {given_none}" if none else "")
            + f"; run them with --tasks {args.name} --include-path {args.out}"
        )
        return 0

    return exit_code(run)


if __name__ == "__main__":
    sys.exit(main())
