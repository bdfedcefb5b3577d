"""splicer's model of vLLM's compressed-tensors `ignore` reader against vLLM's own should_ignore_layer, per release.

tests/data/vllm-should-ignore.json holds what the released code of vLLM 0.26.0 and 0.33.0 answered for 2,000 generated
ignore lists and qwen3_5_moe layer names (scripts/vllm/should_ignore_cases.py ran each wheel's own two files; a full
import needs vLLM's GPU stack). Every answer must be what splicer predicts for that release: ignored, not ignored, or
refused (the shards of one fused layer disagree)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splicer.formats.compressed_tensors import vllm_should_ignore
from splicer.formats.readings import Entries
from splicer.formats.vllm_versions import RELEASES, modeled, refusing_group_actorder

DATA = json.loads((Path(__file__).parent / "data" / "vllm-should-ignore.json").read_text())


def _shards(layer: str, fused: dict) -> list[str]:
    proj = layer.rsplit(".", 1)[-1]
    return [layer[: -len(proj)] + s for s in fused[proj]] if proj in fused else [layer]


def _splicer(case: dict, release) -> bool | str:
    try:
        return vllm_should_ignore(
            case["layer"], _shards(case["layer"], DATA["fused_mapping"]), Entries(case["ignore"]), release.ignore_fused_name_first
        )
    except ValueError:
        return "refused"


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: r.version)
def test_every_recorded_answer_of_the_release_is_predicted(release):
    recorded = next(v for k, v in DATA["releases"].items() if k.startswith(release.version + "."))
    answers = recorded["answers"]
    assert len(answers) == len(DATA["cases"]) == 2000
    wrong = []
    for case, want in zip(DATA["cases"], answers):
        got = _splicer(case, release)
        want_kind = "refused" if isinstance(want, str) else want
        if got != want_kind:
            wrong.append((case, want, got))
    assert not wrong, f"{len(wrong)} cases differ, e.g. {wrong[0]}"
    # the refusal as the release words it
    refusals = {a for a in answers if isinstance(a, str)}
    assert refusals and all(
        a.startswith("refused: " + release.split_group_refusal.split(" [")[0].split(" LAYER")[0]) for a in refusals
    )


def test_the_releases_differ_where_vllm_0_30_changed_the_reader():
    """A regex that matches a fused layer's name but none of its shards: 0.26 keeps it quantized, 0.33 ignores it."""
    old, new = (next(v for k, v in DATA["releases"].items() if k.startswith(r.version + ".")) for r in RELEASES)
    differ = [
        c
        for c, a, b in zip(DATA["cases"], old["answers"], new["answers"])
        if isinstance(a, bool) and isinstance(b, bool) and a != b
    ]
    assert differ and all(b for c, a, b in zip(DATA["cases"], old["answers"], new["answers"]) if c in differ)
    layer = "language_model.model.layers.3.linear_attn.in_proj_ba"
    case = {"layer": layer, "ignore": ["re:.*in_proj_ba$"]}
    assert [_splicer(case, r) for r in RELEASES] == [False, True]


def test_the_modeled_release_is_the_installed_one_else_the_newest():
    assert modeled("0.26.0").version == "0.26" and modeled("0.33.1").version == "0.33"
    between = modeled("0.31.2")
    assert between.version == "0.31" and between.ignore_fused_name_first and between.refuses_group_actorder
    before = modeled("0.24.0")
    assert not before.ignore_fused_name_first and not before.refuses_group_actorder
    assert "0.30 and later" in refusing_group_actorder()


def test_inspect_names_the_modeled_reader_and_where_another_release_reads_otherwise(pairs, tmp_path):
    """A regex that only vLLM 0.30+ applies to a fused name (qkv_proj exists in vLLM's names only), and group
    activation ordering, which vLLM 0.30+ refuses: the lint says both, naming the releases."""
    import shutil

    from splicer.checkpoint import open_checkpoint
    from splicer.splice.inspect import format_report, inspect_checkpoint

    build = tmp_path / "build"
    shutil.copytree(pairs["fused"]["lowlatency"], build)
    cfg = json.loads((build / "config.json").read_text())
    qc = cfg["quantization_config"]
    qc["ignore"] = [*qc["ignore"], "re:.*self_attn\\.qkv_proj$"]
    first = next(iter(qc["config_groups"].values()))
    first["weights"]["actorder"] = "group"
    (build / "config.json").write_text(json.dumps(cfg))
    import os

    assert "SPLICER_VLLM_VERSION" not in os.environ and modeled().version == "0.33"  # no vLLM here: the newest checked
    info = inspect_checkpoint(open_checkpoint(build, "checkpoint"))
    assert info["lint"]["vllm_reader"] == "vLLM 0.33"
    notes = " ".join(info["lint"]["notes"])
    assert "vLLM 0.26 reads 3 modules otherwise" in notes and "self_attn.k_proj: group_0 against unquantized" in notes
    # 0.33 refuses group activation ordering: a problem of the lint, not a note
    refused = [i["detail"] for i in info["lint"]["issues"] if i["check"] == "refused"]
    assert refused and "actorder 'group' is refused by vLLM 0.30 and later" in refused[0] and 'actorder="weight"' in refused[0]
    assert "(vLLM 0.33's reader)" in format_report(info)


def test_the_release_is_chosen_by_environment_and_an_unchecked_one_says_so(monkeypatch):
    from splicer.formats.vllm_versions import label

    monkeypatch.setenv("SPLICER_VLLM_VERSION", "0.26.0")
    assert modeled().version == "0.26" and label(modeled()) == "vLLM 0.26"
    monkeypatch.setenv("SPLICER_VLLM_VERSION", "0.28.1")
    assert label(modeled()) == "vLLM 0.28, not checked: modeled from 0.26 and 0.33"
    assert modeled().target_fused_before_class and not modeled().ignore_fused_name_first


def test_a_regex_over_the_shards_wins_over_a_class_target_from_vllm_0_27(pairs, tmp_path, monkeypatch):
    """find_matched_target: 0.26 tries class targets (Linear) before the fused layer's shards, 0.27 and later after."""
    import shutil

    from splicer.checkpoint import open_checkpoint
    from splicer.splice.inspect import inspect_checkpoint

    build = tmp_path / "build"
    shutil.copytree(pairs["fused"]["lowlatency"], build)
    cfg = json.loads((build / "config.json").read_text())
    groups = cfg["quantization_config"]["config_groups"]
    groups["group_attn"] = json.loads(json.dumps(next(iter(groups.values()))))
    groups["group_attn"]["targets"] = ["re:.*self_attn\\.[qkv]_proj$"]
    groups["group_attn"]["weights"]["num_bits"] = 8
    (build / "config.json").write_text(json.dumps(cfg))
    readings = {}
    for version in ("0.26.0", "0.33.0"):
        monkeypatch.setenv("SPLICER_VLLM_VERSION", version)
        info = inspect_checkpoint(open_checkpoint(build, "checkpoint"))
        readings[version] = [i for i in info["lint"]["issues"] if i["naming"] == "vllm"]
    assert not readings["0.26.0"]  # the Linear group claims qkv_proj, as stored
    assert readings["0.33.0"] and "self_attn" in readings["0.33.0"][0]["detail"]  # group_attn, 8-bit, for INT4 tensors


def test_a_gptq_build_with_desc_act_is_told_which_releases_refuse_it(tmp_path):
    from splicer.checkpoint import open_checkpoint
    from splicer.fixtures.core import FixtureSpec, write_pair
    from splicer.splice.inspect import inspect_checkpoint

    p = write_pair(tmp_path / "pair", FixtureSpec(), kinds=("gptq-experts-g32",))
    build = p["gptq-experts-g32"]
    cfg = json.loads((build / "config.json").read_text())
    cfg["quantization_config"]["desc_act"] = True
    (build / "config.json").write_text(json.dumps(cfg))
    lint = inspect_checkpoint(open_checkpoint(build, "checkpoint"))["lint"]
    assert any("desc_act=true with group_size" in i["detail"] and "vLLM 0.30 and later" in i["detail"] for i in lint["issues"])


def test_desc_act_is_refused_as_vllm_0_33_refuses_it():
    """Cases read from vLLM 0.33.0's gptq_utils.normalize_and_validate_gptq_desc_act: desc_act with group_size -1 is
    dropped as a no-op, not refused; a dynamic rule (not a `-:` exclusion) that turns it on with groups is refused."""
    from splicer.formats.gptq import desc_act_refused

    assert desc_act_refused({"desc_act": True, "group_size": 128})
    assert desc_act_refused({"desc_act": True, "group_size": -1}) is None
    assert desc_act_refused({"desc_act": False, "group_size": 128}) is None
    assert "dynamic rule" in desc_act_refused(
        {"desc_act": False, "group_size": 128, "dynamic": {"+:.*q_proj": {"desc_act": True}}}
    )
    assert desc_act_refused({"desc_act": False, "group_size": 128, "dynamic": {"-:.*q_proj": {"desc_act": True}}}) is None
    assert desc_act_refused({"desc_act": True, "group_size": -1, "dynamic": {".*q_proj": {"group_size": -1}}}) is None
    assert desc_act_refused({"desc_act": True, "group_size": -1, "dynamic": {".*q_proj": {"group_size": 32}}})
