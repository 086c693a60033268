"""docs/sources.md: its single-process examples run as written, in order, in a fresh directory."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from shardsync.cli import main

# dcp.save(no_dist=True) warns that it runs in one process, which is what these tests want
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

DOC = Path(__file__).parents[1] / "docs" / "sources.md"


def test_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    outputs = []
    for lang, code in re.findall(r"```(python|sh)\n(.*?)```", DOC.read_text(), re.S):
        if code.startswith("# torchrun"):
            continue  # needs a process group; the same path is tested in tests/test_sources_dcp.py
        if lang == "python":
            exec(compile(code, str(DOC), "exec"), {"__name__": "__doc_example__"})
        for line in code.splitlines() if lang == "sh" else ():
            args = shlex.split(line, comments=True)
            if args[0] == "shardsync":
                assert main(args[1:] + (["-q"] if args[1] == "export" else [])) == 0
            else:
                subprocess.run(["bash", "-c", line], check=True)
        outputs.append(capsys.readouterr().out)
    assert outputs[0].splitlines() == ["k [3, 3]", "norm [3]", "q [6, 3]", "v [3, 3]", "156",
                                       "[[7.0, 8.0], [10.0, 11.0], [13.0, 14.0]]"]
    assert outputs[1].splitlines() == ["['model.norm', 'model.w', 'optim.w.exp_avg']",
                                       "norm torch.Size([3])", "wt torch.Size([3, 5])"]
    assert outputs[2].splitlines()[0] == "model.norm  [3] float32  (1 piece from model.norm)"
    assert sorted(load_file(tmp_path / "hf_split/model.safetensors")) == ["k", "norm", "q", "v"]
    assert sorted(load_file(tmp_path / "hf_from_dcp/model.safetensors")) == [
        "model.norm", "model.w", "optim.w.exp_avg"]
