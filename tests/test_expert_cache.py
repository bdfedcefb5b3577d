"""--expert-cache (splicer/backends/vllm_expert_cache.py): the key, the saved entries, and the loader on the stand-in
vLLM's DefaultModelLoader (tests/fake_vllm, vLLM 0.26's interface) with a toy model in vLLM's layout. Whether a real
vLLM engine gives the same scores with the cache is a GPU question (scripts/gpu/start_profile.py --cuts expert_cache)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from splicer.arch import get_architecture
from splicer.backends import vllm_expert_cache as xc
from splicer.backends.vllm_backend import VllmOptions
from splicer.errors import SplicerError

E, H, INTER = 4, 8, 6  # experts, hidden, intermediate size
DEC = "model.language_model.layers.0."


def _config(ignore=(), groups=None):
    return {
        "model_type": "qwen3_5_moe",
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "text_config": {"model_type": "qwen3_5_moe_text", "num_experts": E, "hidden_size": H},
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "config_groups": groups or {"g": {"targets": ["Linear"]}},
            "ignore": list(ignore),
        },
    }


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(E):
        for p, shape in (("gate_proj", (INTER, H)), ("up_proj", (INTER, H)), ("down_proj", (H, INTER))):
            out[f"{DEC}mlp.experts.{e}.{p}.weight"] = torch.randn(shape, generator=g)
    for p, shape in (("gate_proj", (INTER, H)), ("up_proj", (INTER, H)), ("down_proj", (H, INTER))):
        out[f"{DEC}mlp.shared_expert.{p}.weight"] = torch.randn(shape, generator=g)
    out[f"{DEC}mlp.gate.weight"] = torch.randn(E, H, generator=g)
    out["lm_head.weight"] = torch.randn(16, H, generator=g)
    out["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.randn(INTER, H, generator=g)
    return out


def write_ckpt(folder: Path, tensors: dict, *, files=1, ignore=(), groups=None) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(_config(ignore, groups)))
    names = sorted(tensors)
    for i in range(files):
        part = {n: tensors[n] for n in names[i::files]}
        save_file(part, str(folder / f"model-{i + 1:05d}-of-{files:05d}.safetensors"))
    return folder


class RoutedExperts(torch.nn.Module):
    """vLLM's module of the routed experts' weights (named so: the loader finds these modules by class name)."""

    def __init__(self):
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(E, 2 * INTER, H), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.zeros(E, H, INTER), requires_grad=False)


class ToyMoE(torch.nn.Module):
    """vLLM 0.26's layout of a Qwen3.5 MoE layer: mlp.experts is the MoE runner, whose children are the routed experts
    (fused per layer, w13 = gate and up stacked), the router gate and the shared expert, which is also mlp.shared_expert.
    load_weights maps checkpoint names one tensor at a time, as vLLM's model does, and records what it was given."""

    def __init__(self):
        super().__init__()
        lm = torch.nn.Module()
        lm.model = torch.nn.Module()
        layer = torch.nn.Module()
        layer.mlp = torch.nn.Module()
        shared = torch.nn.Module()
        shared.gate_up_proj = torch.nn.Linear(H, 2 * INTER, bias=False)
        shared.down_proj = torch.nn.Linear(INTER, H, bias=False)
        layer.mlp.shared_expert = shared
        layer.mlp.experts = torch.nn.Module()
        layer.mlp.experts.routed_experts = RoutedExperts()
        layer.mlp.experts.gate = torch.nn.Linear(H, E, bias=False)
        layer.mlp.experts._shared_experts = torch.nn.Module()
        layer.mlp.experts._shared_experts._layer = shared
        lm.model.layers = torch.nn.ModuleList([layer])
        lm.lm_head = torch.nn.Linear(H, 16, bias=False)
        self.language_model = lm
        self.given: list[str] = []

    @torch.no_grad()
    def load_weights(self, weights):
        layer = self.language_model.model.layers[0]
        routed = layer.mlp.experts.routed_experts
        prefix = "language_model.model.layers.0.mlp."
        loaded = set()
        for name, t in weights:
            self.given.append(name)
            parts = name.split(".")
            if name.startswith(DEC + "mlp.experts."):
                e, proj = int(parts[6]), parts[7]
                if proj == "down_proj":
                    routed.w2_weight[e].copy_(t)
                    loaded.add(prefix + "experts.routed_experts.w2_weight")
                else:
                    half = slice(0, INTER) if proj == "gate_proj" else slice(INTER, 2 * INTER)
                    routed.w13_weight[e, half].copy_(t)
                    loaded.add(prefix + "experts.routed_experts.w13_weight")
            elif name.startswith(DEC + "mlp.shared_expert."):
                proj = parts[6]
                if proj == "down_proj":
                    layer.mlp.shared_expert.down_proj.weight.copy_(t)
                    loaded.add(prefix + "shared_expert.down_proj.weight")
                else:
                    half = slice(0, INTER) if proj == "gate_proj" else slice(INTER, 2 * INTER)
                    layer.mlp.shared_expert.gate_up_proj.weight[half].copy_(t)
                    loaded.add(prefix + "shared_expert.gate_up_proj.weight")
            elif name == DEC + "mlp.gate.weight":
                layer.mlp.experts.gate.weight.copy_(t)
                loaded.add(prefix + "experts.gate.weight")
            elif name == "lm_head.weight":
                self.language_model.lm_head.weight.copy_(t)
                loaded.add("language_model.lm_head.weight")
        # the shared expert and the gate are registered twice (as vLLM's runner holds them): both names are loaded
        loaded |= {prefix + "experts._shared_experts._layer." + n for n, _ in layer.mlp.shared_expert.named_parameters()}
        return loaded


@pytest.fixture
def fake_vllm(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "fake_vllm"))
    for m in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, m)
    xc._digests.clear()
    xc._file_sums.clear()
    xc.register()
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    return _LOAD_FORMAT_TO_MODEL_LOADER[xc.LOAD_FORMAT]


def _load(loader_cls, folder, cache, monkeypatch, quantization="compressed-tensors"):
    monkeypatch.setenv(xc.ENV, str(cache))
    loader = loader_cls(SimpleNamespace(load_format=xc.LOAD_FORMAT, model_loader_extra_config={}))
    model = ToyMoE()
    cfg = SimpleNamespace(
        model=str(folder), dtype=torch.float32, quantization=quantization, hf_config=SimpleNamespace(model_type="qwen3_5_moe")
    )
    loader.load_weights(model, cfg)
    return model, loader, xc.last_outcome()


def test_expert_names_from_the_family_table():
    rx = xc.checkpoint_expert_regex(get_architecture(_config()))
    assert rx.match(DEC + "mlp.experts.3.down_proj.weight_packed")
    assert rx.match(DEC + "mlp.experts.gate_up_proj")  # the BF16 base's fused tensors
    assert not rx.match(DEC + "mlp.shared_expert.gate_proj.weight")
    assert not rx.match("mtp.layers.0.mlp.experts.0.gate_proj.weight")  # the MTP head loads the normal way
    assert not rx.match("lm_head.weight")


def test_key_is_the_expert_bytes_not_the_file_layout(tmp_path):
    rx = xc.checkpoint_expert_regex(get_architecture(_config()))
    t = _tensors()
    one = write_ckpt(tmp_path / "one", t)
    # another split over files, a different shared expert and head (a restored variant): the same key
    other = dict(t, **{k: v + 1 for k, v in t.items() if "experts." not in k or "shared" in k})
    three = write_ckpt(tmp_path / "three", other, files=3)
    ctx = {"vllm": "0.26.0"}
    k1, n1, b1 = xc.experts_digest(one, rx, ctx)
    k3, n3, b3 = xc.experts_digest(three, rx, ctx)
    assert (k1, n1, b1) == (k3, n3, b3) and n1 == 3 * E and b1 == 3 * E * INTER * H * 4
    changed = dict(t)
    changed[DEC + "mlp.experts.2.up_proj.weight"] = t[DEC + "mlp.experts.2.up_proj.weight"].clone()
    changed[DEC + "mlp.experts.2.up_proj.weight"][0, 0] += 1e-3
    assert xc.experts_digest(write_ckpt(tmp_path / "changed", changed), rx, ctx)[0] != k1
    assert xc.experts_digest(one, rx, {"vllm": "0.33.0"})[0] != k1


def test_a_hard_linked_shard_is_hashed_once_per_process(tmp_path, monkeypatch):
    """A splice hard-links the build's unchanged shards into each variant: the key of a variant whose expert files
    are the build's inodes reads none of them again; a copy of the same bytes (another inode) is read and gives the
    same key; a file changed since is read again and gives another."""
    import hashlib
    import os
    import shutil

    xc._digests.clear(), xc._file_sums.clear()
    rx = xc.checkpoint_expert_regex(get_architecture(_config()))
    t = _tensors()
    build = write_ckpt(tmp_path / "build", t, files=3)
    calls = []
    real = hashlib.sha256
    monkeypatch.setattr(xc.hashlib, "sha256", lambda *a: calls.append(len(a[0]) if a else 0) or real(*a))

    def variant(name, link=True):
        out = tmp_path / name
        out.mkdir()
        for f in build.iterdir():
            (os.link if link and f.suffix == ".safetensors" else shutil.copyfile)(f, out / f.name)
        return out

    ctx = {"vllm": "0.26.0"}
    key = xc.experts_digest(build, rx, ctx)
    hashed = len(calls)
    assert hashed > 3 * E  # every expert tensor, then the key
    calls.clear()
    assert xc.experts_digest(variant("linked"), rx, ctx) == key
    assert len(calls) == 1  # the key alone: no expert tensor read again
    calls.clear()
    assert xc.experts_digest(variant("copied", link=False), rx, ctx) == key
    assert len(calls) == hashed
    calls.clear()
    changed = variant("changed", link=False)
    shard, name, offset = _first_expert_tensor(changed, rx)
    data = bytearray(shard.read_bytes())
    data[offset] ^= 1  # one byte of an expert tensor, in a file this process has not seen
    shard.write_bytes(bytes(data))
    assert xc.experts_digest(changed, rx, ctx)[0] != key[0], name


def _first_expert_tensor(folder, rx):
    """(file, tensor name, absolute offset of its first byte) of the first expert tensor in folder's shards."""
    import struct

    for shard in sorted(folder.glob("*.safetensors")):
        with open(shard, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        for k, v in header.items():
            if k != "__metadata__" and rx.match(k):
                return shard, k, 8 + n + v["data_offsets"][0]
    raise AssertionError("no expert tensor")


def test_entry_round_trip_and_refusals(tmp_path, monkeypatch):
    state = {"a.experts.w13": torch.arange(12.0).reshape(3, 4), "a.experts.scale": torch.ones(3, dtype=torch.float16)}
    entry, why = xc.save_entry(tmp_path / "c", "k1", state, {"source": "x"})
    assert entry and not why and xc.find_entry(tmp_path / "c", "k1", state) == entry
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    assert xc.copy_entry(entry, target) == 12 * 4 + 3 * 2
    assert all(torch.equal(target[k], state[k]) for k in state)
    assert xc.find_entry(tmp_path / "c", "k1", {"a.experts.w13": torch.zeros(3, 5)}) is None  # another layout
    assert xc.find_entry(tmp_path / "c", "k2", state) is None
    base = torch.zeros(8)
    assert xc.save_entry(tmp_path / "c", "k3", {"x": base[:4], "y": base[:4]}, {})[0] is None  # one storage twice
    monkeypatch.setattr(xc, "SPARE_BYTES", 1 << 60)
    entry, why = xc.save_entry(tmp_path / "c", "k4", state, {})
    assert entry is None and "GiB free" in why and not list((tmp_path / "c").glob(".k4*"))


def test_loader_saves_once_then_copies_the_experts(tmp_path, monkeypatch, fake_vllm):
    t = _tensors()
    build = write_ckpt(tmp_path / "build", t)
    variant_t = dict(t, **{k: v * 0 + 0.5 for k, v in t.items() if "shared_expert" in k or "mlp.gate." in k})
    variant = write_ckpt(tmp_path / "variant", variant_t, files=2, ignore=["re:.*shared_expert.*"])
    cache = tmp_path / "cache"

    first, loader1, out1 = _load(fake_vllm, build, cache, monkeypatch)
    assert out1["do"] == "save" and out1["saved"] and out1["expert_tensors"] == 3 * E
    assert any(".mlp.experts." in n for n in first.given)

    second, loader2, out2 = _load(fake_vllm, variant, cache, monkeypatch)
    assert out2["do"] == "load" and out2["key"] == out1["key"]
    # the checkpoint's expert tensors were neither read nor given to the model; everything else was
    assert not [n for n in loader2.reads if n.startswith(DEC + "mlp.experts.")]
    assert not [n for n in second.given if n.startswith(DEC + "mlp.experts.")]
    assert "mtp.layers.0.mlp.experts.0.gate_proj.weight" in second.given
    s1, s2 = first.state_dict(), second.state_dict()
    for k in s1:
        if ".routed_experts." in k:
            assert torch.equal(s1[k], s2[k]), k
    assert torch.equal(s2["language_model.model.layers.0.mlp.shared_expert.down_proj.weight"], torch.full((H, INTER), 0.5))

    # other expert bytes: a new key, loaded the normal way and saved beside the first
    other = write_ckpt(tmp_path / "other", _tensors(seed=1))
    third, _, out3 = _load(fake_vllm, other, cache, monkeypatch)
    assert out3["do"] == "save" and out3["key"] != out1["key"]
    assert torch.equal(
        third.language_model.model.layers[0].mlp.experts.routed_experts.w2_weight[1],
        _tensors(seed=1)[DEC + "mlp.experts.1.down_proj.weight"],
    )
    assert len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 2


def test_a_config_group_that_certainly_reaches_no_expert_leaves_the_key_alone(tmp_path, monkeypatch, fake_vllm):
    """A build with an INT8 lm_head has a config group for it that a variant with lm_head restored drops: the experts'
    bytes and scheme are the same, so the variant copies the build's saved experts. A group is left out of the key only
    when every target of it names or matches another module of the checkpoint and no expert; one that reaches the
    experts, or that might as vLLM reads it (a class, vLLM's spelling of a name, a pattern over fused experts), stays:
    another group there is another key."""
    int4 = {"targets": ["Linear"], "weights": {"num_bits": 4}}
    head = {"targets": ["re:.*lm_head$"], "weights": {"num_bits": 8}}
    t = _tensors()
    build = write_ckpt(tmp_path / "build", t, groups={"group_0": int4, "group_1": head})
    restored_head = write_ckpt(tmp_path / "lm_head", t, groups={"group_0": int4}, ignore=["lm_head"])
    cache = tmp_path / "cache"
    _, _, first = _load(fake_vllm, build, cache, monkeypatch)
    _, _, second = _load(fake_vllm, restored_head, cache, monkeypatch)
    assert first["do"] == "save" and second["do"] == "load" and second["key"] == first["key"]
    experts, other = xc.checkpoint_modules(build, xc.checkpoint_expert_regex(get_architecture(_config())))
    assert DEC + "mlp.experts.0.down_proj" in experts and len(experts) == 3 * E and "lm_head" in other
    # the head by its exact name, or beside the shared expert: still only elsewhere
    for name, elsewhere in {"by name": ["lm_head"], "two patterns": ["re:.*lm_head$", "re:.*shared_expert\\..*"]}.items():
        variant = write_ckpt(tmp_path / name, t, groups={"group_0": int4, "group_1": {"targets": elsewhere}})
        assert _load(fake_vllm, variant, cache, monkeypatch)[2]["key"] == first["key"], name
    for name, targets in {
        "a pattern": ["re:.*mlp\\.experts\\..*"],
        "a module's name": [DEC + "mlp.experts.1.up_proj"],
        "a class": ["Linear"],
        "vLLM's spelling": ["re:language_model\\.model\\.layers\\..*experts.*"],
        "a lowercase class": ["fusedmoe"],
        "fused experts": ["re:.*experts\\.gate_up_proj$"],
        "the head and a class": ["re:.*lm_head$", "Linear"],
    }.items():
        variant = write_ckpt(
            tmp_path / name, t, groups={"group_0": int4, "group_1": {"targets": targets, "weights": {"num_bits": 8}}}
        )
        assert _load(fake_vllm, variant, cache, monkeypatch)[2]["key"] != first["key"], name


def test_the_stand_ins_splices_share_the_builds_key(pairs, tmp_path):
    """On the fixture's build (INT4 experts, an INT8 lm_head group) and its splices, as a plan makes them: every
    variant that keeps the build's experts has the build's expert bytes and schemes, whichever classes it restores."""
    from splicer.splice.core import splice

    p = pairs["fused"]
    build = p["lowlatency"]
    rx = xc.checkpoint_expert_regex(get_architecture(json.loads((build / "config.json").read_text())))
    assert rx is not None

    def key(folder):
        return xc.experts_digest(folder, rx, {}), xc.quant_schemes(folder, xc.checkpoint_modules(folder, rx))

    want = key(build)
    assert want[0][1] > 0 and len(want[1]["config_groups"]) == 1  # the lm_head group is out of the key
    for restore in (["lm_head"], ["gdn"], ["attention", "shared_expert", "lm_head"]):
        out = tmp_path / "+".join(restore)
        splice(str(build), str(p["base"]), out, ",".join(restore), progress=False)
        assert key(out) == want, restore


def test_unquantized_model_skips_strict_tracking_only_when_the_experts_come_from_the_cache(tmp_path, monkeypatch, fake_vllm):
    build = write_ckpt(tmp_path / "bf16", _tensors())
    _load(fake_vllm, build, tmp_path / "c", monkeypatch, quantization=None)  # every parameter loaded: tracking passes
    _, _, out = _load(fake_vllm, build, tmp_path / "c", monkeypatch, quantization=None)
    assert out["do"] == "load"


def test_mtp_drafter_loads_normally_and_leaves_the_main_models_record(tmp_path, monkeypatch, fake_vllm):
    build = write_ckpt(tmp_path / "b", _tensors())
    xc.reset()
    _, loader, main = _load(fake_vllm, build, tmp_path / "c", monkeypatch)  # the main model first, as vLLM loads them
    cfg = SimpleNamespace(
        model=str(build), dtype=torch.float32, quantization="x", hf_config=SimpleNamespace(model_type="qwen3_5_mtp")
    )
    drafter = ToyMoE()
    loader.load_weights(drafter, cfg)
    assert any(n.startswith(DEC + "mlp.experts.") for n in drafter.given)  # the normal path: every tensor
    assert xc.last_outcome() == main and main["do"] == "save"


def test_options_refuse_what_cannot_work_and_keep_the_cache_out_of_the_job(tmp_path):
    o = VllmOptions(expert_cache=tmp_path / "xc")
    # how weights reach the GPU, not the weights: the job and the base pass's cache key are those of a run without it
    assert o.job_settings() == VllmOptions().job_settings() and o.cache_key() == VllmOptions().cache_key()
    assert o.tasks().expert_cache is None  # lm-eval builds its engine outside splicer's worker
    with pytest.raises(SplicerError, match="load_format=fastsafetensors"):
        VllmOptions(expert_cache=tmp_path, engine_args={"load_format": "fastsafetensors"})
    with pytest.raises(SplicerError, match="drop --process-per-variant"):
        VllmOptions(expert_cache=tmp_path, process_per_variant=True)
    with pytest.raises(SplicerError, match="tensor_parallel_size=2"):
        VllmOptions(expert_cache=tmp_path, engine_args={"tensor_parallel_size": 2})
    with pytest.raises(SplicerError, match="give --expert-cache DIR instead"):
        VllmOptions(engine_args={"load_format": xc.LOAD_FORMAT})
    (tmp_path / "file").write_text("")
    with pytest.raises(SplicerError, match="not a folder"):
        VllmOptions(expert_cache=tmp_path / "file")


def test_a_save_that_cannot_be_made_is_reported_not_raised(tmp_path, monkeypatch, fake_vllm):
    build = write_ckpt(tmp_path / "b", _tensors())
    (tmp_path / "file").write_text("")
    model, _, out = _load(fake_vllm, build, tmp_path / "file" / "cache", monkeypatch)  # cannot make the folder
    assert out["do"] == "save" and not out["saved"] and "not saved" in out["why"]
    assert torch.equal(model.language_model.lm_head.weight, _tensors()["lm_head.weight"])  # the engine loaded anyway
    cache = tmp_path / "c"
    cache.mkdir()
    (cache / f".{out['key']}.lock").write_text(str(__import__("os").getpid()))  # another engine (alive) is saving
    _, _, out = _load(fake_vllm, build, cache, monkeypatch)
    assert not out["saved"] and "another engine" in out["why"]
    (cache / f".{out['key']}.lock").write_text("999999999")  # its process has ended: the lock is taken over
    _, _, out = _load(fake_vllm, build, cache, monkeypatch)
    assert out["saved"] and not list(cache.glob(".*"))


def test_the_loader_needs_its_folder(tmp_path, monkeypatch, fake_vllm):
    build = write_ckpt(tmp_path / "b", _tensors())
    monkeypatch.delenv(xc.ENV, raising=False)
    loader = fake_vllm(SimpleNamespace(load_format=xc.LOAD_FORMAT, model_loader_extra_config={}))
    cfg = SimpleNamespace(model=str(build), dtype=torch.float32, quantization="x", hf_config=SimpleNamespace(model_type="q"))
    with pytest.raises(RuntimeError, match="--expert-cache DIR"):
        loader.load_weights(ToyMoE(), cfg)


def test_the_report_says_how_each_engine_got_its_experts():
    from splicer.analysis.table import expert_cache_note

    def eng(**r):
        return {"engine": {"expert_cache": r}}

    results = {
        "base_pass": eng(do="save", saved=True),
        "variants": [
            {"name": "build", **eng(do="load")},
            {"name": "gdn", **eng(do="load")},
            {"name": "all", **eng(do="save", saved=False, why="not saved: 64.0 GiB to write and 20.0 GiB free in C")},
        ],
    }
    assert expert_cache_note(results) == (
        "Routed experts (--expert-cache): copied from the cache into 2 of 4 engines (build, gdn); saved by base pass; "
        "loaded the normal way: all (not saved: 64.0 GiB to write and 20.0 GiB free in C)."
    )
    assert expert_cache_note({"base_pass": {}, "variants": [{"name": "build", "engine": {}}]}) is None


def test_the_file_memo_keeps_a_bounded_number_of_files(tmp_path, monkeypatch):
    """Each variant whose expert shards a splice rewrote adds files of its own; the memo forgets the least recently
    used beyond FILE_SUMS_KEPT, and a file used again is kept."""
    xc._file_sums.clear(), xc._digests.clear()
    monkeypatch.setattr(xc, "FILE_SUMS_KEPT", 4)
    rx = xc.checkpoint_expert_regex(get_architecture(_config()))
    t = _tensors()
    first = write_ckpt(tmp_path / "first", t, files=2)
    xc.experts_digest(first, rx, {})
    for i in range(3):
        xc._digests.clear()
        xc.experts_digest(first, rx, {})  # the build's shards, used by every variant
        xc.experts_digest(write_ckpt(tmp_path / f"v{i}", t, files=1), rx, {})
    assert len(xc._file_sums) == 4
    kept = {ident[1] for ident in xc._file_sums}
    assert {f.stat().st_ino for f in first.glob("*.safetensors")} <= kept
