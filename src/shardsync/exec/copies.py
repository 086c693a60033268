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
* a cast or a permutation: torch's ``copy_`` on pieces below its parallel grain size
  (:data:`TORCH_GRAIN`), so that each runs on one thread;
* copies under :data:`PARALLEL_BYTES` are cut the same way and run on the calling thread; copies of
  at most :data:`TORCH_GRAIN` elements, and copies to or from other devices, are one ``copy_``.

torch's process-wide thread setting is neither read nor changed. The pool has one thread per core
this process may run on (at most :data:`MAX_THREADS`), made on first use and made again in a child
after ``fork``.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import torch

__all__ = ["copy_into", "copy_threads", "cores", "CHUNK_BYTES", "PARALLEL_BYTES", "TORCH_GRAIN", "MAX_THREADS"]

#: Bytes of one chunk of a threaded copy.
CHUNK_BYTES = 1 << 20
#: Copies smaller than this run in the calling thread (a pool hand-off costs more than it saves).
PARALLEL_BYTES = 4 << 20
#: Elements at which torch's copy kernels start to use their own threads (``at::internal::GRAIN_SIZE``).
TORCH_GRAIN = 32768
#: Most threads the pool runs (memory bandwidth is saturated before).
MAX_THREADS = 8
#: Side of the tiles of a cast or permuted copy (elements): a tile stays in cache.
_TILE = 128

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def cores() -> int:
    """The cores this process may run on (its CPU affinity, where the system has one).

    Example:
        >>> cores() >= 1
        True
    """
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def copy_threads() -> int:
    """Threads of the copy pool: the cores this process may run on, at most :data:`MAX_THREADS`.

    Example:
        >>> 1 <= copy_threads() <= MAX_THREADS
        True
    """
    return max(1, min(MAX_THREADS, cores()))


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
    """``t``'s memory as a numpy array of integers of its element size (a view)."""
    return t.view(_INTS[t.element_size()]).numpy()


def _plain(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether both are dense CPU tensors in separate memory (the cases shardsync cuts in chunks);
    sparse tensors, other devices, and a copy within one storage are left to ``copy_``."""
    return (
        all(t.device.type == "cpu" and t.layout == torch.strided for t in (dst, src))
        and dst.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
    )


def _raw(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether the copy is a move of bytes that numpy can do on row runs (not for a lazily conjugated
    or negated view: its bytes are not its values)."""
    return (
        dst.dtype == src.dtype
        and dst.element_size() in _INTS
        and all(t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] == 1 for t in (dst, src))
        and not any(t.is_conj() or t.is_neg() for t in (dst, src))
    )


def _torch_small(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` as copies of at most :data:`TORCH_GRAIN` elements, each on this thread alone:
    tiles of about ``sqrt(TORCH_GRAIN)`` x ``sqrt(TORCH_GRAIN)`` over the last two dims (a transposed
    source is read a tile at a time, which stays in cache), whole rows where they are short."""
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
    width = cols if cols * _TILE <= TORCH_GRAIN else _TILE
    height = max(1, TORCH_GRAIN // width)
    for i in range(0, rows, height):
        for j in range(0, cols, width):
            dst[i : i + height, j : j + width].copy_(src[i : i + height, j : j + width])


def _jobs(dst: torch.Tensor, src: torch.Tensor, raw: bool) -> list[tuple[Any, Any, Any]]:
    """The copy cut along dim 0 into chunks of about :data:`CHUNK_BYTES`: ``(function, dst, src)``."""
    size = max(dst.element_size(), src.element_size())
    rows = max(1, CHUNK_BYTES // (max(1, dst[0].numel()) * size))
    if raw:
        d, s = _as_ints(dst), _as_ints(src)
        return [(np.copyto, d[i : i + rows], s[i : i + rows]) for i in range(0, dst.shape[0], rows)]
    return [(_torch_small, dst[i : i + rows], src[i : i + rows]) for i in range(0, dst.shape[0], rows)]


def _run(jobs: list[tuple[Any, Any, Any]]) -> None:
    """Run ``jobs`` on this thread and the pool's: each thread takes the next job until none is left,
    so a thread that is descheduled holds up one chunk, not a share fixed in advance."""
    queue, lock = iter(jobs), threading.Lock()
    inference = torch.is_inference_mode_enabled()  # thread-local: targets made under it need it to be written

    def work() -> None:
        with torch.inference_mode(inference):
            while True:
                with lock:
                    job = next(queue, None)
                if job is None:
                    return
                fn, a, b = job
                fn(a, b)

    helpers = [_get_pool().submit(work) for _ in range(min(copy_threads(), len(jobs)) - 1)]
    try:
        work()
    finally:
        # a helper that has not started yet (its core is busy) is not waited for: it is cancelled, and
        # this thread has done its share; the targets' memory is written until every started one is done
        started = [f for f in helpers if not f.cancel()]
        wait(started)
    for f in started:
        f.result()


@torch.no_grad()
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
    if dst.shape != src.shape:
        raise ValueError(f"copy_into: shapes differ, {tuple(dst.shape)} and {tuple(src.shape)}")
    if dst.numel() <= TORCH_GRAIN or not _plain(dst, src):
        dst.copy_(src)  # torch copies this on the calling thread alone, or knows what it is
        return
    dst, src = dst.detach(), src.detach()  # the pool's threads do not share this one's no_grad
    if dst.is_contiguous() and src.is_contiguous():  # one run of elements: chunks of any length
        dst, src = dst.view(-1), src.view(-1)
    jobs = _jobs(dst, src, _raw(dst, src))
    nbytes = dst.numel() * max(dst.element_size(), src.element_size())
    if nbytes < PARALLEL_BYTES or len(jobs) == 1 or copy_threads() == 1:
        for fn, a, b in jobs:
            fn(a, b)
        return
    _run(jobs)
