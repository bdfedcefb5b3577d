"""scripts/compare_runs.py: results/ray-h200's comparisons come from it. Synthetic folders with known differences."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from .scripts_import import load_script


def _module():
    return load_script("scripts/compare_runs.py")


def _folder(root: Path, name: str, kl: dict, decode: dict, noisy_chat: dict | None = None) -> Path:
    """A results folder with rows build, gdn, build-again: per-position scores on 'text' (the same in every folder)
    and 'chat' (a row's KL plus noisy_chat[row] at one position), and each row's pooled KL and decode ms/token."""
    out = root / name
    variants = []
    for row, k in kl.items():
        d = out / "scores" / row
        d.mkdir(parents=True)
        base = torch.full((8,), k)
        save_file({"kl_top": base.clone(), "seq_index": torch.zeros(8, dtype=torch.int32)}, str(d / "text.safetensors"))
        chat = base.clone()
        chat[3] += (noisy_chat or {}).get(row, 0.0)
        save_file({"kl_top": chat, "seq_index": torch.zeros(8, dtype=torch.int32)}, str(d / "chat.safetensors"))
        variants.append(
            {
                "name": row,
                "status": "ok",
                "restored": ["gdn"] if row == "gdn" else [],
                **({"repeat_of": "build"} if row.startswith("build-") else {}),  # as ablate records the build's repeats
                "metrics": {"text": {"kl": k}, "chat": {"kl": float(chat.mean())}},
                "timing": {"decode_ms_per_token": decode[row]},
            }
        )
    (out / "results.json").write_text(json.dumps({"variants": variants}))
    return out


def test_identical_corpora_engine_noise_and_decode_are_told_apart(tmp_path):
    m = _module()
    kl = {"build": 1.0, "gdn": 0.5, "build-again": 1.0}
    a = _folder(tmp_path, "a", kl, {"build": 2.0, "gdn": 2.1, "build-again": 2.02}, {"build-again": 0.08})
    b = _folder(tmp_path, "b", kl, {"build": 2.0, "gdn": 2.163, "build-again": 2.0}, {"gdn": 0.16})
    c = m.compare({"a": a, "b": b})
    ya = c["yardsticks"]["a"]
    assert ya["build_engines"] == ["build", "build-again"]
    assert ya["repeatable"] == {"chat": False, "text": True}  # a's two build engines differ on chat only
    assert abs(ya["build_metric_gaps"]["chat"]["kl"] - 0.01) < 1e-6  # 0.08 at one position of 8
    assert abs(ya["build_decode_spread_rel"] - 0.01) < 1e-9
    assert c["yardsticks"]["b"]["repeatable"] == {"chat": True, "text": True}
    (pair,) = c["pairs"]
    assert pair["identical_per_corpus"] == {"chat": False, "text": True}
    rows = {r["row"]: r for r in pair["rows"]}
    assert rows["gdn"]["scores_differ"] == {"chat": ["kl_top: 1 of 8 values differ (max |diff| 0.16)"]}
    assert "build" not in rows["build"]["scores_differ"] and rows["build"]["scores_differ"] == {}
    assert abs(rows["gdn"]["decode_rel_diff"] - 0.03) < 1e-9
    assert abs(pair["max_abs_decode_rel_diff"] - 0.03) < 1e-9
    assert abs(pair["max_metric_gaps"]["chat"]["kl"] - 0.02) < 1e-6
    lines = m.summary(c)
    assert "a: build engines build, build-again; bit-identical on text; not on chat" in lines[0]
    assert "a vs b: every row bit-identical on text; differs on chat" in lines[-1]
    assert "decode differs by at most 3.00 %" in lines[-1]


def test_a_lanes_build_rows_are_compared_with_the_other_folders_build(tmp_path):
    m = _module()
    a = _folder(tmp_path, "a", {"build": 1.0, "gdn": 0.5}, {"build": 2.0, "gdn": 2.0})
    b = _folder(
        tmp_path, "b", {"build": 1.0, "gdn": 0.5, "build-end-ray1": 1.0}, {"build": 2.0, "gdn": 2.0, "build-end-ray1": 2.0}
    )
    rows = {r["row"]: r for r in m.compare({"a": a, "b": b})["pairs"][0]["rows"]}
    lane = rows["build / build-end-ray1"]
    assert lane["vs"] == ["build", "build-end-ray1"] and lane["scores_differ"] == {}
    assert "decode_rel_diff" not in lane  # another engine of the build: not a row's own decode
    assert set(rows) == {"build", "gdn", "build / build-end-ray1"}


def test_bad_arguments_exit_with_one_line(tmp_path, capsys):
    m = _module()
    assert m.main([str(tmp_path), "b=" + str(tmp_path)]) == 2
    assert "is not NAME=DIR" in capsys.readouterr().err
    assert m.main(["a=" + str(tmp_path), "b=" + str(tmp_path)]) == 2
    assert "has no results.json" in capsys.readouterr().err


def test_effect_over_alternating_repeats_has_a_t_interval(tmp_path, capsys):
    m = _module()
    kl = {"build": 1.0, "gdn": 0.5}
    folders = {}
    for i, (da, db) in enumerate([(2.0, 2.02), (2.0, 2.04), (2.0, 2.03)], start=1):
        folders[f"plain-{i}"] = _folder(tmp_path, f"plain-{i}", kl, {"build": 2.0, "gdn": da})
        folders[f"ray-{i}"] = _folder(tmp_path, f"ray-{i}", kl, {"build": 2.0, "gdn": db})
    e = m.compare(folders, ("plain", "ray"))["effect"]
    assert e["repeats"] == [1, 2, 3]
    d = e["rows"]["gdn"]["decode_rel"]
    assert d["values"] == pytest.approx([0.01, 0.02, 0.015])
    assert d["mean"] == pytest.approx(0.015)
    half = 4.303 * 0.005 / 3**0.5  # t(2) times the standard error of the three differences
    assert d["ci"] == pytest.approx([0.015 - half, 0.015 + half]) and d["excludes_0"]
    assert e["rows"]["build"]["decode_rel"]["excludes_0"] is False  # no difference at all: 0 inside [0, 0]
    assert e["rows"]["gdn"]["kl"]["text"]["mean"] == 0
    args = [f"{n}={p}" for n, p in folders.items()]
    assert m.main([*args, "--effect", "plain", "ray"]) == 0
    assert "ray minus plain, gdn: decode +1.50 %" in capsys.readouterr().out
    assert m.main([*args, "--effect", "plain", "gpus"]) == 2
    assert "no folders named plain-N with a gpus-N beside them" in capsys.readouterr().err
