"""The same-host transport's files and mappings: segments, shared storages, blocks, and what each
rank keeps for its group between streams.

A segment is one file in ``/dev/shm`` (:data:`~shardsync.exec.hosts.SHM_DIR`), named
``shardsync-<pid of rank 0>-<n>-<rank>-<pid>`` only while its stream sets up: created with ``O_EXCL``
and its space reserved with ``posix_fallocate`` (a full ``/dev/shm`` is an error, never a
``SIGBUS``), unlinked by every rank right after setup, and removed by :func:`sweep` when every rank of
its stream died during setup. Shared storages (``share_memory_()``) and blocks (boards, pushed
targets: memfds) are reached through their owner's ``/proc/<pid>/fd/<fd>``. :class:`Kept` is what a
rank keeps between streams (warm memory, already mapped); :func:`release` gives it back.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import warnings
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..liveness import ProcessRecord, is_gone
from .hosts import SHM_DIR
from .push_schedule import forget_plans

__all__ = [
    "SHM_PREFIX",
    "SHM_DIR",
    "Kept",
    "group_name",
    "sweep",
    "map_file",
    "as_bytes",
    "kept_by_name",
    "cached_token",
    "release",
    "release_all",
    "storage_handle",
    "open_handle",
    "owner_gone",
    "idle",
]

log = logging.getLogger(__name__)

#: Every segment name starts with this.
SHM_PREFIX = "shardsync-"


def group_name(group: Any) -> str:
    """The name every member process has for ``group`` (None: the default group).

    Example:
        >>> group_name(None)
        'world'
    """
    g = group if group is not None else dist.group.WORLD
    return str(getattr(g, "group_name", None) or "world")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep() -> None:
    """Remove segments whose creator is dead (every rank of that stream was killed during setup)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(SHM_DIR):
            pid = name.rsplit("-", 1)[-1]
            if name.startswith(SHM_PREFIX) and pid.isdigit() and not _alive(int(pid)):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(SHM_DIR, name))
                    log.warning("removed %s/%s, left by a process that died", SHM_DIR, name)


def map_file(path: str, size: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.posix_fallocate(fd, 0, size)  # ENOSPC here, not SIGBUS on first touch
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def as_bytes(mm: mmap.mmap) -> torch.Tensor:
    with warnings.catch_warnings():  # frombuffer warns about buffers it cannot check; ours is writable
        warnings.simplefilter("ignore")
        return torch.frombuffer(mm, dtype=torch.uint8)


class Boards(NamedTuple):
    """Every rank's board as the last stream that set up mapped them: for a plan of ``targets``
    targets, their bytes and the ranks' process records, by group rank."""

    targets: int
    boards: Sequence[torch.Tensor]
    records: Sequence[ProcessRecord | None]


class Kept:
    """What a rank keeps for its group between streams: its own segment (by the reads it holds) and
    board, its mappings of peers' segments, boards and shared storages (by handle), and of the
    peers' blocks it wrote pieces into."""

    def __init__(self) -> None:
        self.token = ""  # the stream that set these up; "" when none (or after a failure)
        self.own: tuple[tuple, tuple, torch.Tensor] | None = None  # (reads and sizes, handle, bytes)
        self.board: tuple[tuple, torch.Tensor] | None = None  # (handle, bytes)
        self.maps: dict[tuple, torch.Tensor] = {}  # handle -> mapped bytes
        # handle -> the views of reads in that memory (its own segment's and the mapped ones'), kept
        # while it is (see shm.read_views)
        self.views: dict[tuple, dict[int, tuple[tuple, torch.Tensor, torch.Tensor]]] = {}
        self.blocks: dict[tuple[int, int], torch.Tensor] = {}  # (rank, inode) -> mapped bytes
        self.last: Boards | None = None  # the boards as the stream of ``token`` mapped them
        self.busy = False  # a stream is using them: another one works on its own


#: Per default group (weakly: a group made after ``destroy_process_group``, whose groups take the same
#: names again, starts afresh), group name -> what its ranks keep between streams.
_caches: weakref.WeakKeyDictionary[Any, dict[str, Kept]] = weakref.WeakKeyDictionary()


def kept_by_name() -> dict[str, Kept]:
    world = dist.distributed_c10d._get_default_group() if dist.is_initialized() else _NO_GROUP
    return _caches.setdefault(world, {})


class _NoGroup:
    """The key of what a process without a process group keeps (never any segment)."""


_NO_GROUP = _NoGroup()


def cached_token(group: Any) -> str:
    """The stream that set up what is kept for ``group``; "" if nothing is or it is in use.

    Example:
        >>> cached_token(None)
        ''
    """
    kept = kept_by_name().get(group_name(group))
    return kept.token if kept is not None and not kept.busy else ""


def release(group: Any = None) -> None:
    """Drop the shared memory kept for ``group`` (None: the default group) between streams.

    After a stream each rank keeps its segment (the bytes it sends) and its mappings of its peers',
    so that the next stream writes and reads memory already touched instead of faulting in fresh
    pages. Call this on every rank to give that memory back.

    Example:
        >>> release()
    """
    kept_by_name().pop(group_name(group), None)


def release_all() -> None:
    """Drop the shared memory kept for every group (see :func:`release`), and what the transport
    derived from plans.

    Example:
        >>> release_all()
    """
    _caches.clear()
    forget_plans()


def storage_handle(view: torch.Tensor) -> tuple[tuple, int] | None:
    """For a contiguous CPU view inside a storage in shared memory (``share_memory_()``): a handle a
    peer can map it by, and the view's byte offset in it. None for any other tensor."""
    if view.device.type != "cpu" or not view.is_contiguous():
        return None
    storage = view.untyped_storage()
    if not storage.is_shared():  # (``view.is_shared()`` goes through a TypedStorage: 5x slower)
        return None
    offset = view.data_ptr() - storage.data_ptr()
    if torch.multiprocessing.get_sharing_strategy() == "file_system":
        _, name, size = storage._share_filename_cpu_()
        path = os.path.join(SHM_DIR, name.decode().lstrip("/"))
        # torch's file starts with a header of its own (a reference count), the storage after it
        header = os.stat(path).st_size - size
        if header < 0:
            raise RuntimeError(f"{path} holds {size + header} bytes, less than its storage's {size}")
        return ("file", path, size + header), offset + header
    fd, size = storage._share_fd_cpu_()
    return ("fd", os.getpid(), fd, os.fstat(fd).st_ino, size), offset


def open_handle(handle: tuple) -> torch.Tensor:
    """The bytes of a segment, board or shared storage a peer published, mapped here."""
    if handle[0] == "fd":  # the owner's descriptor, reached through /proc (same user)
        _, pid, fd, ino, size = handle
        path = f"/proc/{pid}/fd/{fd}"
        try:
            same = os.stat(path).st_ino == ino
        except OSError as exc:
            raise RuntimeError(
                f"cannot reach the shared tensor storage of process {pid} through {path} "
                f"({exc.strerror}): ranks must run as the same user and see each other's "
                "/proc; or pass transport='backend'"
            ) from exc
        if not same:
            raise RuntimeError(f"{path} is no longer the shared storage published by process {pid}")
    else:
        path, size = handle[-2:]
    return as_bytes(map_file(path, size, create=False))


def owner_gone(handle_: tuple, records: Sequence[ProcessRecord]) -> bool:
    """Whether the process that published ``handle_`` has ended (its segment's rank, or its pid)."""
    owner = records[handle_[1]] if handle_[0] != "fd" else next((r for r in records if r.pid == handle_[1]), None)
    return owner is not None and bool(is_gone(owner))


def idle(kept: Kept) -> None:
    kept.busy = False
