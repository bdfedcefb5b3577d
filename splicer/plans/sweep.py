"""`splicer plan sweep`: a plan whose rows restore one class in groups of its layers, to find which layers carry the error.

For a build and a class it writes, as plan rows (corpora, timing and top_k taken from a template plan):
  * the build, and the build again on a fresh engine (every plan times the build twice);
  * one row per group of the class's quantized layers, in layer order, as even as the count allows (`gdn@0-9`);
  * with three groups or more, one leave-one-group-out row per group (every group but that one);
  * the whole class, the end of the sweep and the check that the groups add up.
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoint import Checkpoint, open_checkpoint
from ..errors import SplicerError
from ..io.outputs import protected_paths
from ..splice.modules import list_modules
from ..splice.selection import format_layers
from ..splice.validate import quantized_layers
from .plan import load_plan, plan_path, tomllib, write_plan


def layer_groups(layers: list[int], groups: int) -> list[list[int]]:
    """`layers` in `groups` contiguous runs whose sizes differ by at most one (the first ones longer)."""
    size, extra = divmod(len(layers), groups)
    out, start = [], 0
    for g in range(groups):
        end = start + size + (1 if g < extra else 0)
        out.append(layers[start:end])
        start = end
    return out


def sweep_plan(build: Checkpoint, cls: str, groups: int, template: str = "where-error-comes-from") -> dict:
    """The sweep plan for an opened build, as TOML data (see the module docstring)."""
    arch = build.arch
    if cls not in arch.classes:
        raise SplicerError(f"--class {cls[:40]!r}: this build's family ({arch.name}) has {', '.join(arch.classes)}")
    layers = quantized_layers(list_modules(build), arch).get(cls, [])
    if not layers:
        raise SplicerError(
            f"--class {cls}: no quantized {cls} module in a decoder layer of this build (see splicer inspect); "
            "a sweep needs a class spread over layers"
        )
    if len(layers) < 2:
        raise SplicerError(
            f"--class {cls}: this build has {cls} quantized in one decoder layer only ({layers[0]}), "
            "so there are no groups to sweep; restore it whole in a plan row"
        )
    if not 2 <= groups <= len(layers):
        raise SplicerError(
            f"--groups {groups}: give 2 to {len(layers)} (this build has {cls} in {len(layers)} layers, {format_layers(layers)})"
        )
    from ..arch import all_classes

    load_plan(template, all_classes())  # a template that is not a valid plan is refused as any plan is, naming its file
    raw = tomllib.loads(plan_path(template).read_text(encoding="utf-8"))
    parts = layer_groups(layers, groups)
    rows = [{"name": "build", "restore": []}]
    for i, part in enumerate(parts, 1):
        rows.append({"name": f"{cls}-{i}", "restore": [f"{cls}@{format_layers(part)}"]})
    if groups >= 3:  # with two groups, leaving one out is the other group's row
        for i, part in enumerate(parts, 1):
            rest = [n for n in layers if n not in part]
            rows.append({"name": f"{cls}-without-{i}", "restore": [f"{cls}@{format_layers(rest)}"]})
    rows.append({"name": cls, "restore": [cls]})
    rows.append({"name": "build-again", "restore": [], "repeat": True})
    plan = {
        "name": f"sweep-{cls}-{groups}",
        "description": f"{cls} restored in {groups} groups of its layers ({', '.join(format_layers(p) for p in parts)}), "
        f"{'each left out, ' if groups >= 3 else ''}and whole; corpora and timing of {raw.get('name', template)}",
        "top_k": raw.get("top_k", 20),
    }
    for key in ("corpus", "timing"):
        if key in raw:
            plan[key] = raw[key]
    plan["row"] = rows
    return plan


def write_sweep(build_src: str, cls: str, groups: int, out: str | Path, template: str = "where-error-comes-from") -> Path:
    """Write the sweep plan to `out` (a new .toml file), checked by reading it back as any plan is read."""
    out = Path(out)
    if out.suffix != ".toml":
        raise SplicerError(f"-o {str(out)[:80]}: a plan file ends in .toml; name it e.g. sweep-gdn.toml")
    if out.exists():
        raise SplicerError(f"-o {str(out)[:80]} exists; choose a new file name (a plan is never overwritten)")
    if not out.parent.is_dir():
        raise SplicerError(f"the folder of -o ({out.parent}) does not exist; create it first")
    from ..arch import all_classes
    from ..corpora.core import check_hub_corpora

    # Before the build is opened (or downloaded): the plan is written to be run, and its Hub corpora could not be read.
    check_hub_corpora(
        load_plan(template, all_classes()).corpora,
        f"--from {template}",
        'pass --from demo, or a plan whose corpora are local files (kind = "text")',
    )
    build = open_checkpoint(build_src, "build")
    folder = out.parent.resolve()
    for p in protected_paths([build.root]):  # the build's folder, where its files really live, its Hub-cache repo
        if folder == p or p in folder.parents:
            raise SplicerError(
                f"-o {str(out)[:80]} is inside the build folder ({p}), an input, which splicer never "
                "changes; write the plan elsewhere"
            )
    plan = sweep_plan(build, cls, groups, template)
    return write_plan(out, plan, "Written by `splicer plan sweep`: " + plan["description"])
