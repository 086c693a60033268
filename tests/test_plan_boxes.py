"""Box arithmetic and target partitioning, against dense masks (tier 1)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shardsync.layout import Box
from shardsync.planning import split_ranges
from shardsync.planning.boxes import chunk, overlapping_pairs, subtract_all

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


@settings(max_examples=200, deadline=None)
@given(box=boxes(), cuts=st.lists(boxes(), max_size=4))
def test_subtract_all_is_exact_and_disjoint(box: Box, cuts: list[Box]) -> None:
    left = subtract_all(box, cuts)
    want = (mask([box]) > 0) & (mask(cuts) == 0)
    got = mask(left)
    assert got.max(initial=0) <= 1  # disjoint
    assert np.array_equal(got > 0, want)


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
@given(bs=st.lists(boxes(), max_size=6))
def test_overlapping_pairs_match_brute_force(bs: list[Box]) -> None:
    brute = [(i, j) for i in range(len(bs)) for j in range(i + 1, len(bs))
             if bs[i].intersect(bs[j]) is not None]
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
