"""vLLM's own figures for every engine start in one or more runs' logs.tgz (weight loading, torch.compile, the
profiling/warmup run, CUDA graph capture, init engine), read with the parser splicer uses for results.json
(splicer.backends.vllm_logs.startup_breakdown), one line per engine log.

Usage: python scripts/engine_starts.py DIR/logs.tgz ... > engine-starts.txt
"""

from __future__ import annotations

import sys
import tarfile

from splicer.backends.vllm_logs import startup_breakdown


def main(archives: list[str]) -> int:
    for archive in archives:
        with tarfile.open(archive) as tar:
            for member in sorted((m for m in tar.getmembers() if m.isfile() and m.name.endswith(".log")), key=lambda m: m.name):
                parts = startup_breakdown(tar.extractfile(member).read().decode("utf-8", "replace"))
                if parts:
                    print(archive, member.name, " ".join(f"{k}={v:g}" for k, v in parts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
