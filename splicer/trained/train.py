"""Train a small `qwen3_5_moe` on the data stage's text and write it as a BF16 base in the release layout.

The trunk is transformers' own `Qwen3_5MoeTextModel` (Gated-DeltaNet and gated attention, routed experts with a shared
expert), so what is trained is what transformers and vLLM compute from the same tensors. The MTP head is built the way
vLLM's `qwen3_5_mtp` runs it: the next token's embedding and the trunk's final (normed) hidden state, each RMS-normed,
concatenated [embedding, hidden], projected by `fc`, one full-attention decoder layer, a final norm, and the shared
lm_head (splicer/backends/torch_mtp.py, the one definition the torch backend runs too); it is trained on the token
after next. The base is written by `splicer.fixtures.core.write_base` with the trained tensors (routed experts split
per expert, as Qwen's release stores them); the tiny vision tower stays random (text only).

    python -m splicer.trained.train DATA OUT [--seed N] [--steps N] [--device cuda] [--recipe small|tiny]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..backends.torch_mtp import MTPHead, draft_logits
from ..errors import SplicerError, exit_code
from ..fixtures.core import TEXT_PRESETS


@dataclass
class Recipe:
    """Everything a training run is made from; `text` is the transformers text config's dimensions."""

    name: str
    text: dict
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup: int
    eval_windows: int
    max_seconds: float
    sample_tokens: int  # greedy tokens per sample prompt in the report
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_weight: float = 0.3
    router_aux_weight: float = 0.01
    seed: int = 0


# Hyperparameters as data. `small` is the model the results come from: the GPU fixture's dimensions (which vLLM 0.26
# loaded on the H200) with twice the layers and experts, an 8,192-token vocabulary and a wider shared expert; 400 steps
# of 64 x 512 tokens (13.1M tokens), about 13 s per 1M tokens on one H200 alone (a 60-step trial: 76k tokens/s,
# 34.5 GiB peak). `tiny` (the tiny fixture's dimensions) is for tests.
RECIPES = {
    "small": Recipe(
        name="small",
        text=dict(TEXT_PRESETS["gpu"], vocab_size=8192, num_hidden_layers=8, num_experts=32, shared_expert_intermediate_size=512),
        seq_len=512,
        batch_size=64,
        steps=400,
        lr=2e-3,
        warmup=40,
        eval_windows=64,
        max_seconds=330,
        sample_tokens=40,
    ),
    "tiny": Recipe(
        name="tiny",
        text=dict(TEXT_PRESETS["tiny"], vocab_size=512),
        seq_len=64,
        batch_size=4,
        steps=3,
        lr=1e-3,
        warmup=1,
        eval_windows=2,
        max_seconds=120,
        sample_tokens=3,
    ),
}
RECIPE_VERSION = "trained-1"
SAMPLE_PROMPTS = [
    ("en-dict", "ABACUS, n."),
    ("en-kernel", "The kernel"),
    ("en-python", "The function"),
    ("zh", "床前明月光"),
    ("chat", '<|im_start|>user\nWhat does the word "river" mean?<|im_end|>\n<|im_start|>assistant\n'),
]


def recipe(name: str, **overrides) -> Recipe:
    if name not in RECIPES:
        raise SplicerError(f"unknown recipe {name!r}; choose from {', '.join(RECIPES)}")
    return replace(RECIPES[name], **overrides)


def fixture_spec(r: Recipe):
    from ..fixtures.core import FixtureSpec

    # The tiny preset's non-text parts (vision tower) with the recipe's text dims.
    return FixtureSpec(preset="tiny", experts_layout="per_expert", seed=r.seed, text_overrides=dict(r.text))


class TrainedLM(nn.Module):
    def __init__(self, tc):
        super().__init__()
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextModel

        self.config = tc
        self.model = Qwen3_5MoeTextModel(tc)
        self.lm_head = nn.Linear(tc.hidden_size, tc.vocab_size, bias=False)
        nn.init.normal_(self.lm_head.weight, std=tc.initializer_range)
        self.mtp = MTPHead(tc)
        self.mtp.apply(self.model._init_weights)
        self._router_logits: list[torch.Tensor] = []
        for name, mod in self.named_modules():
            if name.endswith("mlp.gate"):
                mod.register_forward_hook(lambda m, i, o: self._router_logits.append(o[0]))

    def forward(self, ids: torch.Tensor):
        """ids [B, T+2] -> (next-token logits [B, T+1, V], next-next logits from MTP [B, T, V], router logits)."""
        self._router_logits = []
        inp = ids[:, :-1]
        hidden = self.model(input_ids=inp).last_hidden_state  # final norm applied, as vLLM hands to the drafter
        logits = self.lm_head(hidden)
        mtp_logits = draft_logits(self.mtp, self.model, self.lm_head, hidden[:, :-1], ids[:, 1:-1])
        return logits, mtp_logits, self._router_logits


def router_balance_loss(router_logits: list[torch.Tensor], n_experts: int, top_k: int) -> torch.Tensor:
    """Switch-style load balance: n_experts * sum_e (fraction of routed slots to e) * (mean router prob of e)."""
    total = 0.0
    for lg in router_logits:
        probs = lg.float().softmax(-1)
        chosen = torch.zeros_like(probs).scatter_(1, probs.topk(top_k, dim=-1).indices, 1.0)
        total = total + n_experts * (chosen.mean(0) / top_k * probs.mean(0)).sum()
    return total / max(len(router_logits), 1)


# --- data ---------------------------------------------------------------------------------------------------------


def _load_tokenizer(data: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(data / "tokenizer"))


def _token_stream(tok, texts: list[str]) -> torch.Tensor:
    """Documents tokenized and joined with <|endoftext|>, as one int64 stream."""
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    ids: list[int] = []
    for start in range(0, len(texts), 1024):
        for row in tok(texts[start : start + 1024], add_special_tokens=False)["input_ids"]:
            ids.extend(row)
            ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def check_data(data: Path) -> None:
    for need in ("train.jsonl", "heldout", "tokenizer"):
        if not (data / need).exists():
            raise SplicerError(f"{data}: no {need}; make the data folder with `python -m splicer.trained.data {data} --debs DIR`")


def read_data(data: Path, tok) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    texts = [json.loads(line)["text"] for line in (data / "train.jsonl").read_text(encoding="utf-8").splitlines() if line]
    train = _token_stream(tok, texts)
    heldout = {}
    for f in sorted((data / "heldout").iterdir()):
        if f.suffix == ".txt":
            heldout[f.stem] = _token_stream(tok, [f.read_text(encoding="utf-8")])
        elif f.suffix == ".jsonl":
            heldout[f.stem] = _token_stream(
                tok, [json.loads(line)["text"] for line in f.read_text(encoding="utf-8").splitlines() if line]
            )
    return train, heldout


def ngram_baselines(train: torch.Tensor, heldout: torch.Tensor, vocab: int) -> dict:
    """Held-out cross-entropy (nats/token) of an add-one unigram and of a bigram interpolated with it; the bigram's
    weight is the best of a grid on the held-out text itself, so the baseline is if anything flattered."""
    uni = torch.bincount(train, minlength=vocab).double() + 1.0
    p_uni = uni / uni.sum()
    pairs = train[:-1] * vocab + train[1:]
    big = torch.bincount(pairs, minlength=vocab * vocab).double().view(vocab, vocab)
    row = big.sum(1, keepdim=True)
    prev, nxt = heldout[:-1], heldout[1:]
    pu = p_uni[nxt]
    pb = torch.where(row[prev, 0] > 0, big[prev, nxt] / row[prev, 0].clamp(min=1), torch.zeros_like(pu))
    best = min(((-(lam * pb + (1 - lam) * pu).log().mean().item()), lam) for lam in (0.5, 0.6, 0.7, 0.8, 0.9, 0.95))
    return {"unigram": -pu.log().mean().item(), "bigram": best[0], "bigram_weight": best[1]}


def _windows(stream: torch.Tensor, length: int, n: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - length, (n,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model: TrainedLM, stream: torch.Tensor, r: Recipe, device) -> dict:
    """Mean next-token and next-next-token (MTP) loss, and MTP top-1 agreement with the actual token, on fixed
    non-overlapping windows of a held-out stream."""
    length = r.seq_len + 2
    n = min(r.eval_windows, (len(stream) - 1) // length)
    if n < 1:
        return {}
    batch = stream[: n * length].view(n, length)
    nll = mtp_nll = mtp_hit = count = 0.0
    for i in range(0, n, r.batch_size):
        ids = batch[i : i + r.batch_size].to(device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits, mtp_logits, _ = model(ids)
        nll += F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:-1].flatten(), reduction="sum").item()
        mtp_nll += F.cross_entropy(mtp_logits.float().flatten(0, 1), ids[:, 2:].flatten(), reduction="sum").item()
        mtp_hit += (mtp_logits.argmax(-1) == ids[:, 2:]).sum().item()
        count += ids[:, 2:].numel()
    return {"loss": nll / count, "mtp_loss": mtp_nll / count, "mtp_top1": mtp_hit / count, "tokens": int(count)}


@torch.no_grad()
def greedy(model: TrainedLM, tok, prompt: str, n: int, device) -> str:
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
    stop = {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}
    for _ in range(n):
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            hidden = model.model(input_ids=ids).last_hidden_state[:, -1]
        nxt = model.lm_head(hidden.to(model.lm_head.weight.dtype)).argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
        if nxt.item() in stop:
            break
    return tok.decode(ids[0], skip_special_tokens=False)


# --- training -----------------------------------------------------------------------------------------------------


def lr_at(step: int, r: Recipe) -> float:
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    frac = (step - r.warmup) / max(r.steps - r.warmup, 1)
    return r.lr * (r.min_lr_ratio + (1 - r.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def build_model(r: Recipe) -> TrainedLM:
    from ..fixtures.core import hf_config

    torch.manual_seed(r.seed)
    tc = hf_config(fixture_spec(r)).text_config
    return TrainedLM(tc)


def train(data: Path, r: Recipe, device: torch.device, log=print) -> tuple[TrainedLM, dict]:
    check_data(data)
    tok = _load_tokenizer(data)
    if len(tok) > r.text["vocab_size"]:
        raise SplicerError(
            f"the tokenizer in {data} has {len(tok)} tokens, more than the recipe's vocab_size {r.text['vocab_size']}; "
            "remake the data with a smaller vocabulary or pick a recipe that fits"
        )
    t0 = time.time()
    train_ids, heldout = read_data(data, tok)
    log(
        f"data: {len(train_ids):,} train tokens, held-out {', '.join(f'{k} {len(v):,}' for k, v in heldout.items())} "
        f"({time.time() - t0:.1f} s)"
    )
    model = build_model(r).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": r.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=r.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.type == "cuda",
    )
    gen = torch.Generator().manual_seed(r.seed)
    tc = model.config
    history, started, steps_done = [], time.time(), 0
    model.train()
    # Training needs autograd whatever the caller's mode (a test process or a notebook may have switched it off).
    grad_mode = torch.is_grad_enabled()
    torch.set_grad_enabled(True)
    for step in range(r.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, r)
        ids = _windows(train_ids, r.seq_len + 2, r.batch_size, gen).to(device, non_blocking=True)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits, mtp_logits, routers = model(ids)
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:-1].flatten())
            mtp_loss = F.cross_entropy(mtp_logits.float().flatten(0, 1), ids[:, 2:].flatten())
            aux = router_balance_loss(routers, tc.num_experts, tc.num_experts_per_tok)
            total = loss + r.mtp_weight * mtp_loss + r.router_aux_weight * aux
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), r.grad_clip)
        opt.step()
        steps_done = step + 1
        if step % 50 == 0 or step == r.steps - 1:
            elapsed = time.time() - started
            history.append(
                {
                    "step": step,
                    "loss": loss.item(),
                    "mtp_loss": mtp_loss.item(),
                    "router_aux": aux.item(),
                    "lr": lr_at(step, r),
                    "seconds": round(elapsed, 1),
                }
            )
            log(
                f"step {step}/{r.steps}: loss {loss.item():.3f} mtp {mtp_loss.item():.3f} aux {aux.item():.3f} "
                f"({elapsed:.0f} s, {(step + 1) * r.batch_size * r.seq_len / max(elapsed, 1e-9):,.0f} tok/s)"
            )
        if time.time() - started > r.max_seconds:
            log(f"stopped at step {steps_done} of {r.steps}: the recipe's {r.max_seconds:.0f} s limit")
            break
    torch.set_grad_enabled(grad_mode)
    train_seconds = time.time() - started
    model.eval()
    held = {name: evaluate(model, stream, r, device) for name, stream in heldout.items()}
    vocab = r.text["vocab_size"]
    for name, stream in heldout.items():
        held[name].update(ngram_baselines(train_ids, stream, vocab))
    samples = {src: greedy(model, tok, p, r.sample_tokens, device) for src, p in SAMPLE_PROMPTS}
    report = {
        "recipe": asdict(r),
        "recipe_version": RECIPE_VERSION,
        "parameters": n_params,
        "steps_done": steps_done,
        "train_tokens_seen": steps_done * r.batch_size * r.seq_len,
        "train_tokens": len(train_ids),
        "train_seconds": round(train_seconds, 1),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "history": history,
        "heldout": held,
        "samples": samples,
    }
    return model, report


def export_tensors(model: TrainedLM) -> dict[str, torch.Tensor]:
    """The trained tensors under the release's names (`model.language_model.*`, `lm_head`, `mtp.*`), experts fused
    3-D as transformers holds them (write_base splits them per expert)."""
    out = {}
    for name, t in model.model.state_dict().items():
        out[f"model.language_model.{name}"] = t
    out["lm_head.weight"] = model.lm_head.weight
    for name, t in model.mtp.state_dict().items():
        out[f"mtp.{name}"] = t
    return {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in out.items() if "rotary_emb" not in k}


def write_trained_base(out: Path, data: Path, model: TrainedLM, report: dict, r: Recipe) -> Path:
    from ..fixtures.core import write_base

    tmp = out.parent / f".{out.name}.splicer-partial"
    if tmp.exists():
        shutil.rmtree(tmp)
    write_base(tmp, fixture_spec(r), tensors=export_tensors(model))
    # The data stage's tokenizer replaces the fixture's demo tokenizer (same special tokens and ids).
    for f in (data / "tokenizer").iterdir():
        shutil.copy2(f, tmp / f.name)
    (tmp / "README.md").write_text(
        f"Small qwen3_5_moe trained by splicer.trained (recipe {r.name}, seed {r.seed}) on text from Debian packages; "
        "see train_report.json. Vision tower random and unused.\n"
    )
    (tmp / "train_report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    if out.exists():
        raise SplicerError(f"{out} appeared while training; pass a new OUT")
    tmp.rename(out)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m splicer.trained.train", description=__doc__.split("\n\n")[0])
    p.add_argument("data", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--recipe", default="small", choices=sorted(RECIPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, help="override the recipe's step count")
    p.add_argument("--max-seconds", type=float, help="override the recipe's wall-clock limit on training")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)

    def run() -> int:
        if a.out.exists():
            raise SplicerError(f"{a.out} exists; pass a new OUT (the trained base is never overwritten)")
        over = {"seed": a.seed}
        if a.steps:
            over["steps"] = a.steps
        if a.max_seconds:
            over["max_seconds"] = a.max_seconds
        r = recipe(a.recipe, **over)
        model, report = train(a.data, r, torch.device(a.device), log=lambda s: print(s, flush=True))
        write_trained_base(a.out, a.data, model, report, r)
        print(
            f"wrote {a.out}: held-out loss "
            + ", ".join(f"{k} {v['loss']:.3f} (bigram {v['bigram']:.3f})" for k, v in report["heldout"].items() if v)
        )
        return 0

    return exit_code(run)


if __name__ == "__main__":
    sys.exit(main())
