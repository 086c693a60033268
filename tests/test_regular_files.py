"""Readers open only regular files: a FIFO, a device or a directory named like a checkpoint file, an
index entry or a mapping file is a clear error at once, never a read that blocks or has no end.

Cases that used to hang cannot hang the tests: command lines run with a timeout, and in process a
watchdog thread opens every FIFO's write end now and then, so a reader stuck on one gets end-of-file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import shardsync.mapping.program as program
from shardsync import save_hf
from shardsync.cli import main
from shardsync.errors import FormatError, MappingError
from shardsync.files import FileStamp, check_unchanged, file_kind, open_regular, read_bounded
from shardsync.mapping import Mapping
from shardsync.sources import DcpSource, open_source, read_layout

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")


@pytest.fixture(autouse=True)
def watchdog(tmp_path: Path) -> Iterator[None]:
    """Gives every FIFO under ``tmp_path`` a writer now and then, so that a reader stuck opening one
    (the bug) gets end-of-file and the test fails instead of hanging."""
    done = threading.Event()

    def release() -> None:
        while not done.wait(0.5):
            for fifo in (p for p in tmp_path.rglob("*") if p.is_fifo()):
                try:  # succeeds only while a reader has it open (or waits to)
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    yield
    done.set()
    thread.join()


def _run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardsync", *argv], capture_output=True, text=True, timeout=timeout)


def test_fifo_in_a_directory_without_index_is_refused_not_read(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "model-00001-of-00001.safetensors")
    with pytest.raises(FormatError) as err:
        read_layout(tmp_path)
    assert str(err.value) == (
        f"{tmp_path} holds *.safetensors names that are not regular files: "
        f"{tmp_path}/model-00001-of-00001.safetensors is a FIFO (named pipe), not a regular file "
        "(remove them, or pass the checkpoint's files by an index)"
    )


def test_fifo_beside_regular_files_is_refused(tmp_path: Path) -> None:
    save_file({"w": torch.arange(17.0)}, str(tmp_path / "a.safetensors"))
    os.mkfifo(tmp_path / "b.safetensors")
    with pytest.raises(FormatError, match=r"b\.safetensors is a FIFO \(named pipe\), not a regular file"):
        open_source(tmp_path)


def test_fifo_passed_as_the_checkpoint_is_named_as_such(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(FormatError) as err:
        open_source(tmp_path / "model.safetensors")
    assert str(err.value).startswith(
        f"{tmp_path}/model.safetensors is a FIFO (named pipe), not a checkpoint; pass a .safetensors file"
    )


def test_fifo_named_by_an_index_is_not_a_regular_file_not_missing(tmp_path: Path) -> None:
    save_file({"a": torch.arange(17.0)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    os.mkfifo(tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(FormatError) as err:
        read_layout(tmp_path)
    assert str(err.value) == (
        f"{tmp_path}/model.safetensors.index.json names files that cannot be read: "
        f"{tmp_path}/model-00002-of-00002.safetensors is a FIFO (named pipe), not a regular file"
    )


def test_index_that_is_a_fifo_is_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "model.safetensors.index.json")
    with pytest.raises(FormatError, match=r"index\.json is a FIFO \(named pipe\), not a regular file"):
        read_layout(tmp_path)


def test_cli_inspect_and_convert_of_a_fifo_directory_end_at_once(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "model.safetensors")
    for argv in (["inspect", str(tmp_path)], ["convert", str(tmp_path), str(tmp_path / "out")]):
        done = _run(argv)
        assert done.returncode == 2, done.stderr
        assert "model.safetensors is a FIFO (named pipe), not a regular file" in done.stderr
    assert not (tmp_path / "out").exists()


def test_mapping_file_that_is_a_fifo_or_a_device(tmp_path: Path) -> None:
    fifo = tmp_path / "map.txt"
    os.mkfifo(fifo)
    with pytest.raises(MappingError) as err:
        Mapping.parse(str(fifo))
    assert str(err.value) == (
        f"cannot read mapping file {str(fifo)!r}: {fifo} is a FIFO (named pipe), "
        "not a regular file; only regular files are read (a mapping file is a "
        "regular file of at most 16 MiB)"
    )
    with pytest.raises(MappingError, match="/dev/zero is a character device, not a regular file"):
        Mapping.parse("/dev/zero")


def test_cli_mapping_dev_zero_is_one_line(tmp_path: Path) -> None:
    save_file({"w": torch.arange(17.0)}, str(tmp_path / "model.safetensors"))
    done = _run(["convert", str(tmp_path), str(tmp_path / "out"), "--mapping", "/dev/zero"], timeout=60)
    assert done.returncode == 2
    assert done.stderr == (
        "shardsync convert: cannot read mapping file '/dev/zero': /dev/zero is a "
        "character device, not a regular file; only regular files are read (a mapping "
        "file is a regular file of at most 16 MiB) (fix the mapping)\n"
    )


def test_mapping_file_over_the_cap_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "map.txt"
    path.write_text("a -> b\n" * 20)  # 140 bytes
    monkeypatch.setattr(program, "MAX_MAPPING_BYTES", 127)
    with pytest.raises(
        MappingError,
        match=r"map\.txt holds 140 bytes, more than the 127 a file of its "
        "kind may hold",
    ):
        Mapping.parse(str(path))
    monkeypatch.setattr(program, "MAX_MAPPING_BYTES", 140)
    assert len(Mapping.parse(str(path)).statements) == 20


def test_layout_json_that_is_a_fifo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "layout.json"
    os.mkfifo(fifo)
    assert main(["explain", str(fifo)]) == 2
    assert f"{fifo} is a FIFO (named pipe), not a regular file" in capsys.readouterr().err


def test_dcp_data_file_that_is_a_fifo(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(17.0)}, checkpoint_id=str(tmp_path), no_dist=True)
    (data,) = tmp_path.glob("*.distcp")
    data.unlink()
    os.mkfifo(data)
    with pytest.raises(FormatError) as err:
        DcpSource(tmp_path)
    assert str(err.value) == (
        f"{tmp_path}: the DCP metadata names data files that are not regular files: "
        f"{data.name} (a FIFO (named pipe)); only regular files are read"
    )


def test_open_regular_and_read_bounded(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(bytes(range(127)))
    fh, stamp = open_regular(f)
    with fh:
        assert fh.read() == bytes(range(127))
    assert stamp == FileStamp.of(os.stat(f))
    assert read_bounded(f, 127) == bytes(range(127))
    with pytest.raises(FormatError, match="holds 127 bytes, more than the 126"):
        read_bounded(f, 126)
    with pytest.raises(FormatError, match="does not exist"):
        open_regular(tmp_path / "nothing")
    with pytest.raises(FormatError, match="is a directory, not a regular file"):
        open_regular(tmp_path)
    assert file_kind(os.stat("/dev/null")) == "a character device"
    check_unchanged(f, stamp)


def test_output_index_that_is_a_fifo_is_refused_before_writing(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "model.safetensors.index.json")
    with pytest.raises(FormatError) as err:
        save_hf({"w": torch.arange(17.0)}, tmp_path, overwrite=True)
    assert str(err.value) == (
        f"{tmp_path} holds model.safetensors.index.json (a FIFO (named pipe)), "
        "where the checkpoint's files go, and not as a regular file; remove it, "
        "or choose another directory"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors.index.json"]
