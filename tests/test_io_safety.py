"""Nothing is ever lost: what the reader would read is a checkpoint, nothing is removed before every
check passed, empty paths are refused, and a save killed at any instant (SIGKILL, in a spawned
process) leaves bytes only under names the writer chose, which the next save removes. The killed
saves run in children of :class:`crash_helpers.Crasher` (never a fork of pytest)."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardsync
from crash_helpers import Crasher
from reference import arange_tensor
from shardsync.errors import FormatError, MappingError
from shardsync.io import commit, save_safetensors
from shardsync.io.commit import CheckpointNames, scan
from shardsync.io.safetensors_file import SafetensorsFile
from shardsync.sources import read_tensors

NAMES = CheckpointNames()


def checkpoint(n: int, start: int, numel: int = 17) -> dict[str, torch.Tensor]:
    return {f"layers.{i}.w": arange_tensor((numel,), torch.float32, start=start + 1000 * i) for i in range(n)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def index_less_set(d: Path) -> dict[str, torch.Tensor]:
    """Three files ``model-0000k-of-00003.safetensors`` without their index."""
    old = checkpoint(5, 0)
    save_safetensors(list(old.items()), d, max_shard_bytes=150)
    (d / NAMES.index).unlink()
    assert sorted(p.name for p in d.iterdir()) == [NAMES.shard(i, 3) for i in (1, 2, 3)]
    return old


def test_index_less_set_is_a_checkpoint(tmp_path: Path) -> None:
    old = index_less_set(tmp_path)
    before = snapshot(tmp_path)
    assert same(read_tensors(tmp_path), old)  # shardsync's own reader reads it...
    state = scan(tmp_path, NAMES)  # ... so the writer protects it
    assert state.committed == tuple(NAMES.shard(i, 3) for i in (1, 2, 3)) and state.leftovers == ()
    with pytest.raises(FormatError, match="already holds a checkpoint"):
        save_safetensors([("x", torch.zeros(3))], tmp_path)
    with pytest.raises(FormatError, match="already holds a checkpoint"):
        shardsync.save_hf({"x": torch.zeros(3)}, tmp_path)
    assert snapshot(tmp_path) == before


def test_incomplete_set_without_index_is_leftovers(tmp_path: Path) -> None:
    index_less_set(tmp_path)
    (tmp_path / NAMES.shard(2, 3)).unlink()
    assert scan(tmp_path, NAMES) == commit.DirectoryState((), (NAMES.shard(1, 3), NAMES.shard(3, 3)))


@pytest.mark.parametrize("limit", [150, 10**6])
def test_overwrite_of_index_less_set(tmp_path: Path, limit: int) -> None:
    index_less_set(tmp_path)
    new = checkpoint(4, 7)
    save_safetensors(list(new.items()), tmp_path, max_shard_bytes=limit, overwrite=True)
    assert same(read_tensors(tmp_path), new)
    assert {p.name for p in tmp_path.iterdir()} == set(scan(tmp_path, NAMES).committed)


def _save_and_die(d: str, limit: int, kill_at: int) -> None:
    """In a crash child: save, SIGKILLing this process right after commit stage ``kill_at``."""
    calls = [0]

    def hook(stage: str) -> None:
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        calls[0] += 1

    commit.stage_hook = hook
    save_safetensors(list(checkpoint(4, 7).items()), d, max_shard_bytes=limit, overwrite=True)


def test_overwrite_of_index_less_set_killed_at_every_stage(tmp_path: Path, crasher: Crasher) -> None:
    """Two files over three without an index: the new files must stay unseen until the commit."""
    old, new = index_less_set(tmp_path / "template"), checkpoint(4, 7)
    stages: list[str] = []
    dry = tmp_path / "dry"
    index_less_set(dry)
    commit.stage_hook = stages.append
    try:
        save_safetensors(list(new.items()), dry, max_shard_bytes=150, overwrite=True)
    finally:
        commit.stage_hook = None
    commit_at = stages.index("committed")
    assert "indexed the old files" in stages[:commit_at]
    for k in range(len(stages)):
        d = tmp_path / f"kill{k}"
        index_less_set(d)
        status = crasher.run(_save_and_die, str(d), 150, k)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, stages[k]
        assert same(read_tensors(d), new if k >= commit_at else old), f"killed after {stages[k]!r}"
        save_safetensors(list(new.items()), d, max_shard_bytes=150, overwrite=True)
        assert same(read_tensors(d), new)
        assert {p.name for p in d.iterdir()} == set(scan(d, NAMES).committed), stages[k]


LEFTOVERS = {
    ".model.0a1b2c3d.00001.tmp": b"half a file",
    "model-00001-of-00004.safetensors": b"a member of a set that was never finished",
    "model-00002-of-00003-0a1b2c3d.safetensors": b"renamed, then killed before its index",
}


def _with_leftovers(d: Path) -> dict[str, bytes]:
    shardsync.save_hf(checkpoint(3, 0), d)
    for name, data in LEFTOVERS.items():
        (d / name).write_bytes(data)
    assert set(scan(d, NAMES).leftovers) == set(LEFTOVERS)
    return snapshot(d)


@pytest.mark.parametrize(
    "bad",
    [
        dict(mapping="layers.0.w -> a\nlayers.9.w -> b"),  # a source that does not exist
        dict(max_file_size="5 parsecs"),
        dict(extra_files=["no/such/config.json"]),
    ],
)
def test_save_hf_removes_nothing_before_every_check_passed(tmp_path: Path, bad: dict) -> None:
    before = _with_leftovers(tmp_path)
    with pytest.raises((MappingError, FormatError)):
        shardsync.save_hf(checkpoint(3, 100), tmp_path, overwrite=True, **bad)
    assert snapshot(tmp_path) == before


def test_leftovers_go_with_the_commit(tmp_path: Path) -> None:
    _with_leftovers(tmp_path)
    new = checkpoint(3, 100)
    shardsync.save_hf(new, tmp_path, overwrite=True)
    assert same(read_tensors(tmp_path), new) and sorted(p.name for p in tmp_path.iterdir()) == [NAMES.single]


@pytest.mark.parametrize(
    "save",
    [
        lambda s, d: shardsync.save_hf(s, d),
        lambda s, d: shardsync.save(s, d),
        lambda s, d: save_safetensors(list(s.items()), d),
    ],
)
def test_empty_output_path_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, save) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"someone else's file")
    with pytest.raises(FormatError, match="empty"):
        save({"w": torch.ones(3)}, "")
    assert snapshot(tmp_path) == {"model.safetensors": b"someone else's file"}


def _save_torn(d: str, writer: str, tensors: int) -> None:
    """In a crash child: save 2 files of three 4 MiB tensors, SIGKILLed right after the writer thread
    put ``tensors`` tensors into their files (the file being written is torn: its header and one of
    its three tensors)."""
    original = SafetensorsFile.write
    count = [0]

    def write(self: SafetensorsFile, name: str, tensor: torch.Tensor) -> None:
        original(self, name, tensor)
        count[0] += 1
        if count[0] == tensors:
            os.kill(os.getpid(), signal.SIGKILL)

    SafetensorsFile.write = write  # type: ignore[method-assign]
    _save_big(d, writer, 3 * 2**22)


def _save_big(d: str, writer: str, limit: int = 2**22) -> None:
    """Six tensors of 4 MiB, in files of ``limit`` bytes (one tensor each by default)."""
    new = checkpoint(6, 0, numel=2**20)
    if writer == "save_hf":
        shardsync.save_hf(new, d, max_file_size=limit, overwrite=True)
    else:
        save_safetensors(list(new.items()), d, max_shard_bytes=limit, overwrite=True)


def _after_kill_then_save(d: Path, old: dict[str, torch.Tensor], writer: str) -> None:
    """The killed save left the old checkpoint (or the new), only names the writer chose, and the next
    save leaves nothing but its checkpoint."""
    got = read_tensors(d)
    assert same(got, old) or same(got, checkpoint(6, 0, numel=2**20))
    for f in scan(d, NAMES).committed:  # each file loads with safetensors itself
        assert f.endswith(".json") or load_file(d / f)
    assert all(NAMES.is_own(p.name) for p in d.iterdir()), sorted(p.name for p in d.iterdir())
    _save_big(str(d), writer)
    assert same(read_tensors(d), checkpoint(6, 0, numel=2**20))
    assert {p.name for p in d.iterdir()} == set(scan(d, NAMES).committed)


@pytest.mark.parametrize("writer", ["save_safetensors", "save_hf"])
@pytest.mark.parametrize("tensors", [1, 4])
def test_killed_mid_file(tmp_path: Path, writer: str, tensors: int, crasher: Crasher) -> None:
    old = checkpoint(2, 5)
    shardsync.save_hf(old, tmp_path)
    status = crasher.run(_save_torn, str(tmp_path), writer, tensors)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    temps = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert temps and all(p.is_file() for p in temps)  # killed with a file half written: no work directory
    _after_kill_then_save(tmp_path, old, writer)


def test_leftovers_of_the_old_writer_are_removed(tmp_path: Path) -> None:
    """Earlier versions of shardsync wrote each file through safetensors' own temporary file, in a work
    directory of its own; a save killed then left that directory, which the next save removes."""
    old = checkpoint(2, 5)
    shardsync.save_hf(old, tmp_path)
    work = tmp_path / ".model.0a1b2c3d.00001.dir.tmp"
    work.mkdir()
    (work / ".tmpAbCdEf").write_bytes(b"torn")
    (tmp_path / ".model.0a1b2c3d.00001.tmp").write_bytes(b"torn")
    assert scan(tmp_path, NAMES).leftovers == (".model.0a1b2c3d.00001.dir.tmp", ".model.0a1b2c3d.00001.tmp")
    shardsync.save_hf(checkpoint(6, 0, numel=2**20), tmp_path, max_file_size=2**22, overwrite=True)
    assert {p.name for p in tmp_path.iterdir()} == set(scan(tmp_path, NAMES).committed)


@pytest.mark.parametrize("writer", ["save_safetensors", "save_hf"])
def test_killed_at_random_instants(tmp_path: Path, writer: str, crasher: Crasher) -> None:
    rng = random.Random(19)
    old = checkpoint(2, 5)
    for k in range(6):
        d = tmp_path / f"kill{k}"
        shardsync.save_hf(old, d)
        pid = crasher.start(_save_big, str(d), writer)
        time.sleep(rng.uniform(0.0, 1.0))  # the child saves at once (torch is imported) for about a second
        os.kill(pid, signal.SIGKILL)
        crasher.wait(pid)
        _after_kill_then_save(d, old, writer)
