#!/usr/bin/env bash
# Wheels the GPU machine lacks for `splicer tasks` through lm-eval's VLLM model, for Python 3.12 x86-64.
#
#   bash scripts/gpu/make_lmeval_wheels.sh DIR        (e.g. .lmwhl, git-ignored)
#
# There (trained_call.sh start): pip install --no-index --no-deps --target /tmp/lmeval_site DIR/*.whl, together with
# datasets and multiprocess from llm-compressor's wheels (make_lc_wheels.sh: the same versions), and lm-eval runs with
# PYTHONPATH=vLLM's site:/tmp/lmeval_site.
#
# What lm-eval 0.4.13 imports on the way to a multiple-choice task through its VLLM model, against what the machine's
# image holds (device notes; run 4's probe found sklearn, scipy, sacrebleu, jinja2, peft and accelerate there):
#   lm_eval          -> datasets (api/task.py), more_itertools (models/vllm_causallms.py), dill (caching: vLLM's
#                       bundle has it), sacrebleu (api/metrics.py: on the image)
#   datasets         -> dill, multiprocess (pyarrow, pandas, xxhash, fsspec, huggingface-hub are on the image)
#   evaluate         -> imported only for a metric lm-eval does not define itself (api/registry.py); small, so it travels
# Not carried: rouge-score, sqlitedict, word2number and nltk (sources only on the registry, or imported only by tasks
# and features a cloze task does not use). The last step lists what the wheels here ask for and none provides.
set -euo pipefail
dir=${1:?usage: make_lmeval_wheels.sh DIR}
mkdir -p "$dir"
wheels=(
  lm_eval==0.4.13
  more_itertools==11.2.1
  evaluate==0.4.6
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "${wheels[@]}"
python3 "$(dirname "$0")/wheel_needs.py" "$dir"
du -ch "$dir"/*.whl | tail -1
