"""The training stage's figures as Markdown, from the `train_report.json` each trained base carries.

    python -m splicer.trained.summary REPORT.json [REPORT.json ...]

One table of held-out loss per source (nats per token) against the add-one unigram and the interpolated bigram of the
training text, the MTP head's loss and top-1 on the token after next, and the greedy samples of the first report.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tabulate import tabulate

from ..errors import SplicerError, exit_code


def _load(path: Path) -> dict:
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        report["heldout"], report["recipe"]["seed"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SplicerError(f"{path} is not a train_report.json ({e}); give the file a trained base holds") from None
    return report


def summary(paths: list[Path]) -> str:
    reports = [_load(p) for p in paths]
    rows = []
    for r in reports:
        for source, h in r["heldout"].items():
            if not h:
                continue
            rows.append(
                [
                    f"seed {r['recipe']['seed']}",
                    source,
                    h["tokens"],
                    f"{h['loss']:.3f}",
                    f"{h['bigram']:.3f}",
                    f"{h['unigram']:.3f}",
                    f"{h['bigram'] - h['loss']:.3f}",
                    f"{h['mtp_loss']:.3f}",
                    f"{100 * h['mtp_top1']:.1f} %",
                ]
            )
    table = tabulate(
        rows,
        headers=[
            "model",
            "held-out text",
            "tokens",
            "loss",
            "bigram",
            "unigram",
            "bigram - loss",
            "MTP loss (t+2)",
            "MTP top-1 (t+2)",
        ],
        tablefmt="github",
        disable_numparse=True,
    )
    runs = "; ".join(
        f"seed {r['recipe']['seed']}: {r['steps_done']} steps, {r['train_tokens_seen']:,} tokens seen of "
        f"{r['train_tokens']:,}, {r['train_seconds']} s, {r['parameters']:,} parameters"
        for r in reports
    )
    samples = "\n".join(f"- {src}: `{text!r}`" for src, text in reports[0]["samples"].items())
    return (
        f"{table}\n\nLoss in nats per token on the held-out text; bigram: interpolated with the unigram at the weight "
        f"best on the held-out text itself. {runs}.\n\nGreedy samples, seed {reports[0]['recipe']['seed']} "
        f"(prompt included):\n{samples}\n"
    )


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m splicer.trained.summary REPORT.json [REPORT.json ...]", file=sys.stderr)
        return 2

    def run() -> int:
        sys.stdout.write(summary([Path(a) for a in args]))
        return 0

    return exit_code(run)


if __name__ == "__main__":
    sys.exit(main())
