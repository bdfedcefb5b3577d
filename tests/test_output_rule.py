"""The output rule as a property: whatever the command and wherever -o points, the command changes nothing outside its
own output, leaves no temporary sibling behind, and either finishes (exit 0) or refuses in one line (exit 2).

A user's world is laid out once per case: `models/` holding a build and its base, a Hub-cache copy of the build,
a folder of someone's own files, a plain file, a symlink to the build, an earlier splice and an earlier ablate run.
Every command is pointed at every kind of place; the whole tree is hashed before and after.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from splicer.cli import main

from .test_inputs_never_lost import _to_hub_cache

# Cheap to run: the smallest plan that still splices one row.
PLAN = """
name = "rule"
top_k = 5
[[corpus]]
name = "wiki-en"
kind = "builtin"
text = "wiki-en"
chunk_tokens = 16
max_chunks = 1
[[row]]
name = "build"
restore = []
[[row]]
name = "gdn"
restore = ["gdn"]
"""


def _world(pairs, root: Path) -> dict[str, Path]:
    w = {"root": root}
    models = root / "models"
    models.mkdir()
    shutil.copytree(pairs["fused"]["lowlatency"], models / "build")
    shutil.copytree(pairs["fused"]["base"], models / "base")
    w.update(models=models, build=models / "build", base=models / "base")
    w["snapshot"] = _to_hub_cache(w["build"], root / "hub", "someone/build")
    w["foreign"] = root / "papers"
    w["foreign"].mkdir()
    (w["foreign"] / "draft.md").write_text("mine")
    w["file"] = root / "notes.txt"
    w["file"].write_text("mine")
    w["link"] = root / "build-link"
    w["link"].symlink_to(w["build"])
    w["plan"] = root / "plan.toml"
    w["plan"].write_text(PLAN)
    w["old_splice"] = root / "old-splice"
    assert main(["splice", "-q", "--restore", "attention", str(w["build"]), str(w["base"]), "-o", str(w["old_splice"])]) == 0
    return w


def _snapshot(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif p.is_file():
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[rel] = "dir"
    return out


# (where -o points, relative to the world) for each command; "new" is a fresh path beside everything.
PLACES = ["new", "models", "build", "build/sub", "base", "snapshot", "hub", "foreign", "file", "link", "link/sub", "old_splice"]


def _out(w: dict, place: str) -> Path:
    if place == "new":
        return w["root"] / "out"
    if place == "hub":
        return w["root"] / "hub"
    head, _, tail = place.partition("/")
    return w[head] / tail if tail else w[head]


def _argv(command: str, w: dict, out: Path) -> list[str]:
    if command == "splice":
        return ["splice", "-q", "--restore", "gdn", str(w["build"]), str(w["base"]), "-o", str(out)]
    if command == "splice-force":
        return ["splice", "-q", "--force", "--restore", "gdn", str(w["build"]), str(w["base"]), "-o", str(out)]
    if command == "splice-from-cache":
        return ["splice", "-q", "--force", "--restore", "gdn", str(w["snapshot"]), str(w["base"]), "-o", str(out)]
    if command == "ablate":
        return [
            "ablate",
            "all",
            str(w["build"]),
            str(w["base"]),
            "-o",
            str(out),
            "-q",
            "--no-time",
            "--device",
            "cpu",
            "--plan",
            str(w["plan"]),
        ]
    if command == "fixture-force":
        return ["fixture", str(out), "--builds", "experts-g32", "--force"]
    raise AssertionError(command)


# Where each command may finish: a fresh path, or (--force) an earlier output of the same command. Everything else
# holds, is, or sits inside an input or someone's files, and must be refused.
SUCCEEDS = {
    ("splice", "new"),
    ("splice-force", "new"),
    ("splice-force", "old_splice"),
    ("splice-from-cache", "new"),
    ("splice-from-cache", "old_splice"),
    ("ablate", "new"),
    ("fixture-force", "new"),
    # models/build is no input of a splice from the cache copy: a new folder in it is just a new folder
    ("splice-from-cache", "build/sub"),
    ("splice-from-cache", "link/sub"),
}
CASES = [
    (c, p)
    for c in ("splice", "splice-force", "splice-from-cache", "ablate", "fixture-force")
    for p in PLACES
    # the fixture has no inputs: inside models/ it is just a new folder, so only the refusals are its cases
    if not (c == "fixture-force" and p in ("build/sub", "link/sub"))
]


@pytest.mark.parametrize("command,place", CASES, ids=[f"{c}->{p}" for c, p in CASES])
def test_a_command_writes_only_inside_its_own_output(pairs, tmp_path, capsys, command, place):
    w = _world(pairs, tmp_path)
    out = _out(w, place)
    before = _snapshot(tmp_path)
    code = main(_argv(command, w, out))
    err = capsys.readouterr().err
    after = _snapshot(tmp_path)
    own = str(out.resolve().relative_to(tmp_path.resolve()))  # through build-link, OUT lands in models/build
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    outside = sorted(k for k in changed if k != own and not k.startswith(own + "/"))
    assert not outside, f"{command} -o {place} changed {outside[:5]} (exit {code}: {err})"
    assert not [k for k in after if Path(k).name.startswith(".") and ".splicer-" in Path(k).name], "temporary sibling left"
    if (command, place) in SUCCEEDS:
        assert code == 0, err
    else:
        lines = [x for x in err.splitlines() if x.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith("splicer: error: "), err
        assert not changed, f"a refused {command} changed {sorted(changed)[:5]}"
