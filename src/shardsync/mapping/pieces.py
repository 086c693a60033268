"""What the resolver hands to the planner: each target as pieces of source boxes.

A :class:`Piece` says: take ``source_box`` (global coordinates of source key ``source``), permute its
dims by ``perm`` (target dim i is source dim ``perm[i]``), cast through ``casts`` in order, and write
the result at ``target_box`` of the target. Everything downstream works on these only.
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
        perm: target dim i is source dim ``perm[i]``; ``None`` for identity.
        casts: dtype names applied in order; empty when the source dtype is kept.
    """

    source: str
    source_box: Box
    target_box: Box
    perm: tuple[int, ...] | None = None
    casts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        sizes = self.source_box.sizes if self.perm is None else self.source_box.permute(self.perm).sizes
        if sizes != self.target_box.sizes:
            raise ValueError(f"piece {self.source}{self.source_box} -> {self.target_box}: sizes differ "
                             f"after perm {self.perm}")

    def restrict(self, sub: Box) -> Piece:
        """The part of this piece whose *source* region is ``sub`` (a box inside ``source_box``)."""
        rel = sub.relative_to(self.source_box)
        if self.perm is not None:
            rel = rel.permute(self.perm)
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
