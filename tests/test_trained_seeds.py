"""splicer.trained.seeds: the ranking of classes by KL change in two seeds' folders, and whether swaps are resolved."""

import pytest

from splicer.errors import SplicerError
from splicer.trained.seeds import compare


def _results(**rows):
    return {
        "variants": [{"name": "build"}]
        + [{"name": n, "vs_build": {"kl": {"pooled": {"rel": r, "rel_ci": [lo, hi]}}}} for n, (r, lo, hi) in rows.items()]
    }


def test_same_ranking():
    a = _results(gdn=(-0.05, -0.07, -0.03), attention=(-0.13, -0.15, -0.12), shared_expert=(-0.24, -0.27, -0.21))
    b = _results(gdn=(-0.11, -0.13, -0.09), attention=(-0.13, -0.15, -0.12), shared_expert=(-0.18, -0.20, -0.16))
    text = compare(a, b)
    assert "Both seeds rank the 3 rows the same way." in text
    assert text.index("| shared_expert") < text.index("| attention") < text.index("| gdn")
    assert "-5.0 % [-7.0, -3.0]" in text


def test_swaps_resolved_or_not():
    a = _results(gdn=(-0.10, -0.12, -0.08), attention=(-0.20, -0.22, -0.18), lm_head=(-0.01, -0.02, 0.0))
    b = _results(gdn=(-0.21, -0.30, -0.12), attention=(-0.19, -0.25, -0.13), lm_head=(-0.01, -0.02, 0.0))
    text = compare(a, b, rows=("lm_head", "gdn", "attention"))
    assert "gdn and attention change places (resolved in seed A)" in text
    c = _results(gdn=(-0.10, -0.25, 0.05), attention=(-0.12, -0.22, -0.02), lm_head=(-0.01, -0.02, 0.0))
    assert "the intervals overlap in both seeds" in compare(c, b, rows=("lm_head", "gdn", "attention"))


def test_too_few_rows():
    with pytest.raises(SplicerError, match="fewer than two"):
        compare(_results(gdn=(-0.1, -0.2, 0.0)), _results(attention=(-0.1, -0.2, 0.0)))
