"""--expert-cache's loader against vLLM 0.26's own DefaultModelLoader, here on the CPU: the bundle's Python code (its
compiled parts are not used), the toy model of tests/test_expert_cache.py in vLLM 0.26's MoE layout. What the stand-in vLLM
of the tests cannot show: that the loader works with the real DefaultModelLoader (its load-format checks, its file
selection, its strict tracking for unquantized models, the EP filter).

    python3.12 -m venv V && V/bin/pip install torch==2.13.0 && V/bin/pip install -e . urllib3 aiohttp requests httpx
    bash scripts/gpu/install_bundle.sh .bundle/vb .bundle/vb/SHA256SUMS SITE
    PYTHONPATH=SITE V/bin/python scripts/check_expert_cache_vllm.py WORKDIR

(vLLM 0.26.0's bundle is built for Python 3.12; the machine's device configuration cannot be inferred on a CPU, so the
EP filter's config lookup is given one with expert parallelism off.) Prints what each load did; exits 1 on a mismatch.
"""

import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    import test_expert_cache as T
    import torch
    import vllm
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    from splicer.backends import vllm_expert_cache as xc

    print("vllm", vllm.__version__, vllm.__file__)
    xc.register()
    tmp = Path(sys.argv[1])
    t = T._tensors()
    build = T.write_ckpt(tmp / "build", t)
    variant_t = dict(t, **{k: v * 0 + 0.5 for k, v in t.items() if "shared_expert" in k or "mlp.gate." in k})
    variant = T.write_ckpt(tmp / "variant", variant_t, files=2)
    import os

    os.environ[xc.ENV] = str(tmp / "cache")

    def load(folder, quant="compressed-tensors"):
        loader = get_model_loader(LoadConfig(load_format=xc.LOAD_FORMAT))
        print("loader", type(loader).__name__, "load_format seen by DefaultModelLoader:", loader.load_config.load_format)
        cfg = SimpleNamespace(
            model=str(folder),
            revision=None,
            dtype=torch.float32,
            quantization=quant,
            hf_config=SimpleNamespace(model_type="qwen3_5_moe"),
        )
        cfg.is_moe = True
        m = T.ToyMoE()
        from unittest import mock

        pc = SimpleNamespace(parallel_config=SimpleNamespace(enable_expert_parallel=False, enable_ep_weight_filter=False))
        with mock.patch("vllm.config.get_current_vllm_config", lambda: pc):  # no device config on this CPU machine
            loader.load_weights(m, cfg)
        return m, xc.last_outcome()

    m1, o1 = load(build)
    print("first:", o1)
    m2, o2 = load(variant)
    print("second:", o2)
    experts_given = [n for n in m2.given if n.startswith(T.DEC + "mlp.experts.")]
    print("expert tensors given to the model on the second load:", len(experts_given))
    s1, s2 = m1.state_dict(), m2.state_dict()
    print("routed experts equal:", all(torch.equal(s1[k], s2[k]) for k in s1 if ".routed_experts." in k))
    print("variant's gate kept:", bool(torch.all(s2["language_model.model.layers.0.mlp.experts.gate.weight"] == 0.5)))
    m3, o3 = load(build, quant=None)  # unquantized: DefaultModelLoader's strict tracking on the normal path
    print("unquantized, from cache:", o3["do"])
    m4, o4 = load(build, quant=None)  # again: from the cache, with DefaultModelLoader's strict tracking turned off
    print("unquantized again:", o4["do"])
    ok = (
        o1["do"] == "save"
        and o2["do"] == "load"
        and not experts_given
        and o3["do"] == "save"
        and o4["do"] == "load"
        and all(torch.equal(s1[k], s2[k]) for k in s1 if ".routed_experts." in k)
        and bool(torch.all(s2["language_model.model.layers.0.mlp.experts.gate.weight"] == 0.5))
    )
    print("ok" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
