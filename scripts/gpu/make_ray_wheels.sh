#!/usr/bin/env bash
# Ray for `--ray` on the GPU machine (issue "Beyond one machine"), Python 3.12 x86-64, split into parts that each fit
# one device transfer beside the working tree (Ray's wheel alone is about 80 MB; a call carries 64 MiB).
#
#   bash scripts/gpu/make_ray_wheels.sh DIR        (e.g. .raywhl, git-ignored)
#
# There, with the parts of one call after another staged into one folder:
#   cat DIR/ray.part* > /tmp/ray.tar && sha256sum -c DIR/SHA256SUMS && tar -C /tmp -xf /tmp/ray.tar
#   pip install --no-index --no-deps --target /tmp/ray_site /tmp/raywhl/*.whl
# and splicer runs with PYTHONPATH=vLLM's site:/tmp/ray_site, `--ray` starting a local cluster on the one host.
# The last step lists what the wheels here ask for and none provides (what the machine's image must hold).
set -euo pipefail
dir=${1:?usage: make_ray_wheels.sh DIR}
stage=$(mktemp -d)
mkdir -p "$dir" "$stage/raywhl"
# Ray and what its import needs beyond the image's torch/transformers stack (filelock, packaging, pyyaml, requests come
# with transformers; protobuf with vLLM's bundle), whether or not the image has them: the target folder comes first
wheels=(
  ray==2.60.0
  msgpack==1.1.2
  click==8.3.1
  jsonschema==4.25.1
  jsonschema-specifications==2025.9.1
  referencing==0.37.0
  rpds-py==0.30.0
  attrs==25.4.0
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$stage/raywhl" "${wheels[@]}"
python3 "$(dirname "$0")/wheel_needs.py" "$stage/raywhl" || true
tar -C "$stage" -cf "$stage/ray.tar" raywhl
rm -f "$dir"/ray.part* "$dir"/SHA256SUMS
# 26 MiB: a part and the working tree (about 27 MiB now) must fit one 64 MiB device call; 40 MiB parts stopped fitting
split -b 26m -d -a 2 "$stage/ray.tar" "$dir/ray.part"
( cd "$stage" && sha256sum ray.tar | sed 's#ray.tar#/tmp/ray.tar#' > "$OLDPWD/$dir/SHA256SUMS" )
rm -rf "$stage"
ls -la "$dir"
