"""Shared fixtures: tiny qwen3_5_moe pairs written once per session (a few seconds on 2 cores)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network


@pytest.fixture(scope="session")
def pairs(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """{'fused': {...}, 'per_expert': {...}}: base + lowlatency build (+ experts-g32 for fused)."""
    from splicer.fixtures import FixtureSpec, write_pair

    root = tmp_path_factory.mktemp("pairs")
    return {
        "fused": write_pair(root / "fused", FixtureSpec(experts_layout="fused"), kinds=("lowlatency", "experts-g32")),
        "per_expert": write_pair(root / "per_expert", FixtureSpec(experts_layout="per_expert", seed=1), kinds=("lowlatency",)),
    }


def tree_digest(folder: Path) -> dict[str, str]:
    """Every file's sha256 and mode under a folder: inputs must be byte-identical after any command."""
    out = {}
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file():
            out[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest() + oct(p.stat().st_mode)
    return out
