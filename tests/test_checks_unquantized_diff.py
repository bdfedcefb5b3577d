"""scripts/checks/unquantized_diff.py and offset_norm_roundtrip.py: results/trained-h200/norm-roundtrip/ comes from them."""

import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

CHECKS = Path(__file__).resolve().parent.parent / "scripts" / "checks"


def run(script: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECKS / script), *map(str, args)], capture_output=True, text=True)


def offset_roundtrip(w: torch.Tensor) -> torch.Tensor:
    return ((1.0 + w.float()).to(torch.bfloat16).float() - 1.0).to(torch.bfloat16)


def pair(tmp_path: Path) -> tuple[Path, Path]:
    g = torch.Generator().manual_seed(0)
    norm = (torch.randn(64, generator=g) * 0.02).to(torch.bfloat16)
    lin = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    base = {
        "model.layers.0.input_layernorm.weight": norm,
        "model.layers.1.input_layernorm.weight": norm.clone(),
        "model.embed_tokens.weight": lin.clone(),
        "model.layers.0.mlp.down_proj.weight": lin.clone(),
    }
    build = {
        "model.layers.0.input_layernorm.weight": offset_roundtrip(norm),
        "model.layers.1.input_layernorm.weight": offset_roundtrip(norm),
        "model.embed_tokens.weight": lin.clone(),
        # quantized: its packed weight and scale are not compared
        "model.layers.0.mlp.down_proj.weight_packed": torch.zeros(8, 8, dtype=torch.int32),
        "model.layers.0.mlp.down_proj.weight_scale": torch.ones(8, 1, dtype=torch.bfloat16),
    }
    for folder, tensors in (("base", base), ("build", build)):
        (tmp_path / folder).mkdir()
        save_file(tensors, str(tmp_path / folder / "model.safetensors"))
    return tmp_path / "build", tmp_path / "base"


def test_diff_groups_the_changed_norms_and_skips_quantized(tmp_path):
    build, base = pair(tmp_path)
    r = run("unquantized_diff.py", build, base)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(line.startswith("model.layers.N.input_layernorm.weight ") and " 2 " in line for line in lines)
    assert "embed_tokens" not in r.stdout and "down_proj" not in r.stdout
    assert "summary: 3 unquantized tensors in both; 2 differ in value (1 patterns)" in r.stdout


def test_roundtrip_verdict(tmp_path):
    build, base = pair(tmp_path)
    r = run("offset_norm_roundtrip.py", build, base)
    assert r.returncode == 0, r.stderr
    assert "summary: 0 equal to base; 2 equal to round trip, not base; 0 neither" in r.stdout
    r = run("offset_norm_roundtrip.py", base, base)
    assert "summary: 2 equal to base; 0 equal to round trip, not base; 0 neither" in r.stdout


def test_bad_folder_is_one_line(tmp_path):
    r = run("unquantized_diff.py", tmp_path / "missing", tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not a folder" in r.stderr
