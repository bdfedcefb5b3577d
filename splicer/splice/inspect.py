"""`splicer inspect`: what a build quantizes, what each class weighs, and what its config gets wrong."""

from __future__ import annotations

from collections import defaultdict

from ..arch import family_mismatch
from ..checkpoint import Checkpoint
from ..errors import SplicerError
from ..formats.layouts import group_format, group_scheme
from ..formats.registry import checkpoint_format, format_of, format_or_default, read_methods, unreadable
from ..formats.vllm_versions import label, modeled
from .modules import list_modules
from .rules import check


def decode_fraction(ckpt: Checkpoint, tensor: str, shape) -> float:
    """Share of a tensor one batch-1 decode step reads (the memory-bandwidth floor's numerator)."""
    arch = ckpt.arch
    tc = ckpt.text_config
    module = tensor.rpartition(".")[0]
    if not arch.is_text(module):
        return 0.0  # text decode without speculative decoding reads neither a vision tower nor the MTP head
    if arch.is_embedding(module):
        return 1.0 / shape[0] if shape and shape[0] else 0.0  # one row
    if arch.expert_parts(module) or arch.fused_expert_parts(tensor):
        return arch.experts_read_per_token(tc)
    return 1.0


def bytes_per_decode_step(ckpt: Checkpoint) -> int:
    """Weight bytes one batch-1 decode step reads, from the shard headers alone."""
    return int(
        sum(
            info.nbytes * decode_fraction(ckpt, name, info.shape)
            for hdr in ckpt.headers.values()
            for name, info in hdr.tensors.items()
        )
    )


def inspect_checkpoint(ckpt: Checkpoint) -> dict:
    qc = ckpt.quantization_config or {}
    why = unreadable(qc)
    if why:
        total = sum(info.nbytes for hdr in ckpt.headers.values() for info in hdr.tensors.values())
        raise SplicerError(
            f"{ckpt.label}: splicer cannot read {why}: it reads {read_methods()}, so it reports no modules or "
            f"sizes per class ({total / 1e9:.3f} GB of tensors in all); vLLM may still load it: score it "
            "with `splicer score BASE BUILD --backend vllm`"
        )
    format_or_default(qc).validate_regexes(qc, ckpt.label)
    arch = ckpt.arch
    modules = list_modules(ckpt)
    per_class: dict[str, dict] = defaultdict(
        lambda: {
            "modules": 0,
            "quantized": 0,
            "schemes": set(),
            "bytes_on_disk": 0,
            "bytes_per_decode_step": 0.0,
        }
    )
    for m in modules.values():
        row = per_class[m.cls]
        row["modules"] += 1
        if m.quantized:
            row["quantized"] += 1
            row["schemes"].add(m.scheme)
        else:
            row["schemes"].add(m.weight_dtype.lower())
    for hdr in ckpt.headers.values():
        for name, info in hdr.tensors.items():
            row = per_class[arch.tensor_class(name)]
            row["bytes_on_disk"] += info.nbytes
            row["bytes_per_decode_step"] += info.nbytes * decode_fraction(ckpt, name, info.shape)
    report = check(modules, qc, arch, {n: info.dtype for hdr in ckpt.headers.values() for n, info in hdr.tensors.items()})
    if why := family_mismatch(ckpt.config.get("model_type"), ckpt.weight_map):
        report.issues.insert(0, {"check": "model-type", "naming": "hf", "detail": why})
    if (fmt := format_of(qc)) and fmt.inspect_validates_config:
        # What vLLM's loader requires of the config itself (splice refuses these before writing anything).
        from .validate import validate_build

        try:
            validate_build(ckpt)
        except SplicerError as e:
            if not (why and why in str(e)):  # the model type's mismatch is reported above, once
                report.issues.append({"check": "config-invalid", "naming": "vllm", "detail": str(e)})
    if not ckpt.config.get("architectures"):
        # vLLM picks the model class (and the runner) from this list; without it vLLM 0.26 resolved the qwen3 family
        # fixtures to their bare Qwen3Model and served them as embedding models (results/gpu-families).
        report.issues.append(
            {
                "check": "no-architectures",
                "naming": "vllm",
                "detail": "config.json names no architectures, so vLLM may load a bare model class as an "
                'embedding model; add the "architectures" list a released checkpoint has (its '
                "causal-LM class)",
            }
        )
    classes = {}
    for cls in (*arch.classes, "other"):
        if cls in per_class:
            row = per_class[cls]
            classes[cls] = dict(row, schemes=sorted(row["schemes"]), bytes_per_decode_step=int(row["bytes_per_decode_step"]))
    return {
        "checkpoint": ckpt.label,
        "model_type": ckpt.config.get("model_type"),
        "quant_method": qc.get("quant_method"),
        "format": checkpoint_format(qc),
        "config_groups": {
            g: {
                "targets": v.get("targets"),
                "format": group_format(qc, v),
                "scheme": group_scheme(qc, g),
                "bits": (v.get("weights") or {}).get("num_bits"),
                "group_size": (v.get("weights") or {}).get("group_size"),
            }
            for g, v in (qc.get("config_groups") or {}).items()
        },
        "classes": classes,
        "total_bytes_on_disk": sum(r["bytes_on_disk"] for r in classes.values()),
        "total_bytes_per_decode_step": sum(r["bytes_per_decode_step"] for r in classes.values()),
        "lint": {
            "issues": report.issues,
            "dead_ignore": report.dead_ignore,
            "notes": report.notes,
            # the vLLM release whose reader the lint models (the installed one, else the newest checked)
            "vllm_reader": label(modeled()),
        },
        "header_digest": ckpt.header_digest(),
    }


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f}" if n >= 1e7 else f"{n / 1e6:.3f} MB".replace(" MB", "M")


def format_report(info: dict) -> str:
    from tabulate import tabulate

    rows = []
    for cls, r in info["classes"].items():
        rows.append([cls, r["modules"], r["quantized"], ", ".join(r["schemes"]), r["bytes_on_disk"], r["bytes_per_decode_step"]])
    rows.append(["total", "", "", "", info["total_bytes_on_disk"], info["total_bytes_per_decode_step"]])
    out = [
        f"{info['checkpoint']}  ({info['model_type']}, {info['quant_method'] or 'not quantized'}, {info['format'] or '-'})",
        "",
    ]
    out.append(
        tabulate(
            rows,
            headers=["class", "modules", "quantized", "stored as", "bytes on disk", "bytes read / decode step"],
            tablefmt="github",
            intfmt=",",
        )
    )
    out.append("")
    issues = info["lint"]["issues"]
    reader = f" ({info['lint']['vllm_reader']}'s reader)" if info["lint"].get("vllm_reader") else ""
    if not issues:
        out.append(f"lint{reader}: no problems under HF or vLLM naming")
    else:
        out.append(f"lint{reader}: {len(issues)} problem(s)")
        out.append(
            tabulate(
                [[i["check"], i["naming"], i["detail"]] for i in issues], headers=["check", "naming", "detail"], tablefmt="github"
            )
        )
    for note in info["lint"].get("notes", []):
        out.append(f"note: {note}")
    return "\n".join(out)
