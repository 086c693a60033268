"""Destinations: resolved targets cut to the boxes ranks hold of them (``load``, ``reshard``).

A target resolved from the sources is a whole tensor. When the ranks already hold the destination,
sharded, each distinct box of it (on the ranks holding that box: several for replicas) becomes a
target of its own: the pieces of the whole target restricted to the box, moved into the box's
coordinates, cast to the destination's dtype. The planner then plans these with each box's holders as
its consumers, so a rank receives or reads only the boxes of its own destination shards.

Each box comes from a rank holding it, point to point, or - when several ranks want the same box -
by one broadcast among the sender and those ranks (:func:`schedule_multicast`).

Pure: every rank computes the same cut and schedule from the same gathered layouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..layout.box import Box
from ..layout.meta import GlobalLayout
from ..mapping.pieces import Piece, TargetSpec
from ..mapping.vtensor import simplify_casts
from .model import Read
from .schedule import RawStep, aligned, pack
from .validate import shard_boxes

__all__ = ["BoxTarget", "restrict_piece", "restrict_target", "box_targets", "schedule_multicast", "MULTICAST_RECEIVERS"]

#: A read that at least this many ranks receive travels by one broadcast among them and its sender
#: (a tree or ring in the backend) rather than one message to each.
MULTICAST_RECEIVERS = 2


@dataclass(frozen=True, slots=True)
class BoxTarget:
    """One destination box to fill: the target restricted to it, and where it lives.

    Attributes:
        name: the destination key.
        box: the box of the destination (global coordinates) this target fills: a box ranks hold,
            or its part inside a target shorter than the destination.
        ranks: the ranks holding that box (its consumers).
        spec: the target, in the box's coordinates, with the destination's dtype.

    Example:
        >>> t = TargetSpec("w", (4,), "float32", (Piece("w", Box((0,), (4,)), Box((0,), (4,))),))
        >>> BoxTarget("w", Box((2,), (2,)), (1,), restrict_target(t, Box((2,), (2,)), "w[2:4]")).spec.shape
        (2,)
    """

    name: str
    box: Box
    ranks: tuple[int, ...]
    spec: TargetSpec


def restrict_piece(piece: Piece, box: Box) -> Piece | None:
    """The part of ``piece`` that lands in ``box`` (target coordinates), with its target box made
    relative to ``box``; None when the piece misses the box.

    Example:
        >>> p = Piece("s", Box((0, 0), (2, 3)), Box((0, 0), (3, 2)), perm=(1, 0))
        >>> cut = restrict_piece(p, Box((1, 0), (2, 2)))
        >>> cut.source_box, cut.target_box
        (Box(offsets=(0, 1), sizes=(2, 2)), Box(offsets=(0, 0), sizes=(2, 2)))
    """
    hit = piece.target_box.intersect(box)
    if hit is None:
        return None
    source_box = piece.to_source(hit.relative_to(piece.target_box))
    return Piece(piece.source, source_box, hit.relative_to(box), piece.perm, piece.casts)


def restrict_target(
    target: TargetSpec, box: Box, name: str, dtype: str | None = None, source_dtypes: dict[str, str] | None = None
) -> TargetSpec:
    """``target`` cut to ``box``, named ``name``; cast to ``dtype`` when given (each piece's cast
    chain then ends in it, starting from its source's dtype in ``source_dtypes``).

    Example:
        >>> t = TargetSpec("w", (4,), "float32", (Piece("w", Box((0,), (4,)), Box((0,), (4,))),))
        >>> restrict_target(t, Box((1,), (2,)), "w[1:3]", "bfloat16", {"w": "float32"}).pieces[0].casts
        ('bfloat16',)
    """
    pieces = [p for p in (restrict_piece(p, box) for p in target.pieces) if p is not None]
    if dtype is not None and dtype != target.dtype:
        dtypes = source_dtypes or {}
        pieces = [
            Piece(p.source, p.source_box, p.target_box, p.perm, simplify_casts(dtypes[p.source], p.casts + (dtype,)))
            for p in pieces
        ]
    return TargetSpec(name, box.sizes, dtype or target.dtype, tuple(pieces))


def box_targets(
    targets: Sequence[TargetSpec],
    dest: GlobalLayout,
    layout: GlobalLayout,
) -> list[BoxTarget]:
    """Every target that has a destination, cut to each distinct non-empty box ranks hold of it.

    A box covering the whole destination keeps the target's name; a part is named ``name[box]``
    (``"w[0:8, 0:5]"``). Targets without a destination are left out (the caller checks for them). A
    target shorter than its destination (a padded vocabulary loaded) fills the start of it: each box
    is cut to the target, and what lies past it is left as the destination holds it.

    Args:
        targets: resolved targets (whole tensors, shapes equal to their destinations', or within
            them from the start).
        dest: the gathered destination layout (keys are target names).
        layout: the gathered source layout (source dtypes, for the casts to the destination's).

    Returns:
        the box targets, by name, then by box offsets.

    Example:
        >>> entries = [[("w", (4,), "float32", Box((0,), (2,)))], [("w", (4,), "float32", Box((2,), (2,)))]]
        >>> dest = GlobalLayout.merge(entries)
        >>> src = GlobalLayout.merge([[("w", (4,), "float32", Box((0,), (4,)))], []])
        >>> t = TargetSpec("w", (4,), "float32", (Piece("w", Box((0,), (4,)), Box((0,), (4,))),))
        >>> [(b.spec.name, b.ranks) for b in box_targets([t], dest, src)]
        [('w[0:2]', (0,)), ('w[2:4]', (1,))]
    """
    dtypes = {k: layout[k].dtype for k in layout.keys()}
    out: list[BoxTarget] = []
    for t in targets:
        if t.name not in dest:
            continue
        meta = dest[t.name]
        for held, ranks in sorted(shard_boxes(dest, t.name).items(), key=lambda kv: kv[0].offsets):
            box = held if t.shape == meta.shape else held.intersect(Box.full(t.shape))
            if box is None or box.empty:
                continue  # past the end of a target shorter than its destination (padding rows)
            name = t.name if box == Box.full(meta.shape) else f"{t.name}{box}"
            out.append(BoxTarget(t.name, box, ranks, restrict_target(t, box, name, meta.dtype, dtypes)))
    return out


def _multicast(r: Read) -> bool:
    return len(r.receivers) >= MULTICAST_RECEIVERS


def _rounds(reads: Sequence[Read], cap: int, solo: int | None, many: bool) -> list[dict[_Key, list[int]]]:
    # One buffer per key (a sender and its receivers) per round: a read of ``solo`` bytes or more
    # alone, else reads packed up to ``cap``. A round closes only when one of the read's buffers is
    # taken, so reads between other pairs keep sharing it: every pair's messages travel together.
    # ``many``: the reads several ranks receive (multicast), else those one rank receives.
    rounds: list[dict[_Key, list[int]]] = [{}]
    size: dict[_Key, int] = {}
    alone: set[_Key] = set()
    for i, r in enumerate(reads):
        if not r.receivers or _multicast(r) != many:
            continue
        ks, n = _keys(r), r.nbytes
        big = solo is not None and n >= solo
        if any(k in alone or (k in rounds[-1] and (big or aligned(size[k]) + n > cap)) for k in ks):
            rounds.append({})
            size, alone = {}, set()
        for k in ks:
            rounds[-1].setdefault(k, []).append(i)
            size[k] = aligned(size.get(k, 0)) + n
        if big:
            alone.update(ks)
    return [rnd for rnd in rounds if rnd]


#: A buffer's key: (1 for a multicast, sender, receivers).
_Key = tuple[int, int, tuple[int, ...]]


def _keys(r: Read) -> list[_Key]:
    sender = r.sender if r.sender is not None else -1
    if _multicast(r):
        return [(1, sender, r.receivers)]
    return [(0, sender, (d,)) for d in r.receivers]


def schedule_multicast(
    reads: Sequence[Read],
    cap: int,
    solo: int | None = None,
) -> tuple[list[RawStep], dict[int, int]]:
    """Buffers of at most ``cap`` bytes per (sender, receiver) pair for reads one rank receives, in
    ``p2p`` steps; then buffers per (sender, receiver set) for reads several receive, in ``multicast``
    steps (one broadcast per packet among its sender and receivers). Reads of at least ``solo`` bytes
    get a buffer of their own (sent from the shard, received in place), but share the step with other
    pairs' buffers. Multicast reads go last, packed together: they are usually small (replicated
    norms), and a destination written in place holds no memory while it waits for them.

    Returns:
        the steps and each moved read's step index.

    Example:
        >>> r = Read("w", Box((0,), (4,)), "float32", (0,), (1, 2), (1, 2), 0)
        >>> [(kind, len(packets)) for kind, packets in schedule_multicast([r], 1 << 20)[0]]
        [('multicast', 1)]
    """
    steps: list[RawStep] = []
    step_of: dict[int, int] = {}
    for many, kind in ((False, "p2p"), (True, "multicast")):
        for rnd in _rounds(reads, cap, solo, many):
            packets = tuple(pack(reads, ids, src, -1 if many else dst[0]) for (_, src, dst), ids in sorted(rnd.items()))
            step_of.update({i: len(steps) for pk in packets for i in pk.reads})
            steps.append((kind, packets))  # type: ignore[arg-type]
    return steps, step_of
