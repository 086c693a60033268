"""The command line never loses a file, never runs code from a checkpoint, never prints a name raw,
and ends every failure (corrupt input, full disk, Ctrl-C) with one line and the right exit status."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_checkpoints import Checkpoints, build
from reference import arange_tensor

import shardsync
from shardsync.cli import main
from shardsync.io import read_tensors, save_safetensors


@pytest.fixture(scope="module")
def ck(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return build(tmp_path_factory.mktemp("ckpts"))


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    status = main(argv)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return status, err.strip()


@pytest.mark.parametrize("argv", [["convert", "{single}", ""], ["convert", "", "out"], ["inspect", ""],
                                  ["diff", "{single}", ""], ["plan", ""], ["explain", ""],
                                  ["convert", "{single}", "out", "--config-from", ""]])
def test_empty_paths_are_refused(ck: Checkpoints, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    monkeypatch.chdir(tmp_path)
    save_safetensors([("w", torch.ones(2))], tmp_path, max_shard_bytes=4)  # a checkpoint right here
    before = snapshot(tmp_path)
    status, line = one_line(capsys, [a.format(single=ck.single) for a in argv])
    assert status == 2 and "an empty path names the working directory; give the path" in line
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("fmt", ["single", "sharded", "dcp"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_convert_into_its_own_source_directory_is_refused(ck: Checkpoints, tmp_path: Path, fmt: str,
                                                          overwrite: bool,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    src = tmp_path / "src"
    shutil.copytree(ck.all[fmt], src)
    before = snapshot(src)
    for to in ("hf", "dcp"):
        argv = ["convert", str(src), str(src / "."), "--to", to] + ["--overwrite"] * overwrite
        status, line = one_line(capsys, argv)
        assert status == 2 and "the output would replace the files being read (write to another " \
                               "directory)" in line
    assert snapshot(src) == before


def test_convert_keeps_an_index_less_set(ck: Checkpoints, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    old = {f"w{i}": arange_tensor((17,), start=100 * i) for i in range(5)}
    out = tmp_path / "out"
    shardsync.save_hf(old, out, max_shard_size=150)
    (out / "model.safetensors.index.json").unlink()
    before = snapshot(out)
    status, line = one_line(capsys, ["convert", str(ck.single), str(out)])
    assert status == 2 and "already holds a checkpoint (model-00001-of-00003.safetensors)" in line
    assert snapshot(out) == before
    assert main(["convert", str(ck.single), str(out), "--overwrite", "-q"]) == 0
    assert sorted(read_tensors(out)) == sorted(read_tensors(ck.single))
