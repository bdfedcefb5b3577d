#!/usr/bin/env bash
# The README's first command, step by step from a fresh clone of this repository in a fresh venv, each step timed;
# writes the record to OUT/run.txt and copies the demo's results.json, table.md and report.md into OUT.
# Usage: bash benchmarks/demo_fresh_clone.sh OUT   (run from the repository root; OUT outside the clone)
set -euo pipefail
out=$(realpath -m "$1"); mkdir -p "$out"
repo=$(pwd); work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
git clone -q "$repo" "$work/clone"; cd "$work/clone"
rec="$out/run.txt"
step() { local t0=$SECONDS; "$@" > "$work/step.log" 2>&1; echo "$(( SECONDS - t0 ))"; }
{
  echo "command (README's first command, run step by step from a fresh clone): python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e . && splicer ablate all --demo -o demo-out"
  echo "commit: $(git rev-parse HEAD)"
  echo "date_start: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "machine: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB RAM, $(uname -m)"
} > "$rec"
t_all=$SECONDS
s1=$(step python3 -m venv .venv)
. .venv/bin/activate
s2=$(step pip install torch==2.13.0)
s3=$(step pip install -e .)
t0=$SECONDS
/usr/bin/time -f "%e s wall, %M KB peak RSS" -o "$work/time.txt" splicer ablate all --demo -o demo-out > "$work/demo.log" 2>&1
s4=$(( SECONDS - t0 ))
{
  echo "versions: $(python -c 'import sys, torch, transformers, compressed_tensors as ct; print("Python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "compressed-tensors", ct.__version__)')"
  echo "step_seconds: venv $s1, pip install torch $s2, pip install -e . $s3, splicer ablate all --demo $s4"
  echo "total_seconds: $(( SECONDS - t_all ))"
  echo "splicer ablate (GNU time): $(cat "$work/time.txt")"
  echo "results.json elapsed_s: $(python -c 'import json; print(json.load(open("demo-out/results.json"))["elapsed_s"])')"
  echo "date_end: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "---- splicer ablate output ----"; sed "s#$work/clone/##g" "$work/demo.log"
} >> "$rec"
for f in results.json table.md report.md; do sed "s#$work/clone/##g" "demo-out/$f" > "$out/$f"; done
cat "$rec" | head -12
