"""Layout-independent hashing: the sum, modulo 2^64, of one 64-bit hash per element of a box.

Every element of a target contributes ``mix(i * K + b)``, where ``i`` is its flat index in the target
(row-major, target coordinates), ``b`` the bit pattern of its value in the target dtype, and ``mix``
the splitmix64 finaliser (a bijection of 64-bit words). The sum over disjoint boxes is the sum over
the whole target, so any rank can hash the boxes it holds, in any order and any cut, and the ranks
add their sums (:mod:`shardsync.exec.digests`). The key ``i * K + b`` is injective in ``b`` at each
index, and injective outright where it can be:

* dtypes of at most 4 bytes (``w`` bits): ``K = 2^w`` (the key is ``i << w | b``) while the target
  has at most ``2^(64 - w)`` elements (2^32 for 4-byte dtypes, 2^48 for 2-byte ones);
* otherwise (8-byte elements, or larger targets): ``K`` = :data:`GOLDEN`, an odd constant;
* a 16-byte element (complex128) is two 8-byte words at flat indices ``2i`` and ``2i + 1``.

So changing any one element always changes the sum; :func:`finish` adds a hash of the shape and dtype
(an all-zero tensor still has a digest that depends on both). See docs/digests.md for the guarantees.

A box is hashed in runs of about :data:`CHUNK_ELEMENTS` elements that stay in cache: the index part of
the keys of a run is one precomputed pattern (the box's strides times ``K``) plus the run's start, so
a run costs one add for the index, one for the bits, the eight operations of ``mix`` and a sum, all in
place in two scratch buffers. A box on an accelerator is hashed there, with torch, to the same sum.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from ..layout.dtypes import dtype_name, to_torch_dtype
from .box_hash_device import DEVICE_CHUNK_ELEMENTS, pattern, runs_sum

__all__ = ["box_sum", "finish", "tensor_digest", "mix", "CHUNK_ELEMENTS", "HOST_DEVICES", "MASK", "GOLDEN"]

#: Elements hashed at once: the two scratch arrays (uint64, this length) stay in cache.
CHUNK_ELEMENTS = 1 << 16
#: Device types whose boxes are hashed with numpy on the host; others (accelerators) are hashed where
#: they lie, with torch (:mod:`shardsync.exec.box_hash_device`: the same sums).
HOST_DEVICES = ("cpu",)
#: Sums are taken modulo 2^64.
MASK = (1 << 64) - 1
#: The index multiplier of keys that do not fit ``i << w | b``: 2^64 / golden ratio, odd.
GOLDEN = 0x9E3779B97F4A7C15
_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def mix(z: np.ndarray, tmp: np.ndarray | None = None) -> np.ndarray:
    """The splitmix64 finaliser, in place on a uint64 array (wrapping arithmetic); returns ``z``.

    Args:
        z: the words to mix.
        tmp: a scratch array of ``z``'s length (None: one is allocated).

    Example:
        >>> hex(int(mix(np.array([1], dtype=np.uint64))[0]))
        '0x5692161d100b05e5'
    """
    tmp = np.empty_like(z) if tmp is None else tmp
    for shift, mul in ((_S30, _C1), (_S27, _C2)):
        np.right_shift(z, shift, out=tmp)
        np.bitwise_xor(z, tmp, out=z)
        np.multiply(z, mul, out=z)
    np.right_shift(z, _S31, out=tmp)
    np.bitwise_xor(z, tmp, out=z)
    return z


def _strides(shape: Sequence[int]) -> list[int]:
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= size
    return out[::-1]


def _runs(sizes: Sequence[int], split: int, rows: int) -> Iterator[tuple[tuple[int, ...], int, int]]:
    """The runs of a box of ``sizes``: ``(leading indices, start, stop)``, the run being
    ``[*leading, start:stop, ...]`` along dim ``split`` (at most ``rows`` of it)."""
    for lead in itertools.product(*(range(s) for s in sizes[:split])):
        for start in range(0, sizes[split], rows):
            yield lead, start, min(start + rows, sizes[split])


def _pattern(sizes: Sequence[int], strides: Sequence[int], words: int, step: int) -> np.ndarray:
    """The index part of the keys of a run of ``sizes`` with (scaled) ``strides``, relative to its first
    element, shaped like the run (a last dim of ``words`` when an element is several words)."""
    index = np.zeros((), dtype=np.uint64)
    for size, s in zip(sizes, strides):
        index = np.add.outer(index, np.arange(size, dtype=np.uint64) * np.uint64(s))
    if words > 1:
        index = np.add.outer(index, np.arange(words, dtype=np.uint64) * np.uint64(step))
    return np.ascontiguousarray(index)


def _bits(values: torch.Tensor, words: int) -> np.ndarray:
    """The bit patterns of ``values`` as unsigned integers of their width, a view where the strides
    allow (numpy reads strided data in place: no copy), shaped like ``values`` (a last dim of
    ``words`` when an element is several words); the add that puts them in the keys widens them."""
    if words > 1:  # complex128: its two float64 words
        values = torch.view_as_real(values.contiguous())
    elif values.dtype == torch.bool:
        values = values.view(torch.uint8)
    size = values.element_size()
    return values.cpu().view(_INT[size]).numpy().view(_UINT[size])


def _key_step(dtype: torch.dtype, numel: int) -> tuple[int, int]:
    """``(words per element, K)`` of a target of ``numel`` elements of ``dtype``."""
    words = max(1, dtype.itemsize // 8)
    width = 8 * min(dtype.itemsize, 8)
    fits = width < 64 and numel * words <= 1 << (64 - width)
    return words, (1 << width) if fits else GOLDEN


def box_sum(values: torch.Tensor, shape: Sequence[int], offsets: Sequence[int],
            perm: Sequence[int] | None = None, casts: Sequence[str] = ()) -> int:
    """The sum (mod 2^64) of the element hashes of a box of a target, from the values of its source.

    Args:
        values: the box's values, in source order (any strides, any device).
        shape: the target's global shape.
        offsets: where the box starts in the target (target dims).
        perm: target dim i is dim ``perm[i]`` of ``values`` (None: the same order).
        casts: dtype names applied to ``values`` in order; the last is the target dtype.

    Returns:
        the sum, an int in [0, 2^64).

    Example:
        >>> full = torch.arange(6.).reshape(2, 3)
        >>> whole = box_sum(full, (2, 3), (0, 0))
        >>> whole == (box_sum(full[:, :1], (2, 3), (0, 0)) + box_sum(full[:, 1:], (2, 3), (0, 1))) % 2**64
        True
    """
    dtype = to_torch_dtype(casts[-1]) if casts else values.dtype
    words, step = _key_step(dtype, math.prod(shape))
    if values.numel() == 0:
        return 0
    unit = words * step  # the key of flat index i starts at i * words * K: K is folded into the strides
    target = _strides(shape)
    inv = list(range(values.dim())) if perm is None else [perm.index(d) for d in range(values.dim())]
    stride = [(target[inv[d]] * unit) & MASK for d in range(values.dim())]
    base = sum(o * s for o, s in zip(offsets, target)) * unit & MASK
    if values.dim() == 0:
        values, stride = values.reshape(1), [unit]
    sizes = tuple(values.shape)
    host = values.device.type in HOST_DEVICES
    chunk = CHUNK_ELEMENTS if host else DEVICE_CHUNK_ELEMENTS
    split = next(j for j in range(len(sizes)) if math.prod(sizes[j + 1:]) <= chunk)
    rows = min(sizes[split], max(1, chunk // math.prod(sizes[split + 1:])))
    runs = list(_runs(sizes, split, rows))
    if not host:  # hashed where it lies, with torch
        index = pattern((rows, *sizes[split + 1:]), stride[split:], words, step, values.device)
        return runs_sum(values, casts, base, stride, words, index, runs) & MASK
    index_np = _pattern((rows, *sizes[split + 1:]), stride[split:], words, step)
    return _hash_runs(values, casts, base, stride, words, index_np, runs) & MASK


def _hash_runs(values: torch.Tensor, casts: Sequence[str], base: int, stride: Sequence[int], words: int,
               index: np.ndarray, runs: Sequence[tuple[tuple[int, ...], int, int]]) -> int:
    """The sum (not reduced mod 2^64) of the element hashes of ``runs`` of a box (as
    :func:`~shardsync.exec.box_hash_device.runs_sum`), in two scratch buffers."""
    keys, tmp = np.empty_like(index), np.empty_like(index)
    total = 0
    for lead, start, stop in runs:
        where: tuple[int | slice, ...] = (*lead, slice(start, stop))
        run = values[where]
        for c in casts:
            run = run.to(to_torch_dtype(c))
        at = (base + sum(i * s for i, s in zip((*lead, start), stride))) & MASK
        z = keys[:stop - start]
        np.add(index[:stop - start], np.uint64(at), out=z)
        np.add(z, _bits(run, words), out=z)
        total += int(np.add.reduce(mix(z, tmp[:stop - start]), axis=None))
    return total


def finish(total: int, shape: Sequence[int], dtype: str | torch.dtype) -> str:
    """The digest of a target from the sum of its element hashes: 16 hex digits.

    The sum plus a hash of the shape and dtype (mod 2^64): two targets of one shape and dtype have the
    same digest exactly when their sums are equal.

    Example:
        >>> finish(0, (2, 3), "float32") != finish(0, (3, 2), "float32")
        True
    """
    head = hashlib.blake2b(f"{dtype_name(dtype)}{list(shape)}".encode(), digest_size=8).digest()
    return f"{(total + int.from_bytes(head, 'little')) & MASK:016x}"


def tensor_digest(tensor: torch.Tensor) -> str:
    """The digest of a whole tensor, computed here (no collective): what :func:`shardsync.digest`
    gives for a target with these values, whatever its layout.

    Example:
        >>> tensor_digest(torch.zeros(3)) == tensor_digest(torch.zeros(3, dtype=torch.float64))
        False
    """
    shape = tuple(tensor.shape)
    return finish(box_sum(tensor, shape, (0,) * len(shape)), shape, tensor.dtype)
