"""Where commands write: the one rule that keeps inputs safe.

A command writes only inside its own output (OUT or DIR, and its own temporary siblings) and never deletes or
changes anything else.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import SplicerError


def check_output_path(out: Path, force: bool, inputs: list[Path]) -> None:
    out = Path(out).resolve()
    trash = out.parent / f".{out.name}.splicer-old"
    if trash.exists() and not out.exists():
        os.rename(trash, out)  # a --force run was killed between its two renames: put the old OUT back
    for p in inputs:
        p = Path(p).resolve()
        if out == p or p in out.parents:
            raise SplicerError(f"-o {out} is inside an input folder ({p}); inputs are never modified, choose another -o")
    if out.exists() and not force:
        raise SplicerError(f"{out} exists; pass --force to replace it or choose another -o")
    if not out.parent.exists():
        raise SplicerError(f"the parent folder of -o ({out.parent}) does not exist; create it first")
