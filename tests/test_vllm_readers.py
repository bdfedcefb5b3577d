"""splicer's models of vLLM's quantization readers against the readers' own code, release by release.

tests/data/vllm-*.json hold what the released code of every vLLM from 0.26.0 to 0.33.0 answered for generated cases
over qwen3_5_moe's vLLM layer names (scripts/vllm/reader_cases.py ran each wheel's own functions; a full import needs
vLLM's GPU stack): compressed-tensors `should_ignore_layer` and `find_matched_target`, GPTQ's `dynamic` and
`modules_in_block_to_quantize` reading and its `desc_act` refusal, and the FP8/AWQ skip list. Every answer must be what
splicer predicts for that release, and the releases may differ only where vllm_versions says a behaviour changed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splicer.formats.compressed_tensors import vllm_matched_target, vllm_should_ignore, vllm_targets
from splicer.formats.gptq import desc_act_refused, vllm_gptq_quantized
from splicer.formats.readings import Entries
from splicer.formats.skip_list import vllm_layer_skipped
from splicer.formats.vllm_versions import CHANGED_IN, CHECKED, RELEASES, modeled, refusing_group_actorder

DATA_DIR = Path(__file__).parent / "data"
DATA = {
    name: json.loads((DATA_DIR / f"vllm-{name}.json").read_text())
    for name in ("should-ignore", "find-target", "gptq", "skip-list")
}
FUSED = DATA["should-ignore"]["fused_mapping"]


def _recorded(name: str, release, key: str = "answers") -> list:
    return next(v for k, v in DATA[name]["releases"].items() if k.startswith(release.version + "."))[key]


def _fused_shards(layer: str) -> list[str] | None:
    proj = layer.rsplit(".", 1)[-1]
    return [layer[: -len(proj)] + s for s in FUSED[proj]] if proj in FUSED else None


def _kind(answer):
    return "refused" if isinstance(answer, str) and answer.startswith("refused") else answer


def _refused(call):
    try:
        return call()
    except ValueError:
        return "refused"


def _differences(name: str, predict, key: str = "answers", cases_key: str = "cases", release=None):
    cases = DATA[name][cases_key]
    want = _recorded(name, release, key)
    assert len(want) == len(cases) >= 400
    return [(c, w, g) for c, w in zip(cases, want) if (g := _refused(lambda c=c: predict(c))) != _kind(w)]


def test_every_checked_release_was_recorded():
    for name, data in DATA.items():
        assert [k.rsplit(".", 1)[0] for k in data["releases"]] == list(CHECKED), name
    assert [r.version for r in RELEASES] == list(CHECKED) and all(r.checked for r in RELEASES)


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: r.version)
def test_should_ignore_layer_of_every_release_is_predicted(release):
    def predict(c):
        shards = _fused_shards(c["layer"]) or [c["layer"]]
        return vllm_should_ignore(c["layer"], shards, Entries(c["ignore"]), release.ignore_fused_name_first)

    wrong = _differences("should-ignore", predict, release=release)
    assert not wrong, f"{len(wrong)} cases differ, e.g. {wrong[0]}"
    # the refusal as the release words it
    refusals = {a for a in _recorded("should-ignore", release) if isinstance(a, str)}
    assert refusals and all(
        a.startswith("refused: " + release.split_group_refusal.split(" [")[0].split(" LAYER")[0]) for a in refusals
    )


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: r.version)
def test_find_matched_target_of_every_release_is_predicted(release):
    def predict(c):
        targets = Entries(vllm_targets(dict.fromkeys(c["targets"])))  # as VllmReader builds them, MoE or not
        return vllm_matched_target(
            c["layer"], (c["class"],), _fused_shards(c["layer"]), targets, release.target_fused_before_class
        )

    wrong = _differences("find-target", predict, release=release)
    assert not wrong, f"{len(wrong)} cases differ, e.g. {wrong[0]}"
    assert sum(a is not None for a in _recorded("find-target", release)) > 500  # targets found, not only misses
    moe = [a for c, a in zip(DATA["find-target"]["cases"], _recorded("find-target", release)) if c["class"] == "RoutedExperts"]
    assert "RoutedExperts" in moe and None in moe  # an exact Linear target reaches the experts; re:.*Linear does not


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: r.version)
def test_gptq_dynamic_and_module_list_of_every_release_are_predicted(release):
    import importlib.util

    spec = importlib.util.spec_from_file_location("reader_cases", DATA_DIR.parents[1] / "scripts/vllm/reader_cases.py")
    cases_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cases_mod)
    stored = cases_mod.stored_names()

    def predict(c):
        listed = cases_mod.listed_of(c, stored)
        return vllm_gptq_quantized(
            c["layer"], _fused_shards(c["layer"]), c["kind"], c["dynamic"], listed, release.gptq_empty_list_quantized
        )

    wrong = _differences("gptq", predict, key="gptq_answers", cases_key="gptq_cases", release=release)
    assert not wrong, f"{len(wrong)} cases differ, e.g. {wrong[0]}"
    answers = [_kind(a) for a in _recorded("gptq", release, "gptq_answers")]
    assert {True, False, "refused"} <= set(answers)


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: r.version)
def test_gptq_desc_act_refusal_of_every_release_is_predicted(release):
    answers = _recorded("gptq", release, "desc_act_answers")
    if not release.refuses_group_actorder:
        assert set(answers) == {None}  # the release has no such check
        return
    wrong = [
        (c, a) for c, a in zip(DATA["gptq"]["desc_act_cases"], answers) if bool(desc_act_refused(c)) != (_kind(a) == "refused")
    ]
    assert not wrong, f"{len(wrong)} cases differ, e.g. {wrong[0]}"
    assert {"accepted", "refused"} == {_kind(a) for a in answers}


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: r.version)
def test_fp8_and_awq_skip_lists_of_every_release_are_predicted(release):
    def predict(c):
        return vllm_layer_skipped(c["layer"], _fused_shards(c["layer"]), c["entries"], c["substring"])

    wrong = _differences("skip-list", predict, release=release)
    assert not wrong, f"{len(wrong)} cases differ, e.g. {wrong[0]}"


def test_the_releases_differ_only_where_vllm_versions_says_a_behaviour_changed():
    """Between consecutive releases the recorded answers change at 0.27 (target order), 0.30 (fused name first, the
    desc_act refusal) and 0.32 (an empty GPTQ module list), and nowhere else."""
    readers = [
        ("should-ignore", "answers"),
        ("find-target", "answers"),
        ("gptq", "gptq_answers"),
        ("gptq", "desc_act_answers"),
        ("skip-list", "answers"),
    ]
    changed = {}
    for old, new in zip(RELEASES, RELEASES[1:]):
        for name, key in readers:
            if _recorded(name, old, key) != _recorded(name, new, key):
                changed.setdefault(new.version, set()).add(f"{name}:{key}")
    assert changed == {
        "0.27": {"find-target:answers"},
        "0.30": {"should-ignore:answers", "gptq:desc_act_answers"},
        "0.32": {"gptq:gptq_answers"},
    }
    assert sorted({".".join(map(str, v)) for v in CHANGED_IN.values()}) == sorted(changed)
    # a regex that matches a fused layer's name but none of its shards: kept quantized before 0.30, ignored after
    layer = "language_model.model.layers.3.linear_attn.in_proj_ba"
    got = [
        vllm_should_ignore(layer, _fused_shards(layer), Entries(["re:.*in_proj_ba$"]), r.ignore_fused_name_first)
        for r in (modeled("0.29.0"), modeled("0.30.0"))
    ]
    assert got == [False, True]


def test_the_modeled_release_is_the_installed_one_else_the_newest():
    assert modeled("0.26.0").version == "0.26" and modeled("0.33.1").version == "0.33"
    between = modeled("0.31.2")
    assert between.version == "0.31" and between.checked and between.ignore_fused_name_first
    before = modeled("0.24.0")
    assert not before.checked and not before.ignore_fused_name_first and not before.refuses_group_actorder
    after = modeled("0.35.0")
    assert not after.checked and after.gptq_empty_list_quantized and after.target_fused_before_class
    assert refusing_group_actorder() == "vLLM 0.30 and later (0.30 to 0.33 checked)"


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
    assert label(modeled()) == "vLLM 0.28"
    assert modeled().target_fused_before_class and not modeled().ignore_fused_name_first
    monkeypatch.setenv("SPLICER_VLLM_VERSION", "0.34.0")
    assert label(modeled()) == "vLLM 0.34, not checked: modeled from 0.26 to 0.33"


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
