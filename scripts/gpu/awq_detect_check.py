"""What vLLM does with an AWQ build whose `modules_to_not_convert` is empty, against what `splicer inspect` predicts.

With an empty list vLLM 0.26 lists, itself, the parent of every tensor whose siblings are all float
(`AutoAWQConfig.maybe_update_config`) and matches the entries as substrings of layer names: for qwen3_5_moe that names
`...linear_attn` (its A_log and dt_bias), a substring of every GDN projection, so the quantized GDN projections are
built unquantized. splicer's lint reads the same rule from the tensor dtypes; this runs vLLM on such a build to see.

Records, for the fixture's `awq` build with `modules_to_not_convert` set to null (tensors hard-linked):
  * `splicer inspect --json`'s lint under vLLM naming;
  * vLLM loading it (eager, Triton autotuning off): the error it raises, or that it loaded.
Writes OUT/awq-detect.json. Usage (GPU machine, after install_bundle.sh and `source scripts/gpu/env.sh`):
  python3 scripts/gpu/awq_detect_check.py WORK OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from split_group_check import _splicer, _vllm_says  # noqa: E402  (the same vLLM child and splicer runner)


def main(argv: list[str]) -> int:
    work, out = Path(argv[0]), Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)  # `splicer fixture` wants the parent of its folder to exist
    pair = work / "pair"
    if not (pair / "awq" / "config.json").exists():
        made = _splicer("fixture", str(pair), "--builds", "awq")
        if made.returncode:
            print(made.stderr, file=sys.stderr)
            return 1
    detect = work / "awq-null-list"
    if not detect.exists():
        detect.mkdir()
        for p in (pair / "awq").iterdir():
            if p.name != "config.json":
                os.link(p, detect / p.name)
        config = json.loads((pair / "awq" / "config.json").read_text())
        config["quantization_config"]["modules_to_not_convert"] = None
        (detect / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    record = {"build": "awq with modules_to_not_convert: null"}
    lint = _splicer("inspect", str(detect), "--json")
    issues = json.loads(lint.stdout)["lint"]["issues"] if lint.returncode == 0 else [{"inspect_error": lint.stderr.strip()}]
    record["lint_vllm"] = [i for i in issues if i.get("naming") == "vllm"]
    record["vllm"] = _vllm_says(detect)
    # The same tensors with the build's own list load: results/gpu-formats (score/, run-awq/).
    (out / "awq-detect.json").write_text(json.dumps(record, indent=2) + "\n")
    print(
        json.dumps(
            {
                "vllm": record["vllm"]["outcome"],
                "error": record["vllm"].get("error"),
                "lint_vllm": [i["detail"][:120] for i in record["lint_vllm"]][:6],
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
