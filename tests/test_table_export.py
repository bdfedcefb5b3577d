"""splicer table: CSV and JSON carry numbers, one column per quantity; Markdown has a caption line; all three agree.

Built from the committed results folders (a torch demo run and a vLLM run on the H200 stand-in), copied to a temporary
folder, plus edits of them for the cases those runs do not have (a failed row, a gap, an unresolved decode time).
"""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import pytest

from splicer.analysis.formatting import fmt_change
from splicer.analysis.table import render

RESULTS = Path(__file__).parents[1] / "results"
TEXT = {"variant", "restored", "status", "error", "repeat_of"}
FLAGS = {"decode_change_resolved", "kl_change_significant", "top1_change_significant"}


def _write(folder: Path, results: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(results))
    return folder


@pytest.fixture(params=["demo", "h200-fulldims/run-3-cold"])
def committed(request, tmp_path):
    results = json.loads((RESULTS / request.param / "results.json").read_text())
    return _write(tmp_path / "r", results), results


def _csv(out: Path) -> list[dict]:
    return list(csv.DictReader(io.StringIO(render(out, "csv"))))


def _md_rows(md: str) -> dict[str, dict]:
    """The first Markdown table as {variant name: {header: cell}}."""
    lines = [ln for ln in md.split("\n\n")[1].splitlines() if ln.startswith("|")]
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    headers = cells[0]
    return {row[0].split(" (engine of ")[0]: dict(zip(headers, row)) for row in cells[2:]}


def test_csv_holds_plain_numbers_from_results_json(committed):
    out, results = committed
    rows = _csv(out)
    assert [r["variant"] for r in rows] == [v["name"] for v in results["variants"]]
    columns = list(rows[0])
    for c in results["corpora"]:
        for q in ("top1", "kl"):
            assert {f"{q}_{c}", f"{q}_{c}_ci_low", f"{q}_{c}_ci_high"} <= set(columns)
    numeric = [c for c in columns if c not in TEXT | FLAGS]
    assert {
        "size_gb",
        "decode_ms_per_token",
        "floor_ms_per_token",
        "decode_change_vs_build",
        "kl_change_vs_build",
        "dnll_chat",
    } <= set(numeric)
    for row in rows:
        for col in numeric:
            # a plain decimal or nothing: no %, no thousands separator, no interval brackets, no exponent
            assert row[col] == "" or re.fullmatch(r"-?\d+(\.\d+)?", row[col]), (col, row[col])
        assert all(row[f] in ("", "true", "false") for f in FLAGS)
    by_name = {v["name"]: v for v in results["variants"]}
    for row in rows:  # the numbers themselves, unrounded
        v = by_name[row["variant"]]
        for c, m in v["metrics"].items():
            assert float(row[f"top1_{c}"]) == m["top1"] and float(row[f"kl_{c}"]) == m["kl"]
            assert [float(row[f"top1_{c}_ci_low"]), float(row[f"top1_{c}_ci_high"])] == m["top1_ci"]
            assert [float(row[f"kl_{c}_ci_low"]), float(row[f"kl_{c}_ci_high"])] == m["kl_ci"]
        assert float(row["size_gb"]) == v["size_bytes"] / 1e9
        assert float(row["decode_ms_per_token"]) == v["decode_ms_per_token"]
        # Changes from the build: none for the build and its other engines; the rest where verdicts were computed.
        if row["variant"] == "build" or row["repeat_of"] == "build":
            assert row["kl_change_vs_build"] == row["decode_change_vs_build"] == ""
        elif v.get("vs_build"):
            pooled = v["vs_build"]["kl"]["pooled"]
            assert float(row["kl_change_vs_build"]) == pooled["rel"]
            assert [float(row["kl_change_ci_low"]), float(row["kl_change_ci_high"])] == pooled["rel_ci"]
            assert row["kl_change_significant"] == str(pooled["significant"]).lower()


def test_json_is_a_list_of_objects_with_real_numbers_that_match_the_csv(committed):
    out, _ = committed
    data = json.loads(render(out, "json"), parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    rows = _csv(out)
    assert isinstance(data, list) and len(data) == len(rows)
    numbers = 0
    for obj, row in zip(data, rows):
        assert list(obj) == list(row)  # the same columns in the same order
        for key, x in obj.items():
            if key in TEXT:
                assert x is None or isinstance(x, str), (key, x)
            elif key in FLAGS:
                assert x is None or isinstance(x, bool), (key, x)
                assert row[key] == ("" if x is None else str(x).lower())
            else:
                assert x is None or (isinstance(x, (int, float)) and not isinstance(x, bool)), (key, x)
                assert (row[key] == "") == (x is None) and (x is None or float(row[key]) == x), key
                numbers += x is not None
    assert numbers > 15 * len(data)  # mostly numbers, not a table of gaps


def test_markdown_cells_are_the_exported_numbers_formatted(committed):
    out, results = committed
    md = _md_rows(render(out, "markdown"))
    for r in json.loads(render(out, "json")):
        cells = md[r["variant"]]
        assert cells["size GB"] == f"{r['size_gb']:.3f}"
        for c in results["corpora"]:
            assert cells[f"top-1 {c}"] == f"{100 * r[f'top1_{c}']:.1f} %" and cells[f"KL {c}"] == f"{r[f'kl_{c}']:.4f}"
        assert cells["dNLL"] == f"{r['dnll_chat']:+.4f}"
        assert cells["decode ms/tok"] == f"{r['decode_ms_per_token']:.2f}"
        for col, key, scale, unit, quiet in (
            ("Δ decode [95 %]", "decode_change", 100, " %", "not resolved"),
            ("ΔKL, % of build's [95 %]", "kl_change", 100, " %", "n.s."),
            ("Δtop-1 vs build, pp [95 %]", "top1_change", 100, "", "n.s."),
        ):
            x = r[f"{key}_vs_build"]
            flag = r["decode_change_resolved" if key == "decode_change" else f"{key}_significant"]
            want = (
                ""
                if x is None
                else fmt_change(x, r[f"{key}_ci_low"], r[f"{key}_ci_high"], scale, unit) + (f" {quiet}" if flag is False else "")
            )
            assert cells[col] == want, (r["variant"], col)


def test_caption_names_build_base_backend_corpora_and_positions(committed):
    out, results = committed
    md = render(out, "markdown")
    caption, table = md.split("\n\n")[:2]
    assert "\n" not in caption and table.startswith("| variant")  # one line, then the table as before
    assert f"`{results['inputs']['build']['source']}`" in caption and f"`{results['inputs']['base']['source']}`" in caption
    assert f"backend {results['backend']}" in caption
    if results["backend"] == "vllm":
        assert f"({results['engine_version']})" in caption
    for name, c in results["corpora"].items():
        assert f"{name} {c['positions']:,}" in caption
    assert f"{sum(c['positions'] for c in results['corpora'].values()):,} in all" in caption


def test_a_failed_row_and_gaps_are_missing_values_not_text(tmp_path):
    results = json.loads((RESULTS / "demo" / "results.json").read_text())
    failed = results["variants"][1]
    failed.update(status="error", error="RuntimeError: CUDA out of memory (simulated)")
    gap = results["variants"][2]["metrics"]["wiki-en"]
    gap["kl"], gap["kl_ci"] = float("nan"), None  # json.dumps writes NaN, which JSON itself does not allow
    out = _write(tmp_path / "r", results)
    data = {r["variant"]: r for r in json.loads(render(out, "json"), parse_constant=lambda c: pytest.fail(c))}
    rows = {r["variant"]: r for r in _csv(out)}
    name = failed["name"]
    assert data[name]["status"] == "error" and data[name]["error"].startswith("RuntimeError")
    assert all(data[name][k] is None for k in data[name] if k not in TEXT)
    assert all(rows[name][k] == "" for k in rows[name] if k not in TEXT)
    g = results["variants"][2]["name"]
    assert data[g]["kl_wiki-en"] is None and data[g]["kl_wiki-en_ci_low"] is None and rows[g]["kl_wiki-en"] == ""
    assert data[g]["top1_wiki-en"] == gap["top1"]  # the rest of the row is still there
    assert f"failed: {failed['error']}" in render(out, "markdown")


def test_an_unresolved_decode_time_is_a_gap_everywhere(tmp_path):
    """A timed row whose decode estimate was not positive (decode_ms_per_token None): no table divides by it."""
    from splicer.analysis.verdicts import attach
    from splicer.backends.vllm_outputs import summarise_decode_runs

    results = json.loads((RESULTS / "demo" / "results.json").read_text())
    results["backend"] = "vllm"  # the speed table is rendered for vLLM runs
    unresolved = summarise_decode_runs([0.1, 0.1], [0.09, 0.1], [None, None], new_tokens=4, warmup=0, prompt_tokens=64)
    assert unresolved["decode_ms_per_token"] is None
    for v in results["variants"]:
        if v["name"] in ("build", "gdn"):
            v["timing"], v["decode_ms_per_token"] = unresolved, None
    out = _write(tmp_path / "r", results)
    attach(results, out)
    assert results["verdicts"].get("build_engines") is None  # neither build engine was resolved
    out = _write(tmp_path / "r", results)
    md = render(out, "markdown")
    rows = _md_rows(md)
    assert rows["build"]["decode ms/tok"] == "-" and rows["gdn"]["decode ms/tok"] == "-"
    assert rows["attention"]["decode ms/tok"] != "-" and rows["attention"]["Δ decode [95 %]"] == ""  # no build time
    assert "| gdn " in md.split("Speed per variant")[1] and "not resolved" in md.split("Speed per variant")[1]
    data = {r["variant"]: r for r in json.loads(render(out, "json"))}
    assert data["build"]["decode_ms_per_token"] is None and data["gdn"]["decode_ms_per_token"] is None
    assert all(r["decode_change_vs_build"] is None for r in data.values())


@pytest.mark.parametrize("command", [["table"], ["compare", "build", "gdn"], ["report"]])
def test_table_compare_and_report_refuse_a_broken_results_json_in_one_line(tmp_path, capsys, command):
    from splicer.cli import main

    (tmp_path / "results.json").write_text("{not json")
    assert main([command[0], str(tmp_path), *command[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "is not valid JSON" in err


@pytest.mark.parametrize(
    "run, warned", [("h200-fulldims/run-6", True), ("h200-fulldims/run-3-cold", True), ("h200-fulldims/run-8", False)]
)
def test_timings_of_an_overlapped_run_carry_the_two_level_warning(tmp_path, run, warned):
    """Runs 6 (sleep mode) and 3 (no sleep mode) overlapped engine starts, run 8 timed serially: only 6 and 3 warn."""
    results = json.loads((RESULTS / run / "results.json").read_text())
    md = render(_write(tmp_path / "r", results), "markdown")
    assert ("two levels about 6 % apart" in md) is warned


def test_engine_environment_is_in_the_footnotes_the_cache_key_and_the_job(tmp_path):
    """--engine-env changes what the engines compute (VLLM_TRITON_FORCE_FIRST_CONFIG: untuned prefill kernels), so the
    table says so, the base pass is cached apart, and a run with another environment is another job; a run without it
    keeps the key and job it had before the option existed."""
    from types import SimpleNamespace

    from splicer.ablate import AblateSettings, base_cache, make_job
    from splicer.backends.vllm_backend import VllmOptions

    results = json.loads((RESULTS / "h200-fulldims/run-10/results.json").read_text())
    assert "Engine environment" not in render(_write(tmp_path / "plain", results))
    results["backend_info"]["engine_env"] = {"VLLM_TRITON_FORCE_FIRST_CONFIG": "1"}
    md = render(_write(tmp_path / "env", results))
    assert "Engine environment set for this run: VLLM_TRITON_FORCE_FIRST_CONFIG=1 (Triton autotuning off" in md
    backend, plan = SimpleNamespace(name="vllm"), SimpleNamespace(top_k=20, name="p", digest="d", settings_digest="s", rows=[])
    plain, env = (
        AblateSettings(backend="vllm"),
        AblateSettings(backend="vllm", backend_options=VllmOptions(engine_env={"VLLM_TRITON_FORCE_FIRST_CONFIG": "1"})),
    )
    keys = {base_cache(plan, s, backend=backend, out=tmp_path, base_digest="b", corpora=[]).name for s in (plain, env)}
    assert len(keys) == 2
    # The key of a run without --engine-env is the one computed before the option existed (commit 4cc9f23's formula).
    from splicer.ablate import BASE_PASS_VERSION
    from splicer.ablate.common import parts_digest

    assert base_cache(plan, plain, backend=backend, out=tmp_path, base_digest="b", corpora=[]).name == "base-" + parts_digest(
        BASE_PASS_VERSION, "b", [], [], 20, "vllm", "auto", None, {}
    )
    build = SimpleNamespace(header_digest=lambda: "h")
    jobs = [
        make_job(plan, s, corpora=[], build_src="B", build=build, base_src="R", base_digest="r")["settings"] for s in (plain, env)
    ]
    assert "engine_env" not in jobs[0] and jobs[1]["engine_env"] == {"VLLM_TRITON_FORCE_FIRST_CONFIG": "1"}


def test_the_kl_footnote_names_the_plans_top_k_or_says_it_was_not_recorded(tmp_path):
    """results.json records the plan's top_k; the KL note names it (top-5 here, not a hard-coded top-20), and a file
    written before it was recorded says so rather than guess."""
    results = json.loads((RESULTS / "h200-fulldims/run-10/results.json").read_text())
    assert "top_k" not in results
    md = render(_write(tmp_path / "old", results))
    assert "top-20" not in md and "top-k (top-k not recorded in this results.json)" in md
    assert "the variant's own ties not read" in md  # scored before top-1 read ties on both sides: said, not hidden
    results["top_k"] = 5
    md = render(_write(tmp_path / "k5", results))
    assert "over the base's top-5 with the rest lumped" in md and "own top-5 (an id missing there gets its 5th" in md
    assert "top-20" not in md


def test_decode_verdicts_say_they_hold_within_the_run(tmp_path):
    """Runs 10 and 11 of the same plan give non-overlapping experts-only intervals: the engines' spread across runs is
    not in an interval, and table, report and the CSV's column description say "resolved" holds within the run."""
    from splicer.analysis.report import render_report
    from splicer.analysis.table import __doc__ as columns
    from splicer.analysis.verdicts import attach

    results = json.loads((RESULTS / "h200-fulldims/run-11/results.json").read_text())
    attach(results, tmp_path)  # today's verdicts on the committed timings (its score files are not committed)
    md = render(_write(tmp_path / "r", results))
    assert "Resolved holds within this run" in md and "median of its timed blocks" in md
    assert "per-position scores of the build's engines are not in this folder" in md
    report = render_report(results)
    gdn = next(x for x in report.splitlines() if x.startswith("- gdn "))
    assert "decode -1.08 % [" in gdn and "resolved within this run" in gdn
    assert "holds within" in columns and "the run" in columns


def test_a_re_made_build_s_note_and_a_gptq_checkpoint_read_once_in_the_markdown(tmp_path):
    """Run 5's re-made builds have no splice row, so their Markdown note cell held only why; the note on what a re-made
    build quantizes (which the CSV carries) was dropped. And a GPTQ checkpoint's format is its method's name: the
    restored cell read "checkpoint: gptq gptq"."""
    results = json.loads((RESULTS / "trained-h200/run-5/ablate0/results.json").read_text())
    rows = {v["name"]: v for v in results["variants"]}
    note = "it quantizes experts, mtp, where the build without gdn, shared_expert would quantize attention, lm_head, experts"
    rows["requantized-gdn+shared_expert"]["vs_splice"]["note"] = note
    rows["requantized-attention+gdn+shared_expert"]["checkpoint"].update(quant_method="gptq", format="gptq")
    out = _write(tmp_path / "r", results)
    md = render(out, "markdown")
    pairs = md.split("Splice against re-quantize:")[1]
    line = next(ln for ln in pairs.splitlines() if "| requantized-gdn+shared_expert " in ln)
    why = rows["requantized-gdn+shared_expert"]["vs_splice"]["why"]
    assert line.rstrip(" |").endswith(f"{why}; {note}")
    assert _md_rows(md)["requantized-attention+gdn+shared_expert"]["restored to BF16"] == "checkpoint: gptq"
    assert _md_rows(md)["requantized-gdn+shared_expert"]["restored to BF16"] == "checkpoint: compressed-tensors pack-quantized"
    csv_rows = {r["variant"]: r for r in _csv(out)}
    assert csv_rows["requantized-gdn+shared_expert"]["splice_minus_requantized_note"] == f"{why}; {note}"
