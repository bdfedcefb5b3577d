"""Generated blocks in Markdown files: figures that splicer itself printed, regenerated and compared.

A block is

    <!-- splicer:begin report . -->
    ...exactly what `splicer report DIR` prints...
    <!-- splicer:end -->

The words after `splicer:begin` are a splicer command line, of one of the read-only commands in COMMANDS; its
results folder (the first argument) is read relative to the Markdown file's own folder, so a block means the same
wherever the repository is checked out. `splicer readme-blocks FILE...` says which blocks differ from what the command
prints now; with --update it rewrites them (each file written beside and renamed). The test suite runs the check on
every results README, README.md and docs/*.md, so a figure inside a block cannot be typed by hand or go stale.

The commands run through `splicer_main` (argv -> exit status), which the caller passes: the command line itself
(cli.main), which this module serves and so does not import.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
from collections.abc import Callable
from pathlib import Path

from .errors import SplicerError

# read-only commands whose first argument is a results folder; what each prints is the block's content
COMMANDS = ("report", "table", "compare")

BEGIN = re.compile(r"^<!-- splicer:begin (?P<args>[^\n]*?) -->\n", re.M)
END = "<!-- splicer:end -->"


def blocks(text: str, where: str = "") -> list[dict]:
    """Every block of a Markdown text: its argument list and the span of its content."""
    out = []
    pos = 0
    while (m := BEGIN.search(text, pos)) is not None:
        end = text.find(END, m.end())
        nxt = BEGIN.search(text, m.end())
        line = text.count("\n", 0, m.start()) + 1
        if end < 0 or (nxt is not None and nxt.start() < end):
            raise SplicerError(f"{where}:{line}: a splicer:begin block has no {END} before the next block or the end; add it")
        try:
            args = shlex.split(m.group("args"))
        except ValueError as e:
            raise SplicerError(
                f"{where}:{line}: the block's command cannot be read ({e}); write it as on a command line"
            ) from None
        if not args or args[0] not in COMMANDS or len(args) < 2:
            raise SplicerError(
                f"{where}:{line}: block command {m.group('args')!r}: a block runs one of "
                f"{', '.join(COMMANDS)} followed by a results folder"
            )
        out.append({"args": args, "start": m.end(), "end": end, "line": line})
        pos = end + len(END)
    return out


def command_output(args: list[str], folder: Path, splicer_main: Callable[[list[str]], int]) -> str:
    """What `splicer ARGS` prints, the results folder read relative to FOLDER (the Markdown file's own)."""
    argv = [args[0], str(folder / args[1]), *args[2:]]
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        try:
            rc = splicer_main(argv)
        except SystemExit as e:  # --help or --version: argparse prints and exits
            rc = e.code if isinstance(e.code, int) and e.code else 2
            err.write("a block's command must print results, not help or a version")
    if rc != 0:
        raise SplicerError(f"splicer {shlex.join(args)} (in {folder}) failed: {err.getvalue().strip() or f'exit {rc}'}")
    return buf.getvalue()


def regenerate(text: str, folder: Path, splicer_main: Callable[[list[str]], int], where: str = "") -> str:
    """TEXT with every block's content replaced by its command's output now."""
    parts, pos = [], 0
    for b in blocks(text, where):
        parts += [text[pos : b["start"]], command_output(b["args"], folder, splicer_main)]
        pos = b["end"]
    return "".join(parts) + text[pos:]


def stale_blocks(path: Path, splicer_main: Callable[[list[str]], int]) -> list[str]:
    """One line per block of PATH whose content differs from its command's output now."""
    text = path.read_text()
    fresh = regenerate(text, path.parent, splicer_main, str(path))
    if fresh == text:
        return []
    old, new = blocks(text, str(path)), blocks(fresh, str(path))
    return [
        f"{path}:{a['line']}: block `splicer {shlex.join(a['args'])}` differs from the command's output"
        for a, b in zip(old, new)
        if text[a["start"] : a["end"]] != fresh[b["start"] : b["end"]]
    ]


def update(path: Path, splicer_main: Callable[[list[str]], int]) -> bool:
    """Rewrite PATH's blocks from their commands; True when something changed."""
    from .io.outputs import write_error

    text = path.read_text()
    fresh = regenerate(text, path.parent, splicer_main, str(path))
    if fresh == text:
        return False
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(fresh)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise (write_error(e, path.parent) or e) from None
    return True


def run(paths: list[str], write: bool, splicer_main: Callable[[list[str]], int]) -> tuple[str, int]:
    """The text `splicer readme-blocks` prints, and its exit status (1 when a block differs and --update was not given)."""
    lines, stale = [], 0
    for p in map(Path, paths):
        if not p.is_file():
            raise SplicerError(f"{p}: no such Markdown file; name files that hold splicer:begin blocks")
        n = len(blocks(p.read_text(), str(p)))
        if write:
            lines.append(f"{p}: {n} blocks, {'rewritten' if update(p, splicer_main) else 'already current'}")
        else:
            found = stale_blocks(p, splicer_main)
            stale += len(found)
            lines += found or [f"{p}: {n} blocks, current"]
    return "\n".join(lines), int(stale > 0)
