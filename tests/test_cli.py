"""The command line: explain and export on safetensors checkpoints, errors as exit status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reference import arange_tensor
from safetensors.torch import load_file

from shardsync.cli import main
from shardsync.io import save_safetensors


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    save_safetensors([("qkv", arange_tensor((12, 3))), ("norm", arange_tensor((3,), torch.bfloat16))],
                     src)
    (tmp_path / "m.txt").write_text("qkv -> q, k, v, fused_qkv, num_heads=2, num_key_value_groups=1, "
                                    "axis=0\nnorm -> model.norm\n")
    return tmp_path


def test_explain_prints_pieces(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", str(ckpt / "src"), "-m", str(ckpt / "m.txt")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "k  [3, 3] float32  (1 piece from qkv)"
    assert out[1] == "    qkv[6:9, 0:3] -> [0:3, 0:3]"
    assert out[-1] == "4 targets, 0.00 MiB"


def test_export_writes_mapped_safetensors(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = ckpt / "hf"
    assert main(["export", str(ckpt / "src"), str(out_dir), "-m", str(ckpt / "m.txt"), "-q"]) == 0
    assert "wrote 4 tensors" in capsys.readouterr().out
    got = load_file(out_dir / "model.safetensors")
    qkv = arange_tensor((12, 3))
    assert torch.equal(got["q"], qkv[0:6]) and torch.equal(got["v"], qkv[9:12])
    assert torch.equal(got["model.norm"], arange_tensor((3,), torch.bfloat16))


def test_errors_exit_2_with_the_message(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (ckpt / "bad.txt").write_text("qkvv -> q\n")
    assert main(["explain", str(ckpt / "src"), "-m", str(ckpt / "bad.txt")]) == 2
    err = capsys.readouterr().err
    assert "unknown name 'qkvv'; did you mean 'qkv'?" in err
    assert main(["export", str(ckpt / "nope"), str(ckpt / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_module_entry_point(ckpt: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "shardsync", "explain", str(ckpt / "src")],
                         capture_output=True, text=True, check=True)
    assert run.stdout.splitlines()[0] == "norm  [3] bfloat16  (1 piece from norm)"
