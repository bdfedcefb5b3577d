#!/usr/bin/env bash
# Build, here on the CPU machine, the Python packages the GPU machine lacks for `splicer ... --backend vllm`,
# split into parts that each fit one device transfer (64 MiB) together with the working tree.
#
# The GPU machine has Python 3.12, torch 2.11 (CUDA 13), transformers 5.17 and no package registry. vLLM 0.26.0 is the
# newest release built for torch 2.11; the list of its dependencies missing there, and the files a single-GPU run does
# not need, follow the record of an earlier run on that machine (shared device notes, "vLLM 0.26.0 on the lent H200").
# splicer itself travels as source in the working tree; tabulate and pytest are added for it.
#
# Usage: bash scripts/gpu/make_bundle.sh [OUT=.bundle/vb]   (OUT must be git-ignored: .git/info/exclude has /.bundle/)
set -euo pipefail
OUT=${1:-.bundle/vb}
PART=33m  # four parts: each travels beside the working tree (over 22 MiB), and one transfer carries 64 MiB
STAGE=$(mktemp -d)
PY="--python-version 3.12 --implementation cp --only-binary=:all:"
PLATS=""
for p in manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do PLATS="$PLATS --platform $p"; done
PKGS="vllm==0.26.0 compressed-tensors==0.17.0 tabulate==0.9.0 tomli-w==1.2.0 pytest==8.4.2 pluggy==1.6.0 iniconfig==2.1.0
 pydantic==2.13.4 pydantic-core==2.46.4 typing-inspection==0.4.2 annotated-types==0.8.0 cbor2==6.1.3 pyzmq==27.1.0
 openai-harmony==0.0.8 openai==2.48.0 sniffio==1.3.1 distro==1.9.0 jiter==0.16.0 msgspec==0.21.1 pybase64==1.4.3
 cachetools==7.1.6 llguidance==1.7.6 xgrammar==0.2.3 apache-tvm-ffi==0.1.10 fastapi==0.136.3 starlette==1.3.1
 partial-json-parser==0.2.1.1.post7 loguru==0.7.3 blake3==1.0.9 setproctitle==1.3.7 depyf==0.20.0 astor==0.8.1 dill==0.4.1"
mkdir -p "$STAGE/wheels" "$STAGE/site" "$OUT"
python3 -m pip download -q --no-deps $PY $PLATS -d "$STAGE/wheels" $PKGS
# Every wheel but vLLM's through pip --target (it lays out .data folders); vLLM's unzipped as is, dist-info included.
python3 -m pip install -q --no-deps --no-compile $PY $PLATS --target "$STAGE/site" $(ls "$STAGE"/wheels/*.whl | grep -v '/vllm-')
python3 -m zipfile -e "$STAGE"/wheels/vllm-0.26.0-*.whl "$STAGE/site"
# Not needed for one H200 with BF16 / W4A16 weights: the FlashAttention-2 library (FA3 is used on Hopper), the Rust
# front end binary, vendored DeepGEMM and SM100 attention sources, xgrammar's static library, console scripts, bytecode.
( cd "$STAGE/site" && rm -rf bin xgrammar/lib/libxgrammar.a vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs \
    vllm/third_party/deep_gemm vllm/third_party/fmha_sm100 && find . -name __pycache__ -type d -prune -exec rm -rf {} + )
tar -C "$STAGE/site" -cf - . | xz -9 -T0 > "$STAGE/bundle.tar.xz"
rm -f "$OUT"/bundle.part* "$OUT"/SHA256SUMS
( cd "$STAGE" && sha256sum bundle.tar.xz | sed 's#  #  #' > "$OLDPWD/$OUT/SHA256SUMS" )
split -b "$PART" -d -a 2 "$STAGE/bundle.tar.xz" "$OUT/bundle.part"
rm -rf "$STAGE"
ls -la "$OUT"
