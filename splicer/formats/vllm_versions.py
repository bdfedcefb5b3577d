"""The vLLM releases whose readers splicer models, and what changed between them, as data.

Every release from 0.26.0 to 0.33.0 was checked against its own code: tests/test_vllm_readers.py compares splicer's
model with what each released wheel's functions answered (scripts/vllm/reader_cases.py recorded them: compressed-tensors
`should_ignore_layer` and `find_matched_target`, GPTQ's `dynamic`, list and `desc_act` checks, the FP8/AWQ skip list).
The lint, the refusal predictions and `inspect` model the installed vLLM, else the newest here, and say which.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VllmReleaseReader:
    version: str
    # compressed-tensors `ignore` tried on the fused vLLM layer name first (exact or regex), then shard by shard
    # (0.30: config_utils.find_matching_patterns); before, a fused layer's shards decided unless its name was listed
    # exactly, so a regex matching only the fused name (re:.*in_proj_ba$) did not unquantize it.
    ignore_fused_name_first: bool
    # group (and dynamic) activation ordering, GPTQ desc_act=True with groups: refused at load (0.30:
    # gptq_utils.normalize_and_validate_gptq_desc_act, vLLM PR #54809)
    refuses_group_actorder: bool
    # the refusal for the shards of one fused layer that disagree, as the release words it
    split_group_refusal: str
    # find_matched_target tries a fused layer's shards against name targets before the class-name targets (0.27;
    # before, a class target such as Linear won over a regex naming the shards: compressed_tensors/utils.py)
    target_fused_before_class: bool = False
    # GPTQ: an empty modules_in_block_to_quantize reads every Linear as quantized (0.32:
    # gptq_utils.is_layer_gptq_quantized); before, as unquantized
    gptq_empty_list_quantized: bool = False
    # GPTQ: a `-:` key of `dynamic` that contains "mtp" builds the drafter's decoder layers unquantized, whatever it
    # matches (0.27: qwen3_5_mtp.py; the family's table names the layers, Architecture.vllm_gptq_mtp_rule_layers)
    gptq_mtp_rule: bool = False
    # whether this release's code was checked (one of RELEASES), or its behaviours are taken from where they changed
    checked: bool = True


# Where each behaviour begins, as the released wheels 0.26.0 to 0.33.0 answered (tests/data/vllm-*.json).
CHANGED_IN = {
    "target_fused_before_class": (0, 27),
    "ignore_fused_name_first": (0, 30),
    "refuses_group_actorder": (0, 30),
    "gptq_empty_list_quantized": (0, 32),
    "gptq_mtp_rule": (0, 27),
}
SPLIT_GROUP_REFUSAL = (  # (from release, wording)
    ((0, 0), "Found a different quantization schemes for [shards] in LAYER"),
    ((0, 30), "Found different quantization schemes for the shards of LAYER"),
)
CHECKED = ("0.26", "0.27", "0.28", "0.29", "0.30", "0.31", "0.32", "0.33")


def _release(v: tuple[int, int], checked: bool) -> VllmReleaseReader:
    return VllmReleaseReader(
        f"{v[0]}.{v[1]}",
        split_group_refusal=[w for since, w in SPLIT_GROUP_REFUSAL if v >= since][-1],
        checked=checked,
        **{field: v >= since for field, since in CHANGED_IN.items()},
    )


def _tuple(version: str) -> tuple[int, int]:
    parts = [int("".join(ch for ch in p if ch.isdigit()) or 0) for p in version.split(".")[:2]]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


RELEASES = tuple(_release(_tuple(v), checked=True) for v in CHECKED)


def installed_version() -> str | None:
    try:
        import importlib.metadata as md

        return md.version("vllm")
    except Exception:
        return None


def modeled(version: str | None = None) -> VllmReleaseReader:
    """The reader of vLLM `version` (default: SPLICER_VLLM_VERSION, else the installed one, else the newest checked): a
    checked release as it is, another one with each behaviour as from the release CHANGED_IN names."""
    import os

    version = version or os.environ.get("SPLICER_VLLM_VERSION") or installed_version()
    if version is None:
        return RELEASES[-1]
    v = _tuple(version)
    return next((r for r in RELEASES if _tuple(r.version) == v), None) or _release(v, checked=False)


def label(release: VllmReleaseReader) -> str:
    """How the lint names the reader it models: 'vLLM 0.33', or 'vLLM 0.34, not checked: modeled from 0.26 to 0.33'."""
    if release.checked:
        return f"vLLM {release.version}"
    return f"vLLM {release.version}, not checked: modeled from {RELEASES[0].version} to {RELEASES[-1].version}"


def refusing_group_actorder() -> str:
    """'vLLM 0.30 and later (0.30 to 0.33 checked)': the releases that refuse group activation ordering, in words."""
    first = ".".join(map(str, CHANGED_IN["refuses_group_actorder"]))
    checked = [r.version for r in RELEASES if r.refuses_group_actorder]
    return f"vLLM {first} and later ({checked[0]} to {checked[-1]} checked)"


def ways_of_reading(modeled_release: VllmReleaseReader, fields: tuple[str, ...]) -> list[list[VllmReleaseReader]]:
    """The checked releases that differ from `modeled_release` in any of these behaviours, grouped by how they behave
    (consecutive releases alike form one group), for the lint's notes on how other releases read a checkpoint."""

    def way(r):
        return tuple(getattr(r, f) for f in fields)

    groups: list[list[VllmReleaseReader]] = []
    for r in RELEASES:
        if way(r) == way(modeled_release):
            continue
        if groups and way(groups[-1][-1]) == way(r):
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups
