"""The vLLM releases whose readers splicer models, and what changed between them, as data.

Each entry was checked against that release's own code: `should_ignore_layer` (compressed-tensors `ignore`) by
tests/test_vllm_readers.py over the answers scripts/vllm/should_ignore_cases.py recorded from the released wheels, the
rest read from the release's source (named per field). The lint, the refusal predictions and `inspect` model the
installed vLLM (the nearest release here at or below it), else the newest here, and say which.
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
    # group (and dynamic) activation ordering, GPTQ desc_act=True: refused at load (vLLM PR #54809, 0.30)
    refuses_group_actorder: bool
    # the refusal for the shards of one fused layer that disagree, as the release words it
    split_group_refusal: str
    # find_matched_target tries a fused layer's shards against name targets before the class-name targets (0.27;
    # before, a class target such as Linear won over a regex naming the shards: compressed_tensors/utils.py)
    target_fused_before_class: bool = False
    # whether this release's code was checked (one of RELEASES), or its behaviours are taken from where they changed
    checked: bool = True


RELEASES = (
    VllmReleaseReader(
        "0.26",
        ignore_fused_name_first=False,
        refuses_group_actorder=False,
        split_group_refusal="Found a different quantization schemes for [shards] in LAYER",
    ),
    VllmReleaseReader(
        "0.33",
        ignore_fused_name_first=True,
        refuses_group_actorder=True,
        split_group_refusal="Found different quantization schemes for the shards of LAYER",
        target_fused_before_class=True,
    ),
)
# Where each behaviour begins, for an installed release between the ones checked.
# (read from the released wheels' compressed_tensors/utils.py: the target order changed in 0.27.0, find_matching_patterns
# arrived in 0.30.0; the actorder refusal is dated by the reading of 0.30.0.)
CHANGED_IN = {"ignore_fused_name_first": (0, 30), "refuses_group_actorder": (0, 30), "target_fused_before_class": (0, 27)}


def _tuple(version: str) -> tuple[int, int]:
    parts = [int("".join(ch for ch in p if ch.isdigit()) or 0) for p in version.split(".")[:2]]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def installed_version() -> str | None:
    try:
        import importlib.metadata as md

        return md.version("vllm")
    except Exception:
        return None


def modeled(version: str | None = None) -> VllmReleaseReader:
    """The reader of vLLM `version` (default: SPLICER_VLLM_VERSION, else the installed one, else the newest checked): a
    release checked here as it is, another one with each behaviour as from the release CHANGED_IN names."""
    import os

    version = version or os.environ.get("SPLICER_VLLM_VERSION") or installed_version()
    if version is None:
        return RELEASES[-1]
    v = _tuple(version)
    for r in RELEASES:
        if _tuple(r.version) == v:
            return r
    base = RELEASES[0] if v < _tuple(RELEASES[-1].version) else RELEASES[-1]
    return VllmReleaseReader(
        f"{v[0]}.{v[1]}",
        ignore_fused_name_first=v >= CHANGED_IN["ignore_fused_name_first"],
        refuses_group_actorder=v >= CHANGED_IN["refuses_group_actorder"],
        split_group_refusal=base.split_group_refusal if v < (0, 30) else RELEASES[-1].split_group_refusal,
        target_fused_before_class=v >= CHANGED_IN["target_fused_before_class"],
        checked=False,
    )


def label(release: VllmReleaseReader) -> str:
    """How the lint names the reader it models: 'vLLM 0.33', or 'vLLM 0.28, not checked: modeled from 0.26 and 0.33'."""
    if release.checked:
        return f"vLLM {release.version}"
    return f"vLLM {release.version}, not checked: modeled from " + " and ".join(r.version for r in RELEASES)


def refusing_group_actorder() -> str:
    """'0.30 and later (0.33 checked)': the releases that refuse group activation ordering, in words."""
    first = ".".join(map(str, CHANGED_IN["refuses_group_actorder"]))
    checked = ", ".join(r.version for r in RELEASES if r.refuses_group_actorder)
    return f"vLLM {first} and later ({checked} checked)"
