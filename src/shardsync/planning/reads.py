"""Reads: which boxes of which sources move, from whom, in what order, and the copies they feed.

A piece of a target is cut by the shards of its source into fragments. The fragments that fall in one
shard and go to the same consumers are merged into one read (the shard region they need; if that region
has gaps, one read per fragment). Each read is held by the ranks that hold that shard (replicas) and
sent by one of them, chosen so that replicas share the sending load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import filterfalse

from ..layout.box import Box
from ..layout.dtypes import itemsize
from ..layout.meta import GlobalLayout
from ..mapping.pieces import Piece, TargetSpec
from .boxes import BoxIndex, chunk, holes_in, union_bbox
from .model import Copy, Read
from .validate import shard_index

__all__ = ["build_reads"]


@dataclass
class _Group:
    """Fragments of one shard box of one source that go to the same consumers."""

    source: str
    shard: Box
    holders: tuple[int, ...]
    readers: tuple[int, ...]
    frags: list[tuple[int, Piece]] = field(default_factory=list)  # (target index, restricted piece)


def _groups(targets: Sequence[TargetSpec], consumers: Sequence[tuple[int, ...]], layout: GlobalLayout) -> list[_Group]:
    groups: dict[tuple[str, Box, tuple[int, ...]], _Group] = {}
    indexes: dict[str, tuple[BoxIndex, list[tuple[int, ...]]]] = {}
    for ti, t in enumerate(targets):
        for p in t.pieces:
            if p.source not in indexes:
                indexes[p.source] = shard_index(layout, p.source)
            index, holders = indexes[p.source]
            for i in _touching(index, p.source_box):
                shard = index.boxes[i]
                inter = p.source_box if shard.contains(p.source_box) else p.source_box.intersect(shard)
                if inter is None:
                    continue
                key = (p.source, shard, consumers[ti])
                g = groups.setdefault(key, _Group(p.source, shard, holders[i], consumers[ti]))
                g.frags.append((ti, p if inter == p.source_box else p.restrict(inter)))
    return list(groups.values())


def _touching(index: BoxIndex, box: Box) -> list[int]:
    # The boxes of ``index`` that meet ``box`` or, for an empty one (a zero-size dim), contain it - in
    # index order. Any box containing a non-empty one meets it.
    if box.empty:
        return [i for i, b in enumerate(index.boxes) if b.contains(box)]
    return index.query(box)


def _blocks(frags: Sequence[tuple[int, Piece]]) -> list[Box]:
    # One block if the needed region is a full box; else every fragment box not inside another.
    boxes = list(dict.fromkeys(p.source_box for _, p in frags))
    bbox = union_bbox(boxes) if len(boxes) > 1 else boxes[0]
    if bbox in boxes:
        return [bbox]
    index = BoxIndex(boxes)
    if index.pairs():
        full = not holes_in(bbox, boxes)
    else:  # disjoint boxes fill their bounding box iff they hold as many elements
        full = sum(b.numel for b in boxes) == bbox.numel
    if full:
        return [bbox]
    return [b for b in boxes if not any(boxes[o] != b and boxes[o].contains(b) for o in _touching(index, b))]


def _balance(reads: list[Read], world: int) -> list[Read]:
    # Largest first, each to the holder that has sent least so far (ties: lowest rank).
    load = [0] * world
    chosen: dict[int, int] = {}
    order = sorted(
        (i for i, r in enumerate(reads) if r.receivers), key=lambda i: (-reads[i].nbytes * len(reads[i].receivers), i)
    )
    for i in order:
        r = reads[i]
        sender = min(r.holders, key=lambda h: (load[h], h))
        load[sender] += r.nbytes * len(r.receivers)
        chosen[i] = sender
    return [
        Read(r.source, r.box, r.dtype, r.holders, r.readers, r.receivers, chosen.get(i)) for i, r in enumerate(reads)
    ]


def _order(
    reads: list[Read],
    copies: list[list[Copy]],
    chunk_no: list[int],
) -> tuple[list[Read], list[list[Copy]]]:
    # Reads in the order targets first need them; within a target, reads feeding more targets first,
    # then the k-th chunks of all shards before the (k+1)-th (so every sender's bucket fills at once).
    fanout = [0] * len(reads)
    for per_target in copies:
        for i in {c.read for c in per_target}:
            fanout[i] += 1
    new_index: dict[int, int] = {}
    for per_target in copies:
        fresh = sorted(
            {c.read for c in per_target if c.read not in new_index},
            key=lambda i: (-fanout[i], chunk_no[i], reads[i].source, reads[i].box.offsets),
        )
        for i in fresh:
            new_index[i] = len(new_index)
    ordered = [reads[i] for i in sorted(new_index, key=new_index.__getitem__)]
    return ordered, [[Copy(new_index[c.read], c.piece) for c in per_target] for per_target in copies]


def build_reads(
    targets: Sequence[TargetSpec],
    consumers: Sequence[tuple[int, ...]],
    layout: GlobalLayout,
    world: int,
    *,
    max_read_bytes: int | None = None,
    merge: bool = True,
) -> tuple[list[Read], list[list[Copy]]]:
    """Reads that feed ``targets`` and, per target, the copies that build it.

    Args:
        targets: the targets to build, in yield order; their pieces must be covered by the layout.
        consumers: for each target, the ranks that receive it.
        layout: the gathered global layout.
        world: ranks in the group.
        max_read_bytes: cut larger reads into chunks (to fit a memory budget); None keeps them whole.
        merge: merge the fragments of one shard into one read of the region they cover; False reads
            each fragment on its own (in place: then each read lands in one region of one target).

    Returns:
        ``(reads, copies)``: reads in the order the targets first need them, senders chosen; and for
        each target its copies, each inside one read.

    Example:
        >>> reads, copies = build_reads(targets, [(0, 1)] * len(targets), layout, 2)  # doctest: +SKIP
    """
    reads: list[Read] = []
    chunk_no: list[int] = []
    copies: list[list[Copy]] = [[] for _ in targets]
    for g in _groups(targets, consumers, layout):
        dtype = layout[g.source].dtype
        receivers = tuple(filterfalse(set(g.holders).__contains__, g.readers))
        blocks = []
        for block in _blocks(g.frags) if merge else list(dict.fromkeys(p.source_box for _, p in g.frags)):
            parts = chunk(block, itemsize(dtype), max_read_bytes) if max_read_bytes else [block]
            first = len(reads)
            reads += [Read(g.source, b, dtype, g.holders, g.readers, receivers, None) for b in parts]
            chunk_no += range(len(parts))
            blocks.append((block, range(first, len(reads))))
        for ti, piece in g.frags:
            block, ids = next((b, ids) for b, ids in blocks if b.contains(piece.source_box))
            for i in ids:
                if len(ids) == 1:  # the block is one read: the piece lies inside it as it is
                    copies[ti].append(Copy(i, piece))
                    continue
                inter = piece.source_box.intersect(reads[i].box)
                if inter is not None:
                    copies[ti].append(Copy(i, piece.restrict(inter)))
    reads, copies = _order(reads, copies, chunk_no)
    return _balance(reads, world), copies
