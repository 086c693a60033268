"""save: torch DCP checkpoints from boxes of any shape (uneven TP shards on 2 gloo ranks), read back by
``torch.distributed.checkpoint.load`` into full tensors and into differently sharded DTensors."""

from __future__ import annotations

import os
import signal
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardsync
from crash_helpers import Crasher
from multiproc import run_ranks, run_ranks_one_dies
from reference import arange_tensor
from shardsync import LocalShard, shard_dim
from shardsync.errors import FormatError, LayoutError
from shardsync.io import dcp_writer
from shardsync.sources.dcp_metadata import read_metadata


def full_state(start: int = 0) -> dict[str, torch.Tensor]:
    return {
        "w": arange_tensor((17, 6), start=start),
        "o": arange_tensor((5, 13), start=start + 500),
        "norm": arange_tensor((7,), torch.bfloat16, start=start),
        "experts": arange_tensor((6, 10), start=start),
        "step": torch.tensor(start + 7),
    }


def boxes(t: torch.Tensor, *spec: tuple[tuple[int, int], tuple[int, int]]) -> list[LocalShard]:
    """Shards of ``t`` at ``((row, col), (rows, cols))``."""
    return [LocalShard(t[r : r + h, c : c + w], t.shape, (r, c)) for (r, c), (h, w) in spec]


def rank_state(rank: int, start: int = 0) -> dict:
    """Rows of w and columns of o cut unevenly (9/8, 7/6); norm and step replicated; experts as
    blocks of different shapes, two of them on rank 0."""
    full = full_state(start)
    experts = (
        boxes(full["experts"], ((0, 0), (3, 4)), ((3, 0), (3, 10)))
        if rank == 0
        else boxes(full["experts"], ((0, 4), (3, 6)))
    )
    return {
        "w": shard_dim(full["w"], 0, rank, 2),
        "o": shard_dim(full["o"], 1, rank, 2),
        "norm": full["norm"],
        "experts": experts,
        "step": full["step"],
    }


def load_full(path: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: torch.full_like(v, -1) for k, v in like.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(out, checkpoint_id=str(path))
    return out


def _dcp_worker(rank: int, world: int, out: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    shardsync.save(rank_state(rank), out)
    try:
        shardsync.save(rank_state(rank), out)
        refused = None
    except FormatError as exc:
        refused = str(exc)
    shardsync.save(rank_state(rank, start=1000), out, overwrite=True)
    mesh = init_device_mesh("cpu", (2,))
    targets = {
        "w": distribute_tensor(torch.zeros(17, 6), mesh, [Shard(1)]),
        "experts": distribute_tensor(torch.zeros(6, 10), mesh, [Shard(1)]),
        "o": distribute_tensor(torch.zeros(5, 13), mesh, [Shard(0)]),
    }
    dcp.load(targets, checkpoint_id=out)
    return {
        "refused": refused,
        "resharded": {k: v.full_tensor() for k, v in targets.items()},
        "local_w": targets["w"].to_local().shape,
    }


def test_uneven_shards_on_two_ranks_load_anywhere(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "notes.txt").write_text("not ours")
    results = run_ranks(_dcp_worker, 2, str(out))
    expect = full_state(1000)
    for r in results:
        assert r["refused"] is not None and "already holds a DCP checkpoint" in r["refused"]
        assert all(torch.equal(v, expect[k]) for k, v in r["resharded"].items())
    assert [r["local_w"] for r in results] == [torch.Size([17, 3])] * 2
    back = load_full(out, expect)
    assert all(torch.equal(back[k], expect[k]) and back[k].dtype == expect[k].dtype for k in expect)
    names = sorted(p.name for p in out.iterdir())  # the first generation's files are gone
    tag = names[1].split("_")[2]
    assert names == [".metadata", f"__{tag}_0_0.distcp", f"__{tag}_1_0.distcp", "notes.txt"]


def test_one_process_boxes_are_chunks(tmp_path: Path) -> None:
    full = arange_tensor((17, 5))
    state = {"w": boxes(full, ((0, 0), (9, 5)), ((9, 0), (8, 2)), ((9, 2), (8, 3))), "b": torch.arange(3)}
    metadata = shardsync.save(state, tmp_path)
    chunks = metadata.state_dict_metadata["w"].chunks
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks) == [
        ((0, 0), (9, 5)),
        ((9, 0), (8, 2)),
        ((9, 2), (8, 3)),
    ]
    back = load_full(tmp_path, {"w": full, "b": torch.arange(3)})
    assert torch.equal(back["w"], full) and torch.equal(back["b"], torch.arange(3))


@pytest.mark.parametrize(
    "shards, message",
    [
        ([((0, 0), (9, 5)), ((8, 0), (9, 5))], r"'w': shard \[0:9, 0:5\] on ranks \[0\] overlaps shard \[8:17, 0:5\]"),
        ([((0, 0), (9, 5))], r"'w': box \[9:17, 0:5\] is not covered"),
    ],
)
def test_bad_boxes_are_refused_before_writing(tmp_path: Path, shards: list, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        shardsync.save({"w": boxes(arange_tensor((17, 5)), *shards)}, tmp_path / "out")
    assert not (tmp_path / "out" / ".metadata").exists()


def test_path_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(FormatError, match="is a file"):
        shardsync.save({"w": torch.zeros(2)}, tmp_path / "f")


def save_killed_before(new: dict[str, torch.Tensor], path: Path, kill_before: str) -> None:
    """Save, dying by SIGKILL just before the .metadata rename, or just after it (in a crash child)."""

    def die(*args: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    target = (
        ("rename", dcp_writer._ReplacingFileSystem)
        if kill_before == "commit"
        else ("_remove_old_generation", dcp_writer)
    )
    with mock.patch.object(target[1], target[0], die):
        shardsync.save(new, path, overwrite=True)


@pytest.mark.parametrize("kill_before", ["commit", "removal"])
def test_killed_save_leaves_old_or_new(tmp_path: Path, kill_before: str, crasher: Crasher) -> None:
    old, new = {"w": arange_tensor((17, 3))}, {"w": arange_tensor((17, 3), start=1000)}
    shardsync.save(old, tmp_path)
    status = crasher.run(save_killed_before, new, tmp_path, kill_before)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert torch.equal(load_full(tmp_path, old)["w"], (old if kill_before == "commit" else new)["w"])
    assert len(list(tmp_path.glob("*.distcp"))) == 2  # both generations
    shardsync.save(new, tmp_path, overwrite=True)  # cleans up what the killed save left
    assert torch.equal(load_full(tmp_path, old)["w"], new["w"])
    assert len(list(tmp_path.glob("*.distcp"))) == 1


def _take_fails_on_rank_1(rank: int, world: int, out: str) -> tuple:
    from shardsync.io import save_dcp as module

    if rank == 1:

        def failing(name: str, tensor: torch.Tensor, *args: object) -> list:
            raise MemoryError(f"no memory to hold {name!r}")

        module.written = failing  # type: ignore[assignment]
    try:
        shardsync.save_dcp(full_state(), out)
    except shardsync.DistributedError as exc:
        return exc.phase, sorted(exc.failures), "no memory to hold" in str(exc)
    return ("no error",)


def test_a_target_one_rank_cannot_hold_fails_every_rank_before_writing(tmp_path: Path) -> None:
    # the failing rank keeps serving the stream, and the next agreed phase raises its error on both
    out = run_ranks(_take_fails_on_rank_1, 2, str(tmp_path / "dcp"), timeout=240, group_timeout=600)
    assert out == [("save_dcp: hold targets", [1], True)] * 2
    assert not (tmp_path / "dcp" / ".metadata").exists()


def _killed_while_writing(rank: int, world: int, out: str, dead: int) -> tuple:
    shardsync.save_dcp(full_state(), out)  # the old checkpoint
    if rank == dead:  # killed as torch's writer syncs its data file: the files are half written
        os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[assignment]
    try:
        shardsync.save_dcp(full_state(1000), out, overwrite=True)
    except shardsync.DistributedError as exc:
        return exc.phase, sorted(exc.failures)
    return ("no error",)


@pytest.mark.parametrize("dead", [0, 1])
def test_a_rank_killed_while_dcp_writes_is_named_and_the_old_checkpoint_stays(tmp_path: Path, dead: int) -> None:
    # the survivor raised gloo's own error, naming no rank, and kept the files of the new generation
    # when rank 0 (whose tag named them) was the one killed
    out = tmp_path / "dcp"
    got = run_ranks_one_dies(
        _killed_while_writing,
        2,
        dead,
        str(out),
        dead,
        timeout=240,
        group_timeout=1800,  # torch's default
    )
    assert list(got.values()) == [("save: write (torch's DCP writer)", [dead])]
    old = full_state()
    assert all(torch.equal(v, old[k]) for k, v in load_full(out, old).items())  # the old one, whole
    metadata = read_metadata(out / ".metadata")
    named = {info.relative_path for info in metadata.storage_data.values()}
    assert sorted(p.name for p in out.glob("*.distcp")) == sorted(named)  # nothing of the new generation
