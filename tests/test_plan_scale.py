"""Planning at scale (tier 1): where the planner looks shards up through the box index (coverage, read
blocks, holders, deliveries), it finds what a scan of every shard finds, and builds the same plans.

References here are brute force: every box scanned, dense masks for regions. The index itself is
tested in test_plan_boxes.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardsync.errors import ShardsyncError
from shardsync.layout import Box, GlobalLayout
from shardsync.mapping import Piece, TargetSpec, resolve
from shardsync.planning import PlanOptions, build_plan, reads, validate
from shardsync.planning.validate import coverage_problems, plan_problems

SHAPE = (9, 7)


@st.composite
def boxes(draw: st.DrawFn, shape: tuple[int, ...] = SHAPE) -> Box:
    lo = [draw(st.integers(0, n)) for n in shape]
    size = [draw(st.integers(0, n - o)) for n, o in zip(shape, lo)]
    return Box(tuple(lo), tuple(size))


@st.composite
def tilings(draw: st.DrawFn, shape: tuple[int, ...] = SHAPE, least: int = 0) -> list[Box]:
    """A grid of shards (cut points drawn per dim, at least ``least`` along dim 0), in a drawn order."""
    edges = [
        [0, *sorted(draw(st.sets(st.integers(1, n - 1), min_size=least if d == 0 else 0, max_size=4))), n]
        for d, n in enumerate(shape)
    ]
    grid = [Box((a, c), (b - a, d - c)) for a, b in zip(edges[0], edges[0][1:]) for c, d in zip(edges[1], edges[1][1:])]
    return draw(st.permutations(grid))


def mask(bs: list[Box], shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    m = np.zeros(shape, dtype=np.int32)
    for b in bs:
        m[b.slices()] += 1
    return m


def parse_box(text: str) -> Box:
    """``'[1:3, 0:7]'`` -> the box it prints."""
    spans = [tuple(int(x) for x in part.split(":")) for part in text.strip("[]").split(", ")]
    return Box(tuple(a for a, _ in spans), tuple(b - a for a, b in spans))


class ScanIndex:
    """The reference for :class:`BoxIndex`: every box checked."""

    def __init__(self, bs: list[Box]) -> None:
        self.boxes = list(bs)

    def query(self, box: Box) -> list[int]:
        return [i for i, b in enumerate(self.boxes) if b.intersect(box) is not None and not b.empty]

    def pairs(self) -> list[tuple[int, int]]:
        return [(i, j) for i in range(len(self.boxes)) for j in self.query(self.boxes[i]) if j > i]


@settings(max_examples=60, deadline=None)
@given(
    shards=st.one_of(st.lists(boxes(), max_size=8), tilings()),
    drop=st.integers(0, 30),
    pieces=st.lists(boxes(), min_size=1, max_size=4),
)
def test_coverage_holes_match_dense_mask(shards: list[Box], drop: int, pieces: list[Box]) -> None:
    shards = [b for i, b in enumerate(shards) if i != drop]
    empty = Box((0, 0), (0, 0))  # so that the key exists even with no shard left
    lay = GlobalLayout.merge(
        [
            [("w", SHAPE, "float32", b) for b in [empty, *shards[0::2]]],
            [("w", SHAPE, "float32", b) for b in shards[1::2]],
        ]
    )
    targets = [
        TargetSpec(f"t{i}", p.sizes, "float32", (Piece("w", p, Box.full(p.sizes)),)) for i, p in enumerate(pieces)
    ]
    lines = coverage_problems(targets, lay)
    holes = [parse_box(line.split(" box ")[1].split(" (")[0]) for line in lines]
    want = (mask(pieces) > 0) & (mask(shards) == 0)
    assert np.array_equal(mask(holes) > 0, want)


@settings(max_examples=150, deadline=None)
@given(frags=st.lists(boxes(), min_size=1, max_size=8))
def test_read_blocks_match_brute_force(frags: list[Box]) -> None:
    distinct = list(dict.fromkeys(frags))
    lo = [min(b.offsets[d] for b in distinct) for d in range(2)]
    hi = [max(b.stops[d] for b in distinct) for d in range(2)]
    bbox = Box(tuple(lo), tuple(h - a for a, h in zip(lo, hi)))
    if np.array_equal(mask(distinct) > 0, mask([bbox]) > 0) or bbox in distinct:
        want = [bbox]
    else:
        want = [b for b in distinct if not any(o != b and o.contains(b) for o in distinct)]
    pieces = [(0, Piece("w", b, Box.full(b.sizes))) for b in frags]
    assert reads._blocks(pieces) == want


@st.composite
def problems(draw: st.DrawFn) -> tuple[GlobalLayout, list[str] | None, PlanOptions]:
    """A random grid layout over a few ranks (replicas, sometimes a hole) and a mapping."""
    world = draw(st.sampled_from([1, 2, 3, 4]))
    shape = (12, draw(st.sampled_from([4, 5, 8])))
    grid = draw(tilings(shape, least=3))  # more shards than the index scans without banding
    per: list[list] = [[] for _ in range(world)]
    for k, b in enumerate(grid[: len(grid) - draw(st.sampled_from([0, 0, 0, 1]))]):
        for r in draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=2)):
            per[(r + k) % world].append(("w", shape, "float32", b))
    mapping = draw(
        st.sampled_from(
            [
                None,
                ["w -> a, b, axis=0"],
                ["w^T -> t"],
                ["w -> a, b, axis=1"],
                ["w, w -> ww, axis=1"],
                ["w -> g, u, fused_ffn, axis=0"],
            ]
        )
    )
    options = draw(
        st.sampled_from(
            [
                PlanOptions(strategy="broadcast"),
                PlanOptions(bucket_bytes=64),
                PlanOptions(strategy="p2p", consumers=tuple(range(world))[::2]),
                PlanOptions(memory_budget=1500),
            ]
        )
    )
    return GlobalLayout.merge(per), mapping, options


def _plan_or_error(lay: GlobalLayout, mapping: list[str] | None, options: PlanOptions) -> object:
    try:
        return build_plan(resolve(mapping, lay), lay, options)
    except ShardsyncError as e:
        return str(e)


@settings(max_examples=60, deadline=None)
@given(case=problems())
def test_plans_equal_those_built_by_scanning_every_shard(case: tuple) -> None:
    got = _plan_or_error(*case)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reads, "BoxIndex", ScanIndex)
        mp.setattr(validate, "BoxIndex", ScanIndex)
        want = _plan_or_error(*case)
    assert got == want


def test_bad_deliveries_are_counted_per_receiver() -> None:
    per = [[("w", (8, 2), "float32", Box((4 * r, 0), (4, 2)))] for r in range(2)]
    lay = GlobalLayout.merge(per + [[]])
    for strategy in ("bucketed", "p2p"):
        plan = build_plan(resolve(None, lay), lay, PlanOptions(strategy=strategy))
        assert plan_problems(plan, lay) == []
        k = next(k for k, s in enumerate(plan.steps) if s.packets)
        step, pk = plan.steps[k], plan.steps[k].packets[0]
        for packets, times in ((step.packets + (pk,), 2), (step.packets[1:], 0)):
            steps = list(plan.steps)
            steps[k] = dataclasses.replace(step, packets=packets)
            bad = dataclasses.replace(plan, steps=tuple(steps))
            want = [
                f"read {i} ({plan.reads[i].source}{plan.reads[i].box}) reaches rank {d} {times} times"
                for i in sorted(pk.reads)
                for d in (plan.reads[i].receivers if pk.dst < 0 else (pk.dst,))
            ]
            assert plan_problems(bad, lay) == want
