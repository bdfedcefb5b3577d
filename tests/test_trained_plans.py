"""The trained-model run's plans: one row per GDN layer from a real sweep, and the second seed's class rows."""

import subprocess
import sys
from pathlib import Path

import pytest

from splicer.errors import SplicerError
from splicer.plans.plan import tomllib  # tomli on Python 3.10
from splicer.trained import plans

TEMPLATE = Path(__file__).resolve().parents[1] / "ablations" / "trained-h200.toml"


def _template():
    return tomllib.loads(TEMPLATE.read_text())


def test_gdn_layer_rows_from_splicer_sweep(tmp_path):
    from splicer.fixtures.core import FixtureSpec, write_pair

    pair = write_pair(tmp_path / "pair", FixtureSpec(), kinds=("lowlatency",))
    sweep = tmp_path / "sweep.toml"
    # The tiny fixture has 3 GDN layers: 3 groups = one layer each.
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "splicer",
            "plan",
            "sweep",
            str(pair["lowlatency"]),
            "--class",
            "gdn",
            "--groups",
            "3",
            "--from",
            str(TEMPLATE),
            "-o",
            str(sweep),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    out = tmp_path / "plan0.toml"
    assert plans.main(["gdn-layers", str(TEMPLATE), str(sweep), str(out)]) == 0
    plan = tomllib.loads(out.read_text())
    names = [row["name"] for row in plan["row"]]
    assert names[-1] == "build-again" and names[0] == "build"
    layer_rows = [row for row in plan["row"] if row["name"].startswith("gdn-layer")]
    assert [(row["name"], row["restore"]) for row in layer_rows] == [
        ("gdn-layer0", ["gdn@0"]),
        ("gdn-layer1", ["gdn@1"]),
        ("gdn-layer2", ["gdn@2"]),
    ]
    assert len(names) == len(_template()["row"]) + 3 and len(set(names)) == len(names)
    assert plan["corpus"] == _template()["corpus"]


def test_sweep_of_several_layers_per_group_is_refused():
    sweep = {"row": [{"name": "gdn-1", "restore": ["gdn@0,1"]}]}
    with pytest.raises(SplicerError, match="not one GDN layer"):
        plans.gdn_layer_rows(_template(), sweep)
    with pytest.raises(SplicerError, match="no one-group rows"):
        plans.gdn_layer_rows(_template(), {"row": [{"name": "build", "restore": []}]})


def test_seed_rows(tmp_path):
    plan = plans.seed_rows(_template())
    assert [r["name"] for r in plan["row"]] == ["build", "lm_head", "gdn", "attention", "shared_expert", "experts-only", "all"]
    out = tmp_path / "p.toml"
    assert plans.main(["seed-rows", str(TEMPLATE), str(out)]) == 0
    assert plans.main(["seed-rows", str(TEMPLATE), str(out)]) == 2  # never overwrites


def test_bad_plan_is_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("name = [")
    r = subprocess.run(
        [sys.executable, "-m", "splicer.trained.plans", "seed-rows", str(bad), str(tmp_path / "o.toml")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "cannot read plan" in r.stderr
    assert not (tmp_path / "o.toml").exists()


def test_mtp_rows(tmp_path):
    from splicer.arch import all_classes
    from splicer.plans.plan import load_plan

    out = tmp_path / "mtp.toml"
    assert plans.main(["mtp-rows", str(TEMPLATE), str(out)]) == 0
    plan = load_plan(str(out), all_classes())  # a plan as any is read
    assert [(r.name, r.restore, r.repeat) for r in plan.rows] == [
        ("build", [], False),
        ("mtp", ["mtp"], False),
        ("build-again", [], True),
    ]
    assert plan.corpora == _template()["corpus"]
