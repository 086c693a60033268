"""``save``: a sharded checkpoint in torch's DCP format, written by ``torch.distributed.checkpoint.save``.

Every rank's shards (tensors, LocalShard boxes of any shape - uneven included -, DTensor) become
DCP write items with one chunk per box, through DCP's own extension points: a ``SavePlanner`` that
plans the boxes, and a ``FileSystemWriter`` whose data files carry a generation tag
(``__<tag>_<rank>_0.distcp``). DCP dedups replicas, validates the chunks, writes each rank's file and
commits ``.metadata`` last; as with safetensors, the new files never overwrite the ones the old
``.metadata`` names, so a crash leaves the old checkpoint or the new one, and the old generation's
data files are removed after the commit.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from .. import phases
from ..dist import abandon, agree, data_phase, group_rank, is_distributed
from ..errors import FormatError, LayoutError, ShardsyncError
from ..layout.box import Box
from ..layout.meta import GlobalLayout
from ..layout.sharded import LocalShard, StateValue
from ..planning.validate import layout_problems, shard_boxes, tiling_problems
from ..roll_call import transport_errors
from ..sources import LocalSource
from ..sources.dcp_metadata import read_metadata
from ..sources.megatron import megatron_module_error
from .commit import check_dcp_directory, fsync_path, new_tag, output_dir, remove_files

__all__ = ["save", "BoxSavePlanner", "remove_partial"]

#: Free bytes below which a failed write is taken to have run out of space.
FULL_DISK_BYTES = 1 << 20
_DATA_FILE = re.compile(r"__([0-9a-f]{8}_)?\d+_\d+\.distcp")


class BoxSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, given this rank's shards as boxes instead of a state dict.

    Call sequence (DCP's, every rank): ``set_up_planner`` -> ``create_local_plan`` (one write item
    per non-empty box; a whole tensor is a ``TENSOR`` item, a box a ``SHARD`` item) -> on the
    coordinator ``create_global_plan`` (DCP's: dedups replicas, builds and validates the metadata)
    -> ``finish_plan`` -> ``resolve_data`` per item.

    Example:
        >>> p = BoxSavePlanner({"w": [LocalShard(torch.zeros(2, 3), (5, 3), (2, 0))]})
        >>> p.set_up_planner({}, None, True)
        >>> [(i.type.name, list(i.tensor_data.chunk.offsets)) for i in p.create_local_plan().items]
        [('SHARD', [2, 0])]
    """

    def __init__(self, shards: Mapping[str, list[LocalShard]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.by_index = {
            (key, s.global_offset): s
            for key in sorted(shards)
            for s in shards[key]
            if not s.box.empty or Box.full(s.global_shape).empty
        }

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan([_write_item(key, s) for (key, _), s in self.by_index.items()])
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        return self.by_index[(index.fqn, tuple(index.offset or ()))].local


def _write_item(key: str, s: LocalShard) -> WriteItem:
    kind = WriteItemType.TENSOR if s.box == Box.full(s.global_shape) else WriteItemType.SHARD
    chunk = ChunkStorageMetadata(torch.Size(s.global_offset), torch.Size(s.local.shape))
    return WriteItem(
        MetadataIndex(key, s.global_offset),
        kind,
        tensor_data=TensorWriteData(chunk, TensorProperties.create_from_tensor(s.local), torch.Size(s.global_shape)),
    )


class _ReplacingFileSystem(FileSystem):
    # torch removes the old .metadata before renaming the new one in, which leaves a moment with no
    # checkpoint at all; the rename alone replaces it atomically.
    def rm_file(self, path: str | os.PathLike) -> None:
        if Path(path).name != ".metadata":
            super().rm_file(path)

    # torch writes .metadata through a fixed temporary name (.metadata.tmp): a symbolic link planted
    # there would have it write a file outside the checkpoint. Never write through a link.
    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "w" in mode and Path(path).is_symlink():
            Path(path).unlink()
        with super().create_stream(path, mode) as stream:
            yield stream


class _TaggedWriter(dcp.FileSystemWriter):
    """torch's FileSystemWriter, with this save's tag in the data file names."""

    def __init__(self, path: Path, tag: str) -> None:
        super().__init__(path, overwrite=True)
        self.fs = _ReplacingFileSystem()
        self.tag = tag

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        plans = super().prepare_global_plan(plans)
        return [
            replace(p, storage_data=replace(p.storage_data, prefix=f"__{self.tag}_{i}_")) for i, p in enumerate(plans)
        ]


def _check(path: Path, overwrite: bool, source: LocalSource) -> tuple[list[Any], str]:
    """This rank's entries, and a tag for the new generation (every rank takes the first rank's: the
    files of a save that fails are removed by whichever ranks survive it)."""
    check_dcp_directory(path, overwrite)
    return source.entries(), new_tag()


def _layout_problems(layout: GlobalLayout) -> list[str]:
    problems = layout_problems(layout)
    for key in layout.keys():
        meta = layout[key]
        if not Box.full(meta.shape).empty:
            problems += tiling_problems(repr(key), meta.shape, list(shard_boxes(layout, key)))
    return problems


def _remove_old_generation(path: Path, metadata: Metadata) -> None:
    keep = {info.relative_path for info in (metadata.storage_data or {}).values()}
    old = [p for p in path.iterdir() if _DATA_FILE.fullmatch(p.name) and p.name not in keep]
    for p in old:
        p.unlink()
    if old:
        fsync_path(path)


def _not_a_state(state: object) -> LayoutError:
    if isinstance(state, torch.nn.Module):
        return megatron_module_error(state, "the state") or LayoutError(
            "save takes a state dict, not a torch.nn.Module: pass model.state_dict()"
        )
    return LayoutError(f"save takes a state dict (tensors, LocalShard, DTensor), not a {type(state).__name__}")


def remove_partial(path: Path, tag: str | None = None) -> None:
    """Remove what an interrupted save left in ``path``: torch's ``.metadata.tmp`` and the data files
    of save ``tag`` (None: of every save whose files the current ``.metadata`` does not name).
    Best effort: an error here would hide the failure itself."""
    keep: set[str] = set()
    if tag is None and (path / ".metadata").is_file():
        try:
            stored = read_metadata(path / ".metadata").storage_data or {}
            keep = {info.relative_path for info in stored.values()}
        except FormatError:
            return  # not a checkpoint shardsync can read: touch nothing
    mine = re.compile(rf"__{tag or '[0-9a-f]{8}'}_\d+_\d+\.distcp")
    with contextlib.suppress(OSError):
        remove_files(
            path,
            [
                p.name
                for p in path.iterdir()
                if (mine.fullmatch(p.name) and p.name not in keep) or p.name == ".metadata.tmp"
            ],
        )


def _first_failure(exc: BaseException, path: Path) -> BaseException:
    """The error to raise for a failed ``dcp.save`` into ``path``: torch gathers every rank's failure
    into a ``CheckpointException`` (not an ``Exception``, and its text is each rank's traceback); the
    first rank's own error says what happened. torch's file writer reports a short write (a full
    disk) as a ``RuntimeError``; a disk with no space left then is an ``OSError`` again."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(exc, CheckpointException) or not exc.failures:
        return exc
    rank, (first, _) = min(exc.failures.items(), key=lambda item: item[0])
    if isinstance(first, (OSError, ShardsyncError, KeyboardInterrupt)):
        return first
    with contextlib.suppress(OSError):
        disk = os.statvfs(path)
        if disk.f_bavail * disk.f_frsize < FULL_DISK_BYTES:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return FormatError(
        f"torch's DCP writer failed on rank {rank}: {type(first).__name__}: {first}; check "
        "the output directory and its disk"
    )


def save(
    state: Mapping[str, StateValue], path: str | os.PathLike, *, group: Any = None, overwrite: bool = False
) -> Metadata:
    """Write this rank's shards of ``state`` as one torch DCP checkpoint; call on every rank.

    ``torch.distributed.checkpoint.load`` reads the result into tensors of any sharding (full tensors
    on one process, DTensors on another mesh), and :mod:`shardsync` sources read it back.

    Args:
        state: this rank's state dict (tensors, LocalShard or lists of them, DTensor). Replicas
            (the same box on several ranks) are written once.
        path: the checkpoint directory (created if missing).
        group: process group; None: the default group when torch.distributed is up, else one process.
        overwrite: replace a DCP checkpoint already there (files of other names are never touched).

    Returns:
        DCP's metadata of the checkpoint.

    Raises:
        FormatError: ``path`` holds a checkpoint (and not ``overwrite``), or is a file.
        LayoutError: shards that overlap without being replicas, or leave part of a tensor unheld; a
            module instead of a state dict (a Megatron one: pass shardsync.from_megatron(model)).
        DistributedError: a rank failed (raised on every rank, naming it).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = save({"w": LocalShard(torch.ones(2), (2,), (0,))}, d)
        ...     out = {"w": torch.zeros(2)}
        ...     dcp.load(out, checkpoint_id=d, no_dist=True)
        ...     out["w"].tolist()
        [1.0, 1.0]
    """
    if not isinstance(state, Mapping):  # before the first phase: the peers waiting in it learn why
        error = _not_a_state(state)
        abandon(phases.DCP_CHECK, group, error)
        raise error
    where = output_dir(path, "path")
    source = LocalSource(state)
    gathered = agree(phases.DCP_CHECK, lambda: _check(where, overwrite, source), group, unanimous=True).all

    def validate() -> None:
        problems = _layout_problems(GlobalLayout.merge([entries for entries, _ in gathered]))
        if problems:
            raise LayoutError("cannot save this state as one checkpoint:\n  " + "\n  ".join(problems))

    agree(phases.DCP_VALIDATE, validate, group, unanimous=True)
    writer = _TaggedWriter(where, gathered[0][1])
    try:
        # DCP gathers every rank's own failure into a CheckpointException (raised on every rank); what
        # else escapes it comes from its collectives: a peer died - named by the data phase
        with warnings.catch_warnings(), data_phase(phases.DCP_WRITE, group), transport_errors():
            warnings.filterwarnings("ignore", message=".*(torch.distributed is disabled|existing checkpoint)")
            metadata = dcp.save(
                source.shards,
                storage_writer=writer,
                planner=BoxSavePlanner(source.shards),
                process_group=group,
                no_dist=not is_distributed(group),
            )
    except BaseException as exc:  # a full disk, Ctrl-C: what this save wrote goes, the old one stays
        error = _first_failure(exc, where)  # before the removal frees the space it ran out of
        remove_partial(where, writer.tag)
        raise error from exc
    agree(
        phases.DCP_REMOVE_OLD,
        lambda: _remove_old_generation(where, metadata) if group_rank(group) == 0 else None,
        group,
    )
    return metadata
