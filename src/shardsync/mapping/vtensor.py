"""Virtual tensors: a variable of a mapping program as rectangular fragments of source tensors.

Every operation of the language keeps fragments rectangular: a slice cuts boxes, a concat shifts
them, a permutation permutes them (and composes with each fragment's own permutation), a cast appends
to each fragment's cast chain. No data is touched; :func:`to_pieces` turns the result into pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..layout.box import Box
from .pieces import Piece

__all__ = [
    "Frag",
    "VTensor",
    "source_tensor",
    "take",
    "split",
    "chunk",
    "concat",
    "permute",
    "cast",
    "simplify_casts",
    "to_pieces",
]

# Casts that represent every value of the first dtype exactly in the second: dropping them from a
# chain changes no result, which lets a chain such as f32 -> f64 -> bf16 run as one copy.
_EXACT = {
    "bool": {"uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"},
    "uint8": {"int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"},
    "int8": {"int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"},
    "int16": {"int32", "int64", "float32", "float64"},
    "int32": {"int64", "float64"},
    "float16": {"float32", "float64"},
    "bfloat16": {"float32", "float64"},
    "float32": {"float64"},
}


def simplify_casts(start: str, casts: Sequence[str]) -> tuple[str, ...]:
    """Drop no-op casts and exact intermediate steps; the result equals the chain bit for bit."""
    chain = [start, *casts]
    out: list[str] = []
    for i in range(1, len(chain)):
        prev = out[-1] if out else start
        cur = chain[i]
        if cur == prev:
            continue
        last = i == len(chain) - 1
        if not last and cur in _EXACT.get(prev, ()):
            continue  # exact widening: the next cast sees the same value
        out.append(cur)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Frag:
    """A box of a variable (``box``) filled from ``source_box`` of source ``source`` (whose dtype is
    ``source_dtype``), permuted by ``perm`` and cast through ``casts``. ``perm[i]`` is the source dim of
    variable dim i, or -1 for a unit dim the source lacks; source dims it leaves out are unit dims of
    ``source_box`` that the variable lacks (see :mod:`.views`)."""

    source: str
    source_dtype: str
    source_box: Box
    box: Box
    perm: tuple[int, ...]
    casts: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class VTensor:
    """A program variable: shape, dtype name and the fragments tiling it."""

    shape: tuple[int, ...]
    dtype: str
    frags: tuple[Frag, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)


def source_tensor(key: str, shape: Sequence[int], dtype: str) -> VTensor:
    """The variable that is source ``key`` itself."""
    box = Box.full(shape)
    return VTensor(tuple(shape), dtype, (Frag(key, dtype, box, box, tuple(range(len(shape)))),))


def take(v: VTensor, dim: int, start: int, stop: int) -> VTensor:
    """``v[..., start:stop, ...]`` along ``dim``."""
    slab_off = [0] * v.ndim
    slab_size = list(v.shape)
    slab_off[dim], slab_size[dim] = start, stop - start
    slab = Box(tuple(slab_off), tuple(slab_size))
    shift = [0] * v.ndim
    shift[dim] = -start
    frags = []
    for f in v.frags:
        hit = f.box.intersect(slab)
        if hit is None:
            continue
        rel = hit.relative_to(f.box)  # in variable dims; map back to source dims through perm
        src_off = list(f.source_box.offsets)
        src_size = list(f.source_box.sizes)
        for i, p in enumerate(f.perm):
            if p >= 0:  # -1: a unit dim of the variable that the source lacks
                src_off[p] += rel.offsets[i]
                src_size[p] = rel.sizes[i]
        frags.append(replace(f, source_box=Box(tuple(src_off), tuple(src_size)), box=hit.shift(shift)))
    shape = list(v.shape)
    shape[dim] = stop - start
    return VTensor(tuple(shape), v.dtype, tuple(frags))


def split(v: VTensor, dim: int, sizes: Sequence[int]) -> list[VTensor]:
    """Consecutive slices of ``sizes`` along ``dim``; the sizes must sum to ``v.shape[dim]``.

    Example:
        >>> [p.shape for p in split(source_tensor("w", (5, 2), "float32"), 0, [2, 3])]
        [(2, 2), (3, 2)]
    """
    if sum(sizes) != v.shape[dim] or min(sizes, default=0) < 0:
        raise ValueError(f"sizes {list(sizes)} do not split {v.shape[dim]} (dim {dim})")
    out, at = [], 0
    for s in sizes:
        out.append(take(v, dim, at, at + s))
        at += s
    return out


def chunk(v: VTensor, dim: int, parts: int) -> list[VTensor]:
    """``parts`` equal slices along ``dim``; ``parts`` must divide ``v.shape[dim]`` (callers check it
    first, to report the problem in their own terms)."""
    n = v.shape[dim]
    if parts <= 0 or n % parts:
        raise ValueError(f"size {n} of dim {dim} is not divisible into {parts} parts")
    return split(v, dim, [n // parts] * parts)


def concat(parts: Sequence[VTensor], dim: int) -> VTensor:
    """Concatenate along ``dim`` (the caller has checked dtypes and the other dims)."""
    frags = []
    at = 0
    for part in parts:
        shift = [0] * part.ndim
        shift[dim] = at
        frags += [replace(f, box=f.box.shift(shift)) for f in part.frags]
        at += part.shape[dim]
    shape = list(parts[0].shape)
    shape[dim] = at
    return VTensor(tuple(shape), parts[0].dtype, tuple(frags))


def permute(v: VTensor, perm: Sequence[int]) -> VTensor:
    """New dim i is old dim ``perm[i]``."""
    frags = tuple(replace(f, box=f.box.permute(perm), perm=tuple(f.perm[p] for p in perm)) for f in v.frags)
    return VTensor(tuple(v.shape[p] for p in perm), v.dtype, frags)


def cast(v: VTensor, dtype: str) -> VTensor:
    """Cast every fragment to ``dtype`` (after the casts it already carries)."""
    if dtype == v.dtype:
        return v
    return VTensor(v.shape, dtype, tuple(replace(f, casts=f.casts + (dtype,)) for f in v.frags))


def to_pieces(v: VTensor) -> tuple[Piece, ...]:
    """The fragments as pieces: identity permutations as None, cast chains simplified."""
    return tuple(
        Piece(
            f.source,
            f.source_box,
            f.box,
            None if f.perm == tuple(range(f.source_box.ndim)) else f.perm,
            simplify_casts(f.source_dtype, f.casts),
        )
        for f in v.frags
        if not f.box.empty
    )
