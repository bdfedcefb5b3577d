#!/usr/bin/env bash
# On the GPU machine: join the bundle parts copied by earlier transfers, check them, unpack into SITE.
# Usage: bash scripts/gpu/install_bundle.sh PARTS_DIR SUMS_FILE [SITE=/tmp/vllm_site]; then export PYTHONPATH=SITE
set -euo pipefail
PARTS=$1; SUMS=$2; SITE=${3:-/tmp/vllm_site}
want=$(awk '{print $1}' "$SUMS")
got=$(cat "$PARTS"/bundle.part* | sha256sum | awk '{print $1}')
[ "$want" = "$got" ] || { echo "bundle checksum mismatch (want $want, got $got): copy every part again"; ls -la "$PARTS"; exit 2; }
rm -rf "$SITE"; mkdir -p "$SITE"
cat "$PARTS"/bundle.part* | python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall(sys.argv[1], filter='fully_trusted')" "$SITE"
echo "bundle unpacked into $SITE ($(du -sh "$SITE" | cut -f1))"
