"""What moves through shared memory, and what it costs: pure functions of the plan.

The same-host transport (:mod:`shardsync.exec.shm`) moves a target's pieces one of two ways: its
senders write them straight into its consumers' memory (pushed targets, :func:`pushes`), or each
sender publishes the reads its receivers copy them from (:func:`pulls`; a read whose pieces cast or
permute is published in target form, :func:`arranged_pieces`). :func:`use_shm` decides, the same on
every rank, whether the transport applies at all; :func:`shm_costs` is what the plan then costs.
Everything here is derived once per plan (:func:`~shardsync.exec.push_schedule.per_plan`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from ..errors import PlanError
from ..layout.dtypes import itemsize
from ..mapping.pieces import Piece
from ..planning.model import Costs, Plan
from ..planning.schedule import aligned
from . import push_schedule, shm_blocks
from .hosts import HostInfo, describe_hosts, same_host, same_processes
from .push_schedule import (
    NO_PUSHING,
    Pushing,
    allocations,
    per_plan,
    pushed_bytes,
    pushed_targets,
    writers,
)

__all__ = [
    "TransportChoice",
    "TRANSPORT_CHOICES",
    "HostChoice",
    "SETUP_COLLECTIVES",
    "check_transport",
    "pushes",
    "pulls",
    "shm_costs",
    "piece_dtype",
    "regions",
    "arranged_pieces",
    "use_shm",
]

#: How data moves between ranks: ``"shm"`` through shared memory (every rank on one host, CPU),
#: ``"backend"`` through the process group's collectives, ``"auto"``: shm where it applies.
TransportChoice = Literal["auto", "shm", "backend"]
TRANSPORT_CHOICES: tuple[str, ...] = ("auto", "shm", "backend")
#: What each rank reports when the layout is gathered: its host and its ``transport=`` choice.
HostChoice = tuple[HostInfo, TransportChoice]
#: Collectives of the setup (publish, open); nothing else of the stream is a collective.
SETUP_COLLECTIVES = 2


def check_transport(value: object) -> None:
    """Raise :class:`PlanError` for a ``transport=`` value that is not one of :data:`TRANSPORT_CHOICES`.

    Example:
        >>> check_transport("tcp")
        Traceback (most recent call last):
        ...
        shardsync.errors.PlanError: transport='tcp': use one of ['auto', 'shm', 'backend']
    """
    if value not in TRANSPORT_CHOICES:
        raise PlanError(f"transport={value!r}: use one of {list(TRANSPORT_CHOICES)}")


def pushes(plan: Plan, fresh: bool, hosts: Sequence[HostInfo], budget: int | None = None) -> Pushing:
    """The targets senders write straight into (:func:`~shardsync.exec.push_schedule.pushed_targets`)
    when the destination gives targets fresh memory (``fresh``), every rank runs in one pid namespace
    (``hosts``, gathered with the layout: they open each other's blocks through ``/proc``) and this
    system has shared-memory blocks, and how far ahead their consumers allocate them:
    :data:`~shardsync.exec.push_schedule.PUSH_AHEAD_BYTES`, or what is left of ``budget``
    (``memory_budget``); the same on every rank.

    Example:
        >>> import torch, shardsync
        >>> from shardsync.exec.hosts import host_info
        >>> pushes(shardsync.plan({"w": torch.zeros(3)}), True, [host_info()])
        Pushing(targets=frozenset(), window=0)
    """
    if not (fresh and shm_blocks.supported() and same_processes(hosts)):
        return NO_PUSHING
    limits = (push_schedule.PUSH_MIN_BYTES, push_schedule.PUSH_OPEN_TARGETS)  # read now: tests change them
    pushed = per_plan(plan, ("pushed", limits), lambda: pushed_targets(plan))
    if not pushed:
        return NO_PUSHING
    window = push_schedule.PUSH_AHEAD_BYTES  # read now: tests change it
    if budget is not None:
        held = max(shm_costs(plan, Pushing(pushed)).peak_bytes, default=0)
        window = max(0, min(window, budget - held))
    return Pushing(pushed, window)


def pulls(plan: Plan, pushed: frozenset[int]) -> dict[int, frozenset[int]]:
    """Read -> the ranks that copy it out of its sender's shared memory (for the targets that are not
    pushed), for every read some rank does: the reads their senders publish.

    Example:
        >>> import torch, shardsync
        >>> pulls(shardsync.plan({"w": torch.zeros(3)}), frozenset())
        {}
    """
    return per_plan(plan, ("pulls", pushed), lambda: _pulls(plan, pushed))


def _pulls(plan: Plan, pushed: frozenset[int]) -> dict[int, frozenset[int]]:
    out: dict[int, set[int]] = {}
    for t, tp in enumerate(plan.targets):
        if t in pushed:
            continue
        for cp in tp.copies:
            r = plan.reads[cp.read]
            for c in tp.consumers:
                if c in r.receivers:
                    out.setdefault(cp.read, set()).add(c)
    return {i: frozenset(ranks) for i, ranks in sorted(out.items())}


def shm_costs(plan: Plan, pushing: Pushing = NO_PUSHING) -> Costs:
    """The plan's costs when its data moves through shared memory, the targets of ``pushing`` written
    straight into by their senders (:func:`pushes`): a pushed piece is written once by its sender per
    consumer; any other read is written once by its sender and copied by each rank that pulls it; no
    collective moves data, two small ones set up; and every rank may also hold a segment of the
    bytes it publishes for the whole stream (none for reads published in place) and the pushed
    targets it allocates ahead of their step (no receive or pack buffers either, so this stays an
    upper bound).

    Example:
        >>> import torch, shardsync
        >>> plan = shardsync.plan({"w": torch.zeros(3)})   # one process: nothing is received
        >>> shm_costs(plan).collectives, shm_costs(plan).bytes_received
        ((2,), (0,))
    """
    return per_plan(plan, ("costs", pushing), lambda: _shm_costs(plan, pushing))


def _shm_costs(plan: Plan, pushing: Pushing) -> Costs:
    world = plan.world_size
    sent, recv = pushed_bytes(plan, pushing.targets)
    segment = [0] * world  # at most: every read a rank publishes copied into its segment
    for rank in range(world) if pushing.targets else ():  # and the pushed targets allocated ahead
        segment[rank] += allocations(plan, writers(plan, pushing.targets, rank), pushing.window)[1]
    for i, ranks in pulls(plan, pushing.targets).items():
        r = plan.reads[i]
        if r.sender is not None:
            sent[r.sender] += r.nbytes
            segment[r.sender] += aligned(r.nbytes)
            for d in ranks:
                recv[d] += r.nbytes
    peak = tuple(p + s for p, s in zip(plan.costs.peak_bytes, segment))
    return Costs(tuple(sent), tuple(recv), (SETUP_COLLECTIVES,) * world, peak)


def piece_dtype(piece: Piece, dtype: str) -> str:
    return piece.casts[-1] if piece.casts else dtype


def regions(pieces: Sequence[Piece], dtype: str) -> tuple[list[int], int]:
    """Byte offsets of ``pieces`` in target form (read dtype ``dtype``), one after another, aligned;
    and the bytes they take."""
    offsets, size = [], 0
    for p in pieces:
        offsets.append(size)
        size = aligned(size + p.target_box.numel * itemsize(piece_dtype(p, dtype)))
    return offsets, size


def arranged_pieces(plan: Plan, pushed: frozenset[int] = frozenset()) -> dict[int, tuple[Piece, ...]]:
    """The reads whose sender publishes their pieces in target form rather than the read's own bytes
    (pieces of ``pushed`` targets are written by their senders, not published).

    A receiver copies what it gets into its targets piece by piece, casting and permuting each as it
    goes (a transposed piece is the slow copy of them all). When a sender copies a read into its
    segment anyway, it can as well write the read's pieces already cast and permuted: each is then
    arranged once, by its sender, and every rank that builds it - the receivers, and the sender
    itself when it builds that target too - copies it plainly. So it is done for a read that some
    piece casts or permutes and whose distinct pieces, so written, take no more bytes than the read
    (not for pieces that overlap, nor for a cast that widens).

    Example:
        >>> import torch, shardsync
        >>> plan = shardsync.plan({"w": torch.zeros(3, 2)}, "w^T -> wt")   # one process: no receivers
        >>> arranged_pieces(plan)
        {}
    """
    pieces: dict[int, dict[Piece, None]] = {}
    for t, tp in enumerate(plan.targets):
        if t in pushed:
            continue
        for c in tp.copies:
            r = plan.reads[c.read]
            if r.receivers and r.sender is not None:
                pieces.setdefault(c.read, {})[c.piece] = None
    out = {}
    for i, found in pieces.items():
        r, ps = plan.reads[i], tuple(found)
        if any(p.permutes or p.casts for p in ps) and regions(ps, r.dtype)[1] <= aligned(r.nbytes):
            out[i] = ps
    return out


def use_shm(
    plan: Plan, hosts: Sequence[tuple[HostInfo, str]], budget: int | None, pushing: Pushing = NO_PUSHING
) -> bool:
    """Whether ``plan``'s data moves through shared memory, from every rank's host and ``transport=``
    choice (gathered with the layout): the same answer, or the same error, on every rank.
    ``pushing``: the targets senders would write straight into (:func:`pushes`); their bytes need no
    room in /dev/shm (their blocks have no name there).

    Raises:
        PlanError: the ranks passed different choices, or ``"shm"`` where it cannot be used (mesh2d,
            CUDA targets, several hosts, too little room in /dev/shm, over ``memory_budget``).

    Example:
        >>> import torch, shardsync
        >>> from shardsync.exec.hosts import host_info
        >>> plan = shardsync.plan({"w": torch.zeros(3)})
        >>> use_shm(plan, [(host_info(), "auto")], None)   # nothing to move
        False
        >>> use_shm(plan, [(host_info(), "shm"), (host_info(data_device="cuda"), "shm")], None)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        shardsync.errors.PlanError: transport='shm' cannot be used: targets of some ranks are on cuda, ...
    """
    choices = {choice for _, choice in hosts}
    if len(choices) > 1:
        raise PlanError(
            f"ranks passed different transport= values {sorted(choices)}; pass the same on every rank of the group"
        )
    infos, choice = [h for h, _ in hosts], choices.pop()
    need = sum(plan.reads[i].nbytes for i in pulls(plan, pushing.targets))
    peak = max(shm_costs(plan, pushing).peak_bytes, default=0)
    off_cpu = ", ".join(sorted({h.data_device for h in infos} - {"cpu"}))  # every rank's, gathered
    why = (
        "the strategy is mesh2d (its transport is the mesh's groups)"
        if plan.strategy == "mesh2d"
        else f"targets of some ranks are on {off_cpu}, not cpu"
        if off_cpu
        else f"the ranks are on several hosts ({describe_hosts(infos)})"
        if not same_host(infos)
        else f"{infos[0].shm_free} B free in /dev/shm, {need} B needed"
        if need > infos[0].shm_free
        else f"its segments raise the peak to {peak} B, over memory_budget={budget} B"
        if budget is not None and peak > budget
        else ""
    )
    if choice == "shm" and why:
        raise PlanError(f"transport='shm' cannot be used: {why}; pass transport='backend' or 'auto'")
    return choice != "backend" and not why and any(r.receivers for r in plan.reads)
