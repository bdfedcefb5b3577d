"""Inputs are never lost: what a command may write, and what it must leave alone.

Each case comes from a new user's report: `--force` over the folder holding the inputs, Hub-cache checkpoints whose
files are symlinks, two splices to one OUT at once, index shard names that lead out of the folder, `ablate -o BUILD`,
base weights in another float dtype, leftovers after success or refusal, and the progress a log shows.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from splicer.cli import main

from .conftest import tree_digest
from .test_ablate import PLAN

ROOT = Path(__file__).parents[1]


def _cli(*args, env=None, **kw):
    e = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "splicer", *map(str, args)], capture_output=True, text=True, env=e, **kw)


def _tree(folder: Path) -> dict:
    """Every entry under folder: file bytes, and for a symlink its target (a link re-pointed is a change too)."""
    out = tree_digest(folder)
    for p in Path(folder).rglob("*"):
        if p.is_symlink():
            out[f"{p.relative_to(folder)} ->"] = os.readlink(p)
    return out


def _refused(args, capsys, fragment: str) -> str:
    code = main([str(a) for a in args])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("splicer: error: ") and fragment in lines[0], err
    return lines[0]


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.view(torch.uint8) if a.dtype.is_floating_point else a, b.view(torch.uint8) if b.dtype.is_floating_point else b
        )
    )


@pytest.fixture
def models_dir(pairs, tmp_path):
    """`~/models` with a build and its base in it, as a user keeps them."""
    root = tmp_path / "models"
    root.mkdir()
    shutil.copytree(pairs["fused"]["lowlatency"], root / "build")
    shutil.copytree(pairs["fused"]["base"], root / "base")
    return root


# ---------------------------------------------------------------- OUT is, is inside, or holds an input


def test_force_over_the_folder_holding_the_inputs_is_refused(models_dir, capsys):
    before = _tree(models_dir)
    for extra in ([], ["--force"]):
        _refused(
            ["splice", "--restore", "gdn", models_dir / "build", models_dir / "base", "-o", models_dir, *extra],
            capsys,
            "contains an input folder",
        )
    assert _tree(models_dir) == before


def test_force_over_an_input_itself_is_refused(models_dir, capsys):
    before = _tree(models_dir)
    _refused(
        ["splice", "--restore", "gdn", models_dir / "build", models_dir / "base", "-o", models_dir / "base", "--force"],
        capsys,
        "inside an input folder",
    )
    assert _tree(models_dir) == before


def test_force_over_a_folder_splicer_did_not_write_is_refused(pairs, tmp_path, capsys):
    p = pairs["fused"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    _refused(
        ["splice", "--restore", "gdn", p["lowlatency"], p["base"], "-o", mine, "--force"],
        capsys,
        "not an output of splicer splice",
    )
    assert (mine / "notes.txt").read_text() == "keep"
    afile = tmp_path / "afile"
    afile.write_text("keep")
    _refused(["splice", "--restore", "gdn", p["lowlatency"], p["base"], "-o", afile, "--force"], capsys, "is a file")
    assert afile.read_text() == "keep" and sorted(x.name for x in tmp_path.iterdir()) == ["afile", "mine"]


def test_force_replaces_an_earlier_splice_and_leaves_nothing_beside_it(pairs, tmp_path, capsys):
    p = pairs["fused"]
    out = tmp_path / "out"
    assert main(["splice", "-q", "--restore", "attention", str(p["lowlatency"]), str(p["base"]), "-o", str(out)]) == 0
    assert main(["splice", "-q", "--force", "--restore", "gdn", str(p["lowlatency"]), str(p["base"]), "-o", str(out)]) == 0
    assert json.loads((out / "splice.json").read_text())["restored_classes"] == ["gdn"]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out"]  # no lock, no .splicer-old, no partial folder


def test_out_through_a_symlink_to_an_input_is_refused(models_dir, tmp_path, capsys):
    link = tmp_path / "link"
    link.symlink_to(models_dir / "build")
    before = _tree(models_dir)
    _refused(
        ["splice", "--restore", "gdn", models_dir / "build", models_dir / "base", "-o", link / "x"],
        capsys,
        "inside an input folder",
    )
    _refused(
        ["splice", "--restore", "gdn", models_dir / "build", models_dir / "base", "-o", link, "--force"], capsys, "symbolic link"
    )
    assert _tree(models_dir) == before


def test_ablate_into_or_around_an_input_is_refused(models_dir, tmp_path, capsys):
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    before = _tree(models_dir)
    for out, fragment in (
        (models_dir / "build", "inside an input folder"),
        (models_dir / "build" / "runs", "inside an input folder"),
        (models_dir, "contains an input folder"),
    ):
        _refused(
            ["ablate", "all", models_dir / "build", models_dir / "base", "-o", out, "-q", "--no-time", "--plan", plan],
            capsys,
            fragment,
        )
    assert _tree(models_dir) == before


def test_ablate_into_a_folder_of_other_files_is_refused(pairs, tmp_path, capsys):
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    other = tmp_path / "papers"
    other.mkdir()
    (other / "draft.md").write_text("keep")
    _refused(
        ["ablate", "all", pairs["fused"]["lowlatency"], pairs["fused"]["base"], "-o", other, "-q", "--no-time", "--plan", plan],
        capsys,
        "did not write (no job.json)",
    )
    assert sorted(x.name for x in other.iterdir()) == ["draft.md"]


def test_splice_copies_only_the_top_level_files_of_a_build(pairs, tmp_path):
    build = tmp_path / "build"
    shutil.copytree(pairs["fused"]["lowlatency"], build)
    (build / "runs" / "a").mkdir(parents=True)
    (build / "runs" / "a" / "results.json").write_text("{}")
    (build / ".cache").mkdir()
    (build / ".cache" / "x").write_text("x")
    out = tmp_path / "out"
    assert main(["splice", "-q", "--restore", "gdn", str(build), str(pairs["fused"]["base"]), "-o", str(out)]) == 0
    assert not (out / "runs").exists() and not (out / ".cache").exists()
    assert (out / "tokenizer.json").is_file() and (out / "README.md").is_file()


# ---------------------------------------------------------------- the Hugging Face cache layout


def _to_hub_cache(folder: Path, cache: Path, repo_id: str, revision: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """Lay a checkpoint out as huggingface_hub's cache does: blobs/<hash> files, snapshots/<revision>/<name> relative
    symlinks into blobs, refs/main naming the revision. Returns the snapshot folder."""
    import hashlib

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    for p in sorted(folder.iterdir()):
        if not p.is_file():
            continue
        blob = hashlib.sha256(p.read_bytes()).hexdigest()
        if not (repo / "blobs" / blob).exists():
            shutil.copyfile(p, repo / "blobs" / blob)
        (snap / p.name).symlink_to(Path("..") / ".." / "blobs" / blob)
    return snap


@pytest.mark.parametrize("as_repo_id", [False, True], ids=["snapshot-folder", "repo-id-offline"])
def test_hub_cache_inputs_give_a_self_contained_output(pairs, tmp_path, as_repo_id):
    p = pairs["fused"]
    cache = tmp_path / "hub"
    build_snap = _to_hub_cache(p["lowlatency"], cache, "someone/build-int4")
    base_snap = _to_hub_cache(p["base"], cache, "someone/base-bf16")
    build_arg, base_arg = ("someone/build-int4", "someone/base-bf16") if as_repo_id else (build_snap, base_snap)
    before = _tree(cache)
    out = tmp_path / "out"
    # A subprocess: huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE when it is imported.
    r = _cli("splice", "-q", "--restore", "gdn,lm_head", build_arg, base_arg, "-o", out, env={"HF_HUB_CACHE": str(cache)})
    assert r.returncode == 0, r.stderr
    assert _tree(cache) == before
    assert not any(x.is_symlink() for x in out.rglob("*")), "OUT must hold files, not links into the cache"
    record = json.loads((out / "splice.json").read_text())
    assert record["shards"]["linked"] > 0  # unchanged shards hard-linked to the real blobs, not copied
    expected = _tensors(p["lowlatency"])
    got_before_move = _tensors(out)
    # OUT does not depend on the cache: move the cache away and everything still reads the same.
    shutil.move(str(cache), str(tmp_path / "moved"))
    got = _tensors(out)
    assert set(got) == set(got_before_move)
    assert all(_same_bits(got[k], got_before_move[k]) for k in got)
    kept = [k for k in expected if k in got]
    assert kept and all(_same_bits(got[k], expected[k]) for k in kept)
    assert main(["inspect", str(out)]) == 0


def test_output_inside_the_hub_cache_repo_is_refused(pairs, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "hub"
    snap = _to_hub_cache(pairs["fused"]["lowlatency"], cache, "someone/build-int4")
    before = _tree(cache)
    repo = snap.parent.parent
    for out in (repo / "blobs" / "x", repo / "spliced"):
        _refused(["splice", "--restore", "gdn", snap, pairs["fused"]["base"], "-o", out], capsys, "inside an input folder")
    assert _tree(cache) == before


# ---------------------------------------------------------------- concurrent runs


def test_a_second_splice_to_a_locked_out_is_refused(pairs, tmp_path):
    import fcntl

    p = pairs["fused"]
    out = tmp_path / "out"
    with open(tmp_path / ".out.splicer-lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        r = _cli("splice", "-q", "--restore", "gdn", p["lowlatency"], p["base"], "-o", out)
    assert r.returncode == 2 and "another splicer splice is writing to" in r.stderr and r.stderr.count("\n") == 1
    assert not out.exists()


def test_two_splices_to_one_out_at_once_never_leave_a_broken_out(pairs, tmp_path):
    """Whoever wins, OUT is whole: every run either wrote it, or was refused in one line (locked, or OUT exists)."""
    p = pairs["fused"]
    reference = tmp_path / "reference"
    assert _cli("splice", "-q", "--restore", "gdn", p["lowlatency"], p["base"], "-o", reference).returncode == 0
    want = _tensors(reference)
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    for trial in range(3):
        out = tmp_path / f"out{trial}"
        args = [
            sys.executable,
            "-m",
            "splicer",
            "splice",
            "-q",
            "--restore",
            "gdn",
            str(p["lowlatency"]),
            str(p["base"]),
            "-o",
            str(out),
        ]
        procs = [subprocess.Popen(args, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True) for _ in range(2)]
        results = [(q.wait(), q.stderr.read()) for q in procs]
        assert sum(code == 0 for code, _ in results) >= 1, results
        for code, err in results:
            assert code == 0 or (code == 2 and ("another splicer splice is writing" in err or "exists; pass --force" in err)), err
        got = _tensors(out)
        assert set(got) == set(want) and all(_same_bits(got[k], want[k]) for k in want)
        assert sorted(x.name for x in tmp_path.iterdir() if x.name.startswith(f".out{trial}")) == []


# ---------------------------------------------------------------- index shard names


@pytest.mark.parametrize("name", ["../base/{shard}", "/{abs}", "sub/{shard}", "{shard}.bak"])
def test_index_shard_names_must_be_files_in_the_folder(pairs, tmp_path, capsys, name):
    p = pairs["fused"]
    build = tmp_path / "build"
    shutil.copytree(p["lowlatency"], build)
    base = tmp_path / "base"
    shutil.copytree(p["base"], base)
    index = json.loads((build / "model.safetensors.index.json").read_text())
    victim = index["weight_map"]["model.language_model.embed_tokens.weight"]
    base_shard = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"][
        "model.language_model.embed_tokens.weight"
    ]
    bad = name.format(shard=base_shard, abs=str(base / base_shard).lstrip("/"))
    index["weight_map"] = {k: (bad if v == victim else v) for k, v in index["weight_map"].items()}
    (build / "model.safetensors.index.json").write_text(json.dumps(index))
    before = {"build": _tree(build), "base": _tree(base)}
    _refused(["splice", "--restore", "gdn", build, base, "-o", tmp_path / "out"], capsys, "not a .safetensors file name inside")
    assert {"build": _tree(build), "base": _tree(base)} == before and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- shard contents


def _rewrite_shard(path: Path, fn) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    save_file(fn(tensors), str(path), metadata={"format": "pt"})


def test_a_tensor_stored_in_two_shards_is_refused(pairs, tmp_path, capsys):
    build = tmp_path / "build"
    shutil.copytree(pairs["fused"]["lowlatency"], build)
    index = json.loads((build / "model.safetensors.index.json").read_text())
    name = "model.language_model.embed_tokens.weight"
    other = next(s for s in sorted(set(index["weight_map"].values())) if s != index["weight_map"][name])
    with safe_open(str(build / index["weight_map"][name]), "pt") as f:
        copy = f.get_tensor(name) + 1  # a second, different copy: which one vLLM loads would be an accident
    _rewrite_shard(build / other, lambda t: {**t, name: copy})
    _refused(["splice", "--restore", "gdn", build, pairs["fused"]["base"], "-o", tmp_path / "out"], capsys, "holds " + name)


def test_bytes_the_header_does_not_cover_are_refused(pairs, tmp_path, capsys):
    build = tmp_path / "build"
    shutil.copytree(pairs["fused"]["lowlatency"], build)
    shard = next(build.glob("*.safetensors"))
    with open(shard, "ab") as f:
        f.write(b"\0" * 64)
    _refused(["splice", "--restore", "gdn", build, pairs["fused"]["base"], "-o", tmp_path / "out"], capsys, "header covers")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_base_in_another_float_dtype_is_cast_and_recorded(pairs, tmp_path, dtype):
    base = tmp_path / "base"
    shutil.copytree(pairs["fused"]["base"], base)
    for shard in base.glob("*.safetensors"):
        _rewrite_shard(shard, lambda t: {k: (v.to(dtype) if v.dtype == torch.bfloat16 else v) for k, v in t.items()})
    out = tmp_path / "out"
    assert main(["splice", "-q", "--restore", "gdn", str(pairs["fused"]["lowlatency"]), str(base), "-o", str(out)]) == 0
    record = json.loads((out / "splice.json").read_text())
    name = {torch.float32: "F32", torch.float16: "F16"}[dtype]
    assert record["dtype_cast"]["to"] == "BF16" and record["dtype_cast"]["from"][name] > 0
    got, base_t = _tensors(out), _tensors(base)
    restored = "model.language_model.layers.0.linear_attn.in_proj_qkv.weight"
    assert got[restored].dtype == torch.bfloat16 and torch.equal(got[restored], base_t[restored].to(torch.bfloat16))
    assert {t.dtype for k, t in got.items() if k.endswith(".weight")} == {torch.bfloat16}


# ---------------------------------------------------------------- leftovers, fixtures, the demo


def test_ablate_leaves_no_lock_and_logs_every_stage(pairs, tmp_path, capsys):
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    out = tmp_path / "run"
    code = main(
        [
            "ablate",
            "all",
            str(pairs["fused"]["lowlatency"]),
            str(pairs["fused"]["base"]),
            "-o",
            str(out),
            "--no-time",
            "--device",
            "cpu",
            "--plan",
            str(plan),
        ]
    )
    err = capsys.readouterr().err
    assert code == 0
    assert not (out / ".lock").exists() and not any(x.name.endswith(".splicer-lock") for x in tmp_path.iterdir())
    log = (out / "ablate.log").read_text()
    for text in (err, log):  # stderr is not a terminal here: the stage lines go there as to the log
        assert "base pass: started" in text and "base pass: done in" in text
        assert "gdn: splice gdn: done in" in text and "gdn: scoring wiki-en" in text and "gdn: ok" in text


def test_fixture_is_whole_or_absent_and_force_only_replaces_a_fixture(tmp_path, capsys):
    out = tmp_path / "fx"
    assert main(["fixture", str(out), "--builds", "lowlatency"]) == 0
    first = tree_digest(out)
    _refused(["fixture", out, "--builds", "lowlatency"], capsys, "exists; pass --force")
    assert main(["fixture", str(out), "--builds", "lowlatency", "--force"]) == 0
    assert tree_digest(out) == first  # deterministic, and nothing left of the old one
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("keep")
    _refused(["fixture", other, "--force"], capsys, "not an output of splicer fixture")
    _refused(["fixture", tmp_path / "bad", "--builds", "lowlatency,nope"], capsys, "unknown build kind 'nope'")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["fx", "other"]


def test_demo_with_a_bad_plan_writes_nothing(tmp_path, capsys):
    _refused(["ablate", "all", "--demo", "-q", "-o", tmp_path / "demo", "--plan", "no-such-plan"], capsys, "no plan named")
    bad = tmp_path / "bad.txt"
    bad.write_bytes("Größe".encode("latin-1"))
    _refused(["ablate", "all", "--demo", "-q", "-o", tmp_path / "demo", "--corpus", f"wiki-en={bad}"], capsys, "not UTF-8")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["bad.txt"]


def test_output_into_a_closed_pipe_is_quiet(pairs):
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is printed: every write raises EPIPE
    try:
        r = subprocess.run(
            [sys.executable, "-m", "splicer", "inspect", str(pairs["fused"]["lowlatency"])],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
    finally:
        os.close(write)
    assert r.returncode == 141 and r.stderr == "", r.stderr


def test_version():
    r = _cli("--version")
    from splicer import __version__

    assert r.returncode == 0 and r.stdout.strip() == f"splicer {__version__}"
