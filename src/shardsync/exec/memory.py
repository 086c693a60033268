"""Warm memory for targets and buffers: a pool of recycled blocks, and the process allocator's knobs.

A fresh CPU tensor of a few MiB comes from ``mmap`` and every one of its pages faults on first touch:
copying into fresh memory runs at a fraction of the speed of copying into memory already touched. A
stream that yields many targets of the same sizes (the layers of a model) to a consumer that drops
each one can instead reuse the memory of a target the consumer no longer holds.

:class:`BlockPool` does that safely. Every block is torch memory of exactly the target's bytes, seen
through a numpy array, and a tensor handed out over it keeps a reference to that array for as long as
any tensor, view, storage, numpy array or DLPack capsule of it is alive. A block is reused only when
the pool holds the last reference, so a caller that keeps a target (or any view of it) never sees it
overwritten. The opt-in ``reuse="until-next"`` drops that check for targets already yielded: each
target is then valid only until the next one is requested.

:func:`tune_allocator` is for a process that owns its allocator (the ``shardsync`` command): it tells
glibc to keep freed memory instead of returning it to the system.

A pool made with ``shm=True`` hands out blocks of shared memory instead (:func:`shm_block`: a
``memfd``, no name in any file system): a peer process on the same machine maps a block by its
:func:`handle` and writes into it (the same-host transport's senders write their pieces straight
into their consumers' targets, :mod:`shardsync.exec.push`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
import os
import sys
import weakref
from collections import OrderedDict
from typing import Literal, NamedTuple

import numpy as np
import torch

__all__ = [
    "Reuse",
    "REUSE_MODES",
    "BlockPool",
    "BlockHandle",
    "process_pool",
    "shm_block",
    "shm_blocks_supported",
    "handle",
    "release_memory",
    "tune_allocator",
    "MMAP_THRESHOLD_BYTES",
    "POOL_MIN_BYTES",
]

log = logging.getLogger(__name__)

#: ``"dropped"``: reuse a target's memory once nothing refers to it any more (default, safe);
#: ``"until-next"``: each target is valid until the next one is requested (opt-in);
#: ``"never"``: fresh memory for every target and buffer.
Reuse = Literal["dropped", "until-next", "never"]
REUSE_MODES: tuple[str, ...] = ("dropped", "until-next", "never")
#: Smaller tensors come from torch's allocator: glibc serves them from its heap, already warm (128 KiB
#: is its initial mmap threshold). Above it glibc maps fresh memory unless its dynamic threshold has
#: risen (to 32 MiB at most), which made 56 targets of 4-8 MiB take 0.06-0.12 s from run to run,
#: against 0.06 s steadily from the pool (the warm memcpy ceiling), and 0.54 GB of 16-64 MiB targets
#: 0.28 s against 0.13 s.
POOL_MIN_BYTES = 128 << 10
#: What :func:`tune_allocator` sets glibc's mmap and trim thresholds to.
MMAP_THRESHOLD_BYTES = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # from glibc's malloc.h


class BlockPool:
    """Recycled CPU memory for targets and buffers.

    Args:
        capacity: most bytes of blocks the pool keeps references to; a block that does not fit is
            allocated outside the pool (and freed as usual), the oldest blocks make room first.
        shm: blocks of shared memory (:func:`shm_block`), of any size; else tensors under
            :data:`POOL_MIN_BYTES` are plain ``torch.empty`` ones.

    Example:
        >>> import shardsync.exec.memory as memory
        >>> memory.POOL_MIN_BYTES = 0   # pool even tiny tensors, for the example
        >>> pool = BlockPool(1 << 20)
        >>> a = pool.empty((4, 4), torch.float32)
        >>> ptr = a.data_ptr()
        >>> pool.empty((4, 4), torch.float32).data_ptr() == ptr   # ``a`` is alive: new memory
        False
        >>> del a
        >>> pool.empty((2, 8), torch.float32).data_ptr() == ptr   # nothing refers to it: reused
        True
        >>> memory.POOL_MIN_BYTES = 32 << 20
    """

    def __init__(self, capacity: int, shm: bool = False) -> None:
        self.capacity = capacity
        self.shm = shm
        self.held = 0  # bytes of the blocks in the pool, busy or idle
        self.reused = 0  # blocks handed out again (for stats and tests)
        self._blocks: dict[int, np.ndarray] = {}  # id(block) -> block
        self._sizes: OrderedDict[int, int] = OrderedDict()  # id(block) -> bytes, oldest first
        self._released: set[int] = set()  # "until-next": yielded, busy blocks the caller gave up

    def _idle(self, key: int) -> bool:
        # The pool's dict and getrefcount's argument are the only references: no tensor, view,
        # storage or exported buffer of the block is alive.
        return key in self._released or sys.getrefcount(self._blocks[key]) <= 2

    def _find(self, nbytes: int) -> np.ndarray | None:
        for key, size in self._sizes.items():
            if size == nbytes and self._idle(key):
                self._released.discard(key)
                self._sizes.move_to_end(key)
                self.reused += 1
                return self._blocks[key]
        return None

    def _admit(self, nbytes: int) -> np.ndarray:
        # torch's allocator aligns to 64 B (numpy's large arrays sit 16 B past a page: slower copies);
        # the numpy view is what tensors handed out refer to, so its reference count tells use.
        block = _shm_array(nbytes) if self.shm else torch.empty(nbytes, dtype=torch.uint8).numpy()
        while self._sizes and self.held + nbytes > self.capacity:  # oldest out (busy: the caller's)
            key, size = self._sizes.popitem(last=False)
            del self._blocks[key]
            self._released.discard(key)
            self.held -= size
        if self.held + nbytes <= self.capacity:
            self._blocks[id(block)] = block
            self._sizes[id(block)] = nbytes
            self.held += nbytes
        return block

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor of ``shape`` and ``dtype``, on recycled memory if possible.

        The tensor is not a view: it owns a storage of exactly its bytes.
        """
        nbytes = math.prod(shape) * dtype.itemsize
        if not self.shm and (nbytes == 0 or nbytes < POOL_MIN_BYTES):
            return torch.empty(shape, dtype=dtype)
        block = self._find(nbytes)
        if block is None:
            block = self._admit(nbytes)
        return _over(block, shape, dtype)

    def release(self, tensor: torch.Tensor) -> None:
        """``reuse="until-next"``: the caller is done with ``tensor`` (it asked for the next target);
        its block may be reused although references to it remain."""
        if tensor.device.type != "cpu":
            return
        ptr = tensor.untyped_storage().data_ptr()
        for key in self._sizes:
            if self._blocks[key].ctypes.data == ptr:
                self._released.add(key)
                return


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= max(size, 1)
    return tuple(reversed(out))


def _over(block: np.ndarray, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` over ``block``'s memory, keeping ``block`` alive."""
    storage = torch.from_numpy(block).untyped_storage()
    return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape), _strides(tuple(shape)))


class BlockHandle(NamedTuple):
    """Where a peer process on this machine maps a block of shared memory: ``/proc/<pid>/fd/<fd>``,
    which must still be the file of inode ``inode``, ``nbytes`` long."""

    pid: int
    fd: int
    inode: int
    nbytes: int


#: data pointer of each live shared block -> its handle (dropped, and its descriptor closed, with it)
_handles: dict[int, BlockHandle] = {}


def shm_blocks_supported() -> bool:
    """Whether this system makes shared-memory blocks (``memfd_create``: Linux).

    Example:
        >>> shm_blocks_supported() in (True, False)
        True
    """
    return hasattr(os, "memfd_create")


def _forget(ptr: int, fd: int) -> None:
    _handles.pop(ptr, None)
    os.close(fd)


def _shm_array(nbytes: int) -> np.ndarray:
    """``nbytes`` of shared memory as a numpy array: a memfd (no name in any file system, so nothing
    is left behind whatever happens to this process), its pages reserved and mapped now (a full
    memory cgroup is an error here, not a ``SIGBUS`` later), open for peers until the array is freed."""
    fd = os.memfd_create("shardsync-block", os.MFD_CLOEXEC)
    size = max(nbytes, 1)  # a mapping is never empty
    try:
        os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except BaseException:
        os.close(fd)
        raise
    block = np.frombuffer(mm, dtype=np.uint8)[:nbytes]
    ptr = block.ctypes.data if nbytes else id(block)
    _handles[ptr] = BlockHandle(os.getpid(), fd, os.fstat(fd).st_ino, size)
    weakref.finalize(block, _forget, ptr, fd)
    return block


def shm_block(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A fresh CPU tensor in shared memory that peers on this machine can map (:func:`handle`); it
    owns exactly its bytes.

    Raises:
        OSError: no memory left to reserve it.

    Example:
        >>> t = shm_block((2, 3), torch.float32)
        >>> h = handle(t)
        >>> (h.pid, h.nbytes) == (os.getpid(), 24)
        True
    """
    return _over(_shm_array(math.prod(shape) * dtype.itemsize), shape, dtype)


def handle(tensor: torch.Tensor) -> BlockHandle | None:
    """The handle of the shared-memory block ``tensor``'s storage is (from :func:`shm_block` or a
    pool with ``shm``), or None for any other tensor.

    Example:
        >>> handle(torch.zeros(3)) is None
        True
    """
    return _handles.get(tensor.untyped_storage().data_ptr()) if tensor.device.type == "cpu" else None


_pools: dict[bool, BlockPool] = {}


def process_pool(capacity: int, shm: bool = False) -> BlockPool:
    """The process's pool (of shared-memory blocks with ``shm``), used by every stream (so that a
    stream starts on the blocks the last one left), its capacity raised to at least ``capacity``.
    Sharing it is safe: a block in use by one stream's caller is busy for all of them.

    Example:
        >>> process_pool(1 << 20) is process_pool(0)
        True
    """
    pool = _pools.get(shm)
    if pool is None:
        pool = _pools[shm] = BlockPool(capacity, shm=shm)
    pool.capacity = max(pool.capacity, capacity)
    return pool


def release_memory() -> None:
    """Drop the process's pools of recycled target memory (the blocks nobody uses are freed).

    Example:
        >>> release_memory()
    """
    _pools.clear()


def _after_fork_in_child() -> None:
    # A forked child's shared-memory blocks are its parent's memory: never hand them out there.
    _pools.pop(True, None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def tune_allocator(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Tell glibc's malloc to keep freed memory for reuse (this process only).

    Raises glibc's ``M_MMAP_THRESHOLD`` (blocks above it come from ``mmap`` and go back to the system
    when freed) and ``M_TRIM_THRESHOLD`` (free memory at the top of the heap above it is returned) to
    ``threshold``, through ``mallopt``. Freed targets and buffers then stay mapped and the next
    allocation of that size is warm - what a caching allocator does, at the cost of the process keeping
    its peak memory. For processes that own their allocator (the ``shardsync`` command); a library
    must not change its host's allocator, so :func:`shardsync.full_params` never calls it.

    Returns:
        True if glibc accepted both settings (False on another C library).

    Example:
        >>> tune_allocator() in (True, False)
        True
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.debug("no mallopt in this C library; allocator left as it is")
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, threshold))
    log.debug("mallopt thresholds set to %d B: %s", threshold, ok)
    return ok
