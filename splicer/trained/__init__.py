"""A small `qwen3_5_moe` trained on real text, for tables whose error has real structure.

Stages, one module each, each reading the previous stage's folder:
  data.py      Debian packages -> text splits (train, calibration, held-out) + a BPE tokenizer with a chat template
  train.py     text + tokenizer -> a BF16 base in the release layout (MTP head trained on the next-next token)
The field's quantizers make the builds from the base (scripts/gpu/trained_builds.py, in llm-compressor's own
environment); splicer never quantizes them.
"""
