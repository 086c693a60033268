"""Box arithmetic the planner needs: holes, chunking (memory budget), and an index of boxes for overlap
and containment queries that keeps planning near-linear in the number of shards."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from ..layout.box import Box

__all__ = ["subtract", "holes_in", "chunk", "BoxIndex", "overlapping_pairs", "union_bbox"]


def subtract(box: Box, cut: Box) -> list[Box]:
    """The part of ``box`` outside ``cut``, as disjoint boxes (at most two per dim).

    Example:
        >>> [str(b) for b in subtract(Box((0,), (10,)), Box((3,), (4,)))]
        ['[0:3]', '[7:10]']
    """
    inter = box.intersect(cut)
    if inter is None:
        return [] if box.empty else [box]
    out: list[Box] = []
    offsets, sizes = list(box.offsets), list(box.sizes)
    for d in range(box.ndim):
        lo, hi = inter.offsets[d], inter.stops[d]
        if lo > offsets[d]:  # the slab below the cut in dim d
            out.append(
                Box(
                    tuple(offsets[:d]) + (offsets[d],) + tuple(offsets[d + 1 :]),
                    tuple(sizes[:d]) + (lo - offsets[d],) + tuple(sizes[d + 1 :]),
                )
            )
        if hi < offsets[d] + sizes[d]:  # and above it
            out.append(
                Box(
                    tuple(offsets[:d]) + (hi,) + tuple(offsets[d + 1 :]),
                    tuple(sizes[:d]) + (offsets[d] + sizes[d] - hi,) + tuple(sizes[d + 1 :]),
                )
            )
        offsets[d], sizes[d] = lo, hi - lo  # later dims only split what lies inside the cut here
    return out


def holes_in(box: Box, cuts: Iterable[Box]) -> list[Box]:
    """The part of ``box`` covered by none of ``cuts``, as disjoint boxes sorted by offsets.

    The cuts are taken in order of their offsets, and the parts that end before a cut starts along
    dim 0 are set aside (no later cut reaches them): a box cut by many shards costs about the number
    of shards times the parts left in one band.

    Example:
        >>> [str(b) for b in holes_in(Box((0,), (10,)), [Box((5,), (2,)), Box((0,), (3,))])]
        ['[3:5]', '[7:10]']
    """
    done: list[Box] = []
    left = [] if box.empty else [box]
    for cut in sorted(cuts, key=lambda c: c.offsets):
        if cut.ndim:
            done += [b for b in left if b.stops[0] <= cut.offsets[0]]
            left = [b for b in left if b.stops[0] > cut.offsets[0]]
        left = [part for b in left for part in subtract(b, cut)]
    return sorted(done + left, key=lambda b: b.offsets)


def union_bbox(boxes: Sequence[Box]) -> Box:
    """The smallest box containing all of ``boxes`` (at least one).

    Example:
        >>> str(union_bbox([Box((0, 2), (1, 1)), Box((3, 0), (1, 1))]))
        '[0:4, 0:3]'
    """
    lo = tuple(min(b.offsets[d] for b in boxes) for d in range(boxes[0].ndim))
    hi = tuple(max(b.stops[d] for b in boxes) for d in range(boxes[0].ndim))
    return Box(lo, tuple(h - a for a, h in zip(lo, hi)))


def chunk(box: Box, item: int, max_bytes: int) -> list[Box]:
    """Cut ``box`` into boxes of at most ``max_bytes`` (elements of ``item`` bytes), outer dims first.

    The cut is along the outermost dim whose inner slab still fits, so each chunk is one contiguous
    run of a row-major tensor. A single element larger than ``max_bytes`` stays whole.

    Example:
        >>> [str(b) for b in chunk(Box((0, 0), (5, 4)), 4, 32)]
        ['[0:2, 0:4]', '[2:4, 0:4]', '[4:5, 0:4]']
    """
    if box.numel * item <= max_bytes or box.ndim == 0:
        return [box]
    inner = box.numel
    for d in range(box.ndim):
        inner //= max(box.sizes[d], 1)
        if inner * item <= max_bytes:
            break
    per = max(1, max_bytes // (inner * item))
    heads = [Box(box.offsets[:d], box.sizes[:d])]
    for k in range(d):  # dims before d are walked one index at a time
        heads = [
            Box(h.offsets[:k] + (box.offsets[k] + i,) + h.offsets[k + 1 :], h.sizes[:k] + (1,) + h.sizes[k + 1 :])
            for h in heads
            for i in range(box.sizes[k])
        ]
    out = []
    for h in heads:
        for start in range(0, box.sizes[d], per):
            size = min(per, box.sizes[d] - start)
            out.append(
                Box(
                    h.offsets + (box.offsets[d] + start,) + box.offsets[d + 1 :],
                    tuple(1 for _ in range(d)) + (size,) + box.sizes[d + 1 :],
                )
            )
    return out


class BoxIndex:
    """Boxes indexed for the question "which of them share an element with this box".

    The boxes are grouped into bands of equal extent along dim 0, the bands sorted by offset; each
    band is grouped the same way along dim 1, and so on (small groups are scanned). A query visits
    only the bands whose extent can meet it, so on sharded layouts (cuts along one or more dims) it
    costs about ``log n`` plus the size of the answer. Empty boxes are never reported.

    Example:
        >>> index = BoxIndex([Box((0, 0), (2, 4)), Box((2, 0), (2, 4)), Box((4, 0), (2, 4))])
        >>> index.query(Box((1, 1), (2, 1)))
        [0, 1]
    """

    def __init__(self, boxes: Sequence[Box]) -> None:
        self.boxes = list(boxes)
        self._lo = [b.offsets for b in self.boxes]
        self._hi = [b.stops for b in self.boxes]
        self._root = self._node([i for i, b in enumerate(self.boxes) if not b.empty], 0)

    def _node(self, ids: list[int], dim: int) -> _Node:
        ndim = self.boxes[ids[0]].ndim if ids else 0
        if dim >= ndim or len(ids) <= _SCAN:
            return _Node(dim, ids, [], [], 0, [])
        bands: dict[tuple[int, int], list[int]] = {}
        for i in ids:
            bands.setdefault((self._lo[i][dim], self._hi[i][dim]), []).append(i)
        keys = sorted(bands)
        return _Node(
            dim,
            [],
            [k[0] for k in keys],
            [k[1] for k in keys],
            max(hi - lo for lo, hi in keys),
            [self._node(bands[k], dim + 1) for k in keys],
        )

    def query(self, box: Box) -> list[int]:
        """Indices (ascending) of the boxes sharing at least one element with ``box``."""
        if box.empty:
            return []
        out: list[int] = []
        self._collect(self._root, box.offsets, box.stops, out)
        return sorted(out)

    def pairs(self) -> list[tuple[int, int]]:
        """Index pairs ``(i, j)``, ``i < j``, of the boxes that share at least one element."""
        return [(i, j) for i, b in enumerate(self.boxes) for j in self.query(b) if j > i]

    def _collect(self, node: _Node, lo: tuple[int, ...], hi: tuple[int, ...], out: list[int]) -> None:
        d = node.dim
        if not node.bands:  # dims before d are known to meet; check the rest
            out += [
                i for i in node.ids if all(self._lo[i][k] < hi[k] and lo[k] < self._hi[i][k] for k in range(d, len(lo)))
            ]
            return
        # A band meets [lo, hi) along d iff start < hi[d] and stop > lo[d]; no band is longer than
        # reach, so only starts above lo[d] - reach can qualify.
        first = bisect_right(node.starts, lo[d] - node.reach)
        for k in range(first, bisect_left(node.starts, hi[d])):
            if node.stops[k] > lo[d]:
                self._collect(node.bands[k], lo, hi, out)


class _Node(NamedTuple):
    dim: int
    ids: list[int]  # boxes scanned here (no bands)
    starts: list[int]  # band extents along dim, sorted
    stops: list[int]
    reach: int  # longest band extent
    bands: list[_Node]


#: Groups this small are scanned rather than split into bands.
_SCAN = 4


def overlapping_pairs(boxes: Sequence[Box]) -> list[tuple[int, int]]:
    """Index pairs ``(i, j)``, ``i < j``, of boxes that share at least one element.

    Near-linear for the usual sharded layouts (see :class:`BoxIndex`).

    Example:
        >>> overlapping_pairs([Box((0,), (4,)), Box((2,), (4,)), Box((6,), (1,))])
        [(0, 1)]
    """
    return BoxIndex(boxes).pairs()
