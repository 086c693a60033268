"""The command line never loses a file, never runs code from a checkpoint, never prints a name raw,
and ends every failure (corrupt input, full disk, Ctrl-C) with one line and the right exit status."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cli_checkpoints import Checkpoints, build
from reference import arange_tensor
from safetensors.torch import save_file

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


# -- a full disk, Ctrl-C ----------------------------------------------------------------------------

@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A file system of 256 KiB (a tmpfs; the test is skipped where mounting one is not allowed)."""
    where = tmp_path / "tiny"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


@pytest.mark.parametrize("to", ["hf", "dcp"])
def test_full_disk_is_one_line_and_leaves_nothing(tmp_path: Path, tiny_disk: Path, to: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "big.safetensors"
    save_file({f"w{i}": arange_tensor((127, 129)) for i in range(6)}, str(src))  # 393 KB
    status, line = one_line(capsys, ["convert", str(src), str(tiny_disk / "out"), "--to", to])
    assert status == 2 and line.startswith("shardsync convert: no space left on the device of "), line
    assert line.endswith("(free some space, or write to another directory)")
    assert list((tiny_disk / "out").iterdir()) == []


def _command(*argv: str) -> subprocess.Popen[str]:
    """``python -m shardsync ...`` with SIGINT as a terminal delivers it (a test runner may ignore it)."""
    return subprocess.Popen([sys.executable, "-m", "shardsync", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _interrupted(proc: subprocess.Popen[str], command: str) -> None:
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and err == f"shardsync{command}: interrupted\n", (proc.returncode, err)


def test_ctrl_c_while_starting(tmp_path: Path) -> None:
    proc = _command("inspect", str(tmp_path))
    time.sleep(0.3)  # importing torch takes longer
    proc.send_signal(signal.SIGINT)
    _interrupted(proc, "")


def _big_source(tmp_path: Path) -> Path:
    src = tmp_path / "big.safetensors"
    save_file({f"w{i}": torch.zeros(2**22) for i in range(48)}, str(src))  # 805 MB of zeros
    return src


def _interrupt_when(proc: subprocess.Popen[str], out: Path, pattern: str) -> None:
    deadline = time.monotonic() + 300
    while not (out.is_dir() and any(out.rglob(pattern))):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.001)
    proc.send_signal(signal.SIGINT)


@pytest.mark.parametrize("argv, pattern", [(["--to", "dcp"], "*.distcp"),
                                           (["--max-shard-size", "20MB"], "*.tmp")])
def test_ctrl_c_while_writing_leaves_nothing(tmp_path: Path, argv: list[str], pattern: str) -> None:
    out = tmp_path / "out"
    proc = _command("convert", str(_big_source(tmp_path)), str(out), *argv)
    _interrupt_when(proc, out, pattern)
    _interrupted(proc, " convert")
    assert sorted(p.name for p in out.iterdir()) == []
