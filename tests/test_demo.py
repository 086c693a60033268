"""`make demo` end to end: 2 gloo ranks stream a TP=2 Megatron-style Llama to HF safetensors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))


def test_demo_writes_and_verifies(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    import demo

    demo.main(["--out", str(tmp_path)])
    out = capfd.readouterr().out  # printed by the spawned rank 0
    assert "verified: all 39 tensors equal the unsharded reference" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("model.")}
    assert rows["model.layers.*.self_attn.k_proj.weight"][:3] == ["4", "[64,", "256]"]
    assert rows["model.layers.*.self_attn.k_proj.weight"][-1] == "yes"
    assert (tmp_path / "model.safetensors").exists()
