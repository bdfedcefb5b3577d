"""DIR/results.json through its one record module: a committed run loads and is rewritten byte for byte; a missing,
corrupt, foreign or newer file is one line naming the problem and the fix."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from splicer.errors import SplicerError
from splicer.io import results_record

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = sorted(p.parent for p in (ROOT / "results").rglob("results.json"))


def test_committed_runs_load_and_rewrite_byte_for_byte(tmp_path):
    assert COMMITTED, "no committed results folder found"
    for folder in COMMITTED:
        record = results_record.read(folder)
        assert record.get("schema") == results_record.SCHEMA
        results_record.write(tmp_path, record)
        assert results_record.path_of(tmp_path).read_bytes() == results_record.path_of(folder).read_bytes(), folder
        results_record.load(folder)  # the readers' checks pass on every committed run


@pytest.mark.parametrize(
    "content, words",
    [
        (None, ["does not exist", "run splicer ablate"]),
        ("{not json", ["not valid JSON", "rerun splicer ablate"]),
        ('{"rows": []}', ["no variants list"]),
        ('{"schema": 99, "variants": []}', ["schema 99", "newer", "upgrade splicer"]),
        ('{"schema": "one", "variants": []}', ["schema 'one'", "rerun splicer ablate"]),
    ],
)
def test_a_bad_file_is_one_line_with_the_fix(tmp_path, content, words):
    if content is not None:
        results_record.path_of(tmp_path).write_text(content)
    with pytest.raises(SplicerError) as e:
        results_record.load(tmp_path)
    message = str(e.value)
    assert "\n" not in message and str(tmp_path) in message
    for word in words:
        assert word in message


def test_the_table_command_refuses_a_newer_file_without_a_traceback(tmp_path):
    results_record.path_of(tmp_path).write_text(json.dumps({"schema": results_record.SCHEMA + 1, "variants": []}))
    run = subprocess.run([sys.executable, "-m", "splicer", "table", str(tmp_path)], capture_output=True, text=True)
    assert run.returncode != 0
    assert "Traceback" not in run.stderr and "upgrade splicer" in run.stderr


def test_write_is_the_writers_format(tmp_path):
    record = {"schema": 1, "variants": [{"name": "a", "path": tmp_path, "kl": float("nan")}]}
    results_record.write(tmp_path, record)
    text = results_record.path_of(tmp_path).read_text()
    assert text.endswith("}\n") and '\n  "variants": [' in text
    assert '"kl": NaN' in text and json.loads(text)["variants"][0]["path"] == str(tmp_path)
    assert not list(tmp_path.glob("*.tmp"))
