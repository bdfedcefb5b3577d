"""results/h200-fulldims/decode-median.txt, which that README cites for decode figures recomputed with splicer's
current method, is what scripts/decode_verdicts.py prints on the committed results.json files (a change to
metrics.decode_difference or engine_level shows up here, and the README's sentences must follow)."""

from __future__ import annotations

import os
from pathlib import Path

from .scripts_import import load_script

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "results" / "h200-fulldims"


def test_decode_median_file_is_what_the_script_prints():
    mod = load_script("scripts/decode_verdicts.py")
    committed = (FOLDER / "decode-median.txt").read_text()
    runs = [line for line in committed.splitlines() if line.endswith("results.json")]
    assert runs, "decode-median.txt names no results.json"
    cwd = os.getcwd()
    os.chdir(FOLDER)
    try:
        printed = "\n".join(line for r in runs for line in mod.lines(r)) + "\n"
    finally:
        os.chdir(cwd)
    assert printed == committed
