"""What a restore names: classes, whole or in some decoder layers (`gdn@0-9`, `attention@3,7`, `experts`).

The same spelling serves `splice --restore`, plan rows (`restore = ["gdn@0-9"]`) and results (a row's `restored`), so a
variant has one name everywhere. These are pure functions on the text; which layers a build has is checked where the
build is open (validate.parse_restore).
"""

from __future__ import annotations

import re

from .errors import SplicerError

LAYER_PART = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_CLASS = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# The class of the MTP head in every family: a speculative-decoding drafter, which no scoring pass runs (so restoring
# it changes no score) and which vLLM loads only with --speculative-config. A name of the restore vocabulary, here so
# that analysis (table, budget) can leave it out without importing the families.
DRAFTER_CLASS = "mtp"


def split_restore(spec: str) -> list[tuple[str, str | None]]:
    """`gdn@0-9,attention@3,7,experts` -> [("gdn", "0-9"), ("attention", "3,7"), ("experts", None)].

    Items are comma separated, and so are an item's layers: a bare number or range right after an item with `@`
    belongs to that item (there is no class named by digits)."""
    items: list[tuple[str, str | None]] = []
    for part in (p.strip() for p in (spec or "").split(",")):
        if not part:
            continue
        if items and items[-1][1] is not None and LAYER_PART.fullmatch(part):
            items[-1] = (items[-1][0], f"{items[-1][1]},{part}")
            continue
        cls, at, layers = part.partition("@")
        items.append((cls.strip(), layers.strip() if at else None))
    return items


def entry_class(entry: str) -> str:
    """The class an entry restores: `gdn@0-9` -> gdn."""
    return entry.partition("@")[0].strip()


def layer_numbers(text: str, where: str) -> list[int]:
    """`0-2,7` -> [0, 1, 2, 7], checked for form only (a build's range is checked with the build open)."""
    out: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        m = LAYER_PART.fullmatch(part)
        if m is None or len(part) > 12:
            raise SplicerError(f"{where}: {part[:20]!r} is not a layer number or a range like 4-7")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if lo > hi:
            raise SplicerError(f"{where}: the range {part} runs backwards; write it as {hi}-{lo}")
        if hi - lo > 100_000:
            raise SplicerError(f"{where}: the range {part} is longer than any model")
        out.update(range(lo, hi + 1))
    if not out:
        raise SplicerError(f"{where}: no layers after @; give layer numbers or ranges like 0-9 or 3,7")
    return sorted(out)


def format_layers(layers) -> str:
    """[0, 1, 2, 4, 5, 7] -> `0-2,4-5,7`."""
    nums = sorted(set(layers))
    runs, start = [], None
    for i, n in enumerate(nums):
        if start is None:
            start = n
        if i + 1 == len(nums) or nums[i + 1] != n + 1:
            runs.append(f"{start}-{n}" if n > start else str(start))
            start = None
    return ",".join(runs)


def canonical_entries(entries: list[str], where: str) -> list[str]:
    """Plan or command-line entries in one spelling: a class, or `class@ranges` with the ranges sorted and merged (a
    class named twice is one entry; whole wins over some layers). Each list element is one entry (its own layers may
    be comma separated: "attention@3,7"); an empty element or one that is only numbers is refused."""
    layers: dict[str, set[int] | None] = {}
    for element in entries:
        if not str(element).strip():
            raise SplicerError(f"{where}: an empty entry; name a class, or a class in some layers like gdn@0-9")
        items = split_restore(element)
        if len(items) != 1:
            raise SplicerError(f"{where}: {element[:40]!r} holds {len(items)} entries; give each class its own list element")
        cls, text = items[0]
        if not _CLASS.fullmatch(cls):
            raise SplicerError(f"{where}: {cls[:40]!r} is not a class name (write CLASS or CLASS@LAYERS, e.g. gdn@0-9)")
        if text is None:
            layers[cls] = None
        elif cls not in layers or layers[cls] is not None:
            layers[cls] = (layers.get(cls) or set()) | set(layer_numbers(text, f"{where}: {cls}@{text[:40]}"))
    return [c if ls is None else f"{c}@{format_layers(ls)}" for c, ls in layers.items()]


def layers_read(asked, have) -> set[int] | None:
    """The layers of `asked` that hold the class (`have`), or None when that is all of them: one variant, one name,
    whether it was written `gdn`, `gdn@0-2` or `gdn@0-9` on a build with GDN in layers 0-2."""
    kept = set(asked) & set(have)
    return None if kept == set(have) else kept


def normalize_entry(entry: str, class_layers: dict[str, list[int]], where: str, num_layers: int | None = None) -> str:
    """An entry as this build reads it: layers that hold no quantized module of the class dropped, and all of the
    class's layers written as the bare class, so that one variant has one name. Refused when no layer is left."""
    cls, _, text = entry.partition("@")
    if not text:
        return entry
    have = class_layers.get(cls) or []
    if not have:
        raise SplicerError(f"{where}: {entry}: {cls} has no decoder layers in this build (one head, or stored apart); "
                           f"restore it whole: {cls}")
    asked = set(layer_numbers(text, f"{where}: {entry}"))
    if num_layers is not None and max(asked) >= num_layers:
        raise SplicerError(f"{where}: {entry}: layer {max(asked)} is out of range; this build has {num_layers} decoder "
                           f"layers, 0-{num_layers - 1}")
    kept = layers_read(asked, have)
    if kept is None:
        return cls
    if not kept:
        raise SplicerError(f"{where}: {entry}: no quantized {cls} module in those layers; this build has {cls} in layers "
                           f"{format_layers(have)}")
    return f"{cls}@{format_layers(kept)}"
