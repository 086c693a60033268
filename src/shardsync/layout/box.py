"""Box: a rectangular region of a tensor, as per-dim offsets and sizes."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = ["Box"]

T = TypeVar("T", bound=Any)


@dataclass(frozen=True, slots=True)
class Box:
    """A rectangular region ``[offset, offset + size)`` in every dim.

    Example:
        >>> Box((2, 0), (3, 4)).intersect(Box((0, 1), (4, 2)))
        Box(offsets=(2, 1), sizes=(2, 2))
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    #: ``offsets + sizes`` per dim, computed once (the planner asks for it millions of times)
    stops: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        offsets, sizes = self.offsets, self.sizes
        if len(offsets) != len(sizes):
            raise ValueError(f"box offsets {offsets} and sizes {sizes} differ in length")
        if offsets and (min(sizes) < 0 or min(offsets) < 0):
            raise ValueError(f"box with negative offset or size: {offsets}, {sizes}")
        object.__setattr__(self, "stops", tuple(map(operator.add, offsets, sizes)))

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        """The box covering a whole tensor of ``shape``."""
        return cls(tuple(0 for _ in shape), tuple(int(s) for s in shape))

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def empty(self) -> bool:
        return 0 in self.sizes

    def intersect(self, other: Box) -> Box | None:
        """The common region, or None when it is empty."""
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a, b) for a, b in zip(self.stops, other.stops))
        if any(h <= a for a, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - a for a, h in zip(lo, hi)))

    def contains(self, other: Box) -> bool:
        """Whether ``other`` lies wholly inside this box."""
        return all(
            a <= b and b_stop <= a_stop
            for a, b, a_stop, b_stop in zip(self.offsets, other.offsets, self.stops, other.stops)
        )

    def within(self, shape: Sequence[int]) -> bool:
        """Whether the box lies inside a tensor of ``shape``."""
        return len(shape) == self.ndim and all(s <= n for s, n in zip(self.stops, shape))

    def shift(self, delta: Sequence[int]) -> Box:
        """The box moved by ``delta`` (may be negative, result must stay non-negative)."""
        return Box(tuple(o + d for o, d in zip(self.offsets, delta)), self.sizes)

    def relative_to(self, outer: Box) -> Box:
        """This box in the coordinates of ``outer`` (which must contain it)."""
        return Box(tuple(o - p for o, p in zip(self.offsets, outer.offsets)), self.sizes)

    def permute(self, perm: Sequence[int]) -> Box:
        """The box of a tensor permuted by ``perm`` (new dim i is old dim ``perm[i]``)."""
        return Box(tuple(self.offsets[p] for p in perm), tuple(self.sizes[p] for p in perm))

    def slices(self) -> tuple[slice, ...]:
        """Index with these to cut the box out of a tensor."""
        return tuple(map(slice, self.offsets, self.stops))

    def slices_in(self, outer: Box) -> tuple[slice, ...]:
        """``self.relative_to(outer).slices()``: index a tensor holding ``outer`` with these to cut
        this box out of it.

        Example:
            >>> Box((3, 1), (2, 2)).slices_in(Box((2, 0), (4, 4)))
            (slice(1, 3, None), slice(1, 3, None))
        """
        return tuple(
            map(slice, map(operator.sub, self.offsets, outer.offsets), map(operator.sub, self.stops, outer.offsets))
        )

    def cut(self, data: T, outer: Box) -> T:
        """This box out of ``data`` (a tensor or array holding ``outer``): a view, or ``data`` itself
        when the box is all of ``outer`` (no view to make).

        Example:
            >>> import numpy as np
            >>> a = np.arange(12).reshape(3, 4)
            >>> Box((1, 1), (2, 2)).cut(a, Box((0, 0), (3, 4))).tolist(), Box.full((3, 4)).cut(a, Box.full((3, 4))) is a
            ([[5, 6], [9, 10]], True)
        """
        return data if self == outer else data[self.slices_in(outer)]

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes)) + "]"
