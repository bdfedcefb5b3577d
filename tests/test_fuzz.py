"""Fuzz: malformed variants of everything splice, inspect and ablate read, run through the real CLI in-process.

Each case takes the tiny fixture pair (or the GPTQ build), breaks one thing and runs `splicer.cli.main(argv)`:
config.json of the build or the base (a field of another JSON type, a number out of range, a key deleted or stated
twice, the whole file), the index (shard names that are not plain file names, missing shards, tensors listed twice, in
the wrong shard or not at all), shard headers (dtype, shape and offset changes, a tensor stored in two shards, bytes the
header does not cover, base weights in another float dtype), the ablate plan TOML (types, ranges, missing, unknown and
repeated keys, unsafe names), corpus files (JSONL records whose text is not a string, missing fields, bad UTF-8),
CLI values (--layers, --modules, --batch-size, --bandwidth-gbs, --gpu-memory-utilization, ...), where the output goes
(an existing OUT, a file, a symlink, inside an input, a stale or held lock, a stale partial folder) and inputs reached
through symlinks (a linked folder, a Hub-cache layout, dangling links). The property, for every case:

* refused: exit 2, exactly one non-empty stderr line starting `splicer: error: `, nothing on stdout, no traceback,
  nothing new beside the output (no OUT/DIR, no `.OUT.splicer-partial`, no lock), inputs byte-identical; or
* finished: exit 0; a splice output loads with `safetensors.safe_open` and holds, tensor for tensor, the build's
  tensor of that name or, for a restored module, the base's weight (the per-expert slice of a fused base tensor, cast
  to the build's dtype where the base stores another float dtype), its index lists exactly those tensors and its
  config keeps every key but quantization_config, passes the same config checks and is read by both readers as it
  is stored (no misreading the build did not already have), and it holds no symlinks; an ablate output has
  results.json with every row ok;
* and where the input's validity is known independently of splicer (a corpus file, a CLI value, a plan value of the
  wrong type, a corrupt build header), the outcome is the expected one; a config.json splicer accepts is one the torch
  backend can build its model from (transformers' strict config and the model, built on the meta device).

Plan and corpus cases run on a stub model (deterministic scores, no forward pass) so that a valid plan runs end to end
in milliseconds: everything splicer itself does (plan, corpora, tokenizer, splices of every row, caches, results) is
real, only the model's numbers are not. The backends are still made by the real options' make_backends, so --backend
and --device are checked as in a real run. One real torch-backend ablate runs in the module fixture (its results folder
feeds the table/compare cases).

Deterministic: SEED fixes every case; each case's mutation is drawn from its own seed at run time against the
fixture's actual content (which is itself deterministic). Cases that fail only because of files the lead developer
owns are listed in LEAD_KNOWN and xfail at runtime with a reason starting "LEAD:".
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from splicer.arch.qwen3_5_moe import QWEN3_5_MOE
from splicer.backends.base import SequenceScores, decode_spread
from splicer.backends.torch_ref import TorchOptions
from splicer.backends.vllm_backend import VllmOptions
from splicer.checkpoint import INDEX_NAME, check_config, open_checkpoint
from splicer.cli import main
from splicer.errors import SplicerError

from .conftest import tree_digest
from .test_splice import base_per_expert

# Fixed, so CI runs the same cases every time; SPLICER_FUZZ_SEED explores others locally.
SEED = int(os.environ.get("SPLICER_FUZZ_SEED", "20250611"))
# Cases per group: 505 cases (+3 closed-pipe runs), about 35 s on 2 CPU cores plus the shared fixture pair.
GROUPS = {
    "build-config": 90,
    "gptq-config": 40,
    "base-config": 45,
    "index": 50,
    "header": 75,
    "plan": 55,
    "corpus": 30,
    "cli": 60,
    "output": 40,
    "symlink": 20,
}
PIPE_CASES = ("inspect", "table", "splice")
PACKED = (
    "weight_packed",
    "weight_scale",
    "weight_shape",
    "weight_zero_point",
    "weight_g_idx",
    "qweight",
    "qzeros",
    "scales",
    "g_idx",
)
ROOT = Path(__file__).parents[1]

# Cases that fail only in files the lead developer owns (checkpoint.py, io/safetensors_io.py, splice/core.py,
# ablate/, cli.py, io/outputs.py, analysis/table.py, backends/*): (regex over the case's description, reason). A listed
# case still runs; it xfails only if it fails, and passes once fixed (then remove the entry).
LEAD_KNOWN: list[tuple[str, str]] = []  # none left

OUTCOMES: Counter = Counter()
BY_GROUP: dict[str, Counter] = defaultdict(Counter)


# ---------------------------------------------------------------- the world: fixtures shared by every case


@dataclass
class World:
    work: Path  # per-case folders live here
    builds: dict[str, Path]  # lowlatency, experts-g32, gptq, per-expert lowlatency
    bases: dict[str, Path]  # build kind -> its base
    results: Path  # a finished real ablate (for table / compare)
    hf_home: Path
    shared_digest: dict[str, dict]  # full tree digests of the shared folders, checked again by the summary test
    shared_stat: dict[str, dict] = field(default_factory=dict)


def _stat_fingerprint(folder: Path) -> dict:
    """Names, sizes, modes, inodes and modification times of every file: a write changes the mtime, so this catches a
    changed input at a fraction of the cost of hashing (the full digest is checked at the end). Not the ctime: hard
    links (the clones here, and a splice's unchanged shards) change it without changing the file."""
    out = {}
    for p in sorted(Path(folder).rglob("*")):
        s = p.lstat()
        out[str(p.relative_to(folder))] = (s.st_size, s.st_mode, s.st_ino, s.st_mtime_ns)
    return out


TINY_PLAN = """
name = "fuzz-real"
top_k = 5
[[corpus]]
name = "wiki-en"
kind = "builtin"
text = "wiki-en"
chunk_tokens = 16
max_chunks = 2
[[row]]
name = "build"
restore = []
[[row]]
name = "gdn"
restore = ["gdn"]
"""


@pytest.fixture(scope="module")
def world(pairs, tmp_path_factory) -> World:
    from splicer.fixtures.core import write_build

    root = tmp_path_factory.mktemp("fuzz")
    gptq = write_build(pairs["fused"]["base"], root / "gptq", "gptq-experts-g32")
    builds = {
        "lowlatency": pairs["fused"]["lowlatency"],
        "experts-g32": pairs["fused"]["experts-g32"],
        "gptq": gptq,
        "per-expert": pairs["per_expert"]["lowlatency"],
    }
    bases = {
        "lowlatency": pairs["fused"]["base"],
        "experts-g32": pairs["fused"]["base"],
        "gptq": pairs["fused"]["base"],
        "per-expert": pairs["per_expert"]["base"],
    }
    # One real ablate on the torch backend: the harness must accept a real finished run, and table/compare need one.
    plan = root / "real-plan.toml"
    plan.write_text(TINY_PLAN)
    results = root / "real-results"
    rc = main(
        [
            "ablate",
            "all",
            str(builds["lowlatency"]),
            str(bases["lowlatency"]),
            "-o",
            str(results),
            "-q",
            "--no-time",
            "--device",
            "cpu",
            "--plan",
            str(plan),
        ]
    )
    assert rc == 0 and json.loads((results / "results.json").read_text())["variants"][1]["status"] == "ok"
    shared = sorted({*builds.values(), *bases.values()}, key=str)
    w = World(
        root / "cases",
        builds,
        bases,
        results,
        root / "hf-home",
        {str(p): tree_digest(p) for p in shared},
        {str(p): _stat_fingerprint(p) for p in [*shared, results]},
    )
    w.work.mkdir()
    return w


# ---------------------------------------------------------------- a scenario and the property


@dataclass
class Scenario:
    what: str  # the mutation, in words (messages, LEAD_KNOWN)
    argv: list[str]
    command: str  # splice | inspect | ablate | table | compare | fixture | parse
    out: Path | None = None  # OUT / DIR; its parent must gain nothing on refusal
    inputs: list[Path] = field(default_factory=list)  # case-made inputs (folders or files), hashed before and after
    build: Path | None = None
    base: Path | None = None
    stub: bool = False  # ablate on the stub model
    expect: str | None = None  # "refuse" / "finish" where the input's validity is known independently; None: either
    keep: list[Path] = field(default_factory=list)  # must be unchanged after a refusal (an OUT that was there before)
    hold: Path | None = None  # a lock file held (flock) while the command runs, as a concurrent run would
    watch: Path | None = None  # the folder that must gain nothing on refusal (default: OUT's parent, created if absent)
    config: Path | None = None  # a mutated config.json: if splicer accepts it, the torch backend must build a model from it
    said: str = ""  # what the command wrote on stderr (for SPLICER_FUZZ_TRACE)
    mention: str | None = None  # a word the refusal must name (the broken key)


def _clone(src: Path, dst: Path) -> Path:
    """A copy of a checkpoint folder to mutate: small files copied, shards hard-linked (a mutated shard is always
    written as a new file, so the shared fixture never changes; the digests would catch it if it did)."""
    dst.mkdir(parents=True)
    for p in sorted(src.iterdir()):
        if p.is_file():
            if p.suffix == ".safetensors":
                os.link(p, dst / p.name)
            else:
                shutil.copy2(p, dst / p.name)
    return dst


def _digest(path: Path) -> dict:
    if path.is_dir():
        return tree_digest(path)
    if path.is_file():
        return {"": hashlib.sha256(path.read_bytes()).hexdigest() + oct(path.stat().st_mode)}
    return {"": "absent" if not path.exists() else "other"}


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else ["<absent>"]


_tensor_cache: dict[tuple, dict[str, torch.Tensor]] = {}


def _shard_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A shard's tensors, cached by inode and modification time (hard-linked clones of a shard share one entry)."""
    s = path.stat()
    key = (s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns)
    if key not in _tensor_cache:
        with safe_open(str(path), "pt") as f:
            _tensor_cache[key] = (path, {k: f.get_tensor(k) for k in f.keys()})
    return _tensor_cache[key][1]


def _forget(folder: Path) -> None:
    """Drop the cached tensors of a case's own files (their inodes are reused once the case folder is removed)."""
    for key in [k for k, (p, _) in _tensor_cache.items() if folder in p.parents]:
        del _tensor_cache[key]


class _Tensors:
    """A checkpoint's tensors by name, each shard read on first use: a base is read only where a splice reads it (a
    splice opens only the base shards that hold restored weights, so a broken shard elsewhere is rightly ignored).
    Fused 3-D base experts are also found by their per-expert names, sliced the independent way (torch indexing)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.wm = json.loads((folder / INDEX_NAME).read_text())["weight_map"]

    def names(self) -> set[str]:
        return set(self.wm)

    def get(self, name: str) -> torch.Tensor | None:
        if name in self.wm:
            try:
                return _shard_tensors(self.folder / self.wm[name])[name]
            except Exception as e:  # noqa: BLE001 - reported as a problem: splicer accepted what safetensors cannot read
                raise AssertionError(
                    f"{self.wm[name]} of {self.folder.name}, which splicer read, does not load with "
                    f"safetensors ({str(e).splitlines()[0][:120]})"
                ) from None
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
        if not m:
            return None
        fused = self.get(f"{m.group(1)}.{'down_proj' if m.group(3) == 'down_proj' else 'gate_up_proj'}")
        if fused is None:
            return None
        one = base_per_expert({f"{m.group(1)}.{'down_proj' if m.group(3) == 'down_proj' else 'gate_up_proj'}": fused})
        return one.get(name)


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (a byte compare: torch.equal costs ~100x more on a busy CPU)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.contiguous().view(torch.uint8).numpy().tobytes() == b.contiguous().view(torch.uint8).numpy().tobytes()
    )


def _verify_splice(out: Path, build: Path, base: Path) -> list[str]:
    """Tensor for tensor: every output tensor is the build's of that name, or the base's weight of a restored module."""
    problems = []
    index = json.loads((out / INDEX_NAME).read_text())
    wm = index["weight_map"]
    got = {}
    for shard in sorted(set(wm.values())):
        try:
            with safe_open(str(out / shard), "pt") as f:
                for k in f.keys():
                    got[k] = f.get_tensor(k)
                    if wm.get(k) != shard:
                        problems.append(f"{shard} holds {k} but the output index puts it in {wm.get(k)}")
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error type
            return [f"the output's {shard} does not load with safetensors: {str(e).splitlines()[0][:160]}"]
    if set(got) != set(wm):
        problems.append(f"the output index lists {len(wm)} tensors, its shards hold {len(got)}")
    b, ref = _Tensors(build), _Tensors(base)
    try:
        for name, t in got.items():
            if name in b.wm:
                if not bit_equal(t, b.get(name)):
                    problems.append(f"{name} differs from the build's")
            elif (r := ref.get(name)) is not None:
                if not bit_equal(t, r if r.dtype == t.dtype else r.to(t.dtype)):
                    problems.append(f"restored {name} differs from the base's weight")
            else:
                problems.append(f"{name} is in neither the build nor the base")
    except AssertionError as e:
        return problems + [str(e)]
    restored = {n.rpartition(".")[0] for n in got if n not in b.wm}
    for name in b.wm:
        module, _, suffix = name.rpartition(".")
        if name not in got and not (module in restored and suffix in PACKED):
            problems.append(f"the build's {name} is missing from the output")
    total = sum(t.numel() * t.element_size() for t in got.values())
    if index.get("metadata", {}).get("total_size") != total:
        problems.append(f"index total_size {index.get('metadata', {}).get('total_size')} != {total}")
    cfg, bcfg = json.loads((out / "config.json").read_text()), json.loads((build / "config.json").read_text())
    try:
        check_config(cfg, "the output")
    except SplicerError as e:
        problems.append(f"the output's config.json is malformed: {e}")
    cfg.pop("quantization_config", None)
    bcfg.pop("quantization_config", None)
    if cfg != bcfg:
        problems.append("the output config.json changed keys other than quantization_config")
    # Both readers (compressed-tensors / GPTQModel with HF names, vLLM with its own) must read the output as it is
    # stored, except where the build's own config already misread it.
    new = _misreadings(out) - _misreadings(build)
    if new:
        problems.append(f"the output's config is misread: {sorted(new)[0]}")
    return problems


def _misreadings(folder: Path) -> set[tuple]:
    """(reader, module) for every module a reader would load in another precision than it is stored, or refuse, and
    every fused group whose shards are stored differently."""
    from splicer.splice.modules import list_modules
    from splicer.splice.rules import check

    ckpt = open_checkpoint(folder, "checkpoint")
    modules = list_modules(ckpt)
    report = check(modules, ckpt.quantization_config, ckpt.arch)
    out = {
        (naming, n)
        for naming in ("hf", "vllm")
        for n, r in getattr(report, naming).items()
        if r.error or (r.group is not None) != modules[n].quantized
    }
    return out | {("disk", i["detail"]) for i in report.issues if i["check"] == "fused-shards-disagree"}


def _verify_ablate(out: Path) -> list[str]:
    try:
        results = json.loads((out / "results.json").read_text())
    except (OSError, ValueError) as e:
        return [f"results.json unreadable ({e.__class__.__name__})"]
    bad = [
        f"row {v['name']}: {v.get('status')} {v.get('error', '')[:200]}" for v in results["variants"] if v.get("status") != "ok"
    ]
    if not (out / "table.md").is_file():
        bad.append("no table.md")
    return bad


def _lead_reason(what: str) -> str | None:
    return next((reason for pattern, reason in LEAD_KNOWN if re.search(pattern, what)), None)


def run_scenario(sc: Scenario, world: World, case_dir: Path, monkeypatch, capsys) -> tuple[str, list[str]]:
    """Run the CLI on a scenario and check the property; returns (outcome, problems)."""
    parent = sc.watch or (sc.out.parent if sc.out is not None else case_dir / "outs")
    if sc.watch is None:
        parent.mkdir(parents=True, exist_ok=True)
    before_parent = _listing(parent)
    before_inputs = {str(p): _digest(p) for p in sc.inputs}
    before_keep = {str(p): _digest(p) for p in sc.keep}
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(world.hf_home))
    if sc.stub:
        for options in (TorchOptions, VllmOptions):
            monkeypatch.setattr(options, "make_backends", _stub_factory(options.make_backends))
    capsys.readouterr()
    crash = None
    held = None
    try:
        if sc.hold is not None:
            held = os.open(sc.hold, os.O_RDWR)
            fcntl.flock(held, fcntl.LOCK_EX)
        rc = main(sc.argv)
    except SystemExit as e:  # argparse's --help/--version: not generated, but never a traceback either
        rc = e.code
    except BaseException:  # noqa: BLE001 - any exception escaping main is the bug this test looks for
        rc, crash = None, traceback.format_exc()
    finally:
        monkeypatch.undo()
        if held is not None:
            os.close(held)
    out_text, err = capsys.readouterr()
    sc.said = err.strip()
    problems = []
    if crash is not None:
        last = [x for x in crash.strip().splitlines() if x.strip()][-1]
        where = [ln.strip() for ln in crash.splitlines() if ln.strip().startswith('File "') and "/splicer/" in ln]
        problems.append(f"exception escaped main: {last} (innermost splicer frame: {where[-1] if where else '?'})")
    elif rc == 2:
        lines = [x for x in err.splitlines() if x.strip()]
        if len(lines) != 1 or not lines[0].startswith("splicer: error: "):
            problems.append(f"refusal should be one 'splicer: error: ' line on stderr, got {err[-600:]!r}")
        if sc.expect == "finish":
            problems.append(f"refused an input that is valid: {err.strip()[:300]}")
        elif sc.mention and sc.mention not in err:
            problems.append(f"the refusal does not name {sc.mention!r}: {err.strip()[:300]}")
        if out_text.strip():
            problems.append(f"refusal printed on stdout: {out_text[:200]!r}")
        if _listing(parent) != before_parent:
            problems.append(f"refusal left something beside the output: {sorted(set(_listing(parent)) ^ set(before_parent))}")
        for p, d in before_keep.items():
            if _digest(Path(p)) != d:
                problems.append(f"refusal changed {p}, which was there before")
    elif rc == 0:
        if sc.expect == "refuse":
            problems.append("finished on an input that must be refused")
        leftovers = [n for n in _listing(parent) if n not in before_parent and (".splicer-" in n or n.endswith(".lock"))]
        if leftovers:
            problems.append(f"finished but left {leftovers}")
        if sc.command == "splice":
            problems += _verify_splice(sc.out, sc.build, sc.base)
            links = [str(p) for p in sc.out.rglob("*") if p.is_symlink()]
            if links:  # OUT must not depend on where the inputs live (Hub-cache snapshots are links into blobs/)
                problems.append(f"the output holds symlinks: {links[:2]}")
        elif sc.command == "ablate":
            problems += _verify_ablate(sc.out)
        elif sc.command in ("inspect", "table", "compare"):
            if not out_text.strip():
                problems.append("finished without printing anything")
            if _listing(parent) != before_parent:
                problems.append("a read-only command wrote beside its input")
    else:
        problems.append(f"exit code {rc}; stderr {err[-400:]!r}")
    if "Traceback" in err:
        problems.append("a traceback on stderr")
    for p, d in before_inputs.items():
        if _digest(Path(p)) != d:
            problems.append(f"input {p} changed")
    for p, fp in world.shared_stat.items():
        if _stat_fingerprint(Path(p)) != fp:
            problems.append(f"shared fixture {p} changed")
            world.shared_stat[p] = _stat_fingerprint(Path(p))  # report it once
    if sc.config is not None:
        problems += _model_builds(sc.config)
    outcome = "crash" if crash else f"exit {rc}"
    return outcome, problems


def _model_builds(path: Path) -> list[str]:
    """A config.json splicer accepts must also be one ablate's torch backend can build its model from (it does so only
    once the run has started writing DIR): the same calls as TorchBackend.load, on the meta device (no memory)."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM

    try:
        cfg = json.loads(path.read_text())
        if not isinstance(cfg, dict):
            return []  # refused when the checkpoint is opened
        check_config(cfg, "x")
    except (OSError, ValueError, SplicerError):
        return []  # refused (or not JSON at all): nothing reaches the backend
    try:
        text_cfg = Qwen3_5MoeConfig(
            **{k: v for k, v in cfg.items() if k not in ("quantization_config", "model_type", "transformers_version")}
        ).text_config
        text_cfg._attn_implementation = "sdpa"
        with torch.device("meta"):
            Qwen3_5MoeForCausalLM(text_cfg)
    except Exception as e:  # noqa: BLE001 - whatever transformers raises is what the base pass would crash with
        return [
            f"check_config accepts it, but the torch backend cannot build the model: {e.__class__.__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''}"
        ]
    return []


# ---------------------------------------------------------------- the stub model (plan, corpus and CLI cases)


class StubBackend:
    """Deterministic scores without a model: what the ablate pipeline needs from a backend, in milliseconds."""

    name = "stub"
    # As the torch backend, whose real run the "earlier-run" cases resume: log-probs gathered at the base's top-k ids
    # (a run keeps its base pass's way of scoring, so a stub that scored otherwise would be refused there)
    exact_gather = True
    default_batch = 4

    def __init__(self, device=None):
        self.folder = None
        self.device = device

    def load(self, folder):
        open_checkpoint(folder, "checkpoint")  # the real backends open it too (and refuse what it refuses)
        if self.device is not None:
            torch.empty(1, device=self.device)  # the real backend builds its model there: the device must work
        self.folder = folder

    def score(self, sequences, top_k=20, gather_ids=None, want_full=False, batch_size=4):
        assert self.folder is not None and batch_size >= 1
        lp = torch.log_softmax(-torch.arange(top_k, dtype=torch.float32), 0)
        gathered_done: list = []
        for seq in sequences:
            n = len(seq) - 1
            gathered = None
            if gather_ids is not None:  # its vocabulary is its top-k: an id outside it has no probability
                ids = gather_ids[len(gathered_done)].long()
                gathered = torch.where(ids < top_k, lp[ids.clamp(0, top_k - 1)], torch.tensor(-1.0e4))
                gathered_done.append(1)
            yield SequenceScores(
                topk_ids=torch.arange(top_k, dtype=torch.int32).repeat(n, 1),
                topk_logprobs=lp.repeat(n, 1),
                target_logprobs=lp[:1].repeat(n),
                gathered=gathered,
            )

    def generate(self, prompts, max_new_tokens, stop_ids):
        return [[7] * max_new_tokens for _ in prompts]

    def time_decode(self, prompt, new_tokens, warmup, runs):
        assert len(prompt) >= 1 and new_tokens >= 2 and runs >= 1 and warmup >= 0
        return {
            **decode_spread([1.0 + i / 100 for i in range(runs)]),
            "ttft_ms": 1.0,
            "ttft_min_max": [1.0, 1.0],
            "runs": runs,
            "warmup": warmup,
            "prompt_tokens": len(prompt),
            "new_tokens": new_tokens,
        }

    overlap_starts = 0
    precompile_slots = 0

    def load_info(self):
        return {}

    def prefetch(self, folder):
        return False

    def precompile(self, folder):
        return False

    def finish_precompile(self):
        return []

    def unload(self):
        self.folder = None

    def hold_exact_gather(self, exact):
        assert exact  # its base passes always gather

    def close(self):
        self.unload()

    def describe(self):
        return {"backend": "stub", "engine": "stub", "device": "cpu"}


def _stub_factory(real_make_backends):
    def make_backends(options, device, log_dir):
        real = real_make_backends(options, device, log_dir)  # checks --device (and refuses vllm here)
        return [StubBackend(getattr(b, "device", None)) for b in real]

    return make_backends


# ---------------------------------------------------------------- JSON mutations


OTHER_VALUES = [
    None,
    True,
    False,
    0,
    -1,
    1,
    3,
    2**31,
    10**15,
    -(2**63),
    2**64,
    1.5,
    0.0,
    -0.5,
    "x",
    "",
    "4",
    "Linear",
    "re:(",
    [],
    ["x"],
    [1, 2],
    [None],
    {},
    {"a": 1},
    float("nan"),
    float("inf"),
]


def _paths(obj, prefix=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


def _get(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def _dumps(obj, dup=None) -> str:
    """JSON text; dup = (path, value, first): the key at path is written twice (value first or last)."""

    def enc(o, here):
        if isinstance(o, dict):
            items = []
            for k, v in o.items():
                entry = f"{json.dumps(k)}: {enc(v, here + (k,))}"
                if dup and dup[0] == here + (k,):
                    other = f"{json.dumps(k)}: {json.dumps(dup[1])}"
                    items += [other, entry] if dup[2] else [entry, other]
                else:
                    items.append(entry)
            return "{" + ", ".join(items) + "}"
        if isinstance(o, list):
            return "[" + ", ".join(enc(v, here + (i,)) for i, v in enumerate(o)) + "]"
        return json.dumps(o)

    return enc(obj, ())


def _near(rng, value):
    """An out-of-range or edge value of the same JSON type."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return rng.choice([0, -1, -value, value + 1, value * 1000 + 7, 2**31, 2**63, 10**30, 1])
    if isinstance(value, float):
        return rng.choice([-value, 0.0, 1e308, value * 1e6, -1.0, float("nan")])
    if isinstance(value, str):
        return rng.choice(["", "x" * 300, "a\nb", "re:(", "re:.*", "\u00e9", value.upper(), value + "x"])
    if isinstance(value, list):
        return rng.choice([[], value[:1], value * 2, list(reversed(value)), [value]])
    if isinstance(value, dict):
        return rng.choice([{}, {"x": value}, dict(list(value.items())[:1])])
    return rng.choice(OTHER_VALUES)


def mutate_json(rng, obj, focus: list[tuple]) -> tuple[str, str]:
    """(new JSON text, description) with one thing broken at a path (70 % from focus, else anywhere)."""
    obj = json.loads(json.dumps(obj))
    everywhere = list(_paths(obj))
    path = rng.choice(focus) if focus and rng.random() < 0.7 else rng.choice(everywhere)
    op = rng.choices(["type", "near", "delete", "dup", "add", "rename"], [4, 3, 2, 2, 1, 1])[0]
    name = ".".join(map(str, path))
    try:
        parent = _get(obj, path[:-1])
        present = isinstance(parent, dict) and path[-1] in parent or isinstance(parent, list) and path[-1] < len(parent)
    except (KeyError, IndexError, TypeError):
        parent, present = None, False
    if parent is None or not isinstance(parent, (dict, list)):
        return _dumps(obj), f"{name}: untouched (no such place)"
    old = parent[path[-1]] if present else None
    if op == "delete" and present and isinstance(parent, dict):
        del parent[path[-1]]
        return _dumps(obj), f"{name} deleted"
    if op == "dup" and present and isinstance(parent, dict):
        value = rng.choice([_near(rng, old), rng.choice(OTHER_VALUES)])
        first = rng.random() < 0.5
        return _dumps(obj, (path, value, first)), f"{name} stated twice ({json.dumps(value)[:40]} {'first' if first else 'last'})"
    if op == "rename" and present and isinstance(parent, dict):
        # Keys are data too: config group names, GPTQ's `dynamic` rules (regexes), label ids.
        new = rng.choice(["", " ", "-:(", "+:[", "re:(", "x" * 200, str(path[-1]).upper(), f"{path[-1]}\n", "-:.*", "0"])
        items = [(new if k == path[-1] else k, v) for k, v in parent.items()]
        parent.clear()
        parent.update(items)
        return _dumps(obj), f"{name} renamed to {json.dumps(new)[:40]}"
    if op == "add" and isinstance(parent, dict):
        key = rng.choice(["quantization_config", "text_config", "extra_field", path[-1]])
        parent[key] = rng.choice(OTHER_VALUES + [{"quant_method": "gptq", "bits": 4}])
        return _dumps(obj), f"{'.'.join(map(str, path[:-1] + (key,)))} set to {json.dumps(parent[key])[:40]}"
    value = (
        _near(rng, old)
        if op == "near" and present
        else rng.choice([v for v in OTHER_VALUES if not (type(v) is type(old) and v == old)])
    )
    if isinstance(parent, list) and not present:
        parent.append(value)
    else:
        parent[path[-1]] = value
    return _dumps(obj), f"{name} = {json.dumps(value)[:60]} (was {json.dumps(old)[:40]})"


WHOLE_FILE = [
    (b"", "empty"),
    (b"[]", "a list"),
    (b'"x"', "a string"),
    (b"null", "null"),
    (b"{", "cut off"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b"\xef\xbb\xbf{}", "with a BOM"),
    (b"{}", "an empty object"),
    (None, "a folder"),
]


def _whole_file(rng, path: Path) -> str:
    data, what = rng.choice(WHOLE_FILE)
    path.unlink()
    if data is None:
        path.mkdir()
    else:
        path.write_bytes(data)
    return f"{path.name} replaced by {what}"


# ---------------------------------------------------------------- case builders

CT_RESTORES = ["gdn", "attention", "shared_expert", "lm_head", "experts", "all", "gdn,lm_head", "attention,experts"]
RESTORES = {
    "lowlatency": CT_RESTORES,
    "per-expert": CT_RESTORES,
    "experts-g32": ["experts", "mtp", "all"],
    "gptq": ["experts", "all"],
}


def _splice_argv(rng, build: Path, base: Path, out: Path, kind: str) -> list[str]:
    restore = rng.choice(RESTORES[kind])
    argv = ["splice", "--restore", restore, str(build), str(base), "-o", str(out), "-q"]
    if "experts" in restore and rng.random() < 0.3:
        argv += ["--layers", rng.choice(["0", "1-2", "0,3"])]
    return argv


def _text_focus(cfg: dict) -> list[tuple]:
    from splicer.io.config_schema import TEXT, TOP, VISION

    tc = ("text_config",) if "text_config" in cfg else ()
    paths = [tuple(f.path.split(".")) for f in TOP + VISION] + [tc + tuple(f.path.split(".")) for f in TEXT]
    return [p for p in paths if "*" not in p]


def _quant_focus(cfg: dict) -> list[tuple]:
    return [p for p in _paths(cfg) if p and p[0] == "quantization_config"]


def case_config(rng, world: World, d: Path, group: str) -> Scenario:
    kind = {"gptq-config": "gptq"}.get(group) or rng.choice(["lowlatency", "lowlatency", "experts-g32", "per-expert"])
    build, base = world.builds[kind], world.bases[kind]
    target = "base" if group == "base-config" else "build"
    src = base if target == "base" else build
    folder = _clone(src, d / "in" / target)
    cfg_path = folder / "config.json"
    expect = None
    if rng.random() < 0.08:
        what, expect = _whole_file(rng, cfg_path), "refuse"
    else:
        cfg = json.loads(cfg_path.read_text())
        focus = _text_focus(cfg) + (_quant_focus(cfg) * (3 if target == "build" else 0))
        text, what = mutate_json(rng, cfg, focus)
        cfg_path.write_text(text)
    what = f"{group} {kind} {target} config.json: {what}"
    if target == "base":
        base = folder
    else:
        build = folder
    out = d / "outs" / "OUT"
    if target == "build" and rng.random() < 0.2:
        return Scenario(
            what,
            ["inspect", str(build)] + (["--json"] if rng.random() < 0.5 else []),
            "inspect",
            inputs=[folder],
            expect=expect if target == "build" else None,
            config=cfg_path,
        )
    return Scenario(
        what, _splice_argv(rng, build, base, out, kind), "splice", out, [folder], build, base, expect=expect, config=cfg_path
    )


def _relevant(rng, names: list[str], restore: str) -> str:
    """A tensor name, half of the time one of the restored classes' (so the mutation is on the splice's path)."""
    classes = set(restore.split(","))

    def cls(name):
        fused = QWEN3_5_MOE.fused_expert_parts(name)
        return "experts" if fused else QWEN3_5_MOE.module_class(name.rpartition(".")[0])

    hits = [n for n in names if "all" in classes or cls(n) in classes]
    return rng.choice(hits if hits and rng.random() < 0.5 else names)


def case_index(rng, world: World, d: Path, group: str) -> Scenario:
    kind = rng.choice(["lowlatency", "experts-g32", "gptq", "per-expert"])
    build, base = world.builds[kind], world.bases[kind]
    target = rng.choice(["build", "build", "base"])
    folder = _clone(base if target == "base" else build, d / "in" / target)
    out = d / "outs" / "OUT"
    argv = _splice_argv(rng, *(([build, folder] if target == "base" else [folder, base]) + [out, kind]))
    restore = argv[2]
    ipath = folder / INDEX_NAME
    index = json.loads(ipath.read_text())
    wm = index["weight_map"]
    shards = sorted(set(wm.values()))
    t = _relevant(rng, sorted(wm), restore)
    op = rng.choice(
        [
            "value-type",
            "escape",
            "escape",
            "missing-shard",
            "extra-tensor",
            "drop-tensor",
            "dup",
            "move",
            "structure",
            "drop-index",
            "delete-shard",
            "whole",
        ]
    )
    text = None
    if op == "value-type":
        wm[t] = rng.choice([1, None, [], {}, True, "", 1.5])
        what = f"weight_map[{t}] = {json.dumps(wm[t])}"
    elif op == "escape":
        shard = wm[t]
        choice = rng.choice(["../", "abs", "sub/", "./", "trailing/", ".hidden", ".bin", "back\\"])
        if choice == "../":
            (d / "in" / shard).write_bytes((folder / shard).read_bytes())
            wm[t] = "../" + shard
        elif choice == "abs":
            wm[t] = str((folder / shard).resolve())
        elif choice == "sub/":
            (folder / "sub").mkdir(exist_ok=True)
            shutil.copy2(folder / shard, folder / "sub" / shard)
            wm[t] = "sub/" + shard
        elif choice == "./":
            wm[t] = "./" + shard
        elif choice == "trailing/":
            wm[t] = shard + "/"
        elif choice == ".hidden":
            shutil.copy2(folder / shard, folder / ("." + shard))
            wm[t] = "." + shard
        elif choice == ".bin":
            shutil.copy2(folder / shard, folder / (shard + ".bin"))
            wm[t] = shard + ".bin"
        else:
            wm[t] = "sub\\" + shard
        what = f"weight_map[{t}] = {wm[t]!r}"
    elif op == "missing-shard":
        wm[t] = "model-99999-of-99999.safetensors"
        what = f"weight_map[{t}] names a shard that does not exist"
    elif op == "extra-tensor":
        extra = rng.choice(
            [
                n
                for n in (
                    "model.language_model.layers.0.extra.weight",
                    t + "_copy",
                    "lm_head.weight_packed",
                    "mtp.fc.weight_packed",
                )
                if n not in wm
            ]
        )
        wm[extra] = rng.choice(shards)
        what = f"index lists {extra}, which no shard holds"
    elif op == "drop-tensor":
        del wm[t]
        what = f"index no longer lists {t}"
    elif op == "dup":
        other = rng.choice(shards)
        first = rng.random() < 0.5
        text = _dumps(index, (("weight_map", t), other, first))
        what = f"weight_map lists {t} twice ({other} {'first' if first else 'last'})"
    elif op == "move":
        wm[t] = rng.choice([s for s in shards if s != wm[t]] or shards)
        what = f"weight_map puts {t} in the wrong shard"
    elif op == "structure":
        key, value = rng.choice(
            [
                ("weight_map", []),
                ("weight_map", {}),
                ("weight_map", "x"),
                ("weight_map", None),
                ("metadata", "x"),
                ("metadata", []),
                ("metadata", {"total_size": "x"}),
                ("metadata", None),
            ]
        )
        index[key] = value
        what = f"index {key} = {json.dumps(value)}"
    elif op == "drop-index":
        ipath.unlink()
        what = "index deleted"
        return Scenario(
            f"index {kind} {target}: {what}",
            argv,
            "splice",
            out,
            [folder],
            *([build, folder] if target == "base" else [folder, base]),
            expect="refuse",
        )
    elif op == "delete-shard":
        victim = wm[t]
        (folder / victim).unlink()
        what = f"shard {victim} deleted"
    else:
        what = _whole_file(rng, ipath)
        return Scenario(
            f"index {kind} {target}: {what}",
            argv,
            "splice",
            out,
            [folder],
            *([build, folder] if target == "base" else [folder, base]),
            expect="refuse",
        )
    ipath.write_text(text if text is not None else json.dumps(index))
    b, s = [build, folder] if target == "base" else [folder, base]
    # Every name in an index is checked, and a build's every shard is read; a base's shards only where they hold
    # restored weights (so a broken entry elsewhere in a base index may pass).
    always = {"value-type", "escape"} | ({"structure"} if what.startswith("index weight_map") else set())
    expect = "refuse" if op in always or (target == "build" and op not in ("dup", "structure")) else None
    return Scenario(f"index {kind} {target} ({restore}): {what}", argv, "splice", out, [folder], b, s, expect=expect)


# -- shard headers


def _read_shard(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_shard(path: Path, header: dict, data: bytes, header_text: str | None = None) -> None:
    """A new file (never writing through the hard link to the shared shard)."""
    text = (header_text if header_text is not None else json.dumps(header)).encode()
    text += b" " * (-len(text) % 8)
    path.unlink()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _repack(tensors: dict[str, tuple[str, list, bytes]], metadata) -> tuple[dict, bytes]:
    header = {"__metadata__": metadata} if metadata is not None else {}
    data, pos = bytearray(), 0
    for name, (dtype, shape, blob) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + len(blob)]}
        data += blob
        pos += len(blob)
    return header, bytes(data)


def _tensors_of(header: dict, data: bytes) -> dict[str, tuple[str, list, bytes]]:
    out = {}
    for name, spec in sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0]):
        b, e = spec["data_offsets"]
        out[name] = (spec["dtype"], list(spec["shape"]), data[b:e])
    return out


SAME_SIZE = {
    "BF16": ["F16", "I16", "U16"],
    "F16": ["BF16", "I16"],
    "F32": ["I32", "U32"],
    "I32": ["F32", "U32"],
    "I64": ["F64", "U64"],
    "U8": ["I8", "BOOL"],
    "I8": ["U8"],
}


def _cast_blob(blob: bytes, src: str, dst: str) -> bytes:
    from splicer.io.dtypes import torch_dtype

    t = torch.frombuffer(bytearray(blob), dtype=torch_dtype(src)).to(torch_dtype(dst))
    return t.view(torch.uint8).numpy().tobytes()


def case_header(rng, world: World, d: Path, group: str) -> Scenario:
    kind = rng.choice(["lowlatency", "experts-g32", "gptq", "per-expert"])
    build, base = world.builds[kind], world.bases[kind]
    target = rng.choice(["build", "base"])
    folder = _clone(base if target == "base" else build, d / "in" / target)
    out = d / "outs" / "OUT"
    b, s = [build, folder] if target == "base" else [folder, base]
    argv = _splice_argv(rng, b, s, out, kind)
    restore = argv[2]
    wm = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
    t = _relevant(rng, sorted(wm), restore)
    shard = folder / wm[t]
    header, data = _read_shard(shard)
    meta = header.get("__metadata__")
    tensors = _tensors_of(header, data)
    dtype, shape, blob = tensors[t]
    ops = [
        "dtype-same-size",
        "dtype-other-size",
        "dtype-unknown",
        "shape-same-bytes",
        "shape-bad",
        "offsets",
        "swap-offsets",
        "dup-other-shard",
        "dup-key",
        "trailing",
        "gap",
        "hlen",
        "header-json",
        "truncate",
        "drop-tensor",
        "extra-tensor",
        "empty-file",
        "listed-extra",
    ]
    if target == "build" and t.rpartition(".")[2] in PACKED:
        ops += ["plain-beside-packed"] * 2
    if target == "base":
        ops += ["base-float"] * 4
    op = rng.choice(ops)
    what = f"header {kind} {target} ({restore}) {wm[t]} {t}: "
    text = None
    if op == "dtype-same-size" and dtype in SAME_SIZE:
        new = rng.choice(SAME_SIZE[dtype])
        header[t]["dtype"] = new
        what += f"dtype {dtype} -> {new} (same bytes)"
    elif op == "dtype-other-size" or (op == "dtype-same-size"):
        from splicer.io.safetensors_io import DTYPE_SIZES

        new = rng.choice([d for d in ("F32", "F64", "I8", "BF16", "F8_E4M3", "I16") if DTYPE_SIZES[d] != DTYPE_SIZES[dtype]])
        header[t]["dtype"] = new
        what += f"dtype {dtype} -> {new}"
    elif op == "dtype-unknown":
        header[t]["dtype"] = rng.choice(["Q4", "", 5, None, "bf16", ["BF16"]])
        what += f"dtype -> {json.dumps(header[t]['dtype'])}"
    elif op == "shape-same-bytes":
        n = math.prod(shape)
        new = rng.choice([list(reversed(shape)), [n], [1, *shape], [*shape, 1], [2, n // 2] if n % 2 == 0 else [n, 1]])
        header[t]["shape"] = new
        what += f"shape {shape} -> {new} (same bytes)"
    elif op == "shape-bad":
        new = rng.choice([[-1, *shape[1:]], [float(shape[0]), *shape[1:]], ["2"], shape + [2], "x", None, [2**62, 2**62]])
        header[t]["shape"] = new
        what += f"shape -> {json.dumps(new)}"
    elif op == "offsets":
        bgn, end = header[t]["data_offsets"]
        new = rng.choice(
            [
                [bgn + 2, end + 2],
                [bgn - 2, end - 2],
                [end, bgn],
                [bgn, end + 8],
                [float(bgn), float(end)],
                [bgn, 2**62],
                [bgn],
                [-8, end - bgn - 8],
                "x",
            ]
        )
        header[t]["data_offsets"] = new
        what += f"data_offsets {[bgn, end]} -> {json.dumps(new)}"
    elif op == "swap-offsets":
        same = [n for n, (dt, sh, bl) in tensors.items() if n != t and len(bl) == len(blob)]
        if same:
            other = rng.choice(same)
            header[t]["data_offsets"], header[other]["data_offsets"] = header[other]["data_offsets"], header[t]["data_offsets"]
            header[t]["shape"], header[other]["shape"] = header[other]["shape"], header[t]["shape"]
            header[t]["dtype"], header[other]["dtype"] = header[other]["dtype"], header[t]["dtype"]
            what += f"data swapped with {other} (a consistent header)"
        else:
            header[t]["data_offsets"] = [header[t]["data_offsets"][0] + 1, header[t]["data_offsets"][1] + 1]
            what += "data_offsets shifted by one"
    elif op == "dup-other-shard":
        others = sorted(set(wm.values()) - {wm[t]})
        if others:
            o = folder / rng.choice(others)
            oh, od = _read_shard(o)
            ot = _tensors_of(oh, od)
            ot[t] = (dtype, shape, blob)
            nh, nd = _repack(ot, oh.get("__metadata__"))
            _write_shard(o, nh, nd)
            return Scenario(
                what + f"also stored in {o.name}",
                argv,
                "splice",
                out,
                [folder],
                b,
                s,
                expect="refuse" if target == "build" else None,
            )
        what += "(single shard) trailing bytes"
        data += b"\0" * 16
    elif op == "dup-key":
        other = dict(header[t], data_offsets=list(header[t]["data_offsets"]))
        if rng.random() < 0.5:
            other["dtype"] = SAME_SIZE.get(dtype, [dtype])[0]
        first = rng.random() < 0.5
        text = _dumps(header, ((t,), other, first))
        what += f"key stated twice in the header ({'first' if first else 'last'}, {other['dtype']})"
    elif op == "trailing":
        data += bytes(rng.choice([1, 7, 8, 4096]))
        what += "bytes appended after the data"
    elif op == "gap":
        names = list(tensors)
        i = names.index(t)
        before = {n: v for n, v in tensors.items() if names.index(n) <= i}
        header, data = _repack(before, meta)
        pad = rng.choice([1, 8, 64])
        data += bytes(pad)
        pos = len(data)
        for n in names[i + 1 :]:
            dt, sh, bl = tensors[n]
            header[n] = {"dtype": dt, "shape": sh, "data_offsets": [pos, pos + len(bl)]}
            data += bl
            pos += len(bl)
        what += f"a {pad}-byte gap after it"
    elif op == "hlen":
        raw = shard.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        new = rng.choice([n + 8, n - 8, 0, 2**40, len(raw), 2**64 - 1])
        shard.unlink()
        shard.write_bytes(struct.pack("<Q", new) + raw[8:])
        return Scenario(
            what + f"header length {n} -> {new}",
            argv,
            "splice",
            out,
            [folder],
            b,
            s,
            expect="refuse" if target == "build" else None,
        )
    elif op == "header-json":
        choice = rng.choice(["not-json", "list", "meta-list", "meta-int-values", "entry-list", "entry-missing-key"])
        if choice == "not-json":
            text = json.dumps(header)[:-3]
        elif choice == "list":
            text = json.dumps([header])
        elif choice == "meta-list":
            header["__metadata__"] = ["pt"]
        elif choice == "meta-int-values":
            header["__metadata__"] = {"format": 1}
        elif choice == "entry-list":
            header[t] = [dtype, shape, header[t]["data_offsets"]]
        else:
            del header[t][rng.choice(["dtype", "shape", "data_offsets"])]
        what += f"header {choice}"
    elif op == "truncate":
        data = data[: max(0, len(data) - rng.choice([1, 2, 100, len(blob)]))]
        what += "data cut short"
    elif op == "drop-tensor":
        del tensors[t]
        header, data = _repack(tensors, meta)
        what += "removed from the shard (the index still lists it)"
    elif op == "extra-tensor":
        tensors[t + "_extra"] = (dtype, shape, blob)
        header, data = _repack(tensors, meta)
        what += "a copy under another name the index does not list"
    elif op in ("plain-beside-packed", "listed-extra"):
        # A consistent header and index that hold one tensor more: an unquantized weight beside the packed ones of the
        # same module, or a tensor of a new name.
        module = t.rpartition(".")[0]
        extra = f"{module}.weight" if op == "plain-beside-packed" else f"{module}.fuzz_extra"
        tensors[extra] = ("BF16", [4, 8], bytes(64))
        header, data = _repack(tensors, meta)
        index = json.loads((folder / INDEX_NAME).read_text())
        index["weight_map"][extra] = wm[t]
        (folder / INDEX_NAME).write_text(json.dumps(index))
        what += f"{extra} added to the shard and the index"
    elif op == "empty-file":
        data, text = b"", None
        shard.unlink()
        shard.write_bytes(rng.choice([b"", b"\0" * 4, b"\0" * 8, struct.pack("<Q", 2) + b"{}"]))
        return Scenario(
            what + "shard replaced by a stub file",
            argv,
            "splice",
            out,
            [folder],
            b,
            s,
            expect="refuse" if target == "build" else None,
        )
    elif op == "base-float":
        new = rng.choice(["F32", "F16"] if dtype == "BF16" else ["BF16"])
        tensors[t] = (new, shape, _cast_blob(blob, dtype, new) if dtype in ("BF16", "F16", "F32") else blob)
        header, data = _repack(tensors, meta)
        what += f"stored as {new} (values converted)"
    _write_shard(shard, header, data, text)
    # A build's every header is read: anything but a consistent rewrite must be refused. A base's shards are read
    # only where they hold restored weights; a base weight in another float dtype is cast.
    consistent = ("dtype-same-size", "shape-same-bytes", "swap-offsets", "dup-key", "listed-extra")
    expect = "finish" if op == "base-float" else "refuse" if target == "build" and op not in consistent else None
    return Scenario(what, argv, "splice", out, [folder], b, s, expect=expect)


# -- plans


BASE_PLAN = {
    "name": "fuzz",
    "description": "one small corpus, a chat corpus, short timing",
    "top_k": 5,
    "corpus": [
        {"name": "wiki-en", "kind": "builtin", "text": "wiki-en", "chunk_tokens": 16, "max_chunks": 2},
        {"name": "chat", "kind": "chat", "conversations": 2, "history_turns": 1, "answer_tokens": 4},
    ],
    "timing": {"prompt_tokens": 8, "new_tokens": 2, "warmup": 0, "runs": 1},
    "row": [{"name": "build", "restore": []}, {"name": "gdn", "restore": ["gdn"]}, {"name": "base", "base": True}],
}
# In-range values a plan may take (kept small: a valid plan runs).
PLAN_VALID = {
    "top_k": [1, 20, 1000],
    "chunk_tokens": [2, 8],
    "max_chunks": [1, 3],
    "conversations": [1, 3],
    "history_turns": [0, 4],
    "answer_tokens": [1, 3],
    "prompt_tokens": [1, 16],
    "new_tokens": [2, 3],
    "warmup": [0, 1],
    "runs": [1, 2],
    "seed": [0, 2**63 - 1],
}
PLAN_BAD = [
    None,
    True,
    "8",
    1.5,
    -1,
    0,
    10**6,
    2**63,
    [],
    {},
    [1],
    "",
    "../x",
    ".hidden",
    "a/b",
    " ",
    "gnd",
    ["gdn", 3],
    "gdn",
    float("inf"),
    float("nan"),
    "1979-05-27T07:32:00Z",
]


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        if isinstance(v, float) and math.isnan(v):
            return "nan"
        if isinstance(v, float) and math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        if re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", v):
            return v  # a TOML date-time
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if v is None:
        return '""'  # TOML has no null: the nearest is an empty string
    raise TypeError(type(v))


def _toml(plan: dict, dup: str | None = None) -> str:
    lines = []
    tables = []
    for k, v in plan.items():
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            tables += [(f"[[{k}]]", x) for x in v]
        elif isinstance(v, dict) and k == "timing":
            tables.append(("[timing]", v))
        else:
            lines.append(f"{json.dumps(k)} = {_toml_value(v)}")
    for head, table in tables:
        lines.append(head)
        lines += [f"{json.dumps(k)} = {_toml_value(x)}" for k, x in table.items()]
        if dup and dup == head:
            first = next(iter(table), None)
            if first is not None:
                lines.append(f"{json.dumps(first)} = {_toml_value(table[first])}")
    return "\n".join(lines) + "\n"


def _plan_places(plan: dict) -> list[tuple]:
    out = [(k,) for k in plan]
    out += [("corpus", i, k) for i, c in enumerate(plan["corpus"]) for k in list(c) + ["seed", "files", "field", "kind"]]
    out += [("timing", k) for k in plan["timing"]]
    out += [("row", i, k) for i, r in enumerate(plan["row"]) for k in list(r) + ["repeat"]]
    return out


# The JSON/TOML type each plan key must have (the spec, independent of how splicer checks it).
PLAN_KINDS = {
    **{
        k: int
        for k in (
            "top_k",
            "chunk_tokens",
            "max_chunks",
            "conversations",
            "history_turns",
            "answer_tokens",
            "prompt_tokens",
            "new_tokens",
            "warmup",
            "runs",
            "seed",
        )
    },
    **{k: str for k in ("name", "description", "kind", "text", "field")},
    **{k: list for k in ("files", "restore", "keep")},
    "base": bool,
    "repeat": bool,
}


def _effective(value):
    """The value as TOML hands it back (None is written as "", the date string becomes a datetime)."""
    if value is None:
        return ""
    if isinstance(value, str) and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", value):
        return object()
    return value


def mutate_plan(rng) -> tuple[str, str, str | None, str | None]:
    """(plan TOML, description, expectation, a key the refusal must name)."""
    plan = json.loads(json.dumps(BASE_PLAN))
    place = rng.choice(_plan_places(plan))
    op = rng.choices(["bad", "valid", "delete", "unknown", "dup", "shape"], [6, 2, 2, 1, 1, 1])[0]
    parent = _get(plan, place[:-1])
    key = place[-1]
    where = ".".join(map(str, place))
    if op == "valid" and key in PLAN_VALID:
        parent[key] = rng.choice(PLAN_VALID[key])
        return _toml(plan), f"{where} = {parent[key]!r} (in range)", "finish", None
    if op == "delete" and key in parent:
        del parent[key]
        required = (
            place in (("corpus",), ("row",))
            or (place[0] == "timing" and len(place) == 2)
            or (place[0] == "corpus" and key in ("name", "kind", "text"))
            or (place[0] == "row" and key in ("name", "restore", "base"))
        )
        optional = place in (("name",), ("description",), ("top_k",), ("timing",)) or (
            place[0] == "corpus" and key in ("max_chunks", "conversations", "history_turns", "answer_tokens")
        )
        return _toml(plan), f"{where} deleted", "refuse" if required else "finish" if optional else None, None
    if op == "unknown":
        parent["colour"] = "red"
        return _toml(plan), f"unknown key colour beside {where}", "refuse", "colour"
    if op == "dup":
        return _toml(plan, rng.choice(["[[corpus]]", "[timing]", "[[row]]"])), "a key stated twice in a table", "refuse", None
    if op == "shape":
        choice = rng.choice(["corpus-table", "row-string", "timing-array", "no-rows", "rows-empty", "corpus-array-of-str"])
        if choice == "corpus-table":
            text = _toml({k: v for k, v in plan.items() if k != "corpus"}) + '[corpus]\nname = "x"\nkind = "chat"\n'
            return text, "corpus given as one [corpus] table", "refuse", "corpus"
        if choice == "row-string":
            return _toml(dict(plan, row="build")), 'row = "build"', "refuse", "row"
        if choice == "timing-array":
            return (
                _toml({k: v for k, v in plan.items() if k != "timing"}) + "[[timing]]\nruns = 1\n",
                "timing as [[timing]]",
                "refuse",
                "timing",
            )
        if choice == "no-rows":
            return _toml({k: v for k, v in plan.items() if k != "row"}), "no rows", "refuse", "row"
        if choice == "rows-empty":
            return _toml(dict(plan, row=[])), "row = []", "refuse", "row"
        return _toml(dict(plan, corpus=["wiki-en"])), 'corpus = ["wiki-en"]', "refuse", "corpus"
    value = rng.choice(PLAN_BAD)
    parent[key] = value
    got, want = _effective(value), PLAN_KINDS.get(key)
    wrong = want is not None and not (isinstance(got, want) and not (want is int and isinstance(got, bool)))
    return _toml(plan), f"{where} = {value!r}", "refuse" if wrong else None, key if wrong else None


def _ablate_argv(build, base, out, plan, *extra) -> list[str]:
    return ["ablate", "all", str(build), str(base), "-o", str(out), "-q", "--device", "cpu", "--plan", str(plan), *extra]


def case_plan(rng, world: World, d: Path, group: str) -> Scenario:
    text, what, expect, mention = mutate_plan(rng)
    plan = d / "in" / "plan.toml"
    plan.parent.mkdir(parents=True)
    plan.write_text(text)
    out = d / "outs" / "DIR"
    extra = [] if rng.random() < 0.5 else ["--no-time"]
    return Scenario(
        f"plan: {what}",
        _ablate_argv(world.builds["lowlatency"], world.bases["lowlatency"], out, plan, *extra),
        "ablate",
        out,
        [plan],
        stub=True,
        expect=expect,
        mention=mention,
    )


# -- corpus files


_LONG = "The quick brown fox jumps over the lazy dog while the river runs past the old mill. " * 4


def _corpus_file(rng, folder: Path) -> tuple[Path, str, bool]:
    """(file, description, whether it is a valid corpus for the plan's 16-token chunks with field "text")."""
    good = json.dumps({"text": _LONG}).encode() + b"\n"
    jsonl = [
        (b'{"text": 5}\n', "text is a number", False),
        (b'{"text": null}\n', "text is null", False),
        (b'{"text": ["a", "b"]}\n', "text is a list", False),
        (b'{"text": {"a": 1}}\n', "text is an object", False),
        (b'{"text": true}\n', "text is true", False),
        (b'{"txt": "hello"}\n', "no text field", False),
        (b'["text"]\n', "a list record", False),
        (b'"just a string"\n', "a string record", False),
        (b"{not json\n", "not JSON", False),
        (b"\xff\xfe{}\n", "not UTF-8", False),
        (b"", "empty", False),
        (b"\n\n  \n", "blank lines", False),
        (b'{"text": "short"}\n', "too short for one chunk", False),
        (good + b'{"text": 7}\n', "a good line, then a number on line 2", False),
        (good, "a good record", True),
        (good + b"\n\n" + good, "good records with blank lines between", True),
        (json.dumps({"text": _LONG + "\ud800"}).encode() + b"\n", "a lone surrogate in the text", False),
        (b"[" * 50000 + b"\n", "deeply nested JSON", False),
        (json.dumps({"text": _LONG + "\u0000"}).encode() + b"\n", "a NUL in the text", True),
    ]
    txt = [
        (b"", "empty", False),
        (b"   \n", "whitespace", False),
        ("Gr\u00f6\u00dfe".encode("latin-1"), "latin-1", False),
        (_LONG.encode(), "good text", True),
        (b"\xef\xbb\xbf" + _LONG.encode(), "good text with a BOM", True),
        (b"hi", "too short", False),
    ]
    if rng.random() < 0.65:
        data, what, ok = rng.choice(jsonl)
        path = folder / "c.jsonl"
    else:
        data, what, ok = rng.choice(txt)
        path = folder / "c.txt"
    path.write_bytes(data)
    return path, f"{path.suffix} {what}", ok


def case_corpus(rng, world: World, d: Path, group: str) -> Scenario:
    folder = d / "in"
    folder.mkdir(parents=True)
    path, what, ok = _corpus_file(rng, folder)
    plan = dict(BASE_PLAN, corpus=[dict(BASE_PLAN["corpus"][0])], row=[{"name": "build", "restore": []}])
    how = rng.choice(["override", "plan-files", "plan-field"])
    if how == "override":
        argv_extra = ["--corpus", f"wiki-en={path}"]
    else:
        spec = {"name": "wiki-en", "kind": "text", "files": [str(path)], "chunk_tokens": 16, "max_chunks": 2}
        if how == "plan-field":
            spec["field"] = rng.choice(["txt", "text", "body"])
            what += f", field = {spec['field']!r}"
            ok = ok and (spec["field"] == "text" or path.suffix != ".jsonl")
        plan["corpus"] = [spec]
        argv_extra = []
    plan_path = folder / "plan.toml"
    plan_path.write_text(_toml(plan))
    out = d / "outs" / "DIR"
    return Scenario(
        f"corpus via {how}: {what}",
        _ablate_argv(world.builds["lowlatency"], world.bases["lowlatency"], out, plan_path, "--no-time", *argv_extra),
        "ablate",
        out,
        [folder],
        stub=True,
        expect="finish" if ok else "refuse",
    )


# -- CLI values


R, F_, E = "refuse", "finish", None  # expected outcome of a CLI value (E: depends on the rest of the command)
SPLICE_OPTIONS = {
    "--layers": {
        "0-999999999": R,
        "-1": R,
        "3-1": R,
        "0,,1": R,
        "one": R,
        "1-": R,
        "-": R,
        "": R,
        " ": R,
        "0-3": E,
        "2": E,
        "4": R,
        "00": E,
        "0x1": R,
        "1_0": R,
        "\u0663": R,
        "999999999999999999999999": R,
        "1e3": R,
        "0-1-2": R,
        "0, 2": E,
    },
    "--modules": {
        "(": R,
        "[": R,
        "*": R,
        "a{2,1}": R,
        "(?P<x>": R,
        "\\": R,
        "(?<=a+)b": R,
        "layers\\.0\\.": E,
        "experts": E,
        "zzz": R,
        "": E,
        ".*": E,
        "(?i)GATE": E,
    },
    "--restore": {
        "": R,
        ",": R,
        "gdn,,attention": F_,
        "GDN": R,
        "all,gdn": R,
        "experts,experts": F_,
        "mtp": R,
        "visual": R,
        "gdn ": F_,
    },
}
ABLATE_OPTIONS = {
    "--batch-size": {"0": R, "-1": R, "x": R, "1.5": R, "2147483648": R, "1": F_, "3": F_, "": R},
    "--bandwidth-gbs": {"0": R, "-1": R, "nan": R, "inf": R, "1e400": R, "x": R, "4800": F_, "1e-300": F_, "-0": R},
    # vLLM-only options: refused with the torch backend whatever their value
    "--gpu-memory-utilization": {"0": R, "1.5": R, "nan": R, "0.5": R, "x": R, "-0.1": R},
    "--max-model-len": {"1": R, "0": R, "x": R, "2048": R},
    "--tensor-parallel-size": {"0": R, "-1": R, "2": R, "x": R},
    "--overlap-starts": {"-1": R, "x": R, "1": R, "99999999999": R},
    "--engine-arg": {"": R, "x": R, "=1": R, "a=": R, "a={": R, "max_model_len=2048": R, "enforce_eager=true": R},
    "--engine-env": {"": R, "x": R, "=1": R, "A B=1": R, "VLLM_X=1": R, "CUDA_VISIBLE_DEVICES=0": R},
    # the torch backend runs on auto, cpu, cuda and cuda:N (cuda only where torch sees a GPU: none in CI)
    "--device": {"tpu": R, "cuda:x": R, "": R, "cpu:0": R, "cuda": E, "cpu": F_, "cuda:99": R, "mps": R, "meta": R, "auto": F_},
    "--corpus": {"x": R, "=a": R, "a=": R, "wiki-en=/nonexistent.txt": R, "nosuch=file.txt": R, "wiki-en=": R},
    "--plan": {"": R, "/nonexistent.toml": R, "nosuch": R, "DIRPLAN": R},
    "--backend": {"vllm": R, "tf": R, "": R},
    "ROWS": {"": R, ",": R, "nosuch": R, "build,build": F_, "gdn": F_, " gdn , base ": R},
}
OTHER_COMMANDS = [
    (["fixture", "OUT", "--seed", "-1"], R),
    (["fixture", "OUT", "--seed", "x"], R),
    (["fixture", "OUT", "--seed", "2147483648"], R),
    (["fixture", "OUT", "--seed", "1.5"], R),
    (["fixture", "OUT", "--builds", ","], R),
    (["fixture", "OUT", "--builds", "nosuch"], R),
    (["fixture", "OUT", "--preset", "huge"], R),
    (["fixture", "OUT", "--experts-layout", "x"], R),
    # never `--device cuda` here: on a GPU machine that would draw the 22 GB stand-in
    (["fixture", "OUT", "--full-dims", "--device", "tpu"], R),
    (["fixture", "OUT", "--full-dims", "--device", ""], R),
    (["inspect", ""], R),
    (["inspect", "/"], R),
    (["inspect", "/dev/null"], R),
    (["inspect", "nobody/none"], R),
    (["inspect", "BUILD", "--json"], F_),
    (["inspect", "BUILD", "--nope"], R),
    (["table", "RESULTS", "--format", "xml"], R),
    (["table", "RESULTS", "--format", "csv"], F_),
    (["table", "/nonexistent"], R),
    (["table", "BUILD"], R),
    (["table", "/dev/null"], R),
    (["compare", "RESULTS", "build", "nosuch"], R),
    (["compare", "RESULTS", "build", "gdn"], F_),
    (["compare", "RESULTS", "gdn", "gdn"], E),
    (["compare", "RESULTS"], R),
    (["splice"], R),
    (["splice", "--restore", "gdn"], R),
    (["ablate"], R),
    (["nope"], R),
    ([], R),
    (["--nope"], R),
    (["ablate", "all", "-o", "OUTDIR", "--demo", "BUILD"], R),
]


def case_cli(rng, world: World, d: Path, group: str) -> Scenario:
    build, base = world.builds["lowlatency"], world.bases["lowlatency"]
    outs = d / "outs"
    roll = rng.random()
    if roll < 0.35:
        opt = rng.choice(sorted(SPLICE_OPTIONS))
        value, expect = rng.choice(sorted(SPLICE_OPTIONS[opt].items()))
        out = outs / "OUT"
        restore = value if opt == "--restore" else rng.choice(["experts", "gdn", "attention", "all"])
        argv = ["splice", "--restore", restore, str(build), str(base), "-o", str(out)]
        if opt != "--restore":
            argv += [opt, value]
        if rng.random() < 0.7:
            argv.append("-q")
        return Scenario(
            f"cli splice {opt} {value!r} (restore {restore})",
            argv,
            "splice",
            out,
            [],
            build,
            base,
            expect=expect,
            mention=opt if expect == R and opt != "--restore" else None,
        )
    if roll < 0.75:
        opt = rng.choice(sorted(ABLATE_OPTIONS))
        value, expect = rng.choice(sorted(ABLATE_OPTIONS[opt].items()))
        out = outs / "DIR"
        plan = d / "in" / "plan.toml"
        plan.parent.mkdir(parents=True)
        plan.write_text(_toml(dict(BASE_PLAN, row=BASE_PLAN["row"][:2])))
        rows = value if opt == "ROWS" else "all"
        argv = ["ablate", rows, str(build), str(base), "-o", str(out), "--no-time"]
        if opt == "--plan":
            if value == "DIRPLAN":
                (d / "in" / "x.toml").mkdir()
                value = str(d / "in" / "x.toml")
            argv += ["--plan", value]
        else:
            argv += ["--plan", str(plan)]
        if opt == "--corpus" and value.endswith("file.txt"):
            value = value.replace("file.txt", str(d / "in" / "file.txt"))
        if opt not in ("ROWS", "--plan"):
            argv += [opt, value]
        if opt != "--device":
            argv += ["--device", "cpu"]
        if rng.random() < 0.7:
            argv.append("-q")
        return Scenario(f"cli ablate {opt} {value!r}", argv, "ablate", out, [plan.parent], stub=True, expect=expect)
    template, expect = rng.choice(OTHER_COMMANDS)
    argv = list(template)
    command = argv[0] if argv and not argv[0].startswith("-") else "parse"
    out = None
    for i, a in enumerate(argv):
        if a in ("OUT", "OUTDIR"):
            out = argv[i] = outs / a
        elif a == "BUILD":
            argv[i] = build
        elif a == "RESULTS":
            argv[i] = world.results
    return Scenario(
        f"cli {' '.join(map(str, argv))}", [str(a) for a in argv], command, Path(out) if out else None, [], expect=expect
    )


def case_output(rng, world: World, d: Path, group: str) -> Scenario:
    """Where the output goes: an existing OUT (splicer's or someone's), a file, a symlink, inside or around an input,
    a missing parent, a stale or held lock, a stale partial folder; and the same for ablate's DIR."""
    kind = rng.choice(["lowlatency", "experts-g32"])
    build, base = world.builds[kind], world.bases[kind]
    outs = d / "outs"
    outs.mkdir(parents=True)
    force = rng.random() < 0.5
    if rng.random() < 0.3:
        return _ablate_output(rng, world, d, outs)
    out = outs / "OUT"
    restore = rng.choice(RESTORES[kind])
    op = rng.choice(
        [
            "empty-dir",
            "foreign-dir",
            "earlier-splice",
            "file",
            "symlink-to-dir",
            "inside-input",
            "is-input",
            "around-input",
            "missing-parent",
            "stale-lock",
            "held-lock",
            "stale-partial",
        ]
    )
    inputs, keep, hold, expect = [], [], None, "refuse"
    b = build
    if op == "empty-dir":
        out.mkdir()
    elif op == "foreign-dir":
        out.mkdir()
        (out / "notes.txt").write_text("someone's")
        keep = [out]
    elif op == "earlier-splice":
        assert main(["splice", "--restore", restore, str(build), str(base), "-o", str(out), "-q"]) == 0
        expect = "finish" if force else "refuse"
        keep = [] if force else [out]
    elif op == "file":
        out.write_text("a file")
        keep = [out]
    elif op == "symlink-to-dir":
        (outs / "real").mkdir()
        out.symlink_to(outs / "real")
        keep = [outs / "real"]
    elif op in ("inside-input", "is-input", "around-input"):
        b = _clone(build, d / "in" / "build")
        inputs = [b]
        out = {"inside-input": b / "OUT", "is-input": b, "around-input": d / "in"}[op]
    elif op == "missing-parent":
        out = outs / "missing" / "OUT"
    elif op in ("stale-lock", "held-lock"):
        lock = outs / ".OUT.splicer-lock"
        lock.write_text("")
        hold = lock if op == "held-lock" else None
        expect = "refuse" if op == "held-lock" else "finish"
    elif op == "stale-partial":
        (outs / ".OUT.splicer-partial").mkdir()
        (outs / ".OUT.splicer-partial" / "model-00001-of-00011.safetensors").write_bytes(b"half a shard")
        expect = "finish"
    argv = ["splice", "--restore", restore, str(b), str(base), "-o", str(out), "-q"] + (["--force"] if force else [])
    sc = Scenario(
        f"output {op}{' --force' if force else ''} ({kind} {restore})",
        argv,
        "splice",
        out,
        inputs,
        b,
        base,
        expect=expect,
        keep=keep,
        hold=hold,
    )
    if op == "missing-parent":
        sc.watch = outs  # OUT's parent does not exist (and must not be created): watch the folder above it
    return sc


def _ablate_output(rng, world: World, d: Path, outs: Path) -> Scenario:
    build, base = world.builds["lowlatency"], world.bases["lowlatency"]
    plan = d / "in" / "plan.toml"
    plan.parent.mkdir(parents=True)
    plan.write_text(TINY_PLAN)
    out = outs / "DIR"
    op = rng.choice(["foreign-dir", "earlier-run", "file", "symlink", "is-input", "missing-parents", "held-lock"])
    keep, hold, expect, inputs = [], None, "refuse", [plan.parent]
    b = build
    if op == "foreign-dir":
        out.mkdir()
        (out / "notes.txt").write_text("someone's")
        keep = [out]
    elif op == "earlier-run":
        shutil.copytree(world.results, out)  # the same job: resumed, every row already done
        expect = "finish"
    elif op == "file":
        out.write_text("a file")
        keep = [out]
    elif op == "symlink":
        (outs / "real").mkdir()
        out.symlink_to(outs / "real")
        keep = [outs / "real"]
    elif op == "is-input":
        b = _clone(build, d / "in" / "build")
        inputs.append(b)
        out = b
    elif op == "missing-parents":
        out = outs / "new" / "DIR"
        expect = "finish"
    elif op == "held-lock":
        shutil.copytree(world.results, out)
        (out / ".lock").write_text("")
        hold = out / ".lock"
        keep = [out]
    argv = ["ablate", "all", str(b), str(base), "-o", str(out), "-q", "--no-time", "--device", "cpu", "--plan", str(plan)]
    sc = Scenario(f"output ablate {op}", argv, "ablate", out, inputs, stub=True, expect=expect, keep=keep, hold=hold)
    if op == "missing-parents":
        sc.watch = outs  # ablate creates DIR's parents once every input is checked
    return sc


def case_symlink(rng, world: World, d: Path, group: str) -> Scenario:
    """Inputs reached through symlinks: the folder itself, a Hub-cache layout (files are links into blobs/), and
    dangling or misdirected links."""
    kind = rng.choice(["lowlatency", "experts-g32", "gptq"])
    build, base = world.builds[kind], world.bases[kind]
    target = rng.choice(["build", "base"])
    src = build if target == "build" else base
    op = rng.choice(["folder-link", "hub-layout", "dangling-config", "dangling-shard", "config-to-other"])
    expect = "refuse"
    if op == "folder-link":
        real = _clone(src, d / "in" / "real")
        folder = d / "in" / "link"
        folder.symlink_to(real)
        expect = "finish"
    else:
        folder = d / "in" / "snapshot"
        folder.mkdir(parents=True)
        blobs = d / "in" / "blobs"
        blobs.mkdir()
        for p in sorted(src.iterdir()):
            if p.is_file():
                blob = blobs / hashlib.sha256(p.name.encode()).hexdigest()
                (os.link if p.suffix == ".safetensors" else shutil.copy2)(p, blob)
                (folder / p.name).symlink_to(os.path.relpath(blob, folder))
        if op == "hub-layout":
            expect = "finish"
        elif op == "dangling-config":
            (blobs / hashlib.sha256(b"config.json").hexdigest()).unlink()
        elif op == "dangling-shard":
            wm = json.loads((folder / INDEX_NAME).read_text())["weight_map"]
            victim = folder / rng.choice(sorted(set(wm.values())))
            os.unlink(os.path.realpath(victim))
            expect = "refuse" if target == "build" else None
        else:
            other = (base if target == "build" else build) / "config.json"
            (folder / "config.json").unlink()
            (folder / "config.json").symlink_to(other)
            expect = "refuse" if target == "build" else None  # a base whose config is the build's is itself quantized
    b, s_ = (folder, base) if target == "build" else (build, folder)
    out = d / "outs" / "OUT"
    argv = _splice_argv(rng, b, s_, out, kind)
    return Scenario(f"symlink {op} {kind} {target} ({argv[2]})", argv, "splice", out, [d / "in"], b, s_, expect=expect)


BUILDERS = {
    "build-config": case_config,
    "gptq-config": case_config,
    "base-config": case_config,
    "index": case_index,
    "header": case_header,
    "plan": case_plan,
    "corpus": case_corpus,
    "cli": case_cli,
    "output": case_output,
    "symlink": case_symlink,
}


def _cases() -> list[tuple[str, str, int]]:
    rng = random.Random(SEED)
    return [(f"{group}-{i:03d}", group, rng.getrandbits(32)) for group, n in GROUPS.items() for i in range(n)]


CASES = _cases()


@pytest.mark.parametrize("case_id,group,seed", CASES, ids=[c[0] for c in CASES])
def test_fuzz(world, monkeypatch, capsys, case_id, group, seed):
    t0 = time.perf_counter()
    rng = random.Random(seed)
    case_dir = world.work / case_id
    shutil.rmtree(case_dir, ignore_errors=True)
    case_dir.mkdir()
    try:
        sc = BUILDERS[group](rng, world, case_dir, group)
        outcome, problems = run_scenario(sc, world, case_dir, monkeypatch, capsys)
    finally:
        _forget(case_dir)
        shutil.rmtree(case_dir, ignore_errors=True)  # ~400 cases: keep the disk use of one
    OUTCOMES[outcome] += 1
    BY_GROUP[group][outcome] += 1
    if os.environ.get("SPLICER_FUZZ_TRACE"):  # one line per case: what was broken and what the CLI made of it
        with capsys.disabled():
            print(
                f"\n{case_id} {outcome} {time.perf_counter() - t0:.2f}s {sc.what[:150]}"
                + (f"\n    {sc.said[:300]}" if sc.said else "")
            )
    if problems:
        reason = _lead_reason(sc.what)
        if reason:
            pytest.xfail(f"LEAD: {reason} [{sc.what}]")
        pytest.fail(f"{case_id}: {sc.what}\n  argv: {' '.join(sc.argv)}\n  " + "\n  ".join(problems), pytrace=False)


@pytest.mark.parametrize("command", PIPE_CASES)
def test_output_into_a_closed_pipe(world, tmp_path, command):
    """stdout closed by its reader (`splicer ... | head -0`): no traceback, nothing on stderr, exit 0 or 141, and a
    splice's output is whole. A real process: what matters happens when the interpreter flushes stdout at exit."""
    build, base = world.builds["lowlatency"], world.bases["lowlatency"]
    argv = {
        "inspect": ["inspect", str(build)],
        "table": ["table", str(world.results)],
        "splice": ["splice", "--restore", "gdn", str(build), str(base), "-o", str(tmp_path / "OUT"), "-q"],
    }[command]
    r, w = os.pipe()
    os.close(r)
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, "-m", "splicer", *argv], stdout=w, stderr=subprocess.PIPE, env=env, timeout=120)
    os.close(w)
    err = p.stderr.decode()
    OUTCOMES[f"exit {p.returncode}"] += 1
    BY_GROUP["closed-pipe"][f"exit {p.returncode}"] += 1
    assert p.returncode in (0, 141) and not err.strip(), (p.returncode, err)
    if command == "splice":
        assert not _verify_splice(tmp_path / "OUT", build, base)


def test_fuzz_summary(world, capsys):
    """The case counts and outcomes (printed for the record), the shared fixtures byte-identical after every case, and a
    mix of outcomes: a generator whose every case is refused at once, or none, would test little."""
    for p, digest in world.shared_digest.items():
        assert tree_digest(Path(p)) == digest, f"{p} changed during the fuzz run"
    total = sum(OUTCOMES.values())
    lines = [f"fuzz (seed {SEED}): {total} cases: " + ", ".join(f"{k} {v}" for k, v in sorted(OUTCOMES.items()))]
    lines += [f"  {g}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())) for g, c in sorted(BY_GROUP.items())]
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    if total < len(CASES) + len(PIPE_CASES):
        pytest.skip(f"only {total} of {len(CASES) + len(PIPE_CASES)} cases ran (selected with -k?)")
    assert OUTCOMES["exit 2"] >= total * 0.3 and OUTCOMES["exit 0"] >= total * 0.1, lines[0]
