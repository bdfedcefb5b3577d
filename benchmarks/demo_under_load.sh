#!/usr/bin/env bash
# The demo (`splicer ablate all --demo`) timed on this machine as it is, then with two busy processes beside it
# (`python3 -c 'while True: pass'` x2, ended when the script ends): once with the thread count splicer chooses
# (OMP_NUM_THREADS, MKL_NUM_THREADS and SPLICER_THREADS unset) and once with one torch thread per core
# (SPLICER_THREADS=$(nproc), torch's own default before splicer chose). Each run is stopped after LIMIT seconds.
# Prints the times side by side and writes the whole record (command, machine, versions, load, each run's
# threads line) to OUT.
# Usage: bash benchmarks/demo_under_load.sh OUT.txt [LIMIT_S]   (from the repository root, splicer importable;
#        PYTHON=... picks the interpreter; CASES="idle-auto loaded-auto" runs only those of the four cases)
set -uo pipefail
out=$(realpath -m "$1"); limit=${2:-300}
cases=${CASES:-idle-auto idle-all-cores loaded-auto loaded-all-cores}
py=${PYTHON:-python3}
work=$(mktemp -d); busy=()
cleanup() { for p in "${busy[@]}"; do kill "$p" 2>/dev/null; done; rm -rf "$work"; }
trap cleanup EXIT
load() { cut -d' ' -f1-4 /proc/loadavg; }

run() {  # run NAME ENV... : one demo run in a fresh folder; prints "seconds|status|threads line|load before"
  local name=$1; shift
  if [[ " $cases " != *" $name "* ]]; then echo "-|not run||"; return; fi
  local before; before=$(load)
  local t0; t0=$(date +%s.%N)
  env -u OMP_NUM_THREADS -u MKL_NUM_THREADS -u SPLICER_THREADS "$@" timeout "$limit" \
    "$py" -m splicer ablate all --demo -o "$work/$name" > "$work/$name.log" 2>&1
  local rc=$?
  local secs; secs=$(echo "$(date +%s.%N) - $t0" | bc)
  local status=ok; [ $rc = 124 ] && status="stopped after ${limit} s"; [ $rc != 0 ] && [ $rc != 124 ] && status="exit $rc"
  local threads; threads=$(grep -m1 'torch threads' "$work/$name.log" | sed 's/^splicer: //')
  rm -rf "${work:?}/$name"
  printf '%.1f|%s|%s|%s\n' "$secs" "$status" "$threads" "$before"
}

{
  echo "command: CASES=\"$cases\" bash benchmarks/demo_under_load.sh $1 $limit"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "machine: $(lscpu | sed -n 's/^Model name: *//p' | head -1), nproc $(nproc), $(free -g | awk '/Mem:/{print $2}') GiB RAM, $(uname -m)"
  echo "versions: $("$py" -c 'import sys, torch, transformers; print("Python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)')"
  echo "load before (1, 5, 15 min, runnable/total): $(load)"
} > "$out"

idle=$(run idle-auto)
idle_all=$(run idle-all-cores SPLICER_THREADS="$(nproc)")
for _ in 1 2; do "$py" -c 'while True: pass' & busy+=($!); done
sleep 5
loaded=$(run loaded-auto)
loaded_all=$(run loaded-all-cores SPLICER_THREADS="$(nproc)")
for p in "${busy[@]}"; do kill "$p" 2>/dev/null; done; busy=()

{
  echo
  printf '%-34s %-26s %-26s\n' "demo wall time (s)" "as found" "+ 2 busy processes"
  printf '%-34s %-26s %-26s\n' "threads chosen by splicer" "$(cut -d'|' -f1,2 <<< "$idle" | tr '|' ' ')" "$(cut -d'|' -f1,2 <<< "$loaded" | tr '|' ' ')"
  printf '%-34s %-26s %-26s\n' "one thread per core ($(nproc))" "$(cut -d'|' -f1,2 <<< "$idle_all" | tr '|' ' ')" "$(cut -d'|' -f1,2 <<< "$loaded_all" | tr '|' ' ')"
  echo
  for r in "idle-auto|$idle" "idle-all-cores|$idle_all" "loaded-auto|$loaded" "loaded-all-cores|$loaded_all"; do
    IFS='|' read -r name secs status threads before <<< "$r"
    echo "$name: $secs s ($status); $threads; load before: $before"
  done
  echo "load after: $(load)"
} | tee -a "$out"
