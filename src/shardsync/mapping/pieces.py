"""What the resolver hands to the planner: each target as pieces of source boxes.

A :class:`Piece` says: take ``source_box`` (global coordinates of source key ``source``), permute its
dims by ``perm`` (target dim i is source dim ``perm[i]``, or a new dim of size 1 where ``perm[i]`` is
-1; a source dim that ``perm`` leaves out has size 1 in ``source_box`` and is dropped), cast through
``casts`` in order, and write the result at ``target_box`` of the target. Dropped and new unit dims are
how a stack, an unstack or a reshape reaches the planner: as views, never as copies of their own.
Everything downstream works on these only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..layout.box import Box
from ..layout.dtypes import itemsize

__all__ = ["Piece", "TargetSpec"]


@dataclass(frozen=True, slots=True)
class Piece:
    """One rectangular copy from a source into a target.

    Attributes:
        source: source key.
        source_box: region of the source, in its global coordinates.
        target_box: where it lands in the target (same sizes after ``perm``).
        perm: target dim i is source dim ``perm[i]``, or a new unit dim where it is -1 (source dims
            it leaves out have size 1 and are dropped); ``None`` for identity.
        casts: dtype names applied in order; empty when the source dtype is kept.
    """

    source: str
    source_box: Box
    target_box: Box
    perm: tuple[int, ...] | None = None
    casts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.perm is None:
            ok = self.source_box.sizes == self.target_box.sizes
        else:
            kept = [p for p in self.perm if p >= 0]
            ok = (
                len(self.perm) == self.target_box.ndim
                and len(set(kept)) == len(kept)
                and all(p < self.source_box.ndim for p in kept)
                and self.to_target(self.source_box).sizes == self.target_box.sizes
                and all(n == 1 for d, n in enumerate(self.source_box.sizes) if d not in kept)
            )
        if not ok:
            raise ValueError(
                f"piece {self.source}{self.source_box} -> {self.target_box}: sizes differ after perm {self.perm}"
            )

    @property
    def permutes(self) -> bool:
        """Whether ``perm`` moves dims (not None and not the identity).

        Example:
            >>> Piece("s", Box((0, 0), (2, 3)), Box((0, 0), (3, 2)), perm=(1, 0)).permutes
            True
        """
        return self.perm is not None and tuple(self.perm) != tuple(range(len(self.perm)))

    def to_target(self, box: Box) -> Box:
        """``box`` (in source dims) in target dims: permuted, unit dims dropped or added."""
        if self.perm is None:
            return box
        return Box(
            tuple(box.offsets[p] if p >= 0 else 0 for p in self.perm),
            tuple(box.sizes[p] if p >= 0 else 1 for p in self.perm),
        )

    def to_source(self, box: Box) -> Box:
        """``box`` (relative to ``target_box``, in target dims) as a box of the source (global)."""
        if self.perm is None:
            return box.shift(self.source_box.offsets)
        offsets, sizes = list(self.source_box.offsets), list(self.source_box.sizes)
        for i, p in enumerate(self.perm):
            if p >= 0:
                offsets[p] += box.offsets[i]
                sizes[p] = box.sizes[i]
        return Box(tuple(offsets), tuple(sizes))

    def restrict(self, sub: Box) -> Piece:
        """The part of this piece whose *source* region is ``sub`` (a box inside ``source_box``)."""
        rel = self.to_target(sub.relative_to(self.source_box))
        return Piece(self.source, sub, rel.shift(self.target_box.offsets), self.perm, self.casts)


@dataclass(frozen=True, slots=True)
class TargetSpec:
    """A target tensor: name, shape, dtype name and the pieces that tile it exactly."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    @property
    def sources(self) -> tuple[str, ...]:
        """Source keys read, in first-use order."""
        return tuple(dict.fromkeys(p.source for p in self.pieces))
