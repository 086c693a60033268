"""Warm memory for targets and buffers: a pool of recycled blocks, and the process allocator's knobs.

A fresh CPU tensor of a few MiB comes from ``mmap`` and every one of its pages faults on first touch:
copying into fresh memory runs at a fraction of the speed of copying into memory already touched. A
stream that yields many targets of the same sizes (the layers of a model) to a consumer that drops
each one can instead reuse the memory of a target the consumer no longer holds.

:class:`BlockPool` does that safely. Every block is torch memory of the target's bytes (and
:data:`ALIGN` more, in a pool of process memory), seen through a numpy array, and a tensor handed out
over it keeps a reference to that array for as long as any tensor, view, storage, numpy array or
DLPack capsule of it is alive. A block is reused only when the pool holds the last reference, so a
caller that keeps a target (or any view of it) never sees it overwritten. The opt-in
``reuse="until-next"`` drops that check for targets already yielded (the ones the stream allocated,
not views of the caller's sources): each target is then valid only until the next one is requested.

:func:`tune_allocator` is for a process that owns its allocator (the ``shardsync`` command): it tells
glibc to keep freed memory instead of returning it to the system.

A block of a pool of process memory starts where the caller asks, modulo :data:`ALIGN` bytes (``align``):
the executor starts each target as its largest piece's source does (:meth:`_Run.align
<shardsync.exec.executor>`), because glibc's ``memcpy`` of a row (``rep movsb``) runs at full speed only
where source and destination agree modulo 64 bytes: numpy's large arrays start 16 bytes past a multiple
of 64, torch's tensors on one (``docs/performance.md``, "Where a target starts").

A pool made with ``shm=True`` hands out blocks of shared memory instead
(:mod:`~shardsync.exec.shm_blocks`): a peer process on the same machine maps a block and writes into
it (the same-host transport's senders write their pieces straight into their consumers' targets,
:mod:`shardsync.exec.push`). Such a pool also says when a block's descriptor may close: once its
target is written (:meth:`BlockPool.written`) and the pool no longer hands it out.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import os
import sys
from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from ..layout.dtypes import NUMPY_DTYPES
from . import shm_blocks

__all__ = [
    "Reuse",
    "REUSE_MODES",
    "BlockPool",
    "process_pool",
    "shm_block",
    "over",
    "release_memory",
    "tune_allocator",
    "MMAP_THRESHOLD_BYTES",
    "POOL_MIN_BYTES",
    "SHM_POOL_BLOCKS",
    "ALIGN",
    "contiguous_strides",
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
#: Most blocks a pool of shared memory keeps: each keeps a descriptor open (peers open it to write
#: into it), and a process may have only so many (often 1024).
SHM_POOL_BLOCKS = 128
#: What :func:`tune_allocator` sets glibc's mmap and trim thresholds to.
MMAP_THRESHOLD_BYTES = 1 << 30
#: The span an ``align`` of :meth:`BlockPool.empty` is taken in: torch's allocator starts every tensor on
#: it, and a block of process memory has that many bytes more to start anywhere in it.
ALIGN = 64
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # from glibc's malloc.h


class BlockPool:
    """Recycled CPU memory for targets and buffers.

    Args:
        capacity: most bytes of blocks the pool keeps references to; a block that does not fit is
            allocated outside the pool (and freed as usual), the oldest blocks make room first (a
            pool of shared memory also keeps at most :data:`SHM_POOL_BLOCKS` blocks).
        shm: blocks of shared memory (:func:`shm_block`), of any size; else tensors under
            :data:`POOL_MIN_BYTES` are plain ``torch.empty`` ones. A block handed out is being
            written until :meth:`written`; its descriptor closes once it is written and out of the
            pool (peers open a block only to write it).

    Example:
        >>> import shardsync.exec.memory as memory
        >>> saved, memory.POOL_MIN_BYTES = memory.POOL_MIN_BYTES, 0   # pool even tiny tensors, for the example
        >>> pool = BlockPool(1 << 20)
        >>> a = pool.empty((4, 4), torch.float32)
        >>> ptr = a.data_ptr()
        >>> pool.empty((4, 4), torch.float32).data_ptr() == ptr   # ``a`` is alive: new memory
        False
        >>> del a
        >>> pool.empty((2, 8), torch.float32).data_ptr() == ptr   # nothing refers to it: reused
        True
        >>> memory.POOL_MIN_BYTES = saved
    """

    def __init__(self, capacity: int, shm: bool = False) -> None:
        self.capacity = capacity
        self.shm = shm
        self.held = 0  # bytes of the targets of the blocks in the pool, busy or idle
        self.reused = 0  # blocks handed out again (for stats and tests)
        self._blocks: dict[int, np.ndarray] = {}  # address -> block
        self._sizes: OrderedDict[int, int] = OrderedDict()  # address -> bytes, oldest first
        self._released: set[int] = set()  # "until-next": yielded, busy blocks the caller gave up
        self._writing: set[int] = set()  # shm: data pointers of blocks handed out, not yet written

    def _idle(self, key: int) -> bool:
        # The pool's dict and getrefcount's argument are the only references: no tensor, view,
        # storage or exported buffer of the block is alive.
        return key in self._released or sys.getrefcount(self._blocks[key]) <= 2

    def _find(self, nbytes: int) -> tuple[int, np.ndarray] | None:
        for key, size in self._sizes.items():
            if size == nbytes and self._idle(key):
                self._released.discard(key)
                self._sizes.move_to_end(key)
                self.reused += 1
                return key, self._blocks[key]
        return None

    def _admit(self, nbytes: int) -> tuple[int, np.ndarray]:
        # torch's allocator starts the block on ALIGN bytes (a tensor starts up to ALIGN - 1 past it);
        # the numpy view is what tensors handed out refer to, so its reference count tells use.
        block = shm_blocks.new_array(nbytes) if self.shm else torch.empty(nbytes + ALIGN, dtype=torch.uint8).numpy()
        most = SHM_POOL_BLOCKS if self.shm else len(self._sizes) + 1
        while self._sizes and (self.held + nbytes > self.capacity or len(self._sizes) >= most):
            self._drop(next(iter(self._sizes)))  # oldest out (busy: the caller's)
        key = _address(block)
        if not self.shm and key % ALIGN:  # _key finds a block from its tensors' storages on ALIGN bytes
            raise RuntimeError(f"torch's allocator gave memory {key % ALIGN} bytes past {ALIGN}; this is a bug")
        if self.held + nbytes <= self.capacity:
            self._blocks[key] = block
            self._sizes[key] = nbytes
            self.held += nbytes
        return key, block

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, align: int = 0) -> torch.Tensor:
        """An uninitialised CPU tensor of ``shape`` and ``dtype``, on recycled memory if possible.

        The tensor is not a view: it owns a storage of exactly its bytes. In a pool of process memory
        it starts ``align`` bytes past a multiple of :data:`ALIGN` (a multiple of the dtype's size
        below :data:`ALIGN`; where it is not, or for a tensor under :data:`POOL_MIN_BYTES`, on one).
        A pool of shared memory starts its blocks on a page.

        Example:
            >>> pool = BlockPool(1 << 30)
            >>> pool.empty((1 << 20,), torch.float32, align=16).data_ptr() % ALIGN
            16
        """
        nbytes = math.prod(shape) * dtype.itemsize
        if not self.shm and (nbytes == 0 or nbytes < POOL_MIN_BYTES):
            return torch.empty(shape, dtype=dtype)
        found = self._find(nbytes)
        key, block = found if found is not None else self._admit(nbytes)
        if self.shm:
            self._writing.add(key)
            return over(block, shape, dtype)
        start = align if 0 < align < ALIGN and align % dtype.itemsize == 0 else 0
        return over(block[start : start + nbytes], shape, dtype)

    def _drop(self, key: int, seal: bool = True) -> None:
        """Block ``key`` leaves the pool (it is freed once nothing else refers to it)."""
        self._blocks.pop(key)
        self.held -= self._sizes.pop(key)
        self._released.discard(key)
        if self.shm and seal and key not in self._writing:
            shm_blocks.seal_at(key)  # never handed out again: no peer opens it

    def _key(self, tensor: torch.Tensor) -> int | None:
        ptr = tensor.untyped_storage().data_ptr()
        if not self.shm:  # a block starts on ALIGN bytes, its tensors up to ALIGN - 1 past it
            ptr -= ptr % ALIGN
        return ptr if ptr in self._blocks else None

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory is a block of this pool (handed out again once dropped)."""
        return self._key(tensor) is not None

    def written(self, tensor: torch.Tensor) -> None:
        """shm: ``tensor`` (handed out by :meth:`empty`) is complete, no peer writes it any more; its
        block's descriptor closes unless the pool hands the block out again."""
        ptr = tensor.untyped_storage().data_ptr()
        self._writing.discard(ptr)
        if self._key(tensor) is None:
            shm_blocks.seal_at(ptr)

    def discard(self, tensor: torch.Tensor) -> None:
        """Never hand ``tensor``'s block out again (peers may still write into it: a failed stream)."""
        self._writing.discard(tensor.untyped_storage().data_ptr())
        key = self._key(tensor)
        if key is not None:
            self._drop(key, seal=False)  # its descriptor stays open for them, until it is freed

    def release(self, tensor: torch.Tensor) -> None:
        """``reuse="until-next"``: the caller is done with ``tensor`` (it asked for the next target);
        its block may be reused although references to it remain."""
        if tensor.device.type != "cpu":
            return
        key = self._key(tensor)
        if key is not None:
            self._released.add(key)


def _address(block: np.ndarray) -> int:
    # not ``block.ctypes.data``: that object refers back to the array in a cycle, which keeps the
    # array's reference count up until the garbage collector runs - a block looks busy meanwhile
    return int(block.__array_interface__["data"][0])


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides (in elements) of a contiguous tensor of ``shape``.

    Example:
        >>> contiguous_strides((2, 3, 4))
        (12, 4, 1)
    """
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= max(size, 1)
    return tuple(reversed(out))


def over(block: np.ndarray, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` over ``block``'s memory (its first bytes), keeping ``block``
    alive; its storage is exactly its bytes.

    Example:
        >>> over(np.zeros(16, dtype=np.uint8), (2, 2), torch.float32).shape
        torch.Size([2, 2])
    """
    as_numpy = NUMPY_DTYPES.get(dtype)
    if as_numpy is not None:  # the cheaper way, where numpy has the dtype (not bf16, fp8)
        count = math.prod(shape)
        return torch.from_numpy(block[: count * dtype.itemsize].view(as_numpy).reshape(tuple(shape)))
    storage = torch.from_numpy(block).untyped_storage()
    return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape), contiguous_strides(shape))


def shm_block(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A fresh CPU tensor in a block of shared memory that peers on this machine can map
    (:mod:`~shardsync.exec.shm_blocks`); it owns exactly its bytes.

    Raises:
        OSError: no memory left to reserve it.

    Example:
        >>> from shardsync.exec.shm_blocks import handle
        >>> t = shm_block((2, 3), torch.float32)
        >>> t.untyped_storage().nbytes(), handle(t) is not None
        (24, True)
    """
    return over(shm_blocks.new_array(math.prod(shape) * dtype.itemsize), shape, dtype)


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
