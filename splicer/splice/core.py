"""`splicer splice`: put module classes of an INT4 build back to the base's BF16, tensor by tensor.

Stages, each a small function: validate the inputs, plan (which modules, which base
tensors, which shards change, the new config), check the plan against both readers of
the config (compressed-tensors and vLLM) before writing a byte, then write into a
temporary folder beside OUT and rename it into place.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__
from ..arch.table import Architecture
from ..checkpoint import (
    INDEX_NAME,
    Checkpoint,
    load_shard_header,
    open_checkpoint,
)
from ..errors import SplicerError
from ..formats.layouts import LAYOUT, QUANT_SUFFIXES
from ..formats.module import Module
from ..io import faults
from ..io.dtypes import SERVED_FLOAT_DTYPES
from ..io.outputs import PARTIAL_SUFFIX, SPLICE, check_output, local_folder, lock_output, replace_dir, sibling, write_error
from ..io.progress import SILENT, Stages
from ..io.safetensors_io import ByteSource, CastSource, OutTensor, write_shard
from .config_edit import (
    exclusions,
    modules_after,
    restored_config,
)
from .modules import list_modules, weight_source
from .rules import check
from .selection import format_layers
from .unquantized import SMOOTHING_NOTE, changed_text, compare_unquantized, unquantized_names
from .validate import (
    check_modules_regex,
    parse_layers,
    parse_restore,
    validate_base,
    validate_build,
    validate_schemes,
)


@dataclass
class SplicePlan:
    build: Checkpoint
    base: Checkpoint
    classes: list[str]
    restore: dict[str, Module]  # build module -> (restored from) base module, keyed by name
    base_modules: dict[str, Module]
    shards_rewritten: dict[str, list[OutTensor]] = field(default_factory=dict)
    shards_linked: list[str] = field(default_factory=list)
    weight_map: dict[str, str] = field(default_factory=dict)
    total_size: int = 0
    config: dict = field(default_factory=dict)
    mtp_added: list[str] = field(default_factory=list)  # base mtp.* tensors added to a build that had none
    added_modules: set[str] = field(default_factory=set)
    side_files: dict[str, Path] = field(default_factory=dict)  # file name -> the base's copy that replaces the build's
    dropped_ignore: list[str] = field(default_factory=list)
    inherited_lint: list[str] = field(default_factory=list)  # misreadings the build's own config already had
    restore_spec: str = ""  # the restore asked for, as splice.json records it (gdn@0-3,attention)
    float_dtype: str = "BF16"  # the dtype the build keeps its unquantized weights in; restored weights get it too
    dtype_cast: dict[str, int] = field(default_factory=dict)  # base dtype -> restored weights cast from it
    unquantized_from_base: list[str] = field(default_factory=list)  # unquantized tensors whose values came from the base
    unquantized_not_compared: list[str] = field(default_factory=list)  # ... that the base lacks or stores otherwise


MTP_SHARD = "model-mtp.safetensors"
# Tokenizer, chat template and processor files: copied verbatim from the base with --tokenizer-from-base
# (seed 000's third fix-up: transformers 5.14 re-serialised tokenizer.json on export).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
)


# ---------------------------------------------------------------- validation


def select_modules(
    modules: dict[str, Module],
    classes: list[str] | dict[str, set[int] | None],
    arch: Architecture,
    layers: set[int] | None = None,
    only: str | None = None,
    allow_empty: bool = False,
) -> dict[str, Module]:
    """The quantized modules of `classes` (a list, or class -> its decoder layers, None for all of them), in `layers`
    (all classes) and matching `only`, grown to whole fused groups and MoE layers."""
    pattern = re.compile(only) if only else None
    per_class = classes if isinstance(classes, dict) else dict.fromkeys(classes)
    picked = {}
    for name, m in modules.items():
        if not m.quantized or m.cls not in per_class:
            continue
        if layers is not None and not arch.is_mtp(name) and arch.layer_index(name) not in layers:
            continue
        if per_class[m.cls] is not None and arch.layer_index(name) not in per_class[m.cls]:
            continue
        if pattern and not pattern.search(name):
            continue
        picked[name] = m
    if not picked and not allow_empty:
        raise SplicerError(
            "the selection matches no quantized module; check --restore, --layers and --modules against splicer inspect"
        )
    # vLLM loads fused shards into one layer and reads all experts of a layer from expert 0.
    units: dict[str, list[str]] = defaultdict(list)
    for name, m in modules.items():
        if m.quantized:
            units[arch.atomic_unit(name)].append(name)
    for name in picked:
        unit = arch.atomic_unit(name)
        left = sorted(set(units[unit]) - set(picked))
        if left:
            raise SplicerError(
                f"restoring {name} alone would split {unit}: vLLM loads {len(units[unit])} modules into that one layer "
                f"and needs one scheme for all (still quantized: {left[0]}{', ...' if len(left) > 1 else ''}); restore the whole group"
            )
    return picked


def _wanted_base_tensors(build: Checkpoint, picked: dict[str, Module], base_weight_map: dict[str, str]) -> dict[str, str]:
    """Build module -> base tensor that holds its BF16 weight (fused experts: the 3-D tensor)."""
    arch = build.arch
    out = {}
    for name in picked:
        if f"{name}.weight" in base_weight_map:
            out[name] = f"{name}.weight"
            continue
        if any(f"{name}.{s}" in base_weight_map for s in QUANT_SUFFIXES):
            raise SplicerError(
                f"{name} ({picked[name].cls}) is quantized in the base too, so it cannot be restored from it; "
                f"drop {picked[name].cls} from --restore or pass a base that holds it in BF16"
            )
        parts = arch.expert_parts(name)
        if parts:
            fused = arch.fused_expert_name(parts[0], parts[2])
            if fused in base_weight_map:
                out[name] = fused
                continue
        raise SplicerError(f"the base has no weight for {name}; pass the BF16 base this build was made from")
    return out


def open_base_for(
    build: Checkpoint,
    base_source: str,
    picked: dict[str, Module],
    add_mtp: bool = False,
    allow_quantized_base: bool = False,
    mtp_optional: bool = False,
    also: set[str] = frozenset(),
) -> tuple[Checkpoint, bool]:
    """Open the base reading (and, for a Hub id, downloading) only the shards that hold what we restore; returns it
    and whether its MTP head is added (mtp_optional: not an error when the base has none, as for `--restore all`)."""

    def shards(wm: dict) -> set[str]:
        tensors = set(_wanted_base_tensors(build, picked, wm).values()) | {t for t in also if t in wm}
        if add_mtp:
            tensors |= {t for t in wm if build.arch.is_mtp(t)}
        return {wm[t] for t in tensors}

    base = open_checkpoint(base_source, "base", wanted_files=lambda index: shards(index.get("weight_map") or {}), shards=set())
    validate_base(base, build, allow_quantized_base)
    if add_mtp and not any(build.arch.is_mtp(t) for t in base.weight_map):
        if not mtp_optional:
            raise SplicerError(f"the build has no MTP head and neither has the base {base.label}; drop mtp from --restore")
        add_mtp = False  # --restore all: restore what there is; a family with an MTP layout need not ship one
    for shard in sorted(shards(base.weight_map)):
        load_shard_header(base, shard)
    return base, add_mtp


def _from_base(info, float_dtype: str, casts: dict[str, int]) -> OutTensor:
    """A base tensor as it goes into the output: verbatim, or cast to the build's float dtype."""
    src = ByteSource(info.path, info.start, info.nbytes)
    if info.dtype in SERVED_FLOAT_DTYPES and info.dtype != float_dtype:
        casts[info.dtype] = casts.get(info.dtype, 0) + 1
        return OutTensor(info.name, float_dtype, info.shape, CastSource(src, info.dtype, float_dtype))
    return OutTensor(info.name, info.dtype, info.shape, src)


def _base_values(base_info, build_info) -> OutTensor:
    """An unquantized tensor of the build, in its place, dtype and shape, with the base's values."""
    src = ByteSource(base_info.path, base_info.start, base_info.nbytes)
    if base_info.dtype != build_info.dtype:
        src = CastSource(src, base_info.dtype, build_info.dtype)
    return OutTensor(build_info.name, build_info.dtype, tuple(build_info.shape), src)


def build_float_dtype(build: Checkpoint) -> str:
    """The float dtype most of the build's unquantized weights are stored in (BF16 for every build seen so far)."""
    counts: dict[str, int] = defaultdict(int)
    for hdr in build.headers.values():
        for name, info in hdr.tensors.items():
            if name.endswith(".weight") and info.dtype in SERVED_FLOAT_DTYPES:
                counts[info.dtype] += info.nbytes
    return max(counts, key=counts.get) if counts else "BF16"


def plan_splice(
    build: Checkpoint,
    base: Checkpoint,
    modules: dict[str, Module],
    picked: dict[str, Module],
    classes: list[str],
    add_mtp: bool = False,
    tokenizer_from_base: bool = False,
    drop_dead_ignore: bool = False,
    from_base: set[str] = frozenset(),
) -> SplicePlan:
    """`from_base`: unquantized tensors of the build that take the base's values (`--unquantized-from-base`)."""
    base_modules = list_modules(base)
    plan = SplicePlan(build, base, classes, restore={}, base_modules=base_modules)
    float_dtype = plan.float_dtype = build_float_dtype(build)
    drop: set[str] = set()
    add_to_shard: dict[str, list[OutTensor]] = defaultdict(list)
    for name, m in sorted(picked.items()):
        b = base_modules.get(name)
        if b is None:
            raise SplicerError(f"the base has no weight for {name}; pass the BF16 base this build was made from")
        dtype, shape, src = weight_source(b)
        if dtype not in SERVED_FLOAT_DTYPES:
            raise SplicerError(f"the base stores {name} as {dtype}, not a float type; pass the BF16 base")
        if dtype != float_dtype:
            # vLLM would cast it to the model's dtype on load anyway; cast once here, so the output holds one float
            # dtype as the build does, and record it (splice.json: dtype_cast).
            plan.dtype_cast[dtype] = plan.dtype_cast.get(dtype, 0) + 1
            src, dtype = CastSource(src, dtype, float_dtype), float_dtype
        if tuple(shape) != tuple(m.shape):
            raise SplicerError(
                f"the base's {name} is {list(shape)} but the build's weight_shape is {list(m.shape)}; "
                "pass the base the build was made from"
            )
        plan.restore[name] = b
        drop.update(t.name for t in m.packed.values())
        anchor = m.packed[LAYOUT[m.layout].anchor]
        shard = build.weight_map[anchor.name]
        add_to_shard[shard].append(OutTensor(f"{name}.weight", dtype, tuple(shape), src))
    for shard, hdr in sorted(build.headers.items()):
        if shard not in add_to_shard and not (set(hdr.tensors) & (drop | from_base)):
            plan.shards_linked.append(shard)
            for t, info in hdr.tensors.items():
                plan.weight_map[t] = shard
                plan.total_size += info.nbytes
            continue
        # Kept tensors in their stored order, then restored weights in the order they lie in the base:
        # both then form long contiguous byte runs (a fused expert tensor is one run), copied in few calls.
        out: list[OutTensor] = []
        for t, info in sorted(hdr.tensors.items(), key=lambda kv: kv[1].start):
            if t in from_base:
                out.append(_base_values(base.tensor(t), info))
                plan.unquantized_from_base.append(t)
            elif t not in drop:
                out.append(OutTensor(t, info.dtype, info.shape, ByteSource(info.path, info.start, info.nbytes)))
        out += sorted(add_to_shard.get(shard, []), key=lambda t: (str(t.source.path), t.source.start))
        plan.shards_rewritten[shard] = out
        for t in out:
            plan.weight_map[t.name] = shard
            plan.total_size += t.nbytes
    added = {}
    if add_mtp:
        infos = sorted((base.tensor(t) for t in base.weight_map if build.arch.is_mtp(t)), key=lambda i: (str(i.path), i.start))
        plan.shards_rewritten[MTP_SHARD] = [_from_base(i, float_dtype, plan.dtype_cast) for i in infos]
        for i in infos:
            plan.weight_map[i.name] = MTP_SHARD
            plan.total_size += i.nbytes
        plan.mtp_added = [i.name for i in infos]
        added = {n: m for n, m in base_modules.items() if build.arch.is_mtp(n)}
    if tokenizer_from_base:
        plan.side_files = {name: base.root / name for name in TOKENIZER_FILES if (base.root / name).is_file()}
    plan.config, plan.dropped_ignore = restored_config(build, modules, picked, added, drop_dead_ignore)
    plan.added_modules = set(added) - set(plan.restore)
    plan.restore.update({n: added[n] for n in plan.added_modules})
    return plan


def verify_plan(plan: SplicePlan, modules: dict[str, Module]) -> list[str]:
    """Refuse a plan whose config either reader would misread, before anything is written.

    Every restored or added module must be read as unquantized, and no other module may be read differently from how it
    is stored unless the build's own config already did so (e.g. a bare `lm_head` ignore entry, which only
    compressed-tensors applies): such inherited problems are returned, for splice.json, not refused.
    """
    arch = plan.build.arch
    after = modules_after(
        modules,
        {n: m for n, m in plan.restore.items() if n in modules},
        {n: m for n, m in plan.restore.items() if n not in modules},
    )
    now = check(after, plan.config.get("quantization_config") or {}, arch)
    before = check(modules, plan.build.quantization_config, arch)

    def misread(readings, mods, name) -> bool:
        r = readings.get(name)
        return r is not None and (r.error is not None or (r.group is not None) != mods[name].quantized)

    inherited = []
    for (naming, now_read), (_, before_read) in zip(now.by_reader(), before.by_reader()):
        for name in after:
            if not misread(now_read, after, name):
                continue
            detail = (
                now_read[name].error or f"{name} is stored {'packed' if after[name].quantized else 'BF16'} but read otherwise"
            )
            if name in plan.restore or not (name in modules and misread(before_read, modules, name)):
                raise SplicerError(
                    f"the spliced config would be misread ({naming} naming: {detail}); this is a splicer bug, please report it"
                )
            inherited.append(f"{naming}: {detail}")
    split = {i["detail"] for i in now.issues if i["check"] == "fused-shards-disagree"} - {
        i["detail"] for i in before.issues if i["check"] == "fused-shards-disagree"
    }
    if split:
        raise SplicerError(
            f"the splice would leave a fused group half restored ({sorted(split)[0]}); this is a splicer bug, please report it"
        )
    return sorted(set(inherited))


# ---------------------------------------------------------------- writing


def _link_or_copy(src: Path, dst: Path) -> str:
    # The real file, never the link: a Hub-cache snapshot holds relative symlinks into blobs/, and Linux's link(2)
    # would hard-link the symlink itself, leaving OUT with dangling links (or, for absolute links, tied to the cache).
    src = Path(os.path.realpath(src))
    try:
        os.link(src, dst)
        return "linked"
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            raise
    shutil.copyfile(src, dst)
    return "copied"


def partial_dir(out: Path) -> Path:
    return sibling(out, PARTIAL_SUFFIX)


def write_plan(plan: SplicePlan, out: Path, progress: bool = True) -> dict:
    """Write the plan into OUT's partial sibling and rename it into place (OUT checked and locked by the caller)."""
    from tqdm.auto import tqdm

    out = Path(out)
    tmp = partial_dir(out)
    stats = {"linked": 0, "copied": 0, "rewritten": 0, "resumed": 0}
    key = _plan_key(plan)
    try:
        done = _resumable(tmp, key)  # shards an interrupted run of this same plan finished
        tmp.mkdir(parents=True, exist_ok=True)
        total = sum(t.nbytes for ts in plan.shards_rewritten.values() for t in ts)
        with tqdm(total=total, unit="B", unit_scale=True, desc="splice", disable=not progress or None, leave=False) as bar:
            for shard in plan.shards_linked:
                if shard not in done:
                    done[shard] = {"how": _link_or_copy(plan.build.root / shard, tmp / shard)}
                stats[done[shard]["how"]] += 1
            _save_progress(tmp, key, done)
            for shard, tensors in plan.shards_rewritten.items():
                if shard in done and done[shard].get("size") == _size(tmp / shard):
                    stats["resumed"] += 1
                else:
                    meta = (plan.build.headers[shard].metadata if shard in plan.build.headers else None) or {"format": "pt"}
                    write_shard(tmp / shard, tensors, meta)
                    done[shard] = {"how": "rewritten", "size": _size(tmp / shard)}
                    _save_progress(tmp, key, done)
                stats["rewritten"] += 1
                bar.update(sum(t.nbytes for t in tensors))
                faults.point("splice:shard-written")
        (tmp / PROGRESS_FILE).unlink()
        for p in plan.build.other_files():
            rel = p.relative_to(plan.build.root)
            if rel.name in ("config.json", "splice.json"):
                continue
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, tmp / rel)
        for name, src in plan.side_files.items():
            shutil.copy2(src, tmp / name)
        index = {
            "metadata": {**plan.build.index_metadata, "total_size": plan.total_size},
            "weight_map": dict(sorted(plan.weight_map.items())),
        }
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(plan.config, indent=2) + "\n")
        record = splice_record(plan, stats)
        (tmp / "splice.json").write_text(json.dumps(record, indent=2) + "\n")
        faults.point("splice:before-rename")
        # OUT is gone, the new one not yet in place between the renames: the next run must recover (check_output)
        replace_dir(tmp, out, before_swap=lambda: faults.point("splice:between-renames"))
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise (write_error(e, out.parent) or e) from None
    except KeyboardInterrupt:
        raise  # keep the partial folder: the next run of the same splice resumes from its finished shards
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


PROGRESS_FILE = ".splice-progress.json"


def _plan_key(plan: SplicePlan) -> str:
    """What a partial folder must have been written for to be reused: every output tensor's source, and the config."""
    shards = {
        shard: [(t.name, t.dtype, list(t.shape), str(t.source.path), t.source.start, t.source.nbytes) for t in ts]
        for shard, ts in plan.shards_rewritten.items()
    }
    blob = json.dumps([sorted(plan.shards_linked), shards, plan.config], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _resumable(tmp: Path, key: str) -> dict:
    if not tmp.exists():
        return {}
    try:
        state = json.loads((tmp / PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        state = None
    if isinstance(state, dict) and state.get("key") == key:
        return dict(state.get("done") or {})
    shutil.rmtree(tmp)  # left by an interrupted run of another plan: never loaded, safe to drop
    return {}


def _save_progress(tmp: Path, key: str, done: dict) -> None:
    part = tmp / (PROGRESS_FILE + ".tmp")
    part.write_text(json.dumps({"key": key, "done": done}))
    os.replace(part, tmp / PROGRESS_FILE)


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _config_digest(ckpt: Checkpoint) -> str:
    return hashlib.sha256(json.dumps(ckpt.config, sort_keys=True).encode()).hexdigest()


def splice_record(plan: SplicePlan, stats: dict) -> dict:
    return {
        "tool": "splicer",
        "version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "build": {
            "source": plan.build.label,
            "header_digest": plan.build.header_digest(),
            "config_digest": _config_digest(plan.build),
        },
        "base": {"source": plan.base.label, "header_digest": plan.base.header_digest(), "shards_read": sorted(plan.base.headers)},
        # The classes a module was restored from (--layers or --modules may leave some of those asked for untouched).
        "restored_classes": [c for c in plan.classes if c in {plan.build.arch.module_class(n) for n in plan.restore}],
        "restore": plan.restore_spec,  # what was asked, per class and layer (--layers and --modules not folded in)
        "restored_modules": len(plan.restore) - len(plan.added_modules),
        "mtp_tensors_added": len(plan.mtp_added),
        "files_from_base": sorted(plan.side_files),
        # Restored weights the base stores in another float dtype, cast to the build's (as vLLM casts on load).
        "unquantized_from_base": sorted(plan.unquantized_from_base),
        "unquantized_not_compared": plan.unquantized_not_compared,
        "dtype_cast": ({"to": plan.float_dtype, "from": dict(sorted(plan.dtype_cast.items()))} if plan.dtype_cast else None),
        "ignore_dropped": plan.dropped_ignore,
        "inherited_lint": plan.inherited_lint[:20],
        "shards": stats,
        "ignore_added": [
            e
            for e in exclusions(plan.config.get("quantization_config") or {})
            if e not in exclusions(plan.build.quantization_config)
        ],
        "quantization_config_removed": "quantization_config" not in plan.config,
    }


# ---------------------------------------------------------------- entry point


def splice(
    build_src: str,
    base_src: str,
    out: str | Path,
    restore: str,
    layers: str | None = None,
    modules_regex: str | None = None,
    force: bool = False,
    progress: bool = True,
    tokenizer_from_base: bool = False,
    drop_dead_ignore: bool = False,
    allow_quantized_base: bool = False,
    unquantized_from_base: bool = False,
    stages: Stages = SILENT,
) -> dict:
    build = open_checkpoint(build_src, "build")
    validate_build(build)
    check_output(out, [build.root, *local_folder(base_src)], SPLICE, force)  # before the base is read (or downloaded)
    modules = list_modules(build)
    validate_schemes(build, modules)
    has_mtp = build.arch.mtp_prefix is None or any(build.arch.is_mtp(t) for t in build.weight_map)
    n_layers = build.text_config["num_hidden_layers"]
    per_class = parse_restore(restore, build.arch, modules, has_mtp, n_layers, build.arch.mtp_layer_index, layers)
    classes = list(per_class)
    add_mtp = "mtp" in classes and not has_mtp  # seed 000's exporter dropped the MTP head: put the base's back
    picked = select_modules(
        modules,
        per_class,
        build.arch,
        parse_layers(layers, n_layers, build.arch.mtp_layer_index),
        check_modules_regex(modules_regex),
        allow_empty=add_mtp,
    )
    also = set(unquantized_names(build, modules)) if unquantized_from_base else set()
    base, add_mtp = open_base_for(
        build, base_src, picked, add_mtp, allow_quantized_base, mtp_optional=restore.strip() == "all", also=also
    )
    if not add_mtp and "mtp" in classes and not has_mtp:
        classes = [c for c in classes if c != "mtp"]
    inputs = [build.root, base.root]
    out = check_output(out, inputs, SPLICE, force)
    comparison = compare_unquantized(build, base, modules) if unquantized_from_base else None
    diffs = comparison.differences if comparison else []
    every_class_whole = all(per_class.get(m.cls, 0) is None for m in modules.values() if m.quantized)
    if any(not d.rounding_only for d in diffs) and not (every_class_whole and not layers and not modules_regex):
        raise SplicerError(
            f"--unquantized-from-base: the build's unquantized tensors were {SMOOTHING_NOTE} ({changed_text(diffs)}); "
            "the base's values would not fit the classes left quantized: use it only with --restore all and no --layers "
            "or --modules, or leave it off"
        )
    from_base = {d.name for d in diffs}
    plan = plan_splice(build, base, modules, picked, classes, add_mtp, tokenizer_from_base, drop_dead_ignore, from_base)
    plan.restore_spec = ",".join(c if per_class.get(c) is None else f"{c}@{format_layers(per_class[c])}" for c in classes)
    plan.inherited_lint = verify_plan(plan, modules)
    plan.unquantized_not_compared = comparison.not_compared if comparison else []
    with lock_output(out, SPLICE):
        # Again under the lock: another run may have finished OUT meanwhile, or a killed --force run parked it aside.
        out = check_output(out, inputs, SPLICE, force, recover=True)
        rewritten = sum(t.nbytes for ts in plan.shards_rewritten.values() for t in ts)
        with stages.stage(
            f"splice into {out}: {len(plan.shards_rewritten)} shards written ({rewritten / 1e9:.2f} GB), "
            f"{len(plan.shards_linked)} linked"
        ):
            return write_plan(plan, out, progress=progress)


__all__ = ["splice", "plan_splice", "select_modules", "verify_plan", "write_plan"]
