"""Layout-independent hashing: the sum, modulo 2^64, of one 64-bit hash per element of a box.

Every element of a target contributes ``mix(key(i, b))``, where ``i`` is its flat index in the target
(row-major, target coordinates), ``b`` the bit pattern of its value in the target dtype, and ``mix``
the splitmix64 finaliser (a bijection of 64-bit words). The sum over disjoint boxes is the sum over
the whole target, so any rank can hash the boxes it holds, in any order and any cut, and the ranks
add their sums (:mod:`shardsync.exec.digests`). ``key`` is injective:

* dtypes of at most 4 bytes (``w`` bits): ``key = i << w | b`` while the target has at most
  ``2^(64 - w)`` elements (2^32 for 4-byte dtypes, 2^48 for 2-byte ones);
* otherwise (8-byte elements, or larger targets): ``key = mix(i) ^ b``, injective in ``b`` for a
  given ``i``;
* a 16-byte element (complex128) is two 8-byte words at flat indices ``2i`` and ``2i + 1``.

So changing any one element always changes the sum; :func:`finish` adds a hash of the shape and dtype
(an all-zero tensor still has a digest that depends on both). See docs/digests.md for the guarantees.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from ..layout.dtypes import dtype_name, to_torch_dtype

__all__ = ["box_sum", "finish", "tensor_digest", "mix", "CHUNK_ELEMENTS", "MASK"]

#: Elements hashed at once: the temporaries (a few uint64 arrays of this length) stay in cache.
CHUNK_ELEMENTS = 1 << 16
#: Sums are taken modulo 2^64.
MASK = (1 << 64) - 1
_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def mix(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, in place on a uint64 array (wrapping arithmetic); returns ``z``.

    Example:
        >>> hex(int(mix(np.array([1], dtype=np.uint64))[0]))
        '0x5692161d100b05e5'
    """
    tmp = np.empty_like(z)
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


def _chunks(sizes: Sequence[int]) -> Iterator[tuple[tuple[int, ...], int, int, int]]:
    """Cut a box of ``sizes`` into runs of at most about :data:`CHUNK_ELEMENTS` elements: yields
    ``(leading indices, split dim, start, stop)``; the run is ``[*leading, start:stop, ...]``."""
    split = next(j for j in range(len(sizes) + 1) if math.prod(sizes[j:]) <= CHUNK_ELEMENTS)
    if split == 0:
        yield (), -1, 0, 0
        return
    dim = split - 1
    rows = max(1, CHUNK_ELEMENTS // math.prod(sizes[split:]))
    for lead in itertools.product(*(range(s) for s in sizes[:dim])):
        for start in range(0, sizes[dim], rows):
            yield lead, dim, start, min(start + rows, sizes[dim])


def _bits(values: torch.Tensor, words: int) -> np.ndarray:
    """The bit patterns of contiguous ``values`` as unsigned integers of their width, one per word
    (``words`` per element); the ufuncs that combine them with the uint64 index widen them."""
    flat = values.reshape(-1)
    size = flat.element_size() // words
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(_INT[size]).cpu().numpy().view(_UINT[size])


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
    words = max(1, dtype.itemsize // 8)
    width = 8 * min(dtype.itemsize, 8)
    numel = math.prod(shape) * words
    shifted = width < 64 and numel <= 1 << (64 - width)
    inv = list(range(values.dim())) if perm is None else [perm.index(d) for d in range(values.dim())]
    target = _strides(shape)
    scale = 1 << width if shifted else words  # idx << w is idx * 2^w: folded into the strides
    base = sum(o * s for o, s in zip(offsets, target)) * scale
    stride = [(target[inv[d]] * scale) & MASK for d in range(values.dim())]
    if values.numel() == 0:
        return 0
    total = 0
    for lead, dim, start, stop in _chunks(values.shape):
        where: tuple[int | slice, ...] = (*lead, slice(start, stop))
        run = values[where] if dim >= 0 else values
        for c in casts:
            run = run.to(to_torch_dtype(c))
        at = (base + sum(i * s for i, s in zip(lead, stride))) & MASK
        if dim >= 0:
            rows = np.arange(start, stop, dtype=np.uint64) * np.uint64(stride[dim]) + np.uint64(at)
        else:
            rows = np.array([at], dtype=np.uint64)
        index = _run_index(rows, values.shape[dim + 1:], stride[dim + 1:], 1 if shifted else words)
        bits = _bits(run.contiguous(), words)
        if shifted:
            np.bitwise_or(index, bits, out=index)
        else:
            np.bitwise_xor(mix(index), bits, out=index)
        total += int(mix(index).sum(dtype=np.uint64))
    return total & MASK


def _run_index(rows: np.ndarray, inner: Sequence[int], strides: Sequence[int], words: int) -> np.ndarray:
    """The keys' index part of a run (uint64, in the run's element order, ``words`` per element):
    ``rows`` (that of its first elements along the split dim) plus the inner dims' (scaled strides)."""
    index = rows
    for size, s in zip(inner, strides):
        index = np.add.outer(index, np.arange(size, dtype=np.uint64) * np.uint64(s)).reshape(-1)
    if words > 1:
        index = np.add.outer(index, np.arange(words, dtype=np.uint64)).reshape(-1)
    return np.ascontiguousarray(index)


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
