"""`splicer readme-blocks`: generated blocks in Markdown files are exactly what their splicer command prints."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from splicer.cli import main

from .test_reliability import small_fs  # noqa: F401  (a fixture)

DEMO = Path(__file__).resolve().parent.parent / "results" / "demo"


@pytest.fixture()
def folder(tmp_path):
    """A results folder (the committed demo's results.json) with a README holding a stale report block and a table block."""
    (tmp_path / "run").mkdir()
    shutil.copy(DEMO / "results.json", tmp_path / "run" / "results.json")
    (tmp_path / "README.md").write_text(
        "# Run\n\nWords before.\n\n<!-- splicer:begin report run -->\nhand-typed 4.21 ms\n"
        "<!-- splicer:end -->\n\nBetween.\n\n<!-- splicer:begin table run --format csv -->\n"
        "<!-- splicer:end -->\nAfter.\n"
    )
    return tmp_path


def test_update_writes_each_block_as_the_command_prints_it_and_check_then_passes(folder, capsys):
    md = folder / "README.md"
    assert main(["readme-blocks", str(md)]) == 1
    out = capsys.readouterr().out
    assert "block `splicer report run` differs" in out and "block `splicer table run --format csv` differs" in out
    assert main(["readme-blocks", "--update", str(md)]) == 0
    assert "2 blocks, rewritten" in capsys.readouterr().out
    text = md.read_text()
    assert main(["report", str(folder / "run")]) == 0
    report = capsys.readouterr().out
    assert main(["table", str(folder / "run"), "--format", "csv"]) == 0
    table = capsys.readouterr().out
    assert text == (
        "# Run\n\nWords before.\n\n<!-- splicer:begin report run -->\n" + report + "<!-- splicer:end -->\n\n"
        "Between.\n\n<!-- splicer:begin table run --format csv -->\n" + table + "<!-- splicer:end -->\nAfter.\n"
    )
    assert main(["readme-blocks", str(md)]) == 0 and "2 blocks, current" in capsys.readouterr().out
    assert main(["readme-blocks", "--update", str(md)]) == 0 and "already current" in capsys.readouterr().out
    # one changed digit inside a block is found
    md.write_text(text.replace("KL 1.", "KL 2.", 1))
    assert main(["readme-blocks", str(md)]) == 1


@pytest.mark.parametrize(
    "block, says",
    [
        ("<!-- splicer:begin report run -->\nno end\n", "has no <!-- splicer:end -->"),
        ("<!-- splicer:begin ablate all run -->\n<!-- splicer:end -->\n", "a block runs one of report, table, compare"),
        ("<!-- splicer:begin report -->\n<!-- splicer:end -->\n", "a block runs one of"),
        ("<!-- splicer:begin report 'run -->\n<!-- splicer:end -->\n", "cannot be read"),
        ("<!-- splicer:begin report missing -->\n<!-- splicer:end -->\n", "splicer report missing (in"),
        ("<!-- splicer:begin report run --help -->\n<!-- splicer:end -->\n", "must print results, not help"),
    ],
)
def test_a_bad_block_is_one_line_and_the_file_is_left_as_it_was(folder, capsys, block, says):
    md = folder / "README.md"
    md.write_text("# Run\n\n" + block)
    before = md.read_bytes()
    assert main(["readme-blocks", "--update", str(md)]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err and "Traceback" not in err
    assert md.read_bytes() == before and sorted(p.name for p in folder.iterdir()) == ["README.md", "run"]


def test_a_missing_file_is_named(tmp_path, capsys):
    assert main(["readme-blocks", str(tmp_path / "nope.md")]) == 2
    assert "nope.md: no such Markdown file" in capsys.readouterr().err


def test_a_full_disk_is_one_line_and_leaves_the_file_as_it_was(folder, small_fs, capsys):  # noqa: F811  (the fixture)
    mnt = small_fs("size=256k")
    shutil.copytree(folder / "run", mnt / "run")
    md = mnt / "README.md"
    md.write_text((folder / "README.md").read_text())
    before = md.read_bytes()
    fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)  # fill the disk: no room for the rewritten README
    try:
        while os.write(fd, b"\0" * 1024):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    assert main(["readme-blocks", "--update", str(md)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no space left" in err and "\n" not in err and "Traceback" not in err
    assert md.read_bytes() == before and sorted(p.name for p in mnt.iterdir()) == ["README.md", "filler", "run"]
