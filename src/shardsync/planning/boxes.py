"""Box arithmetic the planner needs: subtraction (holes), chunking (memory budget), overlaps."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..layout.box import Box

__all__ = ["subtract", "subtract_all", "chunk", "overlapping_pairs", "union_bbox"]


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
            out.append(Box(tuple(offsets[:d]) + (offsets[d],) + tuple(offsets[d + 1:]),
                           tuple(sizes[:d]) + (lo - offsets[d],) + tuple(sizes[d + 1:])))
        if hi < offsets[d] + sizes[d]:  # and above it
            out.append(Box(tuple(offsets[:d]) + (hi,) + tuple(offsets[d + 1:]),
                           tuple(sizes[:d]) + (offsets[d] + sizes[d] - hi,) + tuple(sizes[d + 1:])))
        offsets[d], sizes[d] = lo, hi - lo  # later dims only split what lies inside the cut here
    return out


def subtract_all(box: Box, cuts: Iterable[Box]) -> list[Box]:
    """The part of ``box`` covered by none of ``cuts`` (empty list when fully covered).

    Example:
        >>> [str(b) for b in subtract_all(Box((0,), (10,)), [Box((0,), (3,)), Box((5,), (2,))])]
        ['[3:5]', '[7:10]']
    """
    left = [] if box.empty else [box]
    for cut in cuts:
        left = [part for b in left for part in subtract(b, cut)]
        if not left:
            break
    return left


def union_bbox(boxes: Sequence[Box]) -> Box:
    """The smallest box containing all of ``boxes`` (at least one).

    Example:
        >>> str(union_bbox([Box((0, 2), (1, 1)), Box((3, 0), (1, 1))]))
        '[0:4, 0:3]'
    """
    lo = tuple(min(b.offsets[d] for b in boxes) for d in range(boxes[0].ndim))
    hi = tuple(max(b.stops[d] for b in boxes) for d in range(boxes[0].ndim))
    return Box(lo, tuple(h - l for l, h in zip(lo, hi)))


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
        heads = [Box(h.offsets[:k] + (box.offsets[k] + i,) + h.offsets[k + 1:],
                     h.sizes[:k] + (1,) + h.sizes[k + 1:]) for h in heads for i in range(box.sizes[k])]
    out = []
    for h in heads:
        for start in range(0, box.sizes[d], per):
            size = min(per, box.sizes[d] - start)
            out.append(Box(h.offsets + (box.offsets[d] + start,) + box.offsets[d + 1:],
                           tuple(1 for _ in range(d)) + (size,) + box.sizes[d + 1:]))
    return out


def overlapping_pairs(boxes: Sequence[Box]) -> list[tuple[int, int]]:
    """Index pairs ``(i, j)``, ``i < j``, of boxes that share at least one element.

    A sweep along dim 0 keeps this near-linear for the usual sharded layouts.

    Example:
        >>> overlapping_pairs([Box((0,), (4,)), Box((2,), (4,)), Box((6,), (1,))])
        [(0, 1)]
    """
    if not boxes or boxes[0].ndim == 0:
        return [(i, j) for i in range(len(boxes)) for j in range(i + 1, len(boxes))]
    order = sorted(range(len(boxes)), key=lambda i: boxes[i].offsets[0])
    pairs: list[tuple[int, int]] = []
    active: list[int] = []
    for i in order:
        start = boxes[i].offsets[0]
        active = [j for j in active if boxes[j].stops[0] > start]
        pairs += [(min(i, j), max(i, j)) for j in active if boxes[i].intersect(boxes[j]) is not None]
        if not boxes[i].empty:
            active.append(i)
    return sorted(pairs)
