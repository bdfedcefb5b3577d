"""Where commands write: the one rule that keeps inputs safe, enforced here and nowhere else.

A command writes only inside its own output (OUT or DIR) and its own temporary siblings (`.OUT.splicer-partial`,
`.OUT.splicer-old`, `.OUT.splicer-lock`), and never deletes or changes anything else:
* the output may not be an input, lie inside one, or contain one (inputs are compared by their real paths, so a
  symlink, a Hub-cache snapshot whose files live in `blobs/`, or `..` in a path does not slip past);
* an existing output is replaced (`--force`) or resumed only when splicer itself wrote it: a folder holding the
  record that command writes (`splice.json`, `job.json`, `splicer-fixture.json`) naming splicer as its tool;
  anything else is refused with one line;
* one writer per output at a time: a second run refuses with one line while the first holds the lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import SplicerError


@dataclass(frozen=True)
class OutputKind:
    command: str  # for messages: "splicer splice"
    record: str  # the file that command leaves in every output it finishes or starts
    resumable: bool  # an existing output of this kind is resumed (ablate) rather than replaced (--force)


SPLICE = OutputKind("splicer splice", "splice.json", resumable=False)
ABLATE = OutputKind("splicer ablate", "job.json", resumable=True)
FIXTURE = OutputKind("splicer fixture", "splicer-fixture.json", resumable=False)

LOCK_SUFFIX = ".splicer-lock"
OLD_SUFFIX = ".splicer-old"
PARTIAL_SUFFIX = ".splicer-partial"


def sibling(out: Path, suffix: str) -> Path:
    """A temporary sibling of OUT that belongs to it (hidden, so no loader ever picks it up)."""
    return out.parent / f".{out.name}{suffix}"


def protected_paths(roots: list[Path]) -> list[Path]:
    """The real folders an input occupies: its root, the folders its files really live in (a symlinked file counts
    where its target is), and for a Hugging Face cache snapshot the whole `models--owner--name` repo folder."""
    out: set[Path] = set()
    for root in roots:
        root = Path(root)
        real = root.resolve()
        out.add(real)
        for parent in (root.absolute(), real):
            if parent.parent.name == "snapshots" and parent.parent.parent.name.startswith(("models--", "datasets--")):
                out.add(parent.parent.parent.resolve())
        try:
            entries = list(root.iterdir())
        except OSError:
            continue
        for p in entries:
            if p.is_symlink():
                out.add(p.resolve().parent)
    return sorted(out)


def local_folder(source) -> list[Path]:
    """[the folder] when an input given as text is a local folder, else [] (a Hub id, checked once resolved)."""
    p = Path(str(source)).expanduser()
    return [p] if p.is_dir() else []


def _written_by_splicer(folder: Path, kind: OutputKind) -> bool:
    try:
        record = json.loads((folder / kind.record).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and str(record.get("tool", "")).startswith("splicer")


def check_output(
    out: Path, inputs: list[Path], kind: OutputKind, force: bool = False, recover: bool = False, own: tuple[Path, ...] = ()
) -> Path:
    """Refuse an output that would lose or change anything splicer did not write; returns OUT as an absolute path.

    Writes nothing. With recover (only while holding the output's lock), first puts back an OUT that a killed
    `--force` run had parked beside it. `own`: folders inside OUT that this same command writes and then reads
    (`ablate --demo`'s pair), which OUT may therefore hold.
    """
    out = Path(os.path.abspath(Path(out).expanduser()))
    if out.is_symlink():
        raise SplicerError(f"-o {out} is a symbolic link; pass the folder it points to, or a new path")
    if not out.parent.exists() and not kind.resumable:  # ablate creates DIR's parents, once every input is checked
        raise SplicerError(f"the parent folder of -o ({out.parent}) does not exist; create it first")
    real = out.resolve()  # the existing part of the path resolved, symlinks and .. included
    mine = [Path(o).resolve() for o in own]
    for p in protected_paths(inputs):
        if any(p == o or o in p.parents for o in mine):
            continue
        if real == p or p in real.parents:
            raise SplicerError(f"-o {out} is inside an input folder ({p}); inputs are never modified, choose another -o")
        if real in p.parents:
            raise SplicerError(
                f"-o {out} contains an input folder ({p}); an output may not hold the checkpoints it reads, choose another -o"
            )
    old = sibling(out, OLD_SUFFIX)
    if recover and old.exists() and not out.exists() and _written_by_splicer(old, kind):
        os.rename(old, out)  # a --force run was killed between its two renames: put the old OUT back
    if not out.exists():
        return out
    if not out.is_dir():
        raise SplicerError(f"-o {out} is a file; splicer writes a folder there, choose another -o")
    if kind.resumable:
        leftovers = [p.name for p in out.iterdir() if p.name != ".lock" and p.resolve() not in mine]
        if leftovers and not _written_by_splicer(out, kind):
            raise SplicerError(
                f"-o {out} holds files that {kind.command} did not write (no {kind.record}); choose a new or empty folder"
            )
        return out
    if not force:
        raise SplicerError(f"{out} exists; pass --force to replace it or choose another -o")
    if not _written_by_splicer(out, kind):
        raise SplicerError(
            f"{out} exists and is not an output of {kind.command} (no {kind.record}); --force replaces "
            "only splicer's own outputs: remove it yourself or choose another -o"
        )
    return out


def write_error(e: OSError, parent: Path) -> SplicerError | None:
    """The one-line message for an OSError met while writing under parent, when it is the user's to fix."""
    if e.errno == errno.ENOSPC:
        return SplicerError(f"no space left on the device holding {parent}; free space or choose another -o")
    if e.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
        return SplicerError(f"cannot write under {parent} ({e.strerror}); choose a writable -o")
    return None


@contextmanager
def exclusive(lock_path: Path, busy: str, in_place: bool = False):
    """Hold an exclusive lock on lock_path for the block, and remove the file afterwards.

    The file is removed while still locked; a process that opened it just before checks, once it holds the lock,
    that the path still names the file it locked, and starts over if not, so two holders can never coexist.
    A SIGKILLed holder leaves the file behind, unlocked: the next run takes it and removes it.
    in_place: the lock sits in a folder the command writes into (not a new -o): a read-only one is said so.
    """
    while True:
        try:
            fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
        except OSError as e:
            raise (cannot_write(e, lock_path) if in_place else write_error(e, lock_path.parent) or e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SplicerError(busy) from None
        held = os.fstat(fd)
        try:
            now = os.stat(lock_path)
        except FileNotFoundError:
            now = None
        if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            break
        os.close(fd)
    try:
        yield
    finally:
        try:
            os.unlink(lock_path)
        except FileNotFoundError:
            pass
        os.close(fd)


def lock_output(out: Path, kind: OutputKind):
    """The lock of one output: beside it, so that it exists before the output does and never lands inside it."""
    return exclusive(
        sibling(out, LOCK_SUFFIX), f"another {kind.command} is writing to {out}; wait for it to finish or choose another -o"
    )


def replace_dir(tmp: Path, out: Path, before_swap=None) -> None:
    """Put the finished folder tmp at out; an existing out (already checked by check_output) is replaced.

    Renames only: a run killed between the two renames leaves the old out parked beside it, and check_output puts it
    back on the next run.
    """
    if out.exists():
        old = sibling(out, OLD_SUFFIX)
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
        if before_swap:
            before_swap()
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


@contextmanager
def removed_on_refusal(out: Path):
    """A folder this command creates is removed again if the command is refused before finishing anything in it."""
    existed = out.exists()
    try:
        yield
    except SplicerError:
        if not existed and out.is_dir() and not (out / "results.json").exists():
            shutil.rmtree(out, ignore_errors=True)
        raise


def os_error_of(e: BaseException) -> OSError | None:
    """The OSError behind a failed write: e itself, or the one safetensors reports as its own SafetensorError
    ('... I/O error: No space left on device (os error 28)'); None for any other failure."""
    if isinstance(e, OSError):
        return e
    found = re.search(r"\(os error (\d+)\)", str(e)) if type(e).__name__ == "SafetensorError" else None
    return OSError(int(found.group(1)), os.strerror(int(found.group(1)))) if found else None


def cannot_write(e: OSError, path: Path) -> SplicerError:
    """The one-line message for an OSError met while writing the file `path` inside a results folder (or a plan
    file): what went wrong and the fix, naming the path."""
    if e.errno == errno.ENOSPC:
        return SplicerError(f"cannot write {path}: no space left on its device; free space there and run again")
    if e.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
        return SplicerError(
            f"cannot write {path} ({e.strerror}); copy the folder somewhere writable and run there, or ask its owner"
        )
    return SplicerError(f"cannot write {path} ({e.strerror or e.__class__.__name__}); check the folder and run again")


def write_file(path: Path, fill, tmp: Path | None = None, error=None) -> Path:
    """Put the file `path` in place whole or not at all: fill(tmp) writes a temporary beside it (by default hidden),
    which is then renamed over path. On any failure the temporary is removed (no 0-byte or partial file is left, an
    existing path is untouched); a failed write (an OSError, or safetensors' own error for one: os_error_of) becomes
    the one line error(e, path) gives, cannot_write's by default; an error that gives None is raised as it was."""
    path = Path(path)
    tmp = sibling(path, PARTIAL_SUFFIX) if tmp is None else tmp
    try:
        fill(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        failed = os_error_of(e)
        said = (error or cannot_write)(failed, path) if failed is not None else None
        if said is None:
            raise
        raise said from None
    return path


def write_json(path: Path, data) -> Path:
    """`path` as JSON, written by write_file. Strict JSON: a NaN or infinity anywhere is refused before anything is
    written (Python would write a bare NaN, which no other JSON reader accepts)."""
    try:
        text = json.dumps(data, indent=2, allow_nan=False, default=_path_text) + "\n"
    except ValueError:
        raise SplicerError(
            f"{path} was not written: a value to store in it is not a finite number (a value in the "
            "results.json it was computed from too large to compute with, such as 1e308, or else a bug in "
            "splicer: please report it with that results.json)"
        ) from None
    return write_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _path_text(o):
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"{type(o).__name__} is not JSON")


def own_inputs_inside(out: Path, roots: list[Path]) -> tuple[Path, ...]:
    """The folders directly inside OUT that hold some of `roots` and that splicer wrote as a fixture (the demo's
    pair, `DIR/demo-pair`): a run that reads them again (budget --verify on the demo's folder) passes them to
    check_output as `own`, as the run that wrote them did. Any other input inside OUT stays refused."""
    real, out_folders = Path(out).resolve(), []
    for root in roots:
        r = Path(root).resolve()
        if real in r.parents:
            top = real / r.relative_to(real).parts[0]
            if _written_by_splicer(top, FIXTURE) and top not in out_folders:
                out_folders.append(top)
    return tuple(out_folders)
