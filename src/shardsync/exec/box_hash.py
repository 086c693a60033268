"""Layout-independent hashing: a random-linear checksum of a box, a sum over its elements mod 2^64.

An element of a target at row ``q`` and column ``c`` (``c`` its index in the target's last dim, ``q``
the row-major flat index over the other dims, 0 for a 1-d or 0-d target) with bit pattern ``b``
(zero-extended to 64 bits; an 8-byte word as ``b ^ (b >> 32)``) contributes ``A(q) * B(c) * b``,
where ``A(q) = mix(q ^ SEED_A) | 1``, ``B(c) = mix(c ^ SEED_B) | 1`` and ``mix`` is the splitmix64
finaliser; all arithmetic is modulo 2^64. Elements of 1 and 2 bytes count as their place in a 32-bit
word of ``g = 4 / size`` of them: their ``B(c)`` is ``B(c // g) << (32 / g) * (c % g)`` (so whole
words of a row are summed as words). A 16-byte element (complex128) is two 8-byte words at columns
``2c`` and ``2c + 1`` (the last dim doubled). Narrow targets fold trailing dims into the column index
(:func:`folded`: the shape alone decides).

The weights are odd (times a power of two below 2^32 for small elements), so changing any one element
always changes the sum; the sum over disjoint boxes is the sum over the whole target, so any rank can
hash the boxes it holds, in any order and any cut, and the ranks add their sums
(:mod:`shardsync.exec.digests`). :func:`finish` adds a hash of the shape and dtype (an all-zero tensor
still has a digest that depends on both). See docs/digests.md for the guarantees.

A box is hashed in runs of about :data:`CHUNK_ELEMENTS` elements, as
``sum_q A(q) * (sum_c B(c) * b[q, c])``: per element (per 32-bit word of small elements) one widening
multiply-add (``np.einsum``, read in place from strided boxes), then one product per row. ``B`` of a
target's width is computed once and cached; ``A`` per run (as many values as the run has rows). A box
on an accelerator is hashed there, with torch, to the same sum
(:mod:`shardsync.exec.box_hash_device`).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import sys
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..layout.dtypes import BITS, dtype_name, to_torch_dtype
from .box_hash_device import DEVICE_CHUNK_ELEMENTS, run_values, runs_sum

__all__ = [
    "box_sum",
    "finish",
    "tensor_digest",
    "mix",
    "weights",
    "column_weights",
    "folded",
    "Run",
    "CHUNK_ELEMENTS",
    "HOST_DEVICES",
    "MASK",
    "SEED_A",
    "SEED_B",
    "CACHED_WIDTH",
    "NARROW",
    "FOLD_LIMIT",
]

#: Elements hashed at once on the host (a run: its casts' temporaries and its row weights stay small).
CHUNK_ELEMENTS = 1 << 18
#: Device types whose boxes are hashed with numpy on the host; others (accelerators) are hashed where
#: they lie, with torch (:mod:`shardsync.exec.box_hash_device`: the same sums).
HOST_DEVICES = ("cpu",)
#: Sums are taken modulo 2^64.
MASK = (1 << 64) - 1
#: The seeds of the row weights ``A`` and the column weights ``B`` (digits of pi).
SEED_A, SEED_B = 0x243F6A8885A308D3, 0x13198A2E03707344
#: Widths (in words) whose column weights are cached whole; wider targets compute the slice of a run.
CACHED_WIDTH = 1 << 18
#: Trailing dims are folded into the column index while it has fewer columns than this (so that a
#: narrow target, a conv kernel's [.., 3, 3], costs few row weights), up to ``FOLD_LIMIT`` columns.
NARROW, FOLD_LIMIT = 64, 1 << 16
_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S32 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32)
_ONE = np.uint64(1)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

#: A run of a box (target order): ``(leading indices, start, stop, first column, end column)``, the
#: elements ``[*leading, start:stop, ..., c0:c1]``, ``start:stop`` along the split dim.
Run = tuple[tuple[int, ...], int, int, int, int]


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


def weights(index: np.ndarray, seed: int, tmp: np.ndarray | None = None) -> np.ndarray:
    """The odd weights ``mix(index ^ seed) | 1``, in place on a uint64 array; returns it.

    Example:
        >>> w = weights(np.arange(4, dtype=np.uint64), SEED_B)
        >>> bool((w & np.uint64(1)).all()), len(set(w.tolist()))
        (True, 4)
    """
    np.bitwise_xor(index, np.uint64(seed), out=index)
    return np.bitwise_or(mix(index, tmp), _ONE, out=index)


def _expanded(c0: int, c1: int, group: int) -> np.ndarray:
    """The weights of columns ``c0..c1`` whose elements are packed ``group`` to a 32-bit word:
    ``B(c // group) << (32 // group) * (c % group)`` (``B(c)`` when ``group`` is 1)."""
    c = np.arange(c0, c1, dtype=np.uint64)
    if group == 1:
        return weights(c, SEED_B)
    g = np.uint64(group)
    out = weights(c // g, SEED_B)
    return np.left_shift(out, (c % g) * np.uint64(32 // group), out=out)


@functools.lru_cache(maxsize=16)
def _column_weights(width: int, group: int) -> np.ndarray:
    """The weights of all columns of a target ``width`` words wide, read-only (cached per width)."""
    out = _expanded(0, width, group)
    out.setflags(write=False)
    return out


def column_weights(width: int, c0: int, c1: int, group: int = 1) -> np.ndarray:
    """The weights of columns ``c0..c1`` of a target ``width`` words wide, its elements packed ``group``
    to a 32-bit word (a slice of the cached whole where the target is not too wide).

    Example:
        >>> w = column_weights(6, 0, 6, group=2)
        >>> bool((w[1::2] == w[::2] << np.uint64(16)).all()), bool((w[::2] == column_weights(3, 0, 3)).all())
        (True, True)
    """
    if width <= CACHED_WIDTH:
        return _column_weights(width, group)[c0:c1]
    return _expanded(c0, c1, group)


def folded(shape: Sequence[int]) -> int:
    """How many trailing dims of a target of ``shape`` make its column index: the last, and the ones
    before it while the columns are fewer than :data:`NARROW` and would stay at most
    :data:`FOLD_LIMIT` (the shape alone decides: the same for every box of the target).

    Example:
        >>> folded((4096, 11008)), folded((64, 32, 3, 3)), folded((100000, 1)), folded(())
        (1, 3, 1, 0)
    """
    m = min(1, len(shape))
    while m < len(shape) and math.prod(shape[-m:]) < NARROW and math.prod(shape[-m - 1 :]) <= FOLD_LIMIT:
        m += 1
    return m


def _row_strides(shape: Sequence[int], m: int) -> list[int]:
    """Row-major strides of the row index ``q`` over the target dims but the last ``m`` (0 for those)."""
    out, step = [0] * m, 1
    for size in reversed(shape[:-m]):
        out.append(step)
        step *= size
    return out[::-1]


def _runs(sizes: Sequence[int], m: int, chunk: int) -> tuple[int, int, list[Run]]:
    """``(split dim, rows per run, runs)`` of a box of ``sizes`` (row dims, then ``m`` column dims),
    runs of at most about ``chunk`` elements (the columns are cut only when ``m`` is 1)."""
    n, cols = len(sizes) - m, sizes[-1]
    width = max(1, min(cols, chunk)) if m == 1 else cols
    row = math.prod(sizes[n:-1]) * width
    split = next((j for j in range(n) if math.prod(sizes[j + 1 : n]) * row <= chunk), n - 1)
    rows = min(sizes[split], max(1, chunk // (math.prod(sizes[split + 1 : n]) * row)))
    runs = [
        (lead, start, min(start + rows, sizes[split]), c0, min(c0 + width, cols))
        for lead in itertools.product(*(range(s) for s in sizes[:split]))
        for start in range(0, sizes[split], rows)
        for c0 in range(0, cols, width)
    ]
    return split, rows, runs


def _pattern(sizes: Sequence[int], strides: Sequence[int]) -> np.ndarray:
    """The row indices of a run of row ``sizes`` with ``strides``, relative to its first row."""
    index = np.zeros((), dtype=np.uint64)
    for size, s in zip(sizes, strides):
        index = np.add.outer(index, np.arange(size, dtype=np.uint64) * np.uint64(s))
    return np.ascontiguousarray(index)


def _bits(values: torch.Tensor) -> np.ndarray:
    """The bit patterns of ``values`` as unsigned integers of their width, a view where the strides
    allow (numpy reads strided data in place), shaped like ``values`` (complex128: the last dim
    doubled, the two float64 words of each element); the products widen them. An 8-byte word ``b``
    is ``b ^ (b >> 32)``, a bijection that moves a change of its top bits (a sign) into the low half."""
    if values.dtype == torch.complex128:
        values = torch.view_as_real(values).flatten(-2)
    elif values.dtype == torch.bool:
        values = values.view(torch.uint8)
    size = values.element_size()
    # through DLPack: torch's numpy() would leave the caller's storage unresizable (FSDP resizes them)
    bits = np.from_dlpack(values.detach().cpu().view(BITS[size])).view(_UINT[size])
    return np.bitwise_xor(bits, np.right_shift(bits, _S32)) if size == 8 else bits


def box_sum(
    values: torch.Tensor,
    shape: Sequence[int],
    offsets: Sequence[int],
    perm: Sequence[int] | None = None,
    casts: Sequence[str] = (),
) -> int:
    """The sum (mod 2^64) of the element terms of a box of a target, from the values of its source.

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
    if values.numel() == 0:
        return 0
    dtype = to_torch_dtype(casts[-1]) if casts else values.dtype
    words = 2 if dtype.itemsize == 16 else 1
    view = values if perm is None else values.permute(tuple(perm))  # target order
    if view.dim() == 0:
        view, shape, offsets = view.reshape(1), (1,), (0,)
    m = folded(shape)
    if view.dim() == m:  # no row dims: one row, q = 0
        view, shape, offsets = view.unsqueeze(0), (1, *shape), (0, *offsets)
    strides, width = _row_strides(shape, m), math.prod(shape[-m:]) * words
    base = sum(o * s for o, s in zip(offsets, strides))
    host = view.device.type in HOST_DEVICES
    split, rows, runs = _runs(view.shape, m, (CHUNK_ELEMENTS if host else DEVICE_CHUNK_ELEMENTS) // words)
    q = _pattern((rows, *view.shape[split + 1 : -m]), strides[split:-m])
    inner = tuple(slice(o, o + n) for o, n in zip(offsets[-m:-1], view.shape[-m:-1]))
    group = 4 // dtype.itemsize if dtype.itemsize < 4 else 1  # elements per 32-bit word

    def columns(c0: int, c1: int) -> np.ndarray:  # the weights of the run's columns c0:c1 of the box
        at = slice((offsets[-1] + c0) * words, (offsets[-1] + c1) * words)
        if m == 1:
            return column_weights(width, at.start, at.stop, group)
        return column_weights(width, 0, width, group).reshape(*shape[-m:-1], -1)[inner + (at,)]

    if not host:  # hashed where it lies, with torch
        return runs_sum(view, casts, (base, strides, m), q, runs, columns) & MASK
    packing = (offsets[-1], group if m == 1 and sys.byteorder == "little" else 1, -(-width // group))
    return _host_sum(view, casts, (base, strides, m), q, runs, columns, packing) & MASK


def _host_sum(
    view: torch.Tensor,
    casts: Sequence[str],
    frame: tuple[int, Sequence[int], int],
    q: np.ndarray,
    runs: Sequence[Run],
    columns: Callable[[int, int], np.ndarray],
    packing: tuple[int, int, int],
) -> int:
    """The sum (not reduced mod 2^64) of the terms of ``runs`` of a box in target order (as
    :func:`~shardsync.exec.box_hash_device.runs_sum`); ``packing``: see :func:`_row_sums`."""
    base, strides, m = frame
    dims = "abcdefghijklmnopqrstuvwxyz"[:m]
    rows, tmp = np.empty_like(q), np.empty_like(q)
    total = 0
    for lead, start, stop, c0, c1 in runs:
        sums = _row_sums(_bits(run_values(view, (lead, start, stop, c0, c1), casts)), dims, c0, c1, columns, packing)
        at = (base + sum(i * s for i, s in zip((*lead, start), strides))) & MASK
        a = np.add(q[: stop - start], np.uint64(at), out=rows[: stop - start])
        np.multiply(sums, weights(a, SEED_A, tmp[: stop - start]), out=sums)
        total += int(np.add.reduce(sums, axis=None))
    return total


def _row_sums(
    bits: np.ndarray,
    dims: str,
    c0: int,
    c1: int,
    columns: Callable[[int, int], np.ndarray],
    packing: tuple[int, int, int],
) -> np.ndarray:
    """``sum_c weight(c) * b[..., c]`` of the bits of a run (columns ``c0:c1`` of its box), per row.

    ``packing``: the box's first column in the target, elements per 32-bit word (1: no packing), and
    the target's width in words. Where the elements of a row lie side by side, the columns that fill
    whole words are summed as 32-bit words with the word weights ``B(p)`` (half or a quarter of the
    multiply-adds; the same sum), the few at the edges element by element.
    """

    def plain(a: int, b: int) -> np.ndarray:  # columns c0 + a : c0 + b, element by element
        part = bits if (a, b) == (0, c1 - c0) else bits[..., a:b]  # (complex128: two words per column)
        return np.einsum(f"...{dims},{dims}->...", part, columns(c0 + a, c0 + b), dtype=np.uint64, casting="unsafe")

    first, group, width = packing
    a0 = -(first + c0) % group
    a1 = a0 + max(0, c1 - c0 - a0) // group * group
    if group == 1 or bits.strides[-1] != bits.itemsize or a1 <= a0:
        return plain(0, c1 - c0)
    p0 = (first + c0 + a0) // group
    sums = np.einsum(
        "...c,c->...",
        bits[..., a0:a1].view(np.uint32),
        column_weights(width, p0, p0 + (a1 - a0) // group),
        dtype=np.uint64,
        casting="unsafe",
    )
    for a, b in ((0, a0), (a1, c1 - c0)):
        if b > a:
            sums += plain(a, b)
    return sums


def finish(total: int, shape: Sequence[int], dtype: str | torch.dtype) -> str:
    """The digest of a target from the sum of its element terms: 16 hex digits.

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
