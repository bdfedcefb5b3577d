"""Per-layer restores (issue 17, first part): `gdn@0-1`, `attention@3,7` in `splice --restore` and in plan rows."""

from __future__ import annotations

import json

import pytest

from splicer.checkpoint import open_checkpoint
from splicer.cli import main
from splicer.errors import SplicerError
from splicer.plans.plan import Row
from splicer.splice.inspect import inspect_checkpoint
from splicer.splice.modules import list_modules
from splicer.splice.selection import canonical_entries, format_layers, split_restore


def test_split_canonical_and_format():
    assert split_restore("gdn@0-9,attention@3,7,experts") == [("gdn", "0-9"), ("attention", "3,7"), ("experts", None)]
    assert split_restore(" gdn , lm_head ") == [("gdn", None), ("lm_head", None)]
    assert format_layers([7, 0, 1, 2, 4, 5]) == "0-2,4-5,7"
    assert canonical_entries(["attention@7,3", "gdn@2-3,0-1"], "x") == ["attention@3,7", "gdn@0-3"]
    assert canonical_entries(["gdn@0", "gdn"], "x") == ["gdn"]  # the whole class wins
    for bad, message in (
        ("gdn@", "is not a layer number"),
        ("gdn@3-1", "runs backwards"),
        ("gdn@a", "not a layer number"),
        ("9x@1", "not a class name"),
    ):
        with pytest.raises(SplicerError, match=message):
            canonical_entries([bad], "row r")


def _splice(pairs, tmp_path, *args):
    out = tmp_path / "out"
    code = main(["splice", *args, str(pairs["fused"]["lowlatency"]), str(pairs["fused"]["base"]), "-o", str(out)])
    return code, out


def test_splice_restores_a_class_in_some_layers_only(pairs, tmp_path):
    """gdn@0-1,attention@3: GDN modules of layers 0 and 1 and the attention of layer 3 restored, whole fused groups,
    the rest as built; both readers read the result; splice.json records the restore as asked."""
    code, out = _splice(pairs, tmp_path, "--restore", "gdn@1,0,attention@3")
    assert code == 0
    build = list_modules(open_checkpoint(pairs["fused"]["lowlatency"], "build"))
    after = list_modules(open_checkpoint(out, "out"))
    arch = open_checkpoint(out, "out").arch
    for name, m in build.items():
        if not m.quantized or name not in after:
            continue
        layer = arch.layer_index(name)
        restored = (m.cls == "gdn" and layer in (0, 1) and not arch.is_mtp(name)) or (m.cls == "attention" and layer == 3)
        assert after[name].quantized != restored, name
    assert inspect_checkpoint(open_checkpoint(out, "out"))["lint"]["issues"] == []
    # attention is quantized in layer 3 only: attention@3 is all of it, recorded as the bare class
    assert json.loads((out / "splice.json").read_text())["restore"] == "gdn@0-1,attention"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--restore", "gdn@3"], "no quantized gdn module in those layers; this build has gdn in layers 0-2"),
        (["--restore", "gdn@0-9"], "--restore gdn@0-9: layer 9 is out of range"),
        (["--restore", "lm_head@1"], "lm_head has no decoder layers in this build"),
        (["--restore", "gdn@0", "--layers", "1"], "--layers is given too"),
    ],
)
def test_bad_layer_restores_are_refused(pairs, tmp_path, capsys, args, message):
    code, out = _splice(pairs, tmp_path, *args)
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_plan_rows_name_layers_and_resume_without_splicing_again(pairs, tmp_path):
    plan = tmp_path / "layers.toml"
    plan.write_text("""name = "layers"
description = "per-layer rows"
top_k = 20
[[corpus]]
name = "wiki-en"
kind = "builtin"
text = "wiki-en"
chunk_tokens = 32
max_chunks = 2
[[row]]
name = "build"
restore = []
[[row]]
name = "gdn-early"
restore = ["gdn@1,0"]
[[row]]
name = "two"
restore = ["attention@3", "gdn@0-1"]
""")
    args = [
        "ablate",
        "all",
        str(pairs["fused"]["lowlatency"]),
        str(pairs["fused"]["base"]),
        "-o",
        str(tmp_path / "run"),
        "--plan",
        str(plan),
        "--no-time",
        "--device",
        "cpu",
    ]
    assert main(args) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert {v["name"]: v["restored"] for v in results["variants"]} == {
        "build": [],
        "gdn-early": ["gdn@0-1"],
        "two": ["gdn@0-1", "attention"],
    }
    spliced = tmp_path / "run" / "variants" / "two" / "splice.json"
    assert json.loads(spliced.read_text())["restore"] == "gdn@0-1,attention"
    stamp = spliced.stat().st_mtime_ns
    (tmp_path / "run" / "results.json").unlink()  # rows to run again: their splices are current and reused
    assert main(args) == 0
    assert spliced.stat().st_mtime_ns == stamp


def test_row_restored_keeps_layer_entries_in_class_order():
    row = Row("r", restore=["attention@3", "gdn@0-1", "mtp"])
    assert row.restored(["gdn", "attention", "shared_expert"]) == ["gdn@0-1", "attention@3"]


def test_a_plan_keep_with_layers_is_refused(tmp_path):
    from splicer.arch import all_classes
    from splicer.plans.plan import load_plan

    plan = tmp_path / "p.toml"
    plan.write_text(
        'name = "p"\ndescription = "d"\ntop_k = 20\n[[corpus]]\nname = "c"\nkind = "builtin"\ntext = "wiki-en"\n'
        '[[row]]\nname = "r"\nkeep = ["gdn@0"]\n'
    )
    with pytest.raises(SplicerError, match="keep takes whole classes"):
        load_plan(str(plan), all_classes())


def test_layer_groups_are_contiguous_and_even():
    from splicer.plans.sweep import layer_groups

    assert layer_groups([0, 1, 2, 4, 5, 6, 8, 9, 10, 12], 4) == [[0, 1, 2], [4, 5, 6], [8, 9], [10, 12]]
    assert layer_groups([0, 1, 2], 3) == [[0], [1], [2]]


def test_plan_sweep_writes_group_leave_one_out_and_whole_rows(pairs, tmp_path, capsys):
    from splicer.arch import all_classes
    from splicer.plans.plan import load_plan

    out = tmp_path / "sweep.toml"
    assert (
        main(
            [
                "plan",
                "sweep",
                str(pairs["fused"]["lowlatency"]),
                "--class",
                "gdn",
                "--groups",
                "3",
                "-o",
                str(out),
                "--from",
                "demo",
            ]
        )
        == 0
    )
    plan = load_plan(str(out), all_classes())
    assert [(r.name, r.restore, r.repeat) for r in plan.rows] == [
        ("build", [], False),
        ("gdn-1", ["gdn@0"], False),
        ("gdn-2", ["gdn@1"], False),
        ("gdn-3", ["gdn@2"], False),
        ("gdn-without-1", ["gdn@1-2"], False),
        ("gdn-without-2", ["gdn@0,2"], False),
        ("gdn-without-3", ["gdn@0-1"], False),
        ("gdn", ["gdn"], False),
        ("build-again", [], True),
    ]
    assert plan.corpora == load_plan("demo", all_classes()).corpora
    two = tmp_path / "two.toml"
    assert (
        main(
            [
                "plan",
                "sweep",
                str(pairs["fused"]["lowlatency"]),
                "--class",
                "gdn",
                "--groups",
                "2",
                "-o",
                str(two),
                "--from",
                "demo",
            ]
        )
        == 0
    )
    assert [r.name for r in load_plan(str(two), all_classes()).rows] == ["build", "gdn-1", "gdn-2", "gdn", "build-again"]
    capsys.readouterr()
    for args, message in (
        (["--groups", "4"], "--groups 4: give 2 to 3"),
        (["--groups", "2", "--class", "lm_head"], "no quantized lm_head"),
        (["--groups", "2", "--class", "nope"], "--class 'nope'"),
    ):
        argv = ["plan", "sweep", str(pairs["fused"]["lowlatency"]), "-o", str(tmp_path / "x.toml"), "--from", "demo", *args]
        if "--class" not in args:
            argv += ["--class", "gdn"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
        assert not (tmp_path / "x.toml").exists()
    assert (
        main(
            [
                "plan",
                "sweep",
                str(pairs["fused"]["lowlatency"]),
                "--class",
                "gdn",
                "--groups",
                "2",
                "-o",
                str(two),
                "--from",
                "demo",
            ]
        )
        == 2
    )
    assert "exists" in capsys.readouterr().err
    inside = pairs["fused"]["lowlatency"] / "sweep.toml"
    assert (
        main(
            [
                "plan",
                "sweep",
                str(pairs["fused"]["lowlatency"]),
                "--class",
                "gdn",
                "--groups",
                "2",
                "-o",
                str(inside),
                "--from",
                "demo",
            ]
        )
        == 2
    )
    assert "inside the build folder" in capsys.readouterr().err and not inside.exists()


def test_plan_entries_are_read_as_the_build_reads_them():
    """One variant, one name: layers without the class dropped, all of a class's layers written as the bare class, so
    two spellings of one variant are one row; an entry no layer of the build serves is refused before anything runs."""
    from splicer.plans.plan import Plan, resolve_rows

    def plan(*rows):
        return Plan("p", "d", 20, [], None, [Row(n, restore=r) for n, r in rows], "digest")

    layers = {"gdn": [0, 1, 2], "attention": [3], "experts": [0, 1, 2, 3]}
    quantized = ["gdn", "attention", "experts"]
    todo, skipped = resolve_rows(
        plan(("a3", ["attention@3"]), ("a", ["attention"]), ("g03", ["gdn@0,3"]), ("g0", ["gdn@0"]), ("g", ["gdn@0-2"])),
        "qwen3_5_moe",
        quantized + ["lm_head"],
        quantized,
        [],
        layers,
        4,
    )
    assert [(t.row.name, t.restored) for t in todo] == [("a3", ["attention"]), ("g03", ["gdn@0"]), ("g", ["gdn"])]
    assert {s["name"]: s["reason"] for s in skipped} == {"a": "same variant as a3", "g0": "same variant as g03"}
    for entry, message in (
        ("gdn@3", "no quantized gdn module in those layers"),
        ("gdn@9", "layer 9 is out of range"),
        ("lm_head@0", "lm_head has no decoder layers"),
    ):
        with pytest.raises(SplicerError, match=message):
            resolve_rows(plan(("r", [entry])), "qwen3_5_moe", quantized + ["lm_head"], quantized + ["lm_head"], [], layers, 4)


def test_plan_entries_that_are_empty_or_only_numbers_are_refused():
    for entries, message in (
        ([""], "an empty entry"),
        (["gdn@0", "3"], "'3' is not a class name"),
        (["gdn@0,attention"], "holds 2 entries"),
    ):
        with pytest.raises(SplicerError, match=message):
            canonical_entries(entries, "row r")


def test_splice_names_a_variant_as_the_build_reads_it(pairs, tmp_path):
    for spec, recorded in (("gdn@0,3", "gdn@0"), ("gdn@0-2", "gdn")):
        out = tmp_path / spec.replace(",", "_").replace("@", "_")
        assert (
            main(
                [
                    "splice",
                    "-q",
                    "--restore",
                    spec,
                    str(pairs["fused"]["lowlatency"]),
                    str(pairs["fused"]["base"]),
                    "-o",
                    str(out),
                ]
            )
            == 0
        )
        assert json.loads((out / "splice.json").read_text())["restore"] == recorded


def test_sweep_refuses_a_bad_template_and_a_class_in_one_layer(pairs, tmp_path, capsys):
    template = tmp_path / "t.toml"
    template.write_text('name = "t"\ndescription = "d"\ntop_k = 20\n[[row]]\nname = "b"\nrestore = []\n')
    for args, message in (
        (["--class", "gdn", "--from", str(template)], f"plan {template} declares no [[corpus]]"),
        (["--class", "attention", "--from", "demo"], "attention quantized in one decoder layer only"),
    ):
        assert (
            main(["plan", "sweep", str(pairs["fused"]["lowlatency"]), "--groups", "2", "-o", str(tmp_path / "s.toml"), *args])
            == 2
        )
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "s.toml").exists()
