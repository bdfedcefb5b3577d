"""The plans of the trained-model run, made from `ablations/trained-h200.toml` (the template) and a sweep.

    python -m splicer.trained.plans gdn-layers TEMPLATE SWEEP OUT   the template's rows plus one row per GDN layer
    python -m splicer.trained.plans seed-rows TEMPLATE OUT          the single-class rows, for a second training seed
    python -m splicer.trained.plans mtp-rows TEMPLATE OUT           the build and its MTP head restored (a build that
                                                                    quantizes the drafter: does that cost acceptance?)

`SWEEP` is what `splicer plan sweep BUILD --class gdn --groups N --from TEMPLATE` wrote, with N the number of GDN layers,
so that each of its one-group rows (`gdn-1`, `gdn-2`, ...) restores one layer.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import SplicerError, exit_code

SEED_ROWS = ("build", "lm_head", "gdn", "attention", "shared_expert", "experts-only", "all")


def _read(path: Path) -> dict:
    from ..plans.plan import tomllib  # tomli on Python 3.10

    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise SplicerError(f"cannot read plan {path}: {e}; give a plan file splicer wrote or ablations/ holds") from None


def _write(plan: dict, out: Path) -> None:
    import tomli_w

    from ..io.outputs import write_file

    if out.exists():
        raise SplicerError(f"{out} exists; pass a new plan file")
    text = tomli_w.dumps(plan)
    write_file(out, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def gdn_layer_rows(template: dict, sweep: dict) -> dict:
    """The template's rows with one row per GDN layer before its last row (the build's second engine stays last).
    A sweep row `gdn-k` restoring `gdn@L` becomes `gdn-layerL`."""
    layers = []
    for row in sweep.get("row", []):
        name = row.get("name", "")
        if not name.startswith("gdn-") or name.startswith("gdn-without"):
            continue
        restore = row.get("restore", [])
        if len(restore) != 1 or "@" not in restore[0] or "," in restore[0].split("@", 1)[1]:
            raise SplicerError(
                f"sweep row {name!r} restores {restore}, not one GDN layer; make the sweep with --groups equal "
                "to the number of GDN layers"
            )
        layers.append(dict(row, name="gdn-layer" + restore[0].split("@", 1)[1]))
    if not layers:
        raise SplicerError("the sweep has no one-group rows (gdn-1, gdn-2, ...); make it with splicer plan sweep --class gdn")
    plan = dict(template)
    plan["row"] = template["row"][:-1] + layers + template["row"][-1:]
    plan["name"] = f"{template['name']}-gdn-layers"
    plan["description"] = template.get("description", "") + f"; plus one row per Gated-DeltaNet layer ({len(layers)})"
    return plan


def seed_rows(template: dict) -> dict:
    """The single-class rows only, scored without timing, for the second training seed's ranking of classes."""
    plan = dict(template)
    plan["row"] = [r for r in template["row"] if r.get("name") in SEED_ROWS]
    missing = sorted(set(SEED_ROWS) - {r["name"] for r in plan["row"]})
    if missing:
        raise SplicerError(f"the template lacks rows {missing}; use ablations/trained-h200.toml")
    plan["name"] = f"{template['name']}-seed-rows"
    plan["description"] = "the single-class rows on another training seed's build (is the ranking of classes the same?)"
    return plan


def mtp_rows(template: dict) -> dict:
    """The build, the build with its MTP head restored, and the build again: `splicer mtp` on them tells whether
    quantizing the drafter costs acceptance (restoring it changes no score: no scoring pass runs the drafter)."""
    plan = dict(template)
    plan["row"] = [
        {"name": "build", "restore": []},
        {"name": "mtp", "restore": ["mtp"]},
        {"name": "build-again", "restore": [], "repeat": True},
    ]
    plan["name"] = f"{template['name']}-mtp-rows"
    plan["description"] = "the build and its MTP head restored to BF16, for MTP acceptance (splicer mtp)"
    return plan


USAGE = "usage: python -m splicer.trained.plans gdn-layers TEMPLATE SWEEP OUT | seed-rows TEMPLATE OUT | mtp-rows TEMPLATE OUT"


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)

    def run() -> int:
        if len(args) == 4 and args[0] == "gdn-layers":
            _write(gdn_layer_rows(_read(Path(args[1])), _read(Path(args[2]))), Path(args[3]))
        elif len(args) == 3 and args[0] == "seed-rows":
            _write(seed_rows(_read(Path(args[1]))), Path(args[2]))
        elif len(args) == 3 and args[0] == "mtp-rows":
            _write(mtp_rows(_read(Path(args[1]))), Path(args[2]))
        else:
            print(USAGE, file=sys.stderr)
            return 2
        return 0

    return exit_code(run)


if __name__ == "__main__":
    sys.exit(main())
