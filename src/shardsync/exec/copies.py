"""Copies threaded by shardsync: as fast on a busy machine as on a quiet one, whatever the caller's
thread settings.

A large ``dst.copy_(src)`` runs on torch's intra-op threads (OpenMP), split statically among them,
each waiting for the others at the end. On a machine where anything else runs (a data loader, other
ranks, the trainer itself) one of those threads is descheduled and the others spin until it comes
back, and the copy takes many times longer (``bench/bench_threads.py`` measures it). So the copies
of the executor are cut into chunks of about :data:`CHUNK_BYTES` that a small pool of shardsync's own
threads takes one at a time: a thread that is descheduled delays one chunk, not the whole copy.

* same dtype, innermost dim contiguous on both sides (the common case: whole shards and row blocks):
  numpy's ``copyto`` (a ``memcpy`` per row run, the GIL released), bytes viewed as integers so that
  bf16 and fp8 need no numpy dtype of their own;
* same dtype, transposed (the last two dims swapped): a SIMD transpose kernel (``exec/transpose.py``)
  instead of torch's element-at-a-time ``copy_``;
* another cast or permutation: torch's ``copy_`` on pieces below its parallel grain size
  (:data:`TORCH_GRAIN`), so that each runs on one thread;
* copies under :data:`PARALLEL_BYTES` are cut the same way and run on the calling thread; copies of
  at most :data:`TORCH_GRAIN` elements, and copies to or from other devices, are one ``copy_``.

torch's process-wide thread setting is neither read nor changed. The pool has one thread per core
this process may run on (at most :data:`MAX_THREADS`), made on first use and made again in a child
after ``fork``.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch

from ..layout.dtypes import BITS, NUMPY_DTYPES
from ..planning.costs import AHEAD_BYTES
from .transpose import transposable, transpose_into

__all__ = [
    "no_grad",
    "copy_into",
    "ints",
    "int_array",
    "Copies",
    "Lane",
    "copy_threads",
    "cores",
    "CHUNK_BYTES",
    "PARALLEL_BYTES",
    "TORCH_GRAIN",
    "MAX_THREADS",
]

F = TypeVar("F", bound=Callable[..., Any])


def no_grad(fn: F) -> F:
    """``fn`` run with autograd off, as ``@torch.no_grad()`` does, but entering no_grad only where
    grad is on: torch's decorator costs microseconds a call, and the copy paths nest it per piece.

    Example:
        >>> no_grad(lambda x: (x * 2).requires_grad)(torch.ones(1, requires_grad=True))
        False
    """

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        with torch.no_grad():
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


#: Bytes of one chunk of a threaded copy.
CHUNK_BYTES = 1 << 20
#: Copies smaller than this run in the calling thread (a pool hand-off costs more than it saves); the
#: planner builds targets of this size and more one ahead (``planning.costs.AHEAD_BYTES``).
PARALLEL_BYTES = AHEAD_BYTES
#: Elements at which torch's copy kernels start to use their own threads (``at::internal::GRAIN_SIZE``).
TORCH_GRAIN = 32768
#: Most threads the pool runs (memory bandwidth is saturated before).
MAX_THREADS = 8
#: Width of the tiles of a permuted copy (elements; their height fills TORCH_GRAIN). On 2 cores, one
#: thread, eight 1024 x 1024 fp32 matrices: transposed, 512 x 64 tiles 21.7 ms, 256 x 128 ones 28.4
#: ms, rows of 1024 90 ms; cast to bf16 (not transposed), rows of 1024 7.8 ms, 256 x 128 tiles 16.3 ms.
_TILE = 64

_NP_INTS = {n: NUMPY_DTYPES[t] for n, t in BITS.items()}
_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def cores() -> int:
    """The cores this process may run on (its CPU affinity, where the system has one).

    Example:
        >>> cores() >= 1
        True
    """
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def copy_threads(processes: int = 1) -> int:
    """Threads for copies: the cores this process may run on, shared among ``processes`` processes
    that copy at the same time (ranks on one machine), at most :data:`MAX_THREADS`, at least one.

    Example:
        >>> 1 <= copy_threads() <= MAX_THREADS
        True
        >>> copy_threads(processes=cores())
        1
    """
    return max(1, min(MAX_THREADS, cores() // max(1, processes)))


def _get_pool() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(copy_threads(), thread_name_prefix="shardsync-copy")
        return _pool


def _forget_pool() -> None:  # the parent's threads do not exist in a forked child
    global _pool, _lock
    _pool, _lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _as_ints(t: torch.Tensor) -> np.ndarray:
    """``t``'s memory as a numpy array of integers of its element size (a view). Through DLPack where
    the storage is resizable: torch's ``numpy()`` makes it unresizable for good, and FSDP resizes the
    storage of the parameters it gathers; ``numpy()`` (half the cost) where it is not (shardsync's own
    blocks, made from numpy)."""
    as_int = t.view(BITS[t.element_size()])
    return np.from_dlpack(as_int) if t.untyped_storage().resizable() else as_int.numpy()


def ints(t: torch.Tensor) -> np.ndarray | None:
    """``t``'s memory as a numpy array of integers of its element size (a view), where numpy may move
    its bits: a dense CPU tensor whose bytes are its values (no lazily conjugated or negated view),
    elements of 1, 2, 4 or 8 bytes; else None.

    Example:
        >>> ints(torch.tensor([1.0, -2.0], dtype=torch.bfloat16)).dtype
        dtype('int16')
        >>> ints(torch.zeros(2, dtype=torch.complex128)) is None   # 16-byte elements
        True
    """
    as_int = BITS.get(t.element_size())
    if as_int is None or not t.is_cpu or t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg():
        return None
    return _as_ints(t.detach())


def int_array(raw: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> np.ndarray | None:
    """The first bytes of ``raw`` (flat uint8) as a contiguous array of ``shape`` holding ``dtype``'s
    elements as integers of their size (what :func:`ints` gives of such a tensor); None where no
    integer has that size.

    Example:
        >>> int_array(np.zeros(16, dtype=np.uint8), torch.float32, (2, 1)).shape
        (2, 1)
    """
    as_int = _NP_INTS.get(dtype.itemsize)
    if as_int is None:
        return None
    return raw[: math.prod(shape) * dtype.itemsize].view(as_int).reshape(shape)


def _plain(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether both are dense CPU tensors in separate memory (the cases shardsync cuts in chunks);
    sparse and quantized tensors (``copy_`` gives the destination the source's quantizer), other
    devices, and a copy within one storage are left to ``copy_``."""
    return (
        dst.device.type == "cpu"
        and src.device.type == "cpu"
        and dst.layout == torch.strided
        and src.layout == torch.strided
        and not dst.is_quantized
        and not src.is_quantized
        and dst.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
    )


def _bits(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether the copy moves bytes: the same dtype, and no lazily conjugated or negated view (its
    bytes are not its values)."""
    return dst.dtype == src.dtype and not (dst.is_conj() or src.is_conj() or dst.is_neg() or src.is_neg())


def _rows(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether numpy can move the bytes in row runs: the innermost dim contiguous on both sides."""
    if dst.dim() and dst.stride(-1) != 1 and dst.shape[-1] != 1:
        return False
    if src.dim() and src.stride(-1) != 1 and src.shape[-1] != 1:
        return False
    return dst.element_size() in BITS


def _torch_small(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` as copies of at most :data:`TORCH_GRAIN` elements, each on this thread alone:
    blocks of whole rows where both sides' rows are contiguous (a cast) or short, else tiles
    :data:`_TILE` wide over the last two dims (a transposed source is read a tile at a time, which
    stays in cache)."""
    if dst.numel() <= TORCH_GRAIN or dst.dim() == 0:
        dst.copy_(src)
        return
    if dst.dim() > 2:  # the dims before the last two: a row at a time, or short rows in blocks
        row = dst[0].numel()
        if row > TORCH_GRAIN // 2:
            for i in range(dst.shape[0]):
                _torch_small(dst[i], src[i])
            return
        step = TORCH_GRAIN // max(1, row)  # a copy_ per row of (2, 4) would cost far more than its bytes
        for i in range(0, dst.shape[0], step):
            dst[i : i + step].copy_(src[i : i + step])
        return
    if dst.dim() == 1:
        for i in range(0, dst.shape[0], TORCH_GRAIN):
            dst[i : i + TORCH_GRAIN].copy_(src[i : i + TORCH_GRAIN])
        return
    rows, cols = dst.shape
    if src.stride(-1) == 1 and dst.stride(-1) == 1:  # a cast of whole rows: as long as they go
        width = min(cols, TORCH_GRAIN)
    else:  # tall, narrow tiles: the transposed side's columns are read a few cache lines at a time
        width = cols if cols * _TILE <= TORCH_GRAIN else _TILE
    height = max(1, TORCH_GRAIN // width)
    for i in range(0, rows, height):
        for j in range(0, cols, width):
            dst[i : i + height, j : j + width].copy_(src[i : i + height, j : j + width])


def _jobs(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[Any, Any, Any]]:
    """A copy that is not a plain move of bytes in row runs (those :meth:`Copies.add_ints` cuts) cut
    along dim 0 into chunks of about :data:`CHUNK_BYTES`: ``(function, dst, src)``."""
    size = max(dst.element_size(), src.element_size())
    rows = max(1, CHUNK_BYTES // (max(1, dst[0].numel()) * size))
    fn = transpose_into if _bits(dst, src) and transposable(dst, src) else _torch_small
    return [(fn, dst[i : i + rows], src[i : i + rows]) for i in range(0, dst.shape[0], rows)]


class Lane:
    """Batches of copies the pool's threads work through in the background, oldest batch first;
    :meth:`wait` joins in on its own batch and returns once that batch is written.

    At most ``threads - 1`` helpers run (the caller is the last thread, when it waits; ``threads``
    defaults to :func:`copy_threads`). Each thread takes the next chunk until none is left, so a
    thread that is descheduled holds up one chunk, not a share fixed in advance, and a helper with
    nothing left to take ends (nothing spins). A waiting caller takes chunks of its own batch only:
    a batch it needs now (a packet to send, the copies of received data) never waits behind batches
    started earlier for later (targets built ahead).
    """

    def __init__(self, threads: int | None = None) -> None:
        self.threads = max(1, threads if threads is not None else copy_threads())
        self._queues: dict[int, deque[tuple[Any, Any, Any]]] = {}  # ticket -> chunks not taken; oldest first
        self._left: dict[int, int] = {}  # ticket -> chunks not yet written
        self._modes: dict[int, bool] = {}  # ticket -> inference mode (thread-local: targets made under it need it)
        self._errors: dict[int, BaseException] = {}
        self._then: dict[int, Callable[[], None]] = {}  # ticket -> called once all of it is written
        self._done = threading.Condition()
        self._tickets = 0
        self._helpers = 0

    def start(self, batch: Copies, then: Callable[[], None] | None = None) -> int:
        """Queue ``batch``'s copies (a batch under :data:`PARALLEL_BYTES`, or with one thread: copied
        now, on this thread); returns the ticket to :meth:`wait` for. ``then`` is called once every
        copy of the batch is written, unless one failed, by the thread that wrote the last one (while
        it holds the lane's lock where helpers run: it must be short and must not use the lane). A lane
        of one thread copies every batch in this call and takes no lock."""
        jobs, nbytes = batch.take()
        if self.threads == 1:  # no helper ever runs: every batch is copied now, no lock to take
            for fn, a, b in jobs:
                fn(a, b)
            if then is not None:
                then()
            self._tickets += 1
            return self._tickets
        with self._done:
            self._tickets += 1
            ticket = self._tickets
            if nbytes < PARALLEL_BYTES or len(jobs) == 1:
                wanted = -1
            else:
                self._queues[ticket] = deque(jobs)
                self._left[ticket] = len(jobs)
                self._modes[ticket] = torch.is_inference_mode_enabled()
                if then is not None:
                    self._then[ticket] = then
                wanted = min(self.threads - 1 - self._helpers, len(jobs))
                self._helpers += wanted
        if wanted < 0:
            for fn, a, b in jobs:
                fn(a, b)
            if then is not None:
                with self._done:
                    then()
        for _ in range(wanted):
            _get_pool().submit(self._help)
        return ticket

    def _next(self, ticket: int | None) -> tuple[int, tuple[Any, Any, Any]] | None:
        """A chunk of batch ``ticket`` (None: of the oldest batch with chunks left), or None."""
        with self._done:
            key = next(iter(self._queues), None) if ticket is None else ticket
            queue = self._queues.get(key) if key is not None else None
            if key is None or not queue:
                return None
            job = queue.popleft()
            if not queue:
                del self._queues[key]
            return key, job

    def _work(self, ticket: int | None) -> None:
        while (item := self._next(ticket)) is not None:
            taken, (fn, a, b) = item
            error = None
            try:
                with torch.inference_mode(self._modes[taken]):
                    fn(a, b)
            except BaseException as e:  # noqa: BLE001 - raised by wait(), in the caller's thread
                error = e
            with self._done:
                if error is not None:
                    self._errors.setdefault(taken, error)
                self._left[taken] -= 1
                if not self._left[taken]:
                    del self._left[taken], self._modes[taken]
                    self._finished(taken)
                    self._done.notify_all()

    def _finished(self, ticket: int) -> None:
        """Batch ``ticket`` is written (the lock is held): call its ``then`` unless a copy failed."""
        then = self._then.pop(ticket, None)
        if then is None or ticket in self._errors:
            return
        try:
            then()
        except BaseException as e:  # noqa: BLE001 - raised by wait(), in the caller's thread
            self._errors[ticket] = e

    def _help(self) -> None:
        try:
            self._work(None)
        finally:
            with self._done:
                self._helpers -= 1

    def wait(self, ticket: int) -> None:
        """Copy what is left of batch ``ticket`` on this thread too; return once every chunk of it is
        written, or raise the first error a thread met in it."""
        if self.threads == 1:  # copied when it started
            return
        self._work(ticket)
        with self._done:
            while ticket in self._left:
                self._done.wait()
            error = self._errors.pop(ticket, None)
        if error is not None:
            raise error

    def settle(self) -> None:
        """Wait for every batch started (nothing is written after this returns); errors are dropped."""
        if self.threads == 1:
            return
        self._work(None)
        with self._done:
            while self._left:
                self._done.wait()
            self._errors.clear()


class Copies:
    """Copies gathered to run together: one hand-off to the pool for all of them, not one per copy.

    :meth:`add` runs a small copy (at most :data:`TORCH_GRAIN` elements) or one to or from another
    device at once, on the calling thread; the others are cut into chunks for :meth:`Lane.start` (on
    the pool, in the background, until :meth:`Lane.wait`) or :meth:`run` (now), in no set order: the
    destinations of a batch must not overlap. Until then the caller must not read the destinations,
    nor write the sources.

    Example:
        >>> src = torch.arange(2_100_000.).reshape(700, 3000)
        >>> dst, small = torch.empty(3000, 700), torch.empty(2, 700)
        >>> batch = Copies()
        >>> batch.add(dst, src.t())
        >>> batch.add(small, src[:2, :700] + 1)   # small: copied now
        >>> lane = Lane()
        >>> ticket = lane.start(batch)   # the pool copies while this thread does other work
        >>> lane.wait(ticket)
        >>> torch.equal(dst, src.t()) and torch.equal(small, src[:2, :700] + 1)
        True
    """

    def __init__(self) -> None:
        self.jobs: list[tuple[Any, Any, Any]] = []
        self.nbytes = 0

    @no_grad
    def add(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into ``dst`` (same shape; a cast to ``dst``'s dtype), now or with the batch."""
        if dst.shape != src.shape:
            raise ValueError(f"copy_into: shapes differ, {tuple(dst.shape)} and {tuple(src.shape)}")
        if dst.numel() <= TORCH_GRAIN or not _plain(dst, src):
            dst.copy_(src)  # torch copies this on the calling thread alone, or knows what it is
            return
        dst, src = dst.detach(), src.detach()  # the pool's threads do not share this one's no_grad
        if _bits(dst, src) and _rows(dst, src) and self.add_ints(_as_ints(dst), _as_ints(src)):
            return  # numpy row copies (memcpy, the GIL released)
        if dst.is_contiguous() and src.is_contiguous():  # one run of elements: chunks of any length
            dst, src = dst.view(-1), src.view(-1)
        self.jobs += _jobs(dst, src)
        self.nbytes += dst.numel() * max(dst.element_size(), src.element_size())

    def add_ints(self, dst: np.ndarray, src: np.ndarray) -> bool:
        """Copy ``src`` into ``dst`` with the batch, as :meth:`add` copies tensors of one dtype that
        :func:`ints` viewed, when numpy moves their bytes in row runs (the innermost dim contiguous on
        both sides); returns False, adding nothing, where it does not. ``dst`` and ``src`` must not
        overlap.

        Example:
            >>> src, dst = torch.arange(12.).reshape(3, 4), torch.zeros(3, 2)
            >>> batch = Copies()
            >>> batch.add_ints(ints(dst), ints(src)[:, 1:3]), batch.add_ints(ints(dst), ints(src.t())[:3, :2])
            (True, False)
            >>> batch.run()
            >>> dst.tolist()
            [[1.0, 2.0], [5.0, 6.0], [9.0, 10.0]]
        """
        if dst.shape != src.shape:
            raise ValueError(f"copy_into: shapes differ, {dst.shape} and {src.shape}")
        if dst.ndim and (
            (dst.strides[-1] != dst.itemsize and dst.shape[-1] != 1)
            or (src.strides[-1] != src.itemsize and src.shape[-1] != 1)
        ):
            return False
        if dst.size == 0:
            return True
        if dst.ndim == 0:
            self.jobs.append((np.copyto, dst, src))
        else:
            if dst.ndim > 1 and dst.flags.c_contiguous and src.flags.c_contiguous:
                dst, src = dst.reshape(-1), src.reshape(-1)
            rows = max(1, CHUNK_BYTES // (dst.nbytes // dst.shape[0]))
            self.jobs += [(np.copyto, dst[i : i + rows], src[i : i + rows]) for i in range(0, dst.shape[0], rows)]
        self.nbytes += dst.nbytes
        return True

    def take(self) -> tuple[list[tuple[Any, Any, Any]], int]:
        """The chunks gathered and their bytes; the batch is empty again."""
        jobs, nbytes, self.jobs, self.nbytes = self.jobs, self.nbytes, [], 0
        return jobs, nbytes

    def run(self) -> None:
        """Run the copies now, on this thread and the pool's."""
        lane = Lane()
        lane.wait(lane.start(self))


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` (same shape; a cast to ``dst``'s dtype) without torch's intra-op threads: on
    shardsync's copy threads when large.

    Example:
        >>> dst = torch.empty(3000, 700, dtype=torch.bfloat16)
        >>> src = torch.arange(2_100_000.).reshape(700, 3000).t()
        >>> copy_into(dst, src)
        >>> torch.equal(dst, src.to(torch.bfloat16))
        True
    """
    batch = Copies()
    batch.add(dst, src)
    batch.run()
