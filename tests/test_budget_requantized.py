"""Do budget's predictions hold for the re-made builds? A build re-made by its quantizer with some classes in BF16
(`--add-requantized CLASSES=DIR`: a checkpoint row with requantized_without) is kept out of budget's fit (it is not a
splice) and compared with the prediction for restoring the same classes: predicted, measured, and measured - predicted
with the interval --verify gives its points. Synthetic results.json and per-position scores, so every number is known."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from splicer.analysis.budget import fit, predictions
from splicer.analysis.report import report
from splicer.cli import main
from splicer.io import results_record

SEQ = torch.arange(24).repeat_interleave(5)  # 24 sequences of 5 positions
ACROSS = 0.9  # the gdn+attention splice reduces KL 0.9x its atoms' sum
OFFSET = 0.05  # the three-class re-made build leaves this much more KL than its prediction, position by position
THREE = "requantized-attention+gdn+shared_expert"
TWO = "requantized-attention+shared_expert"
PAIR = "requantized-attention+gdn"  # the classes of the gdn+attention splice row


def _noise(g, scale: float) -> torch.Tensor:
    return scale * torch.randn(len(SEQ), generator=g, dtype=torch.float64)


def _scores() -> dict[str, torch.Tensor]:
    """Per-position KL of every row: the splice rows, a re-made build of three classes OFFSET above the prediction for
    them, one of two classes exactly at its prediction up to noise of mean 0, one of gdn alone, one of the classes of
    the gdn+attention splice row."""
    g = torch.Generator().manual_seed(3)
    b = 1.0 + _noise(g, 0.1)
    rows = {"build": b, "gdn": b - 0.3 + _noise(g, 0.02), "attention": b - 0.2 + _noise(g, 0.02)}
    rows["shared_expert"] = b - 0.1 + _noise(g, 0.02)
    rows["gdn+attention"] = b - ACROSS * 0.5 + _noise(g, 0.02)
    red = {c: b - rows[c] for c in ("gdn", "attention", "shared_expert")}
    # The across slope the model fits: least squares through 0 of the one multi-class row (its position means).
    across = float((b - rows["gdn+attention"]).mean() / (red["gdn"] + red["attention"]).mean())
    rows[THREE] = b - across * (red["gdn"] + red["attention"] + red["shared_expert"]) + OFFSET + _noise(g, 0.02)
    zero = _noise(g, 0.02)
    rows[TWO] = b - across * (red["attention"] + red["shared_expert"]) + zero - zero.mean()
    rows["requantized-gdn"] = rows["gdn"] - 0.01 + _noise(g, 0.02)
    rows[PAIR] = rows["gdn+attention"] + 0.02 + _noise(g, 0.01)
    return rows


RESTORED = {"build": [], "gdn": ["gdn"], "attention": ["attention"], "shared_expert": ["shared_expert"]}
RESTORED["gdn+attention"] = ["gdn", "attention"]


def _folder(tmp_path: Path, remade=(THREE, TWO, "requantized-gdn"), scores=True, edit=None, scale=1.0, top=None) -> Path:
    """A results folder: the splice rows, the re-made builds named (checkpoint rows as ablate writes them), and each
    row's per-position scores (DIR/scores/ROW/wiki-en.safetensors), every KL times `scale`; `top`: more top-level
    fields of results.json."""
    folder = tmp_path / "run"
    folder.mkdir(parents=True)
    variants = []
    for name, kl in _scores().items():
        kl = scale * kl
        if name.startswith("requantized-") and name not in remade:
            continue
        v = {
            "name": name,
            "status": "ok",
            "size_bytes": 10e9 + 1e9 * len(RESTORED.get(name, [])),
            "decode_ms_per_token": None,
            "metrics": {"wiki-en": {"kl": float(kl.mean()), "positions": len(SEQ)}},
        }
        if name.startswith("requantized-"):
            without = sorted(name.removeprefix("requantized-").split("+"))
            v.update(restored="checkpoint", checkpoint={"source": f"/x/{name}", "quant_method": "compressed-tensors"})
            v["checkpoint"]["requantized_without"] = without
        else:
            v["restored"] = RESTORED[name]
        variants.append((edit or (lambda v: v))(v))
        if scores:
            (folder / "scores" / name).mkdir(parents=True)
            save_file({"kl_top": kl.float(), "seq_index": SEQ}, str(folder / "scores" / name / "wiki-en.safetensors"))
    results = {
        "variants": variants,
        "corpora": {"wiki-en": {}},
        "class_layers": {"gdn": [0, 1, 2], "attention": [3], "shared_expert": [0, 1, 2, 3], "lm_head": []},
        **(top or {}),
    }
    (folder / "results.json").write_text(json.dumps(results))
    return folder


def _budget(folder: Path, capsys, *args) -> tuple[str, dict]:
    capsys.readouterr()
    assert main(["budget", str(folder), *args]) == 0
    return capsys.readouterr().out, json.loads((folder / "budget.json").read_text())


def _remade(record: dict) -> dict:
    return {e["row"]: e for e in record["requantized"]}


def test_a_re_made_build_is_compared_with_the_prediction_for_its_classes(tmp_path, capsys):
    from splicer.analysis.metrics import paired_comparison

    folder = _folder(tmp_path)
    out, record = _budget(folder, capsys)
    e = _remade(record)[THREE]
    # The prediction is the model's for exactly those classes, as the front and the search make it ...
    model = fit(results_record.load(folder))
    [p] = [p for p in predictions(model) if {a.entry for a in p.atoms} == {"gdn", "attention", "shared_expert"}]
    assert e["predicted_kl"] == p.kl and e["restore"] == p.label == "gdn,attention,shared_expert"
    # ... and by hand: the build less the three reductions times the across slope fitted from gdn+attention alone.
    kl = {n: float(x.mean()) for n, x in _scores().items()}
    b = kl["build"]
    across = (b - kl["gdn+attention"]) / ((b - kl["gdn"]) + (b - kl["attention"]))
    assert e["predicted_kl"] == pytest.approx(b - across * sum(b - kl[c] for c in ("gdn", "attention", "shared_expert")))
    assert e["measured_kl"] == kl[THREE] and e["corpus"] is None
    # The error, paired position by position: the interval --verify gives, recomputed here from the score files.
    s = {n: x.float().double() for n, x in _scores().items()}  # as the score files hold them
    pred = s["build"] - across * sum(s["build"] - s[c] for c in ("gdn", "attention", "shared_expert"))
    r = paired_comparison({"wiki-en": {"a": s[THREE], "b": pred, "cluster": SEQ, "unit": "sequences", "weight": None}})["pooled"]
    assert e["error_kl"]["diff"] == pytest.approx(r["diff"], abs=1e-7) == pytest.approx(OFFSET, abs=0.01)
    assert e["error_kl"]["ci"] == pytest.approx(r["diff_ci"], abs=1e-7)
    assert e["includes_0"] is False and e["error_kl"]["ci"][0] > 0
    lo, hi = e["error_kl"]["ci"]
    # ... and as a share of the prediction: the same interval on a fixed scale
    p_kl = e["predicted_kl"]
    assert e["error_rel"] == {"diff": pytest.approx(e["error_kl"]["diff"] / p_kl), "ci": pytest.approx([lo / p_kl, hi / p_kl])}
    rel = f"{100 * e['error_kl']['diff'] / p_kl:+.1f} % of the prediction [{100 * lo / p_kl:+.1f}, {100 * hi / p_kl:+.1f}]"
    assert (
        f"{THREE} (attention, gdn, shared_expert): {e['predicted_kl']:.4f} predicted, {kl[THREE]:.4f} measured, error "
        f"{e['error_kl']['diff']:+.4f} [{lo:+.4f}, {hi:+.4f}], {rel}, excludes 0: the re-made build leaves more KL than "
        "predicted."
    ) in out.splitlines()
    # The two-class build sits at its prediction up to noise of mean 0: its interval includes 0.
    two = _remade(record)[TWO]
    assert two["error_kl"]["diff"] == pytest.approx(0, abs=1e-6) and two["includes_0"] is True
    assert any(
        line.startswith(f"{TWO} (attention, shared_expert): ") and line.endswith(", includes 0: the prediction holds.")
        for line in out.splitlines()
    )


def test_re_made_builds_stay_out_of_the_fit(tmp_path):
    """A re-made build re-fitted every later layer: it is no splice, so it neither is an atom nor measures the
    additivity, even where a hand-written row also lists the classes as restored (then it would be a multi-atom row
    with a KL far from the splices' 0.9 slope)."""
    with_rows = fit(results_record.load(_folder(tmp_path / "a")))
    without = fit(results_record.load(_folder(tmp_path / "b", remade=())))
    assert with_rows.to_json() == without.to_json() and with_rows.additivity.across == pytest.approx(ACROSS, abs=0.05)
    listed = fit(
        results_record.load(
            _folder(
                tmp_path / "c",
                edit=lambda v: dict(v, restored=v["checkpoint"]["requantized_without"]) if "checkpoint" in v else v,
            )
        )
    )
    assert listed.to_json() == without.to_json()
    assert not any(n.startswith("requantized-") for n in [a.row for a in listed.atoms] + [c["row"] for c in listed.checks])


def test_a_single_class_re_made_build_is_not_compared_again(tmp_path, capsys):
    """gdn is one single-entry row: the model predicts restoring it as that row's own measurement, so the comparison
    would be the splice against the re-made build, which vs_splice (the table, the report) already makes."""
    folder = _folder(tmp_path)
    out, record = _budget(folder, capsys)
    e = _remade(record)["requantized-gdn"]
    assert e["predicted_kl"] == float(_scores()["gdn"].mean()) and "error_kl" not in e
    assert "its prediction is the row gdn's own measurement" in e["why"]
    assert (
        "requantized-gdn (gdn): not compared: its prediction is the row gdn's own measurement (one single-entry row), "
        "and the table's splice-against-re-quantize section pairs the two."
    ) in out.splitlines()


def test_a_combination_a_splice_row_measured_says_that_row_is_in_the_fit(tmp_path, capsys):
    """gdn+attention was spliced and measured, and it fits the across slope: the prediction for a re-made build of
    those two classes is that row's measurement here (one row, one slope), and the line says the row is in the fit."""
    out, record = _budget(_folder(tmp_path, remade=(PAIR,)), capsys)
    e = _remade(record)[PAIR]
    assert e["splice_row"] == "gdn+attention" and e["predicted_kl"] == pytest.approx(float(_scores()["gdn+attention"].mean()))
    assert e["error_kl"]["diff"] == pytest.approx(0.02, abs=0.01)
    assert out.splitlines()[-2].endswith("(row gdn+attention, which splices exactly these classes, is in the fit).")


def test_a_folder_without_re_made_builds_answers_as_before(tmp_path, capsys):
    """Without re-made rows, budget's text and budget.json are what they were: the re-made rows add only their own
    lines and their own key, and change no other figure."""
    plain, remade = _folder(tmp_path / "a", remade=()), _folder(tmp_path / "b")
    out_plain, rec_plain = _budget(plain, capsys)
    out_remade, rec_remade = _budget(remade, capsys)
    assert "requantized" not in rec_plain and "Re-made builds" not in out_plain and "requantized-" not in out_plain
    assert {k: v for k, v in rec_remade.items() if k != "requantized"} == rec_plain
    new = [x for x in out_remade.splitlines() if x.startswith(("Re-made builds", "requantized-"))]
    assert len(new) == 4
    kept = [x for x in out_remade.splitlines() if x not in new]
    assert kept == out_plain.replace(str(plain), str(remade)).splitlines()
    assert "Budget against re-quantize" not in report(plain)
    assert report(plain) == report(_folder(tmp_path / "c", remade=()))  # a budget.json without re-made rows: no sentence


def test_without_score_files_the_error_has_no_interval_and_says_why(tmp_path, capsys):
    folder = _folder(tmp_path, remade=(THREE,), scores=False)
    out, record = _budget(folder, capsys)
    e = _remade(record)[THREE]
    assert e["error_kl"]["ci"] is None and e["includes_0"] is None
    assert e["error_kl"]["diff"] == pytest.approx(e["measured_kl"] - e["predicted_kl"])
    rel = 100 * e["error_kl"]["diff"] / e["predicted_kl"]
    assert e["error_rel"] == {"diff": pytest.approx(rel / 100), "ci": None}
    assert (
        f"measured, error {e['error_kl']['diff']:+.4f}, {rel:+.1f} % of the prediction (no interval: neither "
        f"{folder / 'scores'} nor"
    ) in out


def test_report_quotes_budget_until_a_row_changes(tmp_path, capsys):
    folder = _folder(tmp_path)
    _, record = _budget(folder, capsys)
    e = _remade(record)[THREE]
    lo, hi = e["error_kl"]["ci"]
    p_kl = e["predicted_kl"]
    rel = f"{100 * e['error_kl']['diff'] / p_kl:+.1f} % of the prediction [{100 * lo / p_kl:+.1f}, {100 * hi / p_kl:+.1f}]"
    text = report(folder)
    assert (
        f"- Budget against re-quantize (attention, gdn, shared_expert in BF16, KL pooled over corpora): row {THREE} (the "
        f"build re-made by its quantizer) measured {e['measured_kl']:.4f} where budget predicts {e['predicted_kl']:.4f} "
        f"from the splice rows; error (measured minus predicted) {e['error_kl']['diff']:+.4f} [{lo:+.4f}, {hi:+.4f}], "
        f"{rel}, excludes 0: the re-made build leaves more KL than predicted."
    ) in text.splitlines()
    assert text.count("Budget against re-quantize") == 2  # the two multi-class builds; requantized-gdn is vs_splice's
    results = json.loads((folder / "results.json").read_text())
    for v in results["variants"]:
        if v["name"] == "attention":
            v["metrics"]["wiki-en"]["kl"] += 0.01  # the row rerun: the stored prediction no longer follows from the rows
    (folder / "results.json").write_text(json.dumps(results))
    text = report(folder)
    assert "Budget against re-quantize" not in text
    assert f"- {THREE}: budget.json's prediction for it was made before this folder's rows changed" in text


@pytest.mark.parametrize(
    "without, says",
    [
        ("gdn", "checkpoint.requantized_without is 'gdn', not a list of class names"),
        ([], "checkpoint.requantized_without is '[]', not a list of class names"),
        (["gdn", 3], "not a list of class names"),
    ],
)
def test_a_bad_requantized_without_is_one_line(tmp_path, capsys, without, says):
    def bad(v):
        if "checkpoint" in v:
            v["checkpoint"]["requantized_without"] = without
        return v

    folder = _folder(tmp_path, remade=(THREE,), edit=bad)
    capsys.readouterr()
    assert main(["budget", str(folder)]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1 and not (folder / "budget.json").exists()


def test_classes_no_single_entry_rows_make_up_are_named(tmp_path, capsys):
    def lm_head(v):
        if "checkpoint" in v:
            v["checkpoint"]["requantized_without"] = ["gdn", "lm_head"]
        return v

    out, record = _budget(_folder(tmp_path, remade=(THREE,), edit=lm_head), capsys)
    [e] = record["requantized"]
    assert "predicted_kl" not in e and "error_kl" not in e
    assert (
        f"{THREE} (gdn, lm_head): not compared: no single-entry rows make up lm_head: run a row restoring it (or a "
        "sweep of its layers)."
    ) in out.splitlines()


def test_kls_near_0002_print_three_significant_digits_and_the_error_as_a_share_of_the_prediction(tmp_path, capsys):
    """With KLs around 0.002 (the trained model's), four decimals printed "0.0021 predicted, 0.0021 measured, error
    +0.0000 [-0.0000, +0.0001]". The KLs get three significant digits, the error two of its largest end, and the
    error as a share of the prediction (its interval divided by the predicted KL: a fixed scale, no new estimate);
    budget.json keeps the raw numbers and adds the shares."""
    folder = _folder(tmp_path, scale=0.002)
    out, record = _budget(folder, capsys)
    two = _remade(record)[TWO]
    p_kl, m_kl, err = two["predicted_kl"], two["measured_kl"], two["error_kl"]
    assert 0.001 < p_kl < 0.01 and m_kl == pytest.approx(0.002 * float(_scores()[TWO].mean()))  # raw, not rounded
    assert two["error_rel"]["diff"] == pytest.approx(err["diff"] / p_kl)
    assert two["error_rel"]["ci"] == pytest.approx([c / p_kl for c in err["ci"]])
    line = next(x for x in out.splitlines() if x.startswith(f"{TWO} "))
    assert line.startswith(f"{TWO} (attention, shared_expert): {p_kl:.5f} predicted, {m_kl:.5f} measured, error ")
    assert not re.search(r"[-+]0\.0000\b", line)  # no interval end printed as a bare 0 (four decimals did)
    lo, hi = err["ci"]
    d = max(4, 1 - math.floor(math.log10(max(abs(err["diff"]), abs(lo), abs(hi)))))  # two significant digits
    rel = two["error_rel"]
    assert (
        f"error {err['diff']:+.{d}f} [{lo:+.{d}f}, {hi:+.{d}f}], {100 * rel['diff']:+.2f} % of the prediction "
        f"[{100 * rel['ci'][0]:+.2f}, {100 * rel['ci'][1]:+.2f}], includes 0: the prediction holds."
    ) in line
    text = report(folder)
    assert f"measured {m_kl:.5f} where budget predicts {p_kl:.5f} from the splice rows" in text


QUANTIZED = ["gdn", "attention", "shared_expert", "lm_head", "experts"]


def _other_classes(v):
    """THREE's quantizer also left lm_head in BF16 and quantized mtp, which the build keeps in BF16."""
    if v["name"] == THREE:
        v["checkpoint"]["quantized_classes"] = ["experts", "mtp"]
    elif "checkpoint" in v:
        v["checkpoint"]["quantized_classes"] = [c for c in QUANTIZED if c not in v["checkpoint"]["requantized_without"]]
    return v


def test_a_re_made_build_quantizing_other_classes_than_declared_gets_no_verdict(tmp_path, capsys):
    """vs_splice's note ("it quantizes experts, mtp, where the build without ... would quantize ...") is carried into
    budget's line, budget.json and report's sentence, and no verdict is stated: the re-made build is not the build with
    these classes restored, so "leaves more KL than predicted" would compare unlike things."""
    folder = _folder(tmp_path, edit=_other_classes, top={"quantized_classes": QUANTIZED})
    out, record = _budget(folder, capsys)
    e, two = _remade(record)[THREE], _remade(record)[TWO]
    note = "it quantizes experts, mtp, where the build without attention, gdn, shared_expert would quantize lm_head, experts"
    assert e["note"] == note and "note" not in two  # TWO quantizes what it declares
    assert e["error_kl"]["ci"][0] > 0  # the figures are kept: its interval excludes 0 ...
    line = next(x for x in out.splitlines() if x.startswith(f"{THREE} "))
    assert line.endswith(f"; no verdict, the comparison is not like for like: {note}.")
    assert "leaves more KL" not in line and "excludes 0" not in line  # ... but no verdict is drawn from it
    assert next(x for x in out.splitlines() if x.startswith(f"{TWO} ")).endswith("includes 0: the prediction holds.")
    sentence = next(x for x in report(folder).splitlines() if f"row {THREE} (the build re-made" in x)
    assert sentence.endswith(f"; no verdict, the comparison is not like for like: {note}.") and "leaves more" not in sentence


def test_budget_renders_report_md_and_table_md_again(tmp_path, capsys):
    """report.md quotes budget.json, so budget renders it (and table.md) again after writing budget.json, as mtp and
    tasks do: DIR/report.md is then what `splicer report DIR` prints, the budget sentences included."""
    folder = _folder(tmp_path)
    (folder / "report.md").write_text("stale\n")
    out, _ = _budget(folder, capsys)
    assert (folder / "report.md").read_text() == report(folder) and "Budget against re-quantize" in report(folder)
    assert (folder / "table.md").read_text().startswith("Build ")
    assert out.splitlines()[-1] == (
        f"Written: {folder / 'budget.json'}, and {folder / 'report.md'} and {folder / 'table.md'} rendered again with it."
    )


@pytest.mark.parametrize("command", ["budget", "table", "report"])
@pytest.mark.parametrize(
    "without, top, says",
    [
        ("gdn", None, "checkpoint.requantized_without is 'gdn', not a list of class names"),
        (["gdn", "gdn", "shared_expert"], None, "checkpoint.requantized_without names gdn twice"),
        (["nosuch"], None, "checkpoint.requantized_without names unknown class 'nosuch' (classes: gdn, attention,"),
        (
            ["nosuch"],
            {"quantized_classes": QUANTIZED},
            "names unknown class 'nosuch' (the build quantizes gdn, attention, shared_expert, lm_head, experts)",
        ),
        (["mtp"], {"quantized_classes": QUANTIZED}, "names mtp, which the build does not quantize (it quantizes gdn,"),
    ],
    ids=["a-string", "twice", "unknown", "unknown-of-the-build", "not-quantized"],
)
def test_a_hand_edited_requantized_without_is_refused_alike_by_every_reader(tmp_path, capsys, command, without, top, says):
    """results_record.load checks it, so budget, table and report refuse the same edit in the same line: before, the
    string "gdn" was refused by budget and shown by table and report (rc 0), a class named twice gave "no single-entry
    rows make up gdn, gdn, shared_expert" and an unknown one "run a row restoring it"."""

    def bad(v):
        if v["name"] == THREE:
            v["checkpoint"]["requantized_without"] = without
        return v

    folder = _folder(tmp_path, remade=(THREE,), edit=bad, top=top)
    capsys.readouterr()
    assert main([command, str(folder)]) == 2
    err = capsys.readouterr().err
    assert says in err and f"row '{THREE}'" in err and len(err.strip().splitlines()) == 1
    assert not (folder / "budget.json").exists() and not (folder / "report.md").exists()
