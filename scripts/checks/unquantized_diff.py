"""Which tensors a quantized build stores unquantized but not equal to its base.

    python scripts/checks/unquantized_diff.py BUILD BASE [--json OUT.json]

A quantizer should change only the modules it quantizes. This lists every tensor present under the same name in both
checkpoints, unquantized in the build (not a quantization parameter, and its module has none), whose values differ
from BASE: max |diff| and how many elements differ, grouped by name pattern (layer and expert indices become N), with
a summary line. Names under `mtp.` are compared like any other. Standard library + safetensors + torch only, so it runs
in either environment (splicer's or llm-compressor's).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

# Leaves of a quantized module in compressed-tensors, GPTQ/AWQ (AutoGPTQ layout) and FP8-block checkpoints.
QUANT_LEAVES = (
    "weight_packed",
    "weight_scale",
    "weight_zero_point",
    "weight_shape",
    "weight_g_idx",
    "g_idx",
    "qweight",
    "qzeros",
    "scales",
    "weight_scale_inv",
    "input_scale",
    "weight_global_scale",
    "input_global_scale",
)


def fail(msg: str) -> None:
    print(f"unquantized_diff: {msg}", file=sys.stderr)
    sys.exit(2)


def tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / f for name, f in weight_map.items()}
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        fail(f"{folder} has no *.safetensors; pass a checkpoint folder")
    out = {}
    for f in files:
        with safe_open(str(f), "pt") as fh:
            out.update({k: f for k in fh.keys()})
    return out


def is_quantized(name: str, names: set[str]) -> bool:
    module, _, leaf = name.rpartition(".")
    return leaf in QUANT_LEAVES or any(f"{module}.{q}" in names for q in QUANT_LEAVES)


def pattern(name: str) -> str:
    return re.sub(r"\.\d+\.", ".N.", re.sub(r"\.\d+\.", ".N.", name))


def load(path: Path, name: str):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as fh:
        return fh.get_tensor(name)


def compare(build: Path, base: Path) -> dict:
    bfiles, afiles = tensor_files(build), tensor_files(base)
    bnames = set(bfiles)
    shared = sorted(n for n in bnames & set(afiles) if not is_quantized(n, bnames))
    rows, compared, shape_or_dtype = [], 0, []
    for name in shared:
        b, a = load(bfiles[name], name), load(afiles[name], name)
        compared += 1
        if b.shape != a.shape or b.dtype != a.dtype:
            shape_or_dtype.append(f"{name}: build {b.dtype} {tuple(b.shape)} base {a.dtype} {tuple(a.shape)}")
            continue
        neq = b != a
        if bool(neq.any()):
            diff = (b.double() - a.double()).abs()
            rows.append({"name": name, "max_abs_diff": float(diff.max()), "differing": int(neq.sum()), "numel": b.numel()})
    groups: dict[str, dict] = {}
    for r in rows:
        g = groups.setdefault(pattern(r["name"]), {"tensors": 0, "max_abs_diff": 0.0, "differing": 0, "numel": 0})
        g["tensors"] += 1
        g["max_abs_diff"] = max(g["max_abs_diff"], r["max_abs_diff"])
        g["differing"] += r["differing"]
        g["numel"] += r["numel"]
    return {
        "build": str(build),
        "base": str(base),
        "unquantized_shared": compared,
        "differ": len(rows),
        "shape_or_dtype_mismatch": shape_or_dtype,
        "groups": groups,
        "tensors": rows,
    }


def report(r: dict) -> str:
    lines = [f"build {r['build']}", f"base  {r['base']}"]
    if r["groups"]:
        lines.append(f"{'pattern':64} {'tensors':>7} {'max|diff|':>12} {'differing/elements':>20}")
        for pat, g in sorted(r["groups"].items()):
            lines.append(f"{pat:64} {g['tensors']:7d} {g['max_abs_diff']:12.6g} {g['differing']:>10d}/{g['numel']:<9d}")
    for m in r["shape_or_dtype_mismatch"]:
        lines.append(f"shape/dtype differs: {m}")
    lines.append(
        f"summary: {r['unquantized_shared']} unquantized tensors in both; {r['differ']} differ in value "
        f"({len(r['groups'])} patterns); {len(r['shape_or_dtype_mismatch'])} differ in shape or dtype"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("build", type=Path)
    p.add_argument("base", type=Path)
    p.add_argument("--json", type=Path, help="also write the full comparison (every differing tensor) here")
    args = p.parse_args(argv)
    for folder in (args.build, args.base):
        if not folder.is_dir():
            fail(f"{folder} is not a folder; pass BUILD and BASE checkpoint folders")
    r = compare(args.build, args.base)
    print(report(r))
    if args.json:
        args.json.write_text(json.dumps(r, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
