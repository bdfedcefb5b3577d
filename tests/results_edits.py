"""Edits the tests make to a results folder they were given, undone after."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def with_failed_row(out: Path, name: str = "lm_head", error: str = "RuntimeError: out of memory\nat ..."):
    """DIR's results.json with one more row, whose ablate run failed (status error, a two-line error), for as long as
    the block runs: commands must name it as failed, with the first line of its error, not as a row DIR never ran."""
    path = Path(out) / "results.json"
    results = path.read_text()
    failed = {"name": name, "restored": [name], "status": "error", "error": error}
    record = json.loads(results)
    path.write_text(json.dumps(dict(record, variants=[*record["variants"], failed])))
    try:
        yield
    finally:
        path.write_text(results)
