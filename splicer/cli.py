"""The `splicer` command line: argument parsing only; each command calls one stage."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import SplicerError


def _cmd_inspect(args) -> int:
    from .checkpoint import open_checkpoint
    from .inspect import format_report, inspect_checkpoint

    info = inspect_checkpoint(open_checkpoint(args.build, "checkpoint"))
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0


def _cmd_splice(args) -> int:
    from .splice import splice

    record = splice(args.build, args.base, args.out, args.restore, layers=args.layers,
                    modules_regex=args.modules, force=args.force, progress=not args.quiet)
    s = record["shards"]
    print(f"wrote {args.out}: restored {record['restored_modules']} modules ({', '.join(record['restored_classes'])}); "
          f"shards rewritten {s['rewritten']}, hard-linked {s['linked']}, copied {s['copied']}")
    return 0


def _cmd_fixture(args) -> int:
    from .fixtures import FixtureSpec, write_pair

    kinds = [k for k in args.builds.split(",") if k]
    paths = write_pair(args.out, FixtureSpec(preset=args.preset, experts_layout=args.experts_layout, seed=args.seed), kinds)
    for k, p in paths.items():
        print(f"{k}: {p}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splicer", description="Where does the error of an INT4 checkpoint come from, and what would it cost to restore each part?")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("inspect", help="classes, bits, bytes and config lint of a checkpoint")
    s.add_argument("build", metavar="BUILD", help="checkpoint folder or Hub repo id")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s.set_defaults(func=_cmd_inspect)

    s = sub.add_parser("splice", help="restore module classes of BUILD to BF16 from BASE")
    s.add_argument("build", metavar="BUILD", help="compressed-tensors INT4 build: folder or Hub repo id")
    s.add_argument("base", metavar="BASE", help="its BF16 base: folder or Hub repo id (only needed shards are read)")
    s.add_argument("-o", "--out", required=True, metavar="OUT", help="output folder (must not exist unless --force)")
    s.add_argument("--restore", required=True, metavar="CLASSES",
                   help="comma list of gdn, attention, shared_expert, lm_head, experts, mtp, or all")
    s.add_argument("--layers", metavar="LIST", help="only these decoder layers, e.g. 0,4-7")
    s.add_argument("--modules", metavar="REGEX", help="only modules whose HF name matches REGEX (fused groups must stay whole)")
    s.add_argument("--force", action="store_true", help="replace OUT if it exists")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=_cmd_splice)

    s = sub.add_parser("fixture", help="write a tiny synthetic qwen3_5_moe base and INT4 builds (tests, demo, GPU checks)")
    s.add_argument("out", metavar="DIR")
    s.add_argument("--preset", default="tiny", choices=["tiny", "bench"])
    s.add_argument("--experts-layout", default="fused", choices=["fused", "per_expert"])
    s.add_argument("--builds", default="lowlatency,experts-g32", help="comma list of lowlatency, experts-g32")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=_cmd_fixture)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SplicerError as e:
        print(f"splicer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("splicer: interrupted; rerun the same command to start again", file=sys.stderr)
        return 130
    except MemoryError:
        print("splicer: error: out of memory; close other programs or use a machine with more RAM", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
