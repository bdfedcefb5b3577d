"""The routed experts loaded once and reused by every engine whose experts are the same bytes (`--expert-cache DIR`).

Why: vLLM 0.26 loads a checkpoint that stores each routed expert's projections as their own tensors one tensor at a
time. On the Qwen3.6-35B-A3B-shaped stand-in (40 layers x 256 experts x 9 tensors) that is 92,160 calls of the experts'
weight loader, each after a walk of the whole expert mapping, about 21 s of a 41 s engine start from the page cache
(results/engine-starts, docs/engine-starts.md). The rows of a "where the error comes from" table restore other classes
and keep the build's experts, so every engine of a run loads the same expert bytes into the same fused parameters.

How: a vLLM model loader (vLLM's own extension point, `register_model_loader`) built on its DefaultModelLoader. The
first engine loads normally and, before `process_weights_after_loading` repacks anything, saves the state of vLLM's
routed-expert modules (`RoutedExperts`: the fused weights and scales, a few tensors per layer; not the router gate or
the shared expert, which vLLM's MoE layer holds beside them and a restored variant changes) under DIR/<key>/. A later
engine whose key matches loads every other tensor through the model's own `load_weights`, skips the checkpoint's expert
tensors (the weight loaders never see them; their bytes are read once per folder, for the key) and copies the saved
tensors into its fresh parameters; vLLM then repacks them as it would have.

The key is the expert bytes themselves (a SHA-256 over every routed-expert tensor's name, dtype, shape and data), the
checkpoint's quantization schemes that may reach the experts (its quantization_config without the ignore list and
without config groups whose every target certainly applies to other modules, which is what differs between a build and
its restored variants: a restored lm_head drops an INT8 lm_head's group), vLLM's version, the quantization method of the
expert modules, the model's dtype, the GPU's name and the engine's tensor-parallel rank and size; a saved entry is used
only when its tensors match the fresh model's expert state name for name, shape for shape and dtype for dtype. Anything
else (another checkpoint's experts, an MTP drafter, a model without routed experts) loads the normal way. A save that
cannot be made (no room, no permission, another engine saving the same key) is logged and the engine runs on. What
happened is logged in the engine's log and recorded in the engine's info (`last_outcome`).

The loader must run in the process that builds the model: splicer's worker with the engine core in it (its default),
one GPU per engine (VllmOptions refuses tensor, pipeline, data and expert parallelism with it).
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import hashlib
import json
import mmap
import os
import re
import shutil
import struct
import time
from pathlib import Path

LOAD_FORMAT = "splicer_expert_cache"
ENV = "SPLICER_EXPERT_CACHE"  # the cache folder, for the loader in the engine's process
PART_BYTES = 4 << 30  # one saved file per ~4 GiB of expert state
SPARE_BYTES = 2 << 30  # disk left free after a save

_outcome: dict = {}
_digests: dict = {}  # (folder, files' sizes and mtimes, context) -> key: one hash per folder and process
# (device, inode, size, mtime, pattern) of one safetensors file -> its expert tensors' (name, dtype, shape, sha256,
# bytes): a splice hard-links the shards it leaves unchanged, so every variant of a run holds the build's expert files
# and hashes none of them again in the same process (the backend's worker serves a whole run)
_file_sums: collections.OrderedDict = collections.OrderedDict()
FILE_SUMS_KEPT = 128  # files remembered, least recently used first out: a run's variants keep hitting the build's shards


def reset() -> None:
    """Forget the last model's outcome (before each engine of a process)."""
    _outcome.clear()


def last_outcome() -> dict:
    """What the loader did for the last model it loaded in this process (empty when it was not used)."""
    return dict(_outcome)


def _say(msg: str) -> None:
    print(f"splicer expert cache: {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# Which tensors are the routed experts (the family's table, splicer.arch)


def checkpoint_expert_regex(arch) -> re.Pattern | None:
    """The checkpoint names of the main model's routed-expert tensors (per expert or fused per layer), or None when the
    family has no routed experts. The MTP head's experts are left to the normal loader."""
    pats = [p for p in (getattr(arch, "expert_pattern", None), getattr(arch, "fused_expert_pattern", None)) if p]
    if not pats:
        return None
    mtp = getattr(arch, "mtp_prefix", None)
    body = "|".join(f"(?:{p})" for p in pats)
    return re.compile((f"(?!{re.escape(mtp)})" if mtp else "") + f"(?:{body})")


EXPERT_MODULE = "RoutedExperts"  # vLLM 0.26-0.33: the module that owns the routed experts' weights and scales


def expert_modules(model) -> list:
    """[(name, module)] of vLLM's routed-expert modules. Only these: vLLM's MoE layer (MoERunner) also holds the router
    gate and the shared expert as children, which a restored variant changes while its routed experts stay the same."""
    return [(n, m) for n, m in model.named_modules() if any(c.__name__ == EXPERT_MODULE for c in type(m).__mro__)]


def expert_state(model) -> dict:
    """{name: tensor} of the routed-expert modules' state (parameters and persistent buffers), as vLLM's own
    sharded_state loader copies a model's state."""
    out = {}
    for name, module in expert_modules(model):
        out.update(module.state_dict(prefix=f"{name}."))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The key: the expert bytes, hashed in place


def _header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return 8 + n, json.loads(f.read(n))


def _workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def experts_digest(folder, regex: re.Pattern, context: dict) -> tuple[str, int, int]:
    """(key, tensors, bytes): SHA-256 over the sorted (name, dtype, shape, SHA-256 of the data) of every checkpoint
    tensor the regex matches, and the context (JSON). Each tensor's data is hashed from a memory map, in threads
    (hashlib lets go of the GIL), so the files' layout and order do not enter the key. A file this process hashed
    before (the same inode, size and mtime: a splice's hard link of the build's shard) is not read again."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    stamp = (
        str(folder.resolve()),
        tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files),
        regex.pattern,
        json.dumps(context, sort_keys=True),
    )
    if stamp in _digests:
        return _digests[stamp]
    per_file, todo, maps = [], [], []
    try:
        for f in files:
            st = f.stat()
            ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, regex.pattern)
            if ident in _file_sums:
                _file_sums.move_to_end(ident)
                per_file.append(_file_sums[ident])
                continue
            start, header = _header(f)
            names = [k for k in header if k != "__metadata__" and regex.match(k)]
            if not names:
                _file_sums[ident] = []
                continue
            fh = open(f, "rb")
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            fh.close()
            maps.append(mm)
            entries = []
            for k in names:
                a, b = header[k]["data_offsets"]
                entries.append((k, header[k]["dtype"], header[k]["shape"], mm, start + a, start + b))
            todo.append((ident, entries))

        def one(e):
            with memoryview(e[3]) as whole, whole[e[4] : e[5]] as data:
                return hashlib.sha256(data).hexdigest()

        flat = [e for _, entries in todo for e in entries]
        with concurrent.futures.ThreadPoolExecutor(_workers()) as pool:
            sums = iter(list(pool.map(one, flat, chunksize=64)))
        for ident, entries in todo:
            done = [(k, dtype, shape, next(sums), b - a) for k, dtype, shape, _, a, b in entries]
            _file_sums[ident] = done
            per_file.append(done)
        while len(_file_sums) > FILE_SUMS_KEPT:
            _file_sums.popitem(last=False)
        total = hashlib.sha256(json.dumps(context, sort_keys=True).encode())
        rows = sorted((r for done in per_file for r in done), key=lambda r: r[0])
        for k, dtype, shape, digest, _ in rows:
            total.update(f"{k}\0{dtype}\0{shape}\0{digest}\n".encode())
        out = (total.hexdigest()[:32], len(rows), sum(r[4] for r in rows))
    finally:
        todo.clear()
        for mm in maps:
            mm.close()
    _digests[stamp] = out
    return out


def checkpoint_modules(folder, regex: re.Pattern) -> tuple[frozenset, frozenset]:
    """(the routed experts' modules, every other module) of the checkpoint, by its tensors' names less the last part,
    from the safetensors headers (read in milliseconds; nothing kept)."""
    experts, other = set(), set()
    for f in sorted(Path(folder).glob("*.safetensors")):
        for name in _header(f)[1]:
            if name != "__metadata__":
                (experts if regex.match(name) else other).add(name.rsplit(".", 1)[0])
    return frozenset(experts), frozenset(other - experts)


def _only_elsewhere(target: str, experts: frozenset, other: frozenset) -> bool:
    """Whether a compressed-tensors target certainly applies to none of the routed experts: it names or matches
    (re.match, as compressed-tensors and vLLM match "re:" targets) a module of the checkpoint other than an expert, and
    no expert. A target that matches nothing here (a class name such as "Linear", vLLM's own spelling of a name, a
    pattern over fused expert tensors) may still reach them as vLLM reads it, so it is not."""
    if target.startswith("re:"):
        pattern = re.compile(target[3:])
        return not any(pattern.match(m) for m in experts) and any(pattern.match(m) for m in other)
    return target not in experts and target in other


def quant_schemes(folder, modules: tuple[frozenset, frozenset] | None = None) -> dict:
    """The checkpoint's quantization config without its ignore list (a build and its restored variants differ in that
    list), and, given checkpoint_modules, without the config groups every target of which certainly applies elsewhere:
    a build's INT8 lm_head is a group of its own ("re:.*lm_head$"), which a variant with lm_head restored drops, and
    the experts' bytes and scheme are the same either way. Any group that might reach the experts stays in."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    q = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config") or {}
    q = {k: v for k, v in q.items() if k not in ("ignore", "modules_to_not_convert")}
    groups = q.get("config_groups")
    if modules and isinstance(groups, dict):
        experts, other = modules
        q["config_groups"] = {
            name: g
            for name, g in groups.items()
            if not (
                isinstance(g, dict) and g.get("targets") and all(_only_elsewhere(str(t), experts, other) for t in g["targets"])
            )
        }
    return q


# ---------------------------------------------------------------------------------------------------------------------
# Saved entries: DIR/<key>/experts-NNNNN.safetensors + manifest.json, written under a temporary name and renamed


def _layout(state: dict) -> dict:
    return {k: [str(t.dtype).removeprefix("torch."), list(t.shape)] for k, t in state.items()}


def find_entry(cache_dir, key: str, state: dict) -> Path | None:
    """The saved entry for key when its tensors match state (names, dtypes, shapes), else None."""
    entry = Path(cache_dir) / key
    try:
        manifest = json.loads((entry / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("layout") != _layout(state):
        return None
    if not all((entry / f).is_file() for f in manifest.get("files", [])):
        return None
    return entry


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _take_lock(lock: Path) -> bool:
    """One saving engine per key (engines started side by side may save the same experts): an exclusive lock file
    with the saver's pid; a lock whose process has ended is taken over."""
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                pid = int(lock.read_text().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and _pid_alive(pid):
                return False
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True
    return False


def save_entry(cache_dir, key: str, state: dict, about: dict) -> tuple[Path | None, str]:
    """Write state (tensors on any device) as a new entry: (entry, "") or (None, why not). A save that cannot be made
    (no room, no permission, another engine saving it) is reported, never raised: the engine has loaded its weights
    the normal way and runs on."""
    try:
        return _save_entry(Path(cache_dir), key, state, about)
    except Exception as e:  # the cache is an optimisation: an engine that loaded fine must not fail on it
        return None, f"{e.__class__.__name__}: {e}"


def _save_entry(cache_dir: Path, key: str, state: dict, about: dict) -> tuple[Path | None, str]:
    import torch
    from safetensors.torch import save_file

    cache_dir.mkdir(parents=True, exist_ok=True)
    entry = cache_dir / key
    if entry.exists():
        return None, f"{entry} exists (another engine saved it first)"
    ptrs = {}
    for k, t in state.items():
        p = (t.untyped_storage().data_ptr(), t.storage_offset())
        if t.numel() and p in ptrs:
            return None, f"{k} shares its storage with {ptrs[p]}"
        ptrs[p] = k
    need = sum(t.numel() * t.element_size() for t in state.values())
    free = shutil.disk_usage(cache_dir).free
    if free < need + SPARE_BYTES:
        return None, f"{need / 2**30:.1f} GiB to write and {free / 2**30:.1f} GiB free in {cache_dir}"
    lock = cache_dir / f".{key}.lock"
    if not _take_lock(lock):
        return None, "another engine is saving the same experts"
    tmp = cache_dir / f".{key}.tmp-{os.getpid()}"
    files, part, size = [], {}, 0

    def flush():
        nonlocal part, size
        if part:
            name = f"experts-{len(files) + 1:05d}.safetensors"
            save_file(part, str(tmp / name))
            files.append(name)
        part, size = {}, 0

    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for k, t in state.items():
            part[k] = t.detach().to("cpu", copy=True).contiguous()
            size += part[k].numel() * part[k].element_size()
            if size >= PART_BYTES:
                flush()
        flush()
        manifest = dict(about, key=key, files=files, layout=_layout(state), bytes=need, torch=torch.__version__)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        tmp.rename(entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        lock.unlink(missing_ok=True)
    return entry, ""


def copy_entry(entry: Path, state: dict) -> int:
    """Copy an entry's tensors into state's tensors in place; returns the bytes copied."""
    from safetensors import safe_open

    manifest = json.loads((entry / "manifest.json").read_text())
    done, nbytes = set(), 0
    for name in manifest["files"]:
        with safe_open(str(entry / name), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                t = f.get_tensor(k)
                state[k].copy_(t)
                nbytes += t.numel() * t.element_size()
                done.add(k)
    if done != set(state):
        raise RuntimeError(f"expert cache entry {entry} lacks {sorted(set(state) - done)[:3]}")
    return nbytes


# ---------------------------------------------------------------------------------------------------------------------
# The loader


def plan_load(model, model_config, cache_dir, context: dict) -> dict:
    """What to do for this model: {"do": "load" | "save" | "normal", "why", and for load/save "regex", "state", "key",
    "entry"}. Pure apart from reading the checkpoint (tests call it with small stand-ins)."""
    from ..arch import get_architecture

    folder = Path(model_config.model)
    hf = getattr(model_config, "hf_config", None)
    model_type = str(getattr(hf, "model_type", "") or "")
    if "MTP" in type(model).__name__ or model_type.endswith("_mtp"):
        return {"do": "normal", "why": "an MTP drafter (its experts load the normal way)", "drafter": True}
    if not (folder / "config.json").is_file() or not list(folder.glob("*.safetensors")):
        return {"do": "normal", "why": f"{folder} is not a local safetensors checkpoint"}
    try:
        arch = get_architecture(json.loads((folder / "config.json").read_text()))
    except Exception as e:  # an unknown family loads the normal way
        return {"do": "normal", "why": f"family not known to splicer ({e})"}
    regex = checkpoint_expert_regex(arch)
    modules = expert_modules(model) if regex is not None else []
    state = expert_state(model)
    if not state:
        return {"do": "normal", "why": f"no routed-expert modules ({EXPERT_MODULE}) in the model"}
    # the quantization method decides the parameters' layout before repacking (their shapes are checked as well)
    context = dict(context, method=sorted({type(getattr(m, "quant_method", None)).__name__ for _, m in modules}))
    t = time.perf_counter()
    bytes_key, n, nbytes = experts_digest(folder, regex, context)
    schemes = quant_schemes(folder, checkpoint_modules(folder, regex))
    key = hashlib.sha256(json.dumps([bytes_key, schemes], sort_keys=True).encode()).hexdigest()[:32]
    plan = {
        "regex": regex,
        "state": state,
        "key": key,
        "expert_tensors": n,
        "expert_gib": round(nbytes / 2**30, 3),
        "digest_s": round(time.perf_counter() - t, 3),
    }
    if n == 0:
        return {"do": "normal", "why": "no routed-expert tensors in the checkpoint"}
    entry = find_entry(cache_dir, key, state)
    return dict(plan, do="load" if entry else "save", entry=entry)


def load_weights(loader, model, model_config, normal_load, cache_dir, context: dict) -> dict:
    """The loader's load_weights: normal_load() loads through vLLM's DefaultModelLoader (which reads the checkpoint
    through loader.skip_regex, set here while the experts come from the cache)."""
    plan = plan_load(model, model_config, cache_dir, context)
    record = {k: v for k, v in plan.items() if k in ("do", "why", "key", "expert_tensors", "expert_gib", "digest_s")}
    if plan["do"] == "normal":
        _say(f"normal load: {plan['why']}")
        normal_load()
        if not plan.get("drafter"):  # a drafter loads after the main model: the engine's record is the main model's
            _outcome.clear()
            _outcome.update(record)
        return record
    _outcome.clear()
    if plan["do"] == "load":
        t = time.perf_counter()
        loader.skip_regex = plan["regex"]
        loader.enable_weights_track = False  # the experts are checked against the entry instead
        try:
            normal_load()
        finally:
            loader.skip_regex = None
        record["other_tensors_s"] = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        nbytes = copy_entry(plan["entry"], plan["state"])
        record.update(copy_s=round(time.perf_counter() - t, 3), copied_gib=round(nbytes / 2**30, 3))
        _say(
            f"routed experts from {plan['entry']} ({len(plan['state'])} tensors, {nbytes / 2**30:.2f} GiB, copied in "
            f"{record['copy_s']:.2f} s; key over {plan['expert_tensors']} checkpoint tensors in {plan['digest_s']:.2f} s)"
        )
    else:
        normal_load()
        t = time.perf_counter()
        about = {"source": str(Path(model_config.model).resolve()), **context}
        entry, why = save_entry(cache_dir, plan["key"], plan["state"], about)
        record.update(save_s=round(time.perf_counter() - t, 3), saved=entry is not None)
        if entry is None:
            record["why"] = f"not saved: {why}"
            _say(f"normal load; experts not saved: {why}")
        else:
            _say(f"normal load; routed experts saved in {entry} in {record['save_s']:.2f} s")
    _outcome.update(record)
    return record


def register() -> None:
    """Register the loader with the vLLM imported in this process (idempotent)."""
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    try:
        from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER as known
    except ImportError:
        known = {}
    if LOAD_FORMAT in known:
        return

    class SplicerExpertCacheLoader(DefaultModelLoader):
        skip_regex: re.Pattern | None = None

        def __init__(self, load_config):
            super().__init__(load_config)
            # DefaultModelLoader picks the checkpoint's files (and its reader) by load_format and refuses a name it
            # does not know: this loader reads what vLLM's default ("auto") reads.
            self.load_config = copy.copy(load_config)
            self.load_config.load_format = "auto"

        def _get_weights_iterator(self, source):
            if self.skip_regex is None:
                return super()._get_weights_iterator(source)
            from safetensors import safe_open

            _, files, use_safetensors = self._prepare_weights(
                source.model_or_path,
                source.subfolder,
                source.revision,
                source.fall_back_to_pt,
                source.allow_patterns_overrides,
            )
            if not use_safetensors:
                raise RuntimeError("the expert cache reads safetensors checkpoints only")
            if self.counter_before_loading_weights == 0.0:
                self.counter_before_loading_weights = time.perf_counter()
            skip = self.skip_regex

            def weights():
                for path in sorted(files):
                    with safe_open(path, framework="pt") as f:
                        for name in f.keys():  # noqa: SIM118
                            if not skip.match(name):
                                yield source.prefix + name, f.get_tensor(name)

            return weights()

        def load_weights(self, model, model_config):
            import torch
            import vllm

            context = {"vllm": vllm.__version__, "dtype": str(model_config.dtype)}
            try:
                from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

                context["tp"] = [get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()]
            except Exception:
                context["tp"] = [0, 1]
            context["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
            context["quantization"] = str(getattr(model_config, "quantization", None))
            cache_dir = os.environ.get(ENV)
            if not cache_dir:
                raise RuntimeError(f"load format {LOAD_FORMAT} needs its folder in {ENV}: run splicer with --expert-cache DIR")
            load_weights(
                self, model, model_config, lambda: DefaultModelLoader.load_weights(self, model, model_config), cache_dir, context
            )

    register_model_loader(LOAD_FORMAT)(SplicerExpertCacheLoader)
