"""Validation before any data moves: the layout, the resolved targets, and the finished plan.

Every check collects all offenders and raises once, each line naming the key, the boxes and the fix.
All inputs are identical on every rank, so every rank raises the same error at the same point.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from ..errors import LayoutError, PlanError
from ..layout.box import Box
from ..layout.dtypes import DTYPES
from ..layout.meta import GlobalLayout
from ..mapping.pieces import TargetSpec
from .boxes import BoxIndex, holes_in, overlapping_pairs
from .model import Plan

__all__ = [
    "shard_boxes",
    "shard_index",
    "layout_problems",
    "coverage_problems",
    "target_problems",
    "tiling_problems",
    "plan_problems",
    "check_inputs",
    "check_plan",
]

_MAX_LISTED = 40


def shard_boxes(layout: GlobalLayout, key: str) -> dict[Box, tuple[int, ...]]:
    """Distinct non-empty shard boxes of ``key`` and the ranks holding each (replicas).

    Example:
        >>> entry = ("w", (4,), "float32", Box((0,), (4,)))
        >>> shard_boxes(GlobalLayout.merge([[entry], [entry]]), "w")
        {Box(offsets=(0,), sizes=(4,)): (0, 1)}
    """
    out: dict[Box, list[int]] = {}
    for s in layout[key].shards:
        if not s.box.empty:
            out.setdefault(s.box, []).append(s.rank)
    return {b: tuple(sorted(set(r))) for b, r in out.items()}


def shard_index(layout: GlobalLayout, key: str) -> tuple[BoxIndex, list[tuple[int, ...]]]:
    """:func:`shard_boxes` of ``key`` indexed for lookups: the index and the ranks holding each box.

    Example:
        >>> lay = GlobalLayout.merge([[("w", (4,), "float32", Box((0,), (2,)))],
        ...                           [("w", (4,), "float32", Box((2,), (2,)))]])
        >>> index, holders = shard_index(lay, "w")
        >>> [holders[i] for i in index.query(Box((1,), (2,)))]
        [(0,), (1,)]
    """
    boxes = shard_boxes(layout, key)
    return BoxIndex(list(boxes)), list(boxes.values())


def layout_problems(layout: GlobalLayout, keys: Iterable[str] | None = None) -> list[str]:
    """Shards that overlap without being identical replicas, and boxes held twice by one rank.

    Example:
        >>> lay = GlobalLayout.merge([[("w", (4,), "float32", Box((0,), (3,)))],
        ...                           [("w", (4,), "float32", Box((2,), (2,)))]])
        >>> layout_problems(lay)[0].split(";")[0]
        "'w': shard [0:3] on ranks [0] overlaps shard [2:4] on ranks [1] in [2:3]"
    """
    problems = []
    for key in sorted(keys if keys is not None else layout.keys()):
        meta = layout[key]
        seen: dict[tuple[int, Box], int] = {}
        for s in meta.shards:
            seen[(s.rank, s.box)] = seen.get((s.rank, s.box), 0) + 1
        problems += [
            f"{key!r}: rank {r} holds box {b} {n} times; pass each shard once"
            for (r, b), n in seen.items()
            if n > 1 and not b.empty
        ]
        boxes = shard_boxes(layout, key)
        distinct = list(boxes)
        for i, j in overlapping_pairs(distinct):
            a, b = distinct[i], distinct[j]
            problems.append(
                f"{key!r}: shard {a} on ranks {list(boxes[a])} overlaps shard {b} on ranks "
                f"{list(boxes[b])} in {a.intersect(b)}; shards must be identical replicas or "
                "disjoint - fix the global offsets"
            )
    return problems


def coverage_problems(targets: Sequence[TargetSpec], layout: GlobalLayout) -> list[str]:
    """Regions a piece reads that no rank holds (holes), once per source key and box.

    Example:
        >>> from shardsync.mapping import Piece
        >>> lay = GlobalLayout.merge([[("w", (4,), "float32", Box((0,), (3,)))]])
        >>> piece = Piece("w", Box((0,), (4,)), Box((0,), (4,)))
        >>> coverage_problems([TargetSpec("w", (4,), "float32", (piece,))], lay)[0][:45]
        "'w': box [3:4] (needed by target 'w') is held"
    """
    holes: dict[tuple[str, Box], str] = {}
    indexes: dict[str, tuple[BoxIndex, bool]] = {}
    for t in targets:
        for p in t.pieces:
            if p.source not in layout or p.source_box.empty:
                continue  # unknown sources are reported by target_problems; nothing to hold
            if p.source not in indexes:
                index = shard_index(layout, p.source)[0]
                indexes[p.source] = index, not index.pairs()
            index, disjoint = indexes[p.source]
            boxes = [index.boxes[i] for i in index.query(p.source_box)]
            held = sum(x.numel for x in (p.source_box.intersect(b) for b in boxes) if x is not None)
            if disjoint and held == p.source_box.numel:
                continue  # disjoint shards holding as many elements as the box: it is covered
            for hole in holes_in(p.source_box, boxes):
                holes.setdefault((p.source, hole), t.name)
    return [
        f"{key!r}: box {hole} (needed by target {name!r}) is held by no rank; give some rank the "
        "shard covering it or fix the global offsets"
        for (key, hole), name in holes.items()
    ]


def tiling_problems(what: str, shape: tuple[int, ...], boxes: Sequence[Box]) -> list[str]:
    """Boxes that leave ``shape`` or overlap, and the regions of ``shape`` they leave uncovered.

    Example:
        >>> tiling_problems("t", (4,), [Box((0,), (3,))])
        ['t: box [3:4] is not covered']
    """
    full = Box.full(shape)
    problems = [f"{what}: box {b} lies outside shape {list(shape)}" for b in boxes if not b.within(shape)]
    pairs = overlapping_pairs(boxes)
    problems += [f"{what}: boxes {boxes[i]} and {boxes[j]} overlap" for i, j in pairs[:_MAX_LISTED]]
    if sum(b.numel for b in boxes if b.within(shape)) != full.numel or problems:
        problems += [f"{what}: box {h} is not covered" for h in holes_in(full, boxes)[:_MAX_LISTED]]
    return problems


def _piece_problems(t: TargetSpec, layout: GlobalLayout) -> list[str]:
    problems = []
    for p in t.pieces:
        where = f"target {t.name!r} piece {p.source}{p.source_box} -> {p.target_box}"
        if p.source not in layout:
            problems.append(f"{where}: unknown source {p.source!r}; the layout has no such key")
            continue
        meta = layout[p.source]
        if not p.source_box.within(meta.shape):
            problems.append(f"{where}: source box outside {p.source!r} shape {list(meta.shape)}")
        if p.source_box.ndim != meta.ndim or (p.perm is None and p.target_box.ndim != meta.ndim):
            problems.append(f"{where}: the box has {p.source_box.ndim} dims, {p.source!r} has {meta.ndim}")
        unknown = [c for c in p.casts if c not in DTYPES]
        if unknown:
            problems.append(f"{where}: unknown dtype(s) {unknown}")
        final = p.casts[-1] if p.casts else meta.dtype
        if final != t.dtype:
            problems.append(f"{where}: yields {final} but the target is {t.dtype}; add a cast")
    return problems


def target_problems(targets: Sequence[TargetSpec], layout: GlobalLayout) -> list[str]:
    """Resolved targets that are malformed: unknown sources, bad boxes or perms, dtype mismatches,
    pieces that do not tile their target exactly, duplicate names.

    Example:
        >>> from shardsync.mapping import Piece
        >>> lay = GlobalLayout.merge([[("w", (4,), "float32", Box((0,), (4,)))]])
        >>> piece = Piece("w", Box((0,), (4,)), Box((0,), (4,)))
        >>> target_problems([TargetSpec("w", (4,), "bfloat16", (piece,))], lay)[0].split(": ")[-1]
        'yields float32 but the target is bfloat16; add a cast'
    """
    problems = []
    counts = Counter(t.name for t in targets)
    problems += [f"target {n!r} is produced twice" for n in sorted(n for n, c in counts.items() if c > 1)]
    for t in targets:
        if t.dtype not in DTYPES:
            problems.append(f"target {t.name!r}: unknown dtype {t.dtype!r}")
        problems += _piece_problems(t, layout)
        problems += tiling_problems(f"target {t.name!r}", t.shape, [p.target_box for p in t.pieces])
    return problems


def check_inputs(targets: Sequence[TargetSpec], layout: GlobalLayout) -> None:
    """Raise one error listing every layout and target problem.

    Raises:
        LayoutError: overlapping shards or holes (also lists any target problems).
        PlanError: only target problems.

    Example:
        >>> check_inputs(resolve(None, layout), layout)   # doctest: +SKIP
    """
    keys = {p.source for t in targets for p in t.pieces if p.source in layout}
    layout_side = layout_problems(layout, keys) + coverage_problems(targets, layout)
    target_side = target_problems(targets, layout)
    if layout_side:
        raise LayoutError(_format("the sharded state cannot serve the request", layout_side + target_side))
    if target_side:
        raise PlanError(_format("the resolved targets are malformed", target_side))


def _holding_ranks(
    layout: GlobalLayout, key: str, box: Box, indexes: dict[str, tuple[BoxIndex, list[tuple[int, ...]]]]
) -> set[int]:
    # Ranks with a shard of ``key`` containing ``box``: a non-empty box is contained only in shards it
    # meets, which the index finds; an empty one is checked against every shard.
    if box.empty:
        return {s.rank for s in layout[key].shards if s.box.contains(box)}
    if key not in indexes:
        indexes[key] = shard_index(layout, key)
    index, holders = indexes[key]
    return {r for i in index.query(box) if index.boxes[i].contains(box) for r in holders[i]}


def _read_problems(plan: Plan, layout: GlobalLayout) -> list[str]:
    problems = []
    indexes: dict[str, tuple[BoxIndex, list[tuple[int, ...]]]] = {}
    for i, r in enumerate(plan.reads):
        where = f"read {i} ({r.source}{r.box})"
        held = _holding_ranks(layout, r.source, r.box, indexes)
        if not set(r.holders) <= held or not r.holders:
            problems.append(f"{where}: holders {list(r.holders)} but only ranks {sorted(held)} hold it")
        if set(r.receivers) != set(r.readers) - set(r.holders):
            problems.append(f"{where}: receivers {list(r.receivers)} are not readers minus holders")
        if (r.sender is None) != (not r.receivers) or (r.sender is not None and r.sender not in r.holders):
            problems.append(f"{where}: sender {r.sender} for receivers {list(r.receivers)}")
    return problems


def _delivery_problems(plan: Plan) -> list[str]:
    problems: list[str] = []
    to_all: dict[int, int] = {}  # read -> collectives carrying it (each reaches all its receivers)
    to_one: dict[tuple[int, int], int] = {}  # (read, rank) -> messages carrying it to that rank
    for s in plan.steps:
        for pk in s.packets:
            for i in pk.reads:
                sender = plan.reads[i].sender
                if pk.src != sender:
                    problems.append(f"read {i} packed by rank {pk.src} but its sender is {sender}")
                if pk.dst < 0:
                    to_all[i] = to_all.get(i, 0) + 1
                else:
                    to_one[(i, pk.dst)] = to_one.get((i, pk.dst), 0) + 1
    for i, r in enumerate(plan.reads):
        n = to_all.get(i, 0)
        if to_one or n != 1:  # else every receiver got it exactly once, by one collective
            problems += [
                f"read {i} ({r.source}{r.box}) reaches rank {d} {n + to_one.get((i, d), 0)} times"
                for d in r.receivers
                if n + to_one.get((i, d), 0) != 1
            ]
    ready = [t for s in plan.steps for t in s.ready]
    if sorted(ready) != list(range(len(plan.targets))):
        problems.append(f"steps yield targets {sorted(ready)}, expected each of {len(plan.targets)} once")
    return problems


def plan_problems(plan: Plan, layout: GlobalLayout) -> list[str]:
    """Inconsistencies of a built plan: reads not held by their holders, copies outside their reads,
    targets not tiled by their copies, reads delivered zero or several times.

    Example:
        >>> import torch, shardsync
        >>> from shardsync.layout import GlobalLayout, local_layout
        >>> state = {"w": torch.zeros(2, 3)}
        >>> plan_problems(shardsync.plan(state), GlobalLayout.merge([local_layout(state)]))
        []
    """
    problems = _read_problems(plan, layout)
    for t in plan.targets:
        for c in t.copies:
            r = plan.reads[c.read]
            if c.piece.source != r.source or not r.box.contains(c.piece.source_box):
                problems.append(
                    f"target {t.name!r}: copy {c.piece.source}{c.piece.source_box} lies "
                    f"outside its read {r.source}{r.box}"
                )
        if any(not 0 <= x < plan.world_size for x in t.consumers):
            problems.append(f"target {t.name!r}: consumers {list(t.consumers)} outside the group")
        problems += tiling_problems(f"target {t.name!r}", t.shape, [c.piece.target_box for c in t.copies])
    return problems + _delivery_problems(plan)


def check_plan(plan: Plan, layout: GlobalLayout) -> None:
    """Raise :class:`PlanError` listing every inconsistency of ``plan`` (a planner bug if it fires).

    Example:
        >>> check_plan(plan, layout)   # doctest: +SKIP
    """
    problems = plan_problems(plan, layout)
    if problems:
        raise PlanError(_format("internal error: the plan failed validation", problems))


def _format(head: str, problems: list[str]) -> str:
    shown = problems[:_MAX_LISTED]
    more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    return f"{head} ({len(problems)} problem{'s' if len(problems) > 1 else ''}):\n  " + "\n  ".join(shown) + more
