"""KL(base || base with the build's norm weights) in transformers on the CPU: the offset-norm round trip's effect alone.

    python scripts/checks/norm_swap_kl.py BASE BUILD TEXT [--tokens N] [--window L]

Loads BASE (BF16) twice with transformers, copies into the second every `*norm.weight` the BUILD stores unquantized
with a different value (on a llm-compressor oneshot build: the offset norms after the (1 + w) BF16 round trip), and
compares next-token distributions over the first N tokens of TEXT in windows of L: mean KL(base || swapped) per token
and top-1 agreement. Nothing quantized is touched, so this isolates the norms. Needs transformers (either venv).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from unquantized_diff import fail, load, tensor_files  # noqa: E402


def load_model(base: Path):
    import transformers

    arch = json.loads((base / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(base, dtype=torch.bfloat16)
    return model.eval()


def changed_norms(build: Path, base: Path) -> dict[str, torch.Tensor]:
    bfiles, afiles = tensor_files(build), tensor_files(base)
    out = {}
    for name in sorted(set(bfiles) & set(afiles)):
        if name.endswith("norm.weight"):
            b = load(bfiles[name], name)
            if not torch.equal(b, load(afiles[name], name)):
                out[name] = b
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base", type=Path)
    p.add_argument("build", type=Path)
    p.add_argument("text", type=Path)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    args = p.parse_args(argv)
    if not args.text.is_file():
        fail(f"{args.text} is not a file; pass a plain-text file to score")
    from transformers import AutoTokenizer

    swaps = changed_norms(args.build, args.base)
    base, swapped = load_model(args.base), load_model(args.base)
    params = dict(swapped.named_parameters())
    for name, t in swaps.items():
        if name not in params:
            fail(f"{name} from BUILD is not a parameter of the loaded model; the checkpoints do not match")
        params[name].data.copy_(t)
    ids = AutoTokenizer.from_pretrained(args.base)(args.text.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    ids = torch.tensor(ids[: args.tokens])
    kl_sum, agree, n = 0.0, 0, 0
    with torch.no_grad():
        for start in range(0, len(ids), args.window):
            x = ids[start : start + args.window][None]
            lp = torch.log_softmax(base(input_ids=x).logits.float(), -1)[0]
            lq = torch.log_softmax(swapped(input_ids=x).logits.float(), -1)[0]
            kl_sum += float((lp.exp() * (lp - lq)).sum(-1).sum())
            agree += int((lp.argmax(-1) == lq.argmax(-1)).sum())
            n += x.shape[1]
    print(f"swapped {len(swaps)} norm weights: {', '.join(swaps) or 'none'}")
    print(f"tokens {n}: mean KL(base || swapped) {kl_sum / n:.6f} nats/token; top-1 agreement {100 * agree / n:.2f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
