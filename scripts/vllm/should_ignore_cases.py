"""Record what vLLM's own `should_ignore_layer` answers for generated compressed-tensors ignore lists, per release.

    python scripts/vllm/should_ignore_cases.py WHEEL_OR_SOURCE_DIR... -o tests/data/vllm-should-ignore.json

For each vLLM wheel (or unpacked source tree) given, this loads that release's own
`model_executor/layers/quantization/compressed_tensors/utils.py` (and `utils/config_utils.py`, where the release has
it) and calls its `should_ignore_layer` on every case: a vLLM layer name of the qwen3_5_moe text model, an ignore list
drawn from exact names, shard names and regexes, and the model's packed_modules_mapping. A full `import vllm` needs
vLLM's GPU stack; the two files import only `regex`, `fnmatch`, torch's Module, compressed-tensors and names of other
vLLM modules that the matching code never calls, so those few are stubbed and the files' own code runs as released.
The answers (True, False, or the refusal's first words) go to one JSON file that tests/test_vllm_readers.py checks
splicer's model of the reader against, without vLLM on the machine.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import random
import sys
import types
import zipfile
from pathlib import Path

FILES = {
    "utils": "vllm/model_executor/layers/quantization/compressed_tensors/utils.py",
    "config_utils": "vllm/model_executor/layers/quantization/utils/config_utils.py",
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


def load_release(src: str):
    """(version, should_ignore_layer of that release, the files' sha256)."""
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
        for key in ("config_utils", "utils"):  # utils imports config_utils where the release has it
            if key not in files:
                continue
            spec = importlib.util.spec_from_loader(MODULES[key], loader=None)
            module = importlib.util.module_from_spec(spec)
            sys.modules[MODULES[key]] = module
            exec(compile(files[key], f"vllm-{version}/{FILES[key]}", "exec"), module.__dict__)
            loaded[key] = module
        digests = {FILES[k]: hashlib.sha256(v).hexdigest() for k, v in files.items()}
        return version, loaded["utils"].should_ignore_layer, digests
    finally:
        for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def cases(seed: int = 0, n: int = 2000) -> tuple[dict, list[dict]]:
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sources", nargs="+", help="vLLM wheels (.whl) or unpacked source folders")
    p.add_argument("-o", "--out", required=True, type=Path)
    args = p.parse_args(argv)
    fused, todo = cases()
    record = {"generated_by": "scripts/vllm/should_ignore_cases.py", "fused_mapping": fused, "cases": todo, "releases": {}}
    for src in args.sources:
        version, fn, digests = load_release(src)
        answers = []
        for c in todo:
            try:
                answers.append(bool(fn(c["layer"], ignore=c["ignore"], fused_mapping=fused)))
            except ValueError as e:
                answers.append("refused: " + str(e).split(".")[0])
        record["releases"][version] = {"files": digests, "answers": answers}
        print(
            f"vllm {version}: {len(answers)} cases, {sum(a is True for a in answers)} ignored, "
            f"{sum(isinstance(a, str) for a in answers)} refused"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
