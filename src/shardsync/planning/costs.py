"""What a plan costs each rank: bytes sent and received, collectives issued, peak memory held.

The executor counts the same quantities while it runs (see :class:`shardsync.exec.Stats`); these are the
plan-time figures. Conventions: a collective counts once on every rank that calls it; a rank *sends*
the bytes of its own data it hands to a collective or message, and *receives* the bytes of other
ranks' data it gets. Memory held is the open targets (allocated when their first data arrives,
released when yielded) plus the step's buffers (packed sends, receive buffers). A target built from
this rank's own data alone is allocated right before it is yielded - or, in a pipelined plan when it
has at least :data:`AHEAD_BYTES`, while the caller has the target before it (its copies run then).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import get_args

from ..layout.box import Box
from .model import Costs, Read, Step, StepKind, TargetPlan

__all__ = ["is_zero_copy", "builds_ahead", "estimate_costs", "STEP_COSTS", "AHEAD_BYTES"]

#: Smallest target built one ahead: the size at which its copies go to the copy threads in the
#: background (:data:`shardsync.exec.copies.PARALLEL_BYTES` is this value; smaller batches are
#: copied on the spot, so building them early would only hold memory longer).
AHEAD_BYTES = 4 << 20


def is_zero_copy(target: TargetPlan, reads: Sequence[Read], rank: int, copy: bool) -> bool:
    """Whether ``rank`` yields ``target`` as a view of its own source data (``copy=False``).

    True for a target built by one copy with no permutation or cast, whose read ``rank`` holds.

    Example:
        >>> import torch, shardsync
        >>> plan = shardsync.plan({"w": torch.zeros(2, 3), "v": torch.zeros(3)}, "w^T -> wt", copy=False)
        >>> [(t.name, is_zero_copy(t, plan.reads, 0, copy=False)) for t in plan.targets]
        [('v', True), ('wt', False)]
    """
    if copy or len(target.copies) != 1:
        return False
    c = target.copies[0]
    p = c.piece
    # a perm that only drops or adds unit dims reads the same bytes, but the target has its own shape
    identity = p.perm is None or tuple(p.perm) == tuple(range(p.source_box.ndim))
    return identity and not p.casts and p.target_box == Box.full(target.shape) and rank in reads[c.read].holders


def builds_ahead(target: TargetPlan, depth: int) -> bool:
    """Whether a target built from local data is built while the caller has the one before it: in a
    pipelined plan (``depth`` > 1), for targets of at least :data:`AHEAD_BYTES`.

    Example:
        >>> import torch, shardsync
        >>> plan = shardsync.plan({"w": torch.zeros(1024, 1024), "v": torch.zeros(3)})
        >>> [(t.name, builds_ahead(t, plan.depth)) for t in plan.targets]
        [('v', False), ('w', True)]
    """
    return depth > 1 and target.nbytes >= AHEAD_BYTES


class _Tally:
    def __init__(self, world: int) -> None:
        self.sent = [0] * world
        self.recv = [0] * world
        self.calls = [0] * world
        self.buf = [0] * world  # buffers of the current step

    def collective(self, ranks: Sequence[int], src: int, n: int) -> None:
        """One broadcast (or message) of ``n`` bytes from ``src`` to the other ``ranks``."""
        for r in ranks:
            self.calls[r] += 1
            if r == src:
                self.sent[r] += n
            else:
                self.recv[r] += n


def _mesh_hv(
    t: _Tally, step: Step, world: int, topology: Sequence[Sequence[int]] | None, reads: Sequence[Read]
) -> None:
    assert topology is not None  # mesh steps exist only in plans with a topology
    # Every rank holds its column's item (packed, received, or padding) and the all_gather output.
    n, ncols = step.packets[0].nbytes, len(topology[0])
    for j, pk in enumerate(step.packets):
        column = [row[j] for row in topology]
        if pk.src >= 0 and len(column) > 1:
            t.collective(column, pk.src, n)
    for row in topology:
        for r in row:
            t.calls[r] += 1
            t.sent[r] += n
            t.recv[r] += n * (ncols - 1)
            t.buf[r] += n * (ncols + 1)


def _mesh_global(
    t: _Tally, step: Step, world: int, topology: Sequence[Sequence[int]] | None, reads: Sequence[Read]
) -> None:
    assert topology is not None  # mesh steps exist only in plans with a topology
    # Down the sender's column, then across every row from that column; one buffer on every rank.
    pk = step.packets[0]
    j = next(j for row in topology for j, r in enumerate(row) if r == pk.src)
    if len(topology) > 1:
        t.collective([row[j] for row in topology], pk.src, pk.nbytes)
    for row in topology:
        if len(row) > 1:
            t.collective(row, row[j], pk.nbytes)
        for r in row:
            t.buf[r] += pk.nbytes


def _broadcast(
    t: _Tally, step: Step, world: int, topology: Sequence[Sequence[int]] | None, reads: Sequence[Read]
) -> None:
    for pk in step.packets:
        t.collective(range(world), pk.src, pk.nbytes)
        for r in range(world):
            t.buf[r] += pk.nbytes


def _p2p(t: _Tally, step: Step, world: int, topology: Sequence[Sequence[int]] | None, reads: Sequence[Read]) -> None:
    for pk in step.packets:
        t.collective((pk.src, pk.dst), pk.src, pk.nbytes)
        t.buf[pk.src] += pk.nbytes
        t.buf[pk.dst] += pk.nbytes


def _multicast(
    t: _Tally, step: Step, world: int, topology: Sequence[Sequence[int]] | None, reads: Sequence[Read]
) -> None:
    for pk in step.packets:  # among the sender and the receivers its reads share
        members = (pk.src, *reads[pk.reads[0]].receivers)
        t.collective(members, pk.src, pk.nbytes)
        for r in members:
            t.buf[r] += pk.nbytes


def _local(t: _Tally, step: Step, world: int, topology: Sequence[Sequence[int]] | None, reads: Sequence[Read]) -> None:
    """A local step moves nothing: it adds no traffic and no buffers."""


#: The cost model of each step kind: adds a step's traffic and buffers to the tally.
StepCost = Callable[[_Tally, Step, int, Sequence[Sequence[int]] | None, Sequence[Read]], None]
STEP_COSTS: dict[str, StepCost] = {
    "local": _local,
    "broadcast": _broadcast,
    "p2p": _p2p,
    "multicast": _multicast,
    "mesh_hv": _mesh_hv,
    "mesh_global": _mesh_global,
}
if set(STEP_COSTS) != set(get_args(StepKind)):
    raise ImportError(f"STEP_COSTS {sorted(STEP_COSTS)} must cost every StepKind {get_args(StepKind)}")


def estimate_costs(
    steps: Sequence[Step],
    reads: Sequence[Read],
    targets: Sequence[TargetPlan],
    world: int,
    topology: Sequence[Sequence[int]] | None = None,
    copy: bool = True,
    depth: int = 2,
    *,
    in_place: bool = False,
) -> Costs:
    """Per-rank bytes, collectives and peak memory of running ``steps`` ``depth`` deep.

    With ``in_place`` the targets are memory the caller already holds (load, reshard): only buffers
    count.

    Mirrors the executor: starting step k allocates the targets it opens and its buffers; finishing
    the oldest step in flight (once ``depth`` are) frees its buffers and yields its targets, those
    built from local data only being allocated right before they are yielded, or while the target
    before them in the step is (:func:`builds_ahead`).

    Example:
        >>> costs = estimate_costs(plan.steps, plan.reads, plan.targets, 2)   # doctest: +SKIP
    """
    t = _Tally(world)
    held, peak = [0] * world, [0] * world
    size = [
        [
            0 if in_place or is_zero_copy(tp, reads, r, copy) or r not in tp.consumers else tp.nbytes
            for r in range(world)
        ]
        for tp in targets
    ]
    eager = {i for step in steps for i in step.opens}
    inflight: deque[tuple[Step, list[int]]] = deque()

    def finish() -> None:
        step, _ = inflight[0]
        for r in range(world):
            flying = sum(b[r] for _, b in inflight)
            peak[r] = max(peak[r], held[r] + flying)
            flying -= inflight[0][1][r]
            mine = [i for i in step.ready if r in targets[i].consumers]
            for j, i in enumerate(mine):
                now = 0 if i in eager else size[i][r]  # built from local data right before it is yielded
                nxt = mine[j + 1] if j + 1 < len(mine) else None
                if nxt is not None and nxt not in eager and builds_ahead(targets[nxt], depth):
                    now += size[nxt][r]  # and the next one, while the caller has this one
                peak[r] = max(peak[r], held[r] + flying + now)
                if i in eager:
                    held[r] -= size[i][r]
        inflight.popleft()

    for k, step in enumerate(steps):
        t.buf = [0] * world
        STEP_COSTS[step.kind](t, step, world, topology, reads)
        inflight.append((step, t.buf))
        for r in range(world):
            held[r] += sum(size[i][r] for i in step.opens)
        while len(inflight) >= depth or (inflight and k == len(steps) - 1):
            finish()
    return Costs(tuple(t.sent), tuple(t.recv), tuple(t.calls), tuple(peak))
