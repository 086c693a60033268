"""Views of virtual tensors: unit dims added or removed, and reshapes (row-major, as
``torch.reshape``), each kept as rectangular fragments of the sources.

A fragment can drop or add dims of size 1 (its ``perm`` says which, see :class:`~.vtensor.Frag`), so a
squeeze or unsqueeze costs nothing. A reshape that merges two dims cuts each fragment into one per
index of the outer dim, and one that splits a dim cuts it into one per row of the inner size: the
pieces stay rectangular, so every source box (a shard along any dim) is read where it lies.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import replace

from ..layout.box import Box
from .vtensor import Frag, VTensor

__all__ = ["unsqueeze", "squeeze", "merge_dims", "split_dim", "reshape", "infer_shape"]


def _cut(f: Frag, dim: int, lo: int, hi: int) -> Frag:
    """``f`` restricted to ``[lo, hi)`` along variable dim ``dim`` (global variable coordinates)."""
    offsets, sizes = list(f.box.offsets), list(f.box.sizes)
    src_off, src_size = list(f.source_box.offsets), list(f.source_box.sizes)
    p = f.perm[dim]
    if p >= 0:
        src_off[p] += lo - offsets[dim]
        src_size[p] = hi - lo
    offsets[dim], sizes[dim] = lo, hi - lo
    return replace(f, box=Box(tuple(offsets), tuple(sizes)), source_box=Box(tuple(src_off), tuple(src_size)))


def _edit(seq: Sequence[int], dim: int, new: Sequence[int], drop: int = 1) -> tuple[int, ...]:
    """``seq`` with ``drop`` entries at ``dim`` replaced by ``new``."""
    return tuple(seq[:dim]) + tuple(new) + tuple(seq[dim + drop :])


def unsqueeze(v: VTensor, dim: int) -> VTensor:
    """A new dim of size 1 at ``dim`` (``0 <= dim <= v.ndim``)."""
    frags = tuple(
        replace(
            f,
            box=Box(_edit(f.box.offsets, dim, [0], 0), _edit(f.box.sizes, dim, [1], 0)),
            perm=_edit(f.perm, dim, [-1], 0),
        )
        for f in v.frags
    )
    return VTensor(_edit(v.shape, dim, [1], 0), v.dtype, frags)


def squeeze(v: VTensor, dim: int) -> VTensor:
    """Dim ``dim``, of size 1, removed."""
    if v.shape[dim] != 1:
        raise ValueError(f"dim {dim} has size {v.shape[dim]}, not 1")
    frags = tuple(
        replace(f, box=Box(_edit(f.box.offsets, dim, []), _edit(f.box.sizes, dim, [])), perm=_edit(f.perm, dim, []))
        for f in v.frags
        if not f.box.empty
    )
    return VTensor(_edit(v.shape, dim, []), v.dtype, frags)


def merge_dims(v: VTensor, dim: int) -> VTensor:
    """Dims ``dim`` and ``dim + 1`` merged into one of their product (row-major)."""
    inner = v.shape[dim + 1]
    frags = []
    for f in v.frags:
        for i in range(f.box.offsets[dim], f.box.stops[dim]):
            g = _cut(f, dim, i, i + 1)
            at = i * inner + g.box.offsets[dim + 1]
            frags.append(
                replace(
                    g,
                    box=Box(_edit(g.box.offsets, dim, [at], 2), _edit(g.box.sizes, dim, [g.box.sizes[dim + 1]], 2)),
                    perm=_edit(g.perm, dim, []),
                )
            )
    return VTensor(_edit(v.shape, dim, [v.shape[dim] * inner], 2), v.dtype, tuple(frags))


def _rows(lo: int, hi: int, inner: int) -> Iterator[tuple[int, int, int]]:
    """``(row, start, stop)`` for each row of ``inner`` entries that ``[lo, hi)`` touches."""
    for row in range(lo // inner, (hi - 1) // inner + 1):
        yield row, max(lo, row * inner), min(hi, (row + 1) * inner)


def split_dim(v: VTensor, dim: int, outer: int) -> VTensor:
    """Dim ``dim`` viewed as ``[outer, size // outer]`` (row-major); ``outer`` must divide it."""
    n = v.shape[dim]
    if outer <= 0 or n % outer:
        raise ValueError(f"dim {dim} of size {n} does not split into {outer} rows")
    inner = n // outer
    frags = []
    for f in v.frags:
        if f.box.empty:
            continue
        for row, lo, hi in _rows(f.box.offsets[dim], f.box.stops[dim], inner):
            g = _cut(f, dim, lo, hi)
            frags.append(
                replace(
                    g,
                    box=Box(_edit(g.box.offsets, dim, [row, lo - row * inner]), _edit(g.box.sizes, dim, [1, hi - lo])),
                    perm=_edit(g.perm, dim, [-1, g.perm[dim]]),
                )
            )
    return VTensor(_edit(v.shape, dim, [outer, inner]), v.dtype, tuple(frags))


def infer_shape(shape: Sequence[int], numel: int) -> tuple[int, ...]:
    """``shape`` with its one ``-1`` (if any) filled in so that it holds ``numel`` entries.

    Raises:
        ValueError: more than one -1, a size below -1, or a shape that cannot hold ``numel`` entries.

    Example:
        >>> infer_shape([4, -1, 2], 24)
        (4, 3, 2)
    """
    if sum(s == -1 for s in shape) > 1 or any(s < -1 for s in shape):
        raise ValueError(f"{list(shape)}: sizes are non-negative, with at most one -1 (inferred)")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if known == 0 or numel % known:
            raise ValueError(f"{list(shape)} cannot hold {numel} entries")
        shape = [numel // known if s == -1 else s for s in shape]
    if math.prod(shape) != numel:
        raise ValueError(f"{list(shape)} holds {math.prod(shape)} entries, not {numel}")
    return tuple(shape)


def _groups(old: Sequence[int], new: Sequence[int]) -> list[tuple[int, int]]:
    """How many consecutive dims of ``old`` and of ``new`` (no unit dims, same product) make each
    group of equal product, in order."""
    groups, i, j = [], 0, 0
    while i < len(old):
        a, b, pi, pj = old[i], new[j], i + 1, j + 1
        while a != b:
            if a < b:
                a, pi = a * old[pi], pi + 1
            else:
                b, pj = b * new[pj], pj + 1
        groups.append((pi - i, pj - j))
        i, j = pi, pj
    return groups


def reshape(v: VTensor, shape: Sequence[int]) -> VTensor:
    """``v`` reshaped (row-major, as ``torch.reshape``) to ``shape``, which holds as many entries.

    Example:
        >>> from shardsync.mapping.vtensor import source_tensor
        >>> w = reshape(source_tensor("w", (1, 6, 4), "float32"), (6, 4))
        >>> w.shape, w.frags[0].perm
        ((6, 4), (1, 2))
    """
    if math.prod(shape) != math.prod(v.shape):
        raise ValueError(f"{list(v.shape)} cannot be reshaped to {list(shape)}")
    if math.prod(shape) == 0:  # nothing to read: any tiling of no entries
        return VTensor(tuple(shape), v.dtype, ())
    for d in reversed(range(v.ndim)):
        if v.shape[d] == 1:
            v = squeeze(v, d)
    dims = [s for s in shape if s != 1]
    at = 0
    for n_old, n_new in _groups(v.shape, dims):
        for _ in range(n_old - 1):
            v = merge_dims(v, at)
        for k in range(n_new - 1):
            v = split_dim(v, at + k, dims[at + k])
        at += n_new
    for d, s in enumerate(shape):
        if s == 1:
            v = unsqueeze(v, d)
    return v
