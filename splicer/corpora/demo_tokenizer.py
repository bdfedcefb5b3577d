"""A small byte-level BPE tokenizer trained locally on the demo texts, with Qwen's chat markers.

The demo and the tests have no network, so they cannot fetch Qwen's tokenizer; this one
is trained in about a second with the `tokenizers` library and saved with transformers,
so everything downstream (chat template, encode, decode) is the real code path.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def demo_texts() -> list[str]:
    from .chat import chat_training_text

    data = resources.files("splicer") / "data"
    texts = [(data / name).read_text(encoding="utf-8") for name in ("demo_wiki_en.txt", "demo_wiki_zh.txt")]
    return texts + [chat_training_text()]


def write_tokenizer(folder: Path, vocab_size: int, chat_template: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(demo_texts(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = chat_template
    fast.save_pretrained(str(folder))
