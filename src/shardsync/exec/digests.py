"""Digests of planned targets: each rank hashes the copies it owns, one small collective adds the sums.

A plan's copies tile each target exactly, and each copy lies in a read that some ranks hold (replicas).
:func:`owners` gives every read to exactly one of its holders (balanced by bytes), so every element of
every target is hashed by exactly one rank, where its bytes lie: nothing moves but one integer per
target per rank, in one gather (:func:`combine`, an agreed phase: a failure on any rank
is raised on every rank).

Used by :func:`shardsync.digest` (a plan without consumers), ``full_params(..., verify=True)`` (the
stream's own plan) and ``load``/``reshard(..., verify=True)`` (per destination box).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .. import phases
from ..dist import agree
from ..errors import VerifyError
from ..mapping.pieces import Piece
from ..planning.model import Plan, Read
from ..sources import Source
from .box_hash import MASK, box_sum, finish, tensor_digest

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "Part",
    "owners",
    "plan_parts",
    "local_sums",
    "combine",
    "plan_digests",
    "checked",
    "DIGEST_PHASE",
    "RECEIVE_PHASE",
]

#: The agreed phase that adds every rank's sums, and the one that compares what consumers received.
DIGEST_PHASE, RECEIVE_PHASE = phases.DIGEST, phases.RECEIVED


@dataclass(frozen=True, slots=True)
class Part:
    """One copy to hash: its read, its piece, and the frame its target box is in.

    Attributes:
        target: index of the sum it adds to.
        read: index of the read holding the piece's source box.
        piece: the copy's piece (source box, target box, permutation, casts).
        shape: shape of the frame (the target, or the destination box it is cut to).
        dtype: dtype name of the target.
    """

    target: int
    read: int
    piece: Piece
    shape: tuple[int, ...]
    dtype: str


def owners(reads: Sequence[Read], world: int) -> tuple[int, ...]:
    """The rank that hashes each read: one of its holders, largest reads first to the holder with the
    fewest bytes so far (ties: lowest rank). The same on every rank.

    Example:
        >>> from shardsync.layout.box import Box
        >>> r = [Read("w", Box((0,), (4,)), "float32", (0, 1), (), (), None),
        ...      Read("b", Box((0,), (2,)), "float32", (0, 1), (), (), None)]
        >>> owners(r, 2)
        (0, 1)
    """
    load = [0] * world
    chosen = [0] * len(reads)
    for i in sorted(range(len(reads)), key=lambda i: (-reads[i].nbytes, i)):
        holder = min(reads[i].holders, key=lambda h: (load[h], h))
        load[holder] += reads[i].nbytes
        chosen[i] = holder
    return tuple(chosen)


def plan_parts(plan: Plan) -> tuple[Part, ...]:
    """Every copy of every target of ``plan``, in the target's own frame (``plan.targets`` order).

    Example:
        >>> import torch, shardsync
        >>> [p.piece.target_box for p in plan_parts(shardsync.plan({"w": torch.zeros(3)}))]
        [Box(offsets=(0,), sizes=(3,))]
    """
    return tuple(Part(ti, c.read, c.piece, t.shape, t.dtype) for ti, t in enumerate(plan.targets) for c in t.copies)


def local_sums(
    parts: Sequence[Part], reads: Sequence[Read], owner: Sequence[int], source: Source, rank: int, count: int
) -> list[int]:
    """This rank's sums (mod 2^64), one per target index in ``range(count)``, over the parts whose
    read it owns; each read is read once.

    Example:
        >>> import torch, shardsync
        >>> from shardsync.sources import LocalSource
        >>> p = shardsync.plan({"w": torch.arange(3.)})
        >>> local_sums(plan_parts(p), p.reads, owners(p.reads, 1), LocalSource({"w": torch.arange(3.)}),
        ...            0, 1) == [box_sum(torch.arange(3.), (3,), (0,))]
        True
    """
    sums = [0] * count
    by_read: dict[int, list[Part]] = {}
    for part in parts:
        if owner[part.read] == rank:
            by_read.setdefault(part.read, []).append(part)
    for i, mine in by_read.items():
        read = reads[i]
        data = source.read(read.source, read.box)
        for part in mine:
            p = part.piece
            casts = p.casts if p.casts and p.casts[-1] == part.dtype else (*p.casts, part.dtype)
            view = p.source_box.cut(data, read.box)
            s = box_sum(view, part.shape, p.target_box.offsets, p.perm, casts)
            sums[part.target] = (sums[part.target] + s) & MASK
    return sums


def combine(fn: Callable[[], list[int]], group: ProcessGroup | None, phase: str = DIGEST_PHASE) -> list[int]:
    """Run ``fn`` (this rank's sums) on every rank and add the sums of all ranks, mod 2^64: one
    gather of one integer per target; a failure on any rank raises on every rank.

    Example:
        >>> combine(lambda: [1, 2], None)
        [1, 2]
    """
    agreed = agree(phase, fn, group, unanimous=True)
    return [sum(column) & MASK for column in zip(*agreed.all)]


def plan_digests(plan: Plan, source: Source, rank: int, group: ProcessGroup | None) -> dict[str, str]:
    """The digest of every target of ``plan`` from the senders' side (collective: every rank).

    Example:
        >>> import torch, shardsync
        >>> from shardsync.sources import LocalSource
        >>> w = torch.arange(5.)
        >>> plan_digests(shardsync.plan({"w": w}), LocalSource({"w": w}), 0, None) == {"w": tensor_digest(w)}
        True
    """
    parts, owner = plan_parts(plan), owners(plan.reads, plan.world_size)
    sums = combine(lambda: local_sums(parts, plan.reads, owner, source, rank, len(plan.targets)), group)
    return {t.name: finish(s, t.shape, t.dtype) for t, s in zip(plan.targets, sums)}


def checked(
    targets: Iterator[tuple[str, torch.Tensor]], digests: Mapping[str, str], rank: int, group: ProcessGroup | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``targets``, hashing each before it is yielded; after the last, one agreed phase raises
    :class:`VerifyError` on every rank if any rank received a target whose digest is not the sender
    side's (``digests``).

    Example:
        >>> w = torch.arange(3.)
        >>> [n for n, _ in checked(iter([("w", w)]), {"w": tensor_digest(w)}, 0, None)]
        ['w']
    """
    bad = []
    for name, tensor in targets:
        if tensor_digest(tensor) != digests[name]:
            bad.append(name)
        yield name, tensor
    agreed = agree(RECEIVE_PHASE, lambda: bad, group)
    found = {r: names for r, names in enumerate(agreed.all) if names}
    if found:
        names = sorted({n for names in found.values() for n in names})
        where = "; ".join(f"rank {r}: {names}" for r, names in found.items())
        raise VerifyError(
            f"verify: {len(names)} target(s) received differ from the senders' digest "
            f"({where}); the data was changed in transit or by another writer; rerun, and report it if "
            "it persists",
            names,
        )
