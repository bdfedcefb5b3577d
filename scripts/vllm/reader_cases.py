"""Record what each vLLM release's own reader functions answer for generated configs and layer names.

    python scripts/vllm/reader_cases.py WHEEL_OR_SOURCE_DIR... -o tests/data

For each vLLM wheel (or unpacked source tree) given, this runs that release's own code on generated cases over the
qwen3_5_moe text model's vLLM layer names and writes the answers, one JSON file per reader, which
tests/test_vllm_readers.py checks splicer's model of each reader against, without vLLM on the machine:
- vllm-should-ignore.json: compressed-tensors `should_ignore_layer` (an `ignore` list: ignored, kept, or refused);
- vllm-find-target.json: compressed-tensors `find_matched_target` (a layer, its class, a target list: the target);
- vllm-gptq.json: GPTQ `get_dynamic_override` with `is_layer_gptq_quantized` as `get_linear_quant_method` and
  `get_moe_quant_method` combine them (quantized, unquantized, or refused), and `normalize_and_validate_gptq_desc_act`
  where the release has it;
- vllm-skip-list.json: FP8 / AWQ `is_layer_skipped` (exact names or substrings).
A full `import vllm` needs vLLM's GPU stack. The two compressed-tensors files import only `regex`, `fnmatch`, torch's
Module, compressed-tensors and names of other vLLM modules that the matching code never calls, so those few are stubbed
and the files run as released. From `gptq_utils.py` and `quant_utils.py`, whose imports reach the GPU stack, the named
functions are taken out of the release's source as they are and run with the standard-library names they use.
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import importlib.util
import json
import random
import re
import sys
import types
import zipfile
from pathlib import Path

FILES = {
    "utils": "vllm/model_executor/layers/quantization/compressed_tensors/utils.py",
    "config_utils": "vllm/model_executor/layers/quantization/utils/config_utils.py",
    "gptq_utils": "vllm/model_executor/layers/quantization/utils/gptq_utils.py",
    "quant_utils": "vllm/model_executor/layers/quantization/utils/quant_utils.py",
    "ct_config": "vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py",
}
MODULES = {
    "utils": "vllm.model_executor.layers.quantization.compressed_tensors.utils",
    "config_utils": "vllm.model_executor.layers.quantization.utils.config_utils",
}


class _Stub(types.ModuleType):
    """A module whose every attribute is a placeholder class: the names the two files import but never call."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {})
        setattr(self, name, value)
        return value


def _sources(src: str) -> tuple[str, dict[str, bytes]]:
    p = Path(src)
    out = {}
    if p.is_file():
        with zipfile.ZipFile(p) as z:
            names = set(z.namelist())
            version = next(n for n in names if n.startswith("vllm-") and n.endswith(".dist-info/METADATA"))
            version = version.removeprefix("vllm-").split(".dist-info")[0]
            for key, f in FILES.items():
                if f in names:
                    out[key] = z.read(f)
        return version, out
    for key, f in FILES.items():
        if (p / f).exists():
            out[key] = (p / f).read_bytes()
    return p.name, out  # an unpacked tree: its folder names the release


def _functions(source: bytes, path: str, names: tuple[str, ...]) -> dict:
    """The named top-level functions of a release's file, compiled from its source as they are, with the names they
    use from outside (typing, collections.abc, types, copy, and `regex` imported as `re` as those files do)."""
    tree = ast.parse(source)
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):  # methods named Class.method, as functions
        defs += [m for m in cls.body if isinstance(m, ast.FunctionDef) and f"{cls.name}.{m.name}" in names]
    from collections.abc import Iterable, Mapping
    from types import MappingProxyType
    from typing import Any, Literal

    import regex

    space = {
        "re": regex,
        "Mapping": Mapping,
        "Iterable": Iterable,
        "MappingProxyType": MappingProxyType,
        "Any": Any,
        "Literal": Literal,
        "deepcopy": copy.deepcopy,
        "AutoGPTQConfig": object,
        "__name__": "vllm_release_functions",
    }
    exec(compile(ast.Module(body=defs, type_ignores=[]), path, "exec"), space)
    return {next(x for x in names if x.split(".")[-1] == n.name): space[n.name] for n in defs}


def load_release(src: str):
    """(version, {function name: that release's function}, the files' sha256)."""
    version, files = _sources(src)
    saved = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    for k in saved:
        del sys.modules[k]
    try:
        for name in (
            "vllm",
            "vllm.model_executor",
            "vllm.model_executor.layers",
            "vllm.model_executor.layers.quantization",
            "vllm.model_executor.layers.quantization.utils",
            "vllm.model_executor.layers.quantization.compressed_tensors",
        ):
            m = types.ModuleType(name)
            m.__path__ = []
            sys.modules[name] = m
        logger = types.ModuleType("vllm.logger")
        logger.init_logger = lambda name: __import__("logging").getLogger(name)
        sys.modules["vllm.logger"] = logger
        for name in ("vllm.model_executor.parameter", "vllm.model_executor.layers.quantization.utils.quant_utils"):
            sys.modules[name] = _Stub(name)
        loaded = {}
        for key in ("config_utils", "utils"):  # utils imports config_utils where the release has it (files run whole)
            if key not in files:
                continue
            spec = importlib.util.spec_from_loader(MODULES[key], loader=None)
            module = importlib.util.module_from_spec(spec)
            sys.modules[MODULES[key]] = module
            exec(compile(files[key], f"vllm-{version}/{FILES[key]}", "exec"), module.__dict__)
            loaded[key] = module
        digests = {FILES[k]: hashlib.sha256(v).hexdigest() for k, v in files.items()}
        fns = {
            "should_ignore_layer": loaded["utils"].should_ignore_layer,
            "find_matched_target": loaded["utils"].find_matched_target,
        }
        fns |= _functions(
            files["gptq_utils"],
            f"vllm-{version}/{FILES['gptq_utils']}",
            ("get_dynamic_override", "is_layer_gptq_quantized", "flatten_list", "normalize_and_validate_gptq_desc_act"),
        )
        fns |= _functions(files["quant_utils"], f"vllm-{version}/{FILES['quant_utils']}", ("is_layer_skipped",))
        fns |= _functions(
            files["ct_config"],
            f"vllm-{version}/{FILES['ct_config']}",
            ("CompressedTensorsConfig._add_fused_moe_to_target_scheme_map",),
        )
        return version, fns, digests
    finally:
        for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def should_ignore_cases(seed: int = 0, n: int = 2000) -> tuple[dict, list[dict]]:
    """The qwen3_5_moe text model's packed modules (splicer's table of them) and n cases over its layer names."""
    from splicer.arch.qwen3_5_moe import QWEN3_5_MOE as arch

    fused = {k: list(v) for k, v in arch.vllm_packed_modules.items()}
    prefix = "language_model.model.layers"
    layers = []
    for i in (0, 3, 11):
        for mod, projs in (
            ("self_attn", ["qkv_proj", "o_proj"]),
            ("linear_attn", ["in_proj_qkvz", "in_proj_ba", "out_proj"]),
            ("mlp.shared_expert", ["gate_up_proj", "down_proj"]),
        ):
            layers += [f"{prefix}.{i}.{mod}.{p}" for p in projs if p in fused or "_" in p]
    layers.append("lm_head")
    shard_names = []
    for name in layers:
        proj = name.rsplit(".", 1)[-1]
        shard_names += [name[: -len(proj)] + s for s in fused.get(proj, [])]
    projs = sorted({n.rsplit(".", 1)[-1] for n in layers + shard_names})
    pool = (
        layers
        + shard_names
        + [f"re:.*{p}$" for p in projs]
        + [f"re:.*\\.{i}\\..*" for i in (0, 3)]
        + ["re:.*self_attn.*", "re:.*linear_attn\\.in_proj_(qkv|z)$", "re:.*[qk]_proj$", "re:.*proj$", "lm_head", "re:lm_head"]
        + [n.replace("language_model.", "") for n in layers[:6]]  # HF-style names vLLM's mapper would not produce
    )
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ignore = rng.sample(pool, rng.randint(0, 4))
        out.append({"layer": rng.choice(layers), "ignore": ignore})
    return fused, out


def _names():
    """The qwen3_5_moe text model's vLLM layer names the cases draw on: (fused mapping, Linear layers with the head,
    their shards, the MoE layers' prefixes)."""
    fused, _ = should_ignore_cases(n=0)
    prefix = "language_model.model.layers"
    layers = [
        f"{prefix}.{i}.{mod}.{p}"
        for i in (0, 3, 11)
        for mod, projs in (
            ("self_attn", ["qkv_proj", "o_proj"]),
            ("linear_attn", ["in_proj_qkvz", "in_proj_ba", "out_proj"]),
            ("mlp.shared_expert", ["gate_up_proj", "down_proj"]),
        )
        for p in projs
    ] + ["lm_head"]
    shards = [n[: -len(n.rsplit(".", 1)[-1])] + s for n in layers for s in fused.get(n.rsplit(".", 1)[-1], [])]
    moe = [f"{prefix}.{i}.mlp.experts" for i in (0, 3, 11)]
    return fused, layers, shards, moe


def _class_name(layer: str, fused: dict) -> str:
    """The layer's class as splicer's architecture table names it (VllmLayer.class_names[0])."""
    proj = layer.rsplit(".", 1)[-1]
    if layer == "lm_head":
        return "ParallelLMHead"
    return "MergedColumnParallelLinear" if proj in fused else "RowParallelLinear"


def find_target_cases(seed: int = 1, n: int = 2000) -> list[dict]:
    fused, layers, shards, _ = _names()
    projs = sorted({s.rsplit(".", 1)[-1] for s in layers + shards})
    pool = (
        layers
        + shards
        + [f"re:.*{p}$" for p in projs]
        + ["Linear", "linear", "ColumnParallelLinear", "RowParallelLinear", "re:.*Linear", "ParallelLMHead", "lm_head"]
        + ["re:.*\\.3\\..*", "re:.*self_attn\\.[qkv]_proj$", "re:.*linear_attn\\.in_proj_(qkv|z)$", "re:.*proj$"]
        + [n.replace("language_model.", "") for n in layers[:4]]
    )
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        layer = rng.choice(layers)
        targets = rng.sample(pool, rng.randint(0, 4))
        if rng.random() < 0.3:  # a class target beside one naming every shard: where the releases' order decides
            shard_only = ["re:.*\\.(q|k|v|gate|up)_proj$", "re:.*in_proj_(qkv|z|a|b)$", "re:.*_proj$"]
            targets += [rng.choice(["Linear", "re:.*Linear"]), rng.choice(shard_only)]
            rng.shuffle(targets)
        out.append({"layer": layer, "class": _class_name(layer, fused), "targets": targets})
    # An MoE layer's experts, as get_moe_method asks for each (its prefix .0. a projection): a RoutedExperts module,
    # whose target map has "Linear" copied to "RoutedExperts" first (_add_fused_moe_to_target_scheme_map).
    moe_pool = ["Linear", "re:.*Linear", "FusedMoE", "Experts", "RoutedExperts", "re:.*experts.*", "re:.*gate_proj$"]
    moe_pool += ["re:.*mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$", "re:.*\\.3\\..*", "linear"]
    _, _, _, moe = _names()
    rng = random.Random(seed + 100)
    for _ in range(n // 4):
        layer = f"{rng.choice(moe)}.0.{rng.choice(['gate_proj', 'up_proj', 'down_proj'])}"
        out.append({"layer": layer, "class": "RoutedExperts", "targets": rng.sample(moe_pool, rng.randint(1, 3))})
    return out


def gptq_cases(seed: int = 2, n: int = 2000) -> list[dict]:
    _, layers, _, moe = _names()
    stored = stored_names()
    short = sorted({".".join(s.split(".")[-2:]) for s in stored}) + ["mlp.shared_expert", "linear_attn", "lm_head"]
    patterns = (
        [re.escape(n) + "$" for n in layers[::3] + moe[:1]]
        + [".*qkv_proj", ".*\\.3\\..*", ".*mlp\\.experts", ".*mlp\\.experts(\\.|$)", ".*mlp\\.experts\\.\\d+\\..*"]
        + [".*shared_expert.*", ".*linear_attn.*", ".*in_proj_(qkv|z)$", "model\\.language_model\\..*", "lm_head", ".*"]
        + ["language_model\\.model\\.layers\\.(0|3)\\."]
    )
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        dynamic = {}
        for _ in range(rng.randint(0, 4)):
            key = rng.choice(["-:", "+:", ""]) + rng.choice(patterns)
            dynamic.setdefault(key, rng.choice([{}, {"bits": 8}, {"group_size": 32}]))
        r = rng.random()
        if r < 0.03:
            listed = []
        elif r < 0.5:  # the scan of a checkpoint with some modules restored to BF16
            listed = {"restored": [s for s in stored if rng.random() < 0.1]}
        else:  # a config's own list
            listed = rng.sample(short, rng.randint(1, 5))
        kind = rng.choice(["linear"] * 5 + ["moe"])
        layer = rng.choice(moe) if kind == "moe" else rng.choice(layers)
        out.append({"layer": layer, "kind": kind, "dynamic": dynamic, "listed": listed})
    return out


def listed_of(case: dict, stored: list[str]) -> list[str]:
    """A GPTQ case's modules_in_block_to_quantize: the config's list, or the scan of every module stored packed."""
    listed = case["listed"]
    return [s for s in stored if s not in listed["restored"]] if isinstance(listed, dict) else listed


def stored_names() -> list[str]:
    """Every Linear (or shard) name a checkpoint quantized throughout stores packed, as vLLM's scan names them: the
    shards of fused layers, the other layers as they are."""
    fused, layers, shards, _ = _names()
    return shards + [n for n in layers if n.rsplit(".", 1)[-1] not in fused]


def desc_act_cases(seed: int = 3, n: int = 400) -> list[dict]:
    rng = random.Random(seed)
    overrides = [
        {},
        {"desc_act": True},
        {"desc_act": False},
        {"group_size": -1},
        {"desc_act": True, "group_size": -1},
        {"desc_act": True, "group_size": 64},
        {"group_size": 32},
    ]
    out = []
    for _ in range(n):
        dynamic = {}
        for i in range(rng.randint(0, 2)):
            dynamic.setdefault(rng.choice(["-:", "+:", ""]) + f".*layers\\.{i}\\..*", rng.choice(overrides))
        out.append({"desc_act": rng.random() < 0.5, "group_size": rng.choice([-1, 32, 128]), "dynamic": dynamic})
    return out


def skip_list_cases(seed: int = 4, n: int = 2000) -> list[dict]:
    _, layers, shards, moe = _names()
    pool = (
        layers
        + shards
        + moe
        + [m + ".5.gate_proj" for m in moe[:2]]
        + ["linear_attn", "self_attn", "shared_expert", "mlp.experts", "layers.1", "layers.3.", "experts", "lm_head"]
        + [n.replace("language_model.", "") for n in layers[:4]]
    )
    rng = random.Random(seed)
    return [
        {
            "layer": rng.choice(layers + moe),
            "entries": rng.sample(pool, rng.randint(0, 4)),
            "substring": rng.random() < 0.5,
        }
        for _ in range(n)
    ]


def _answer(call):
    try:
        return call()
    except ValueError as e:
        return "refused: " + str(e).split(".")[0]


def answers(fns: dict, fused: dict, cases: dict[str, list[dict]]) -> dict[str, list]:
    """Each reader's answers for its cases, from one release's functions."""
    from types import SimpleNamespace

    stored = stored_names()

    def module_of(name):
        return type(name, (), {})()

    def find_target(c):
        targets = list(c["targets"])
        if c["class"] == "RoutedExperts":  # the MoE method's target map (the target's value is not asked here)
            cfg = SimpleNamespace(target_scheme_map=dict.fromkeys(targets))
            fns["CompressedTensorsConfig._add_fused_moe_to_target_scheme_map"](cfg)
            targets = list(cfg.target_scheme_map)
        return fns["find_matched_target"](c["layer"], module_of(c["class"]), targets, fused)

    def gptq(c):
        cfg = SimpleNamespace(dynamic=c["dynamic"])
        if c["kind"] == "moe":
            return fns["get_dynamic_override"](cfg, layer_name=c["layer"]) != False  # noqa: E712 (as vLLM compares)
        listed = listed_of(c, stored)
        listed = fns["flatten_list"](listed) if "flatten_list" in fns else listed
        quantized = fns["is_layer_gptq_quantized"](prefix=c["layer"], quantized_layers=listed, fused_mapping=fused)
        skipped = fns["get_dynamic_override"](cfg, layer_name=c["layer"]) == False  # noqa: E712
        return not (skipped or not quantized)

    def desc_act(c):
        if "normalize_and_validate_gptq_desc_act" not in fns:
            return None  # the release has no such check: it loads desc_act as given
        fns["normalize_and_validate_gptq_desc_act"](c["desc_act"], c["group_size"], c["dynamic"])
        return "accepted"

    def skipped(c):
        import inspect

        mode = {"match_mode": "substring" if c["substring"] else "exact"}
        if "skip_with_substr" in inspect.signature(fns["is_layer_skipped"]).parameters:
            mode = {"skip_with_substr": c["substring"]}
        return bool(fns["is_layer_skipped"](c["layer"], c["entries"], fused, **mode))

    return {
        "should_ignore": [
            _answer(lambda c=c: bool(fns["should_ignore_layer"](c["layer"], ignore=c["ignore"], fused_mapping=fused)))
            for c in cases["should_ignore"]
        ],
        "find_target": [_answer(lambda c=c: find_target(c)) for c in cases["find_target"]],
        "gptq": [_answer(lambda c=c: gptq(c)) for c in cases["gptq"]],
        "desc_act": [_answer(lambda c=c: desc_act(c)) for c in cases["desc_act"]],
        "skip_list": [_answer(lambda c=c: skipped(c)) for c in cases["skip_list"]],
    }


OUTPUTS = {  # file: the readers it holds
    "vllm-should-ignore.json": ("should_ignore",),
    "vllm-find-target.json": ("find_target",),
    "vllm-gptq.json": ("gptq", "desc_act"),
    "vllm-skip-list.json": ("skip_list",),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sources", nargs="+", help="vLLM wheels (.whl) or unpacked source folders")
    p.add_argument("-o", "--out", required=True, type=Path, help="folder for the JSON files")
    args = p.parse_args(argv)
    fused, si = should_ignore_cases()
    cases = {
        "should_ignore": si,
        "find_target": find_target_cases(),
        "gptq": gptq_cases(),
        "desc_act": desc_act_cases(),
        "skip_list": skip_list_cases(),
    }
    per_release = {}
    for src in args.sources:
        version, fns, digests = load_release(src)
        per_release[version] = (digests, answers(fns, fused, cases))
        print(f"vllm {version}: " + ", ".join(f"{k} {len(v)}" for k, v in per_release[version][1].items()))
    args.out.mkdir(parents=True, exist_ok=True)
    for fname, readers in OUTPUTS.items():
        record = {"generated_by": "scripts/vllm/reader_cases.py", "fused_mapping": fused}
        record |= {("cases" if len(readers) == 1 else f"{r}_cases"): cases[r] for r in readers}
        record["releases"] = {
            v: {"files": d, **{("answers" if len(readers) == 1 else f"{r}_answers"): a[r] for r in readers}}
            for v, (d, a) in per_release.items()
        }
        (args.out / fname).write_text(json.dumps(record, separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
