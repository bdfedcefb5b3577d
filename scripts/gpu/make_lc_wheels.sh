#!/usr/bin/env bash
# Wheels the GPU machine lacks for llm-compressor 0.14 (scripts/gpu/trained_builds.py), for Python 3.12 x86-64.
#
#   bash scripts/gpu/make_lc_wheels.sh DIR        (e.g. .lcwhl, git-ignored)
#
# There: pip install --no-index --no-deps --target /tmp/lcsite DIR/*.whl, then
#        PYTHONPATH=/tmp/lcsite python3 scripts/gpu/trained_builds.py ...   (torch 2.11 and transformers 5.17 are the machine's)
#
# The list: llmcompressor 0.14 and compressed-tensors 0.19.0 (which llmcompressor pins), then every Requires-Dist of
# theirs, recursively, that the machine's image does not already hold (device notes, "Python packages already there"):
#   llmcompressor     -> loguru, datasets, auto-round, compressed-tensors (the rest: torch, transformers, numpy, pyyaml,
#                        requests, tqdm, accelerate 1.15 (>= 1.15.0 asked), nvidia-ml-py, pillow are there)
#   compressed-tensors -> pydantic, loguru (torch, transformers, psutil are there)
#   datasets          -> dill, multiprocess (pyarrow, pandas, xxhash, fsspec, huggingface-hub 1.33, ... are there)
#   pydantic          -> pydantic-core, annotated-types, typing-inspection, typing-extensions
# typing-extensions is on the machine, but pydantic 2.14 needs >= 4.16 and the image's version is not recorded; a newer
# typing_extensions only adds names, so it travels too. One version of each: the versions the llm-compressor venv this
# script was tested with resolved to. The last step lists any requirement of the downloaded wheels left unmet by them.
set -euo pipefail
dir=${1:?usage: make_lc_wheels.sh DIR}
mkdir -p "$dir"

wheels=(
  llmcompressor==0.14.0.1
  compressed-tensors==0.19.0
  auto-round==0.15.1
  datasets==5.2.0
  dill==0.4.1
  multiprocess==0.70.19
  loguru==0.7.3
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
)

python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "${wheels[@]}"

# One version of each: two wheels of one name stop the whole install there.
dups=$(ls "$dir"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z_.' 'a-z--' | sort | uniq -d)
if [ -n "$dups" ]; then
  echo "make_lc_wheels: $dir holds two versions of: $dups; empty $dir and run again" >&2
  exit 1
fi

# Requirements (Python 3.12, Linux, no extras) of the wheels that no wheel here provides: each must be on the machine.
python3 "$(dirname "$0")/wheel_needs.py" "$dir"
du -ch "$dir"/*.whl | tail -1
