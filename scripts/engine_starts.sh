#!/usr/bin/env bash
# Usage: bash scripts/engine_starts.sh DIR/logs.tgz ... > engine-starts.txt
# For each engine log in the given logs.tgz archives: vLLM's own figures for weight loading, the profiling/warmup run,
# CUDA graph capture and init engine (seconds), grepped from the log lines.
for tgz in "$@"; do
  d=$(mktemp -d); tar xzf "$tgz" -C "$d"
  find "$d" -name "*.log" | sort | while read -r f; do
    l=$(grep -h "Loading weights took" "$f" | sed -E 's/.*took ([0-9.]+) seconds/\1/')
    p=$(grep -h "profiling/warmup run took" "$f" | sed -E 's/.*took ([0-9.]+) s/\1/')
    g=$(grep -h "Graph capturing finished" "$f" | sed -E 's/.*finished in ([0-9]+) secs.*/\1/')
    i=$(grep -h "init engine" "$f" | sed -E 's/.*took ([0-9.]+) s.*/\1/')
    [ -n "$l$p$i" ] && echo "$tgz ${f#$d/} weights_load_s=${l:-none} profiling_warmup_s=${p:-none} graph_capture_s=${g:-none} init_engine_s=${i:-none}"
  done
  rm -rf "$d"
done
