"""What a restore names: classes, whole or in some decoder layers (`gdn@0-9`, `attention@3,7`, `experts`).

The same spelling serves `splice --restore`, plan rows (`restore = ["gdn@0-9"]`) and results (a row's `restored`), so a
variant has one name everywhere. These are pure functions on the text and, where a caller has the build open, on the
numbers it passes from it (its decoder layers, the layers holding each class): the one parser of the grammar, which
validate.parse_restore and the plan's rows both call.
"""

from __future__ import annotations

import re

from ..errors import SplicerError

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


def clip(text: str, n: int = 40) -> str:
    """`text` quoted for a one-line message, cut after n characters."""
    return repr(text if len(text) <= n else text[:n] + "...")


def layer_numbers(text: str, where: str, num_layers: int | None = None, mtp_layer: int | None = None) -> list[int]:
    """`0-2,7` -> [0, 1, 2, 7]. Without a build (num_layers None) checked for form only; with one, every number is also
    checked against its num_layers decoder layers, and mtp_layer (an MTP head stored as one more decoder layer,
    DeepSeek-V3 and GLM-4.5) is refused by name.

    Every number is checked before any range is expanded: `0-999999999` is refused in one line instead of building a
    set of a billion ints (with a build by its range, without one by its length)."""
    have = None if num_layers is None else f"this build has {num_layers} decoder layers, 0-{num_layers - 1}"
    bounds = []
    for part in (p.strip() for p in text.split(",")):
        m = LAYER_PART.fullmatch(part)
        if m is None or (have is None and len(part) > 12):
            shown = repr(part[:20]) if have is None else clip(part)
            raise SplicerError(f"{where}: {shown} is not a layer number or a range like 4-7" + (f"; {have}" if have else ""))
        ends = []
        for end in (m.group(1), m.group(2) or m.group(1)):
            # Longer than any layer number: out of range without converting it (int() of a huge string is slow).
            if have is not None and mtp_layer is not None and len(end.lstrip("0")) <= 9 and int(end) == mtp_layer:
                raise SplicerError(
                    f"{where}: layer {mtp_layer} is the MTP head, stored as one more decoder layer; restore "
                    f"it whole with --restore mtp (--layers selects decoder layers 0-{num_layers - 1})"
                )
            if have is not None and (len(end.lstrip("0")) > 9 or int(end) >= num_layers):
                raise SplicerError(f"{where}: layer {clip(end, 12)[1:-1]} is out of range; {have}")
            ends.append(int(end))
        lo, hi = ends
        if lo > hi:
            raise SplicerError(f"{where}: the range {part} runs backwards; write it as {hi}-{lo}")
        if hi - lo > 100_000:
            raise SplicerError(f"{where}: the range {part} is longer than any model")
        bounds.append((lo, hi))
    out = {i for lo, hi in bounds for i in range(lo, hi + 1)}
    if not out:
        raise SplicerError(f"{where}: no layers after @; give layer numbers or ranges like 0-9 or 3,7")
    return sorted(out)


def entry_layers(
    cls: str, text: str, have: list[int], where: str, num_layers: int | None = None, mtp_layer: int | None = None
) -> set[int]:
    """The layers `cls@text` asks for on a build whose layers `have` hold the class quantized: refused when the class
    has no decoder layers there (a head, or stored apart) or a number is not one of the build's layers."""
    if not have:
        raise SplicerError(
            f"{where}: {cls} has no decoder layers in this build (one head, or stored apart); restore it whole: {cls}"
        )
    return set(layer_numbers(text, where, num_layers, mtp_layer))


def check_serves(cls: str, asked: set[int], have: list[int], where: str) -> None:
    """Refused when none of the asked layers holds the class quantized: the entry would restore nothing."""
    if not set(asked) & set(have):
        raise SplicerError(
            f"{where}: no quantized {cls} module in those layers; this build has {cls} in layers {format_layers(have)}"
        )


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
    asked = entry_layers(cls, text, have, f"{where}: {entry}", num_layers)
    check_serves(cls, asked, have, f"{where}: {entry}")
    kept = layers_read(asked, have)
    return cls if kept is None else f"{cls}@{format_layers(kept)}"
