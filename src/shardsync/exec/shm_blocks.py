"""Blocks of shared memory that peer processes on this machine map: the targets senders write into.

A block is a memfd - no name in any file system, so nothing is left behind whatever happens to a
process - its pages reserved (``posix_fallocate``: a full memory cgroup is an error here, not a
``SIGBUS`` later) and mapped at once (``MAP_POPULATE``), through ``mmap(2)`` called with ctypes (Python's
``mmap`` keeps a second descriptor per mapping). A peer opens a block through its owner's
``/proc/<pid>/fd/<fd>`` (:func:`open_block`), maps it and keeps no descriptor; the owner keeps one
open only while a peer may still have to open the block: :func:`seal` closes it (the block's target is
complete and no pool hands the block out again), and the block itself is unmapped once nothing refers
to it. So a process holds one descriptor per block that may yet be written, not per target it keeps.

After ``fork`` a child's blocks are copied into private memory at the same addresses, while the parent
waits: what the child holds is what the parent held at the fork, and no longer changes when the
parent writes into the same blocks (its next stream), as with private memory.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import select
import weakref
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = ["BlockHandle", "supported", "new_array", "handle", "seal", "seal_at", "open_block"]

_PAGE = mmap.PAGESIZE
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_FAILED = ctypes.c_void_p(-1).value


class BlockHandle(NamedTuple):
    """Where a peer process on this machine maps a block: ``/proc/<pid>/fd/<fd>``, which must still be
    the file of inode ``inode``, ``nbytes`` long (its mapping's length)."""

    pid: int
    fd: int
    inode: int
    nbytes: int


def _libc() -> Any:
    if not hasattr(os, "memfd_create"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mremap.restype = ctypes.c_void_p
        libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def supported() -> bool:
    """Whether this system makes blocks (``memfd_create`` and ``mmap``: Linux).

    Example:
        >>> supported() in (True, False)
        True
    """
    return _LIBC is not None


def _map(fd: int, size: int, flags: int) -> int:
    address = _LIBC.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if address is None or address == _FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot map {size} B of shared memory: {os.strerror(err)}")
    return int(address)


class _Mapping:
    """One mapping of a block: unmapped (and its descriptor, if still open, closed) when the last
    array over it goes."""

    def __init__(self, address: int, size: int, fd: int, inode: int, own: bool) -> None:
        self.address, self.size, self.fd, self.inode, self.own = address, size, fd, inode, own

    def close_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        if _LIBC is not None:  # None only while the interpreter shuts down
            _LIBC.munmap(self.address, self.size)
        self.close_fd()


#: address -> the live mapping there (weakly: a mapping lives as long as arrays over it)
_live: weakref.WeakValueDictionary[int, _Mapping] = weakref.WeakValueDictionary()


def _array(m: _Mapping, nbytes: int) -> np.ndarray:
    raw = (ctypes.c_uint8 * m.size).from_address(m.address)
    raw._mapping = m  # type: ignore[attr-defined]  # the array keeps the mapping: no cycle back
    _live[m.address] = m
    # the memory view is cut, not the array: views numpy makes of the block refer to the block itself
    # (numpy collapses a chain of views to the last array), so its reference count tells use
    return np.frombuffer(memoryview(raw).cast("B")[:nbytes], dtype=np.uint8)


def new_array(nbytes: int) -> np.ndarray:
    """A fresh block of ``nbytes`` as a numpy array (uint8) over its mapping, open to peers until
    :func:`seal`.

    Raises:
        OSError: no memory left to reserve it, or no descriptor left.

    Example:
        >>> a = new_array(10)
        >>> a.nbytes, a.__array_interface__["data"][0] % 4096
        (10, 0)
    """
    fd = os.memfd_create("shardsync-block", os.MFD_CLOEXEC)
    size = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
    try:
        os.posix_fallocate(fd, 0, size)
        address = _map(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except BaseException:
        os.close(fd)
        raise
    return _array(_Mapping(address, size, fd, os.fstat(fd).st_ino, own=True), nbytes)


def _mapping(tensor: torch.Tensor) -> _Mapping | None:
    return _live.get(tensor.untyped_storage().data_ptr()) if tensor.device.type == "cpu" else None


def handle(tensor: torch.Tensor) -> BlockHandle | None:
    """How a peer opens the block ``tensor``'s storage is, or None: not a block of this process, or
    sealed.

    Example:
        >>> from shardsync.exec.memory import shm_block
        >>> t = shm_block((2, 3), torch.float32)
        >>> h = handle(t)
        >>> (h.pid, h.nbytes, handle(torch.zeros(3))) == (os.getpid(), 4096, None)
        True
    """
    m = _mapping(tensor)
    if m is None or not m.own or m.fd < 0:
        return None
    return BlockHandle(os.getpid(), m.fd, m.inode, m.size)


def seal(tensor: torch.Tensor) -> None:
    """No peer opens the block of ``tensor`` any more: close its descriptor (the mapping stays).

    Example:
        >>> from shardsync.exec.memory import shm_block
        >>> t = shm_block((3,), torch.float32)
        >>> seal(t)
        >>> handle(t) is None
        True
    """
    if tensor.device.type == "cpu":
        seal_at(tensor.untyped_storage().data_ptr())


def seal_at(address: int) -> None:
    """:func:`seal` the block mapped at ``address`` (nothing if there is none).

    Example:
        >>> seal_at(0)
    """
    m = _live.get(address)
    if m is not None and m.own:
        m.close_fd()


def open_block(h: BlockHandle) -> torch.Tensor:
    """A peer's block (flat uint8), mapped here with its pages; no descriptor is kept.

    Raises:
        OSError: the owner's ``/proc/<pid>/fd/<fd>`` cannot be opened (it ended, or sealed the
            block), or is another file now.

    Example:
        >>> from shardsync.exec.memory import shm_block
        >>> t = shm_block((4,), torch.float32)
        >>> open_block(handle(t)).numel()
        4096
    """
    fd = os.open(f"/proc/{h.pid}/fd/{h.fd}", os.O_RDWR)
    try:
        if os.fstat(fd).st_ino != h.inode:
            raise OSError(f"/proc/{h.pid}/fd/{h.fd} is no longer the block it was")
        address = _map(fd, h.nbytes, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
    return torch.from_numpy(_array(_Mapping(address, h.nbytes, -1, h.inode, own=False), h.nbytes))


#: (read end, write end) of a pipe made before a fork while this process has blocks: the child says
#: through it that it has its private copies, and the parent waits for that before it goes on
_forking: list[tuple[int, int]] = []
#: Longest a parent waits for its child's copies (a child that dies first ends the wait at once).
FORK_WAIT_SECONDS = 60.0


def _before_fork() -> None:
    if any(m.own for m in _live.values()):
        _forking.append(os.pipe())


def _privatize_in_child() -> None:
    """After fork, in the child: each block of the parent's becomes private memory holding what it
    held at the fork (the parent waits meanwhile), at the same address: a fresh anonymous mapping,
    filled, then moved over it."""
    for m in list(_live.values()):
        if not m.own:
            continue
        fresh = _map(-1, m.size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        ctypes.memmove(fresh, m.address, m.size)
        moved = _LIBC.mremap(fresh, m.size, m.size, _MREMAP_MAYMOVE | _MREMAP_FIXED, m.address)
        if moved is None or moved == _FAILED:
            _LIBC.munmap(fresh, m.size)  # left shared: at least the child's pool no longer hands it out
            continue
        m.close_fd()
        m.own = False  # private now: not a block any peer opens
    while _forking:
        r, w = _forking.pop()
        os.write(w, b"1")
        os.close(w)
        os.close(r)


def _after_fork_in_parent() -> None:
    while _forking:
        r, w = _forking.pop()
        os.close(w)
        select.select([r], [], [], FORK_WAIT_SECONDS)  # the child copied, or ended
        os.close(r)


if _LIBC is not None and hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_privatize_in_child, after_in_parent=_after_fork_in_parent)
