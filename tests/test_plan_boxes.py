"""Box arithmetic, the box index and target partitioning, against dense masks and scans (tier 1)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shardsync.layout import Box
from shardsync.planning import split_ranges
from shardsync.planning.boxes import BoxIndex, chunk, holes_in, overlapping_pairs

SHAPE = (7, 5, 3)


@st.composite
def boxes(draw: st.DrawFn, shape: tuple[int, ...] = SHAPE) -> Box:
    lo = [draw(st.integers(0, n - 1)) for n in shape]
    size = [draw(st.integers(0, n - o)) for n, o in zip(shape, lo)]
    return Box(tuple(lo), tuple(size))


def mask(bs: list[Box]) -> np.ndarray:
    m = np.zeros(SHAPE, dtype=np.int32)
    for b in bs:
        m[b.slices()] += 1
    return m


@st.composite
def tilings(draw: st.DrawFn, shape: tuple[int, ...] = SHAPE) -> list[Box]:
    """A grid of boxes tiling ``shape`` (cut points drawn per dim), in a drawn order."""
    edges = [[0, *sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))), n] for n in shape]
    cells: list[tuple[tuple[int, int], ...]] = [()]
    for e in edges:
        cells = [c + ((a, b),) for c in cells for a, b in zip(e, e[1:])]
    return draw(st.permutations([Box(tuple(a for a, _ in c), tuple(b - a for a, b in c)) for c in cells]))


def scan(bs: list[Box], probe: Box) -> list[int]:
    return [i for i, b in enumerate(bs) if not b.empty and b.intersect(probe) is not None]


@settings(max_examples=200, deadline=None)
@given(box=boxes(), cuts=st.one_of(st.lists(boxes(), max_size=6), tilings()), drop=st.integers(0, 60))
def test_holes_are_exact_disjoint_and_sorted(box: Box, cuts: list[Box], drop: int) -> None:
    cuts = [c for i, c in enumerate(cuts) if i != drop]
    holes = holes_in(box, cuts)
    got = mask(holes)
    assert got.max(initial=0) <= 1  # disjoint
    assert np.array_equal(got > 0, (mask([box]) > 0) & (mask(cuts) == 0))
    assert [h.offsets for h in holes] == sorted(h.offsets for h in holes)


@settings(max_examples=200, deadline=None)
@given(bs=st.one_of(st.lists(boxes(), max_size=12), tilings()), probes=st.lists(boxes(), min_size=1, max_size=4))
def test_index_queries_match_a_scan(bs: list[Box], probes: list[Box]) -> None:
    index = BoxIndex(bs)
    for probe in probes + bs:
        assert index.query(probe) == scan(bs, probe)


def test_index_of_scalars_and_of_many_replicas() -> None:
    assert BoxIndex([Box((), ()), Box((), ())]).pairs() == [(0, 1)]
    same = [Box((2, 0), (3, 7))] * 9 + [Box((0, 0), (2, 7))]
    assert BoxIndex(same).query(Box((1, 3), (2, 1))) == list(range(10))
    assert BoxIndex(same).query(Box((1, 3), (0, 1))) == []


@settings(max_examples=200, deadline=None)
@given(box=boxes(), item=st.sampled_from([1, 2, 4, 8]), limit=st.integers(1, 200))
def test_chunks_tile_the_box_and_fit(box: Box, item: int, limit: int) -> None:
    parts = chunk(box, item, limit)
    assert np.array_equal(mask(parts), mask([box]))
    assert all(p.numel * item <= limit or p.numel == 1 for p in parts)
    for p in parts:  # each chunk is one contiguous run of the row-major box
        first = next((d for d in range(p.ndim) if p.sizes[d] != 1), p.ndim)
        assert all(p.sizes[d] == box.sizes[d] for d in range(first + 1, p.ndim))


@settings(max_examples=200, deadline=None)
@given(bs=st.one_of(st.lists(boxes(), max_size=8), tilings()))
def test_overlapping_pairs_match_brute_force(bs: list[Box]) -> None:
    brute = [(i, j) for i in range(len(bs)) for j in range(i + 1, len(bs)) if bs[i].intersect(bs[j]) is not None]
    assert overlapping_pairs(bs) == brute


def test_split_by_count_is_paddles_rule() -> None:
    assert split_ranges([1] * 7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert split_ranges([1] * 2, 4) == [range(0, 1), range(1, 2), range(2, 2), range(2, 2)]


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(1, 1000), min_size=1, max_size=30), parts=st.integers(1, 6))
def test_split_by_bytes_is_contiguous_and_balanced(sizes: list[int], parts: int) -> None:
    by_bytes = split_ranges(sizes, parts, "bytes")
    assert [i for r in by_bytes for i in r] == list(range(len(sizes)))
    worst = lambda rs: max(sum(sizes[i] for i in r) for r in rs)  # noqa: E731
    # each cut sits at the prefix closest to its share: no part exceeds an even share by more than
    # the two largest items around its cuts
    assert worst(by_bytes) <= sum(sizes) / parts + 2 * max(sizes)
