"""Which targets senders write straight into, and what each rank writes and allocates when: pure
functions of the plan (the runtime side is :mod:`shardsync.exec.push`).

A *pushed* target (:func:`pushed_targets`: :data:`PUSH_MIN_BYTES` or more, some consumer builds it from
data it does not hold, and the destination gives it fresh memory) lies in shared memory; each rank
that sends a read writes that read's pieces into every consumer's copy of the target, in the step the
target opens in (:func:`schedule`), and each consumer allocates its pushed targets up to
:data:`PUSH_AHEAD_BYTES` ahead of their step (:func:`allocations`; :data:`PUSH_AHEAD_FIRST_BYTES` on a
plan's first stream in the process). :func:`per_plan` keeps what is
derived from a plan, so that a training loop streaming the same plan derives it once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Hashable
from typing import Any, NamedTuple, TypeVar

from ..layout.dtypes import itemsize
from ..planning.model import Copy, Plan

__all__ = [
    "PUSH_MIN_BYTES",
    "PUSH_AHEAD_BYTES",
    "PUSH_AHEAD_FIRST_BYTES",
    "PUSH_AHEAD_TARGETS",
    "PUSH_OPEN_TARGETS",
    "Pushing",
    "NO_PUSHING",
    "Push",
    "Schedule",
    "per_plan",
    "forget_plans",
    "pushed_targets",
    "piece_bytes",
    "schedule",
    "pushed_bytes",
    "writers",
    "allocations",
    "relays",
]

#: Smallest target pushed: smaller ones come from the process's heap (warm, private) and their
#: senders publish their reads for the consumers to copy (for them the copies cost less than the
#: blocks: one descriptor each while open).
PUSH_MIN_BYTES = 1 << 20
#: Most pushed targets a consumer has open at once in their steps (each block keeps a descriptor open
#: until its target is written): a step that opens more pushes the first ones and publishes the rest.
PUSH_OPEN_TARGETS = 64
#: Most bytes of pushed targets a consumer allocates (and shows its writers) before the step they
#: open in, so that a writer ahead of a consumer need not wait for it. Less under a ``memory_budget``
#: that has no room for it. A writer that waits for a consumer writes its pieces of later steps
#: meanwhile, which is what balances ranks whose work differs from step to step (one writes all of
#: ``q``, the other all of ``v``), as far ahead as this. On the peers workload (2 spawned ranks, 2
#: cores, the stream repeated) 16 and 64 MiB take the same time on a quiet machine; next to a busy
#: process, where one rank or the other is descheduled for a few milliseconds at a time, 64 MiB took
#: 0.93x the time of 16 (0.88x with the ranks in sessions of their own, as torchrun starts them) and
#: 128 MiB no less.
PUSH_AHEAD_BYTES = 64 << 20
#: The same on a plan's first stream in the process and on streams without a pool (``reuse="never"``;
#: at most :data:`PUSH_AHEAD_BYTES`): their blocks are fresh memory (a repeated stream finds the ones
#: the last stream left in its pool), and there running further ahead cost time:
#: ``bench_convert.py``'s 2-rank route, a one-shot export, took 1.26x the time with 64 MiB ahead
#: (median of 10 alternated rounds) and the same as with 16 with this.
PUSH_AHEAD_FIRST_BYTES = 16 << 20
#: Most pushed targets a consumer allocates ahead of their step (each block keeps a descriptor open
#: until its target is written).
PUSH_AHEAD_TARGETS = 64
T = TypeVar("T")


class Pushing(NamedTuple):
    """The targets senders write straight into, and the bytes their consumers allocate ahead
    (:data:`PUSH_AHEAD_BYTES`, or less): the same on every rank.

    Example:
        >>> Pushing().targets
        frozenset()
    """

    targets: frozenset[int] = frozenset()
    window: int = 0


#: Nothing pushed.
NO_PUSHING = Pushing()


class Push(NamedTuple):
    """One piece a sender writes into one consumer's target (``copy`` restricted to the sender's read)."""

    target: int
    consumer: int
    copy: Copy


#: (id(plan), key) -> (plan, value): what :func:`per_plan` keeps (a plan is immutable)
_derived: dict[tuple[int, Hashable], tuple[Plan, Any]] = {}
#: Most values :func:`per_plan` keeps (a training loop uses one or two plans).
_KEEP = 64


def per_plan(plan: Plan, key: Hashable, make: Callable[[], T]) -> T:
    """``make()``, once per plan and ``key``: what the transport derives from a plan (which targets
    are pushed, who pulls what, costs, schedules) is computed on the first stream of a plan only.

    Example:
        >>> import torch, shardsync
        >>> plan = shardsync.plan({"w": torch.zeros(3)})
        >>> per_plan(plan, "n", lambda: len(plan.targets)), per_plan(plan, "n", lambda: 0)
        (1, 1)
    """
    hit = _derived.get((id(plan), key))
    if hit is not None and hit[0] is plan:
        return hit[1]
    while len(_derived) >= _KEEP:
        del _derived[next(iter(_derived))]
    value = make()
    _derived[(id(plan), key)] = (plan, value)
    return value


def forget_plans() -> None:
    """Drop what :func:`per_plan` keeps.

    Example:
        >>> forget_plans()
    """
    _derived.clear()


def pushed_targets(plan: Plan) -> frozenset[int]:
    """The targets whose consumers allocate them in shared memory and whose senders write their
    pieces into them: those of :data:`PUSH_MIN_BYTES` or more that some consumer builds from data it
    does not hold, in step order while no such consumer has :data:`PUSH_OPEN_TARGETS` of them open.

    Example:
        >>> import torch, shardsync
        >>> pushed_targets(shardsync.plan({"w": torch.zeros(1024, 1024)}))   # one process: none
        frozenset()
    """
    ready = {t: k for k, step in enumerate(plan.steps) for t in step.ready}
    closing: list[list[int]] = [[] for _ in plan.steps]  # step -> pushed targets yielded in it
    open_ = [0] * plan.world_size  # pushed targets open on each rank
    out = set()
    for k, step in enumerate(plan.steps):
        for t in step.opens:
            tp = plan.targets[t]
            if tp.nbytes < PUSH_MIN_BYTES:
                continue
            receivers = {c for c in tp.consumers for cp in tp.copies if c in plan.reads[cp.read].receivers}
            if receivers and all(open_[c] < PUSH_OPEN_TARGETS for c in receivers):
                out.add(t)
                for c in receivers:
                    open_[c] += 1
                closing[ready.get(t, k)].append(t)
        for t in closing[k]:
            tp = plan.targets[t]
            for c in {c for c in tp.consumers for cp in tp.copies if c in plan.reads[cp.read].receivers}:
                open_[c] -= 1
    return frozenset(out)


def piece_bytes(plan: Plan, p: Push) -> int:
    """Bytes of pushed piece ``p`` in its target (its dtype after the casts).

    Example:
        >>> import torch, shardsync
        >>> plan = shardsync.plan({"w": torch.zeros(2, 3)}, "w -> v, dtype='bfloat16'")
        >>> piece_bytes(plan, Push(0, 1, plan.targets[0].copies[0]))
        12
    """
    return p.copy.piece.target_box.numel * itemsize(plan.targets[p.target].dtype)


def schedule(plan: Plan, pushed: frozenset[int], rank: int) -> list[list[Push]]:
    """What ``rank`` writes into other consumers' targets, per step: the pieces of each pushed target
    that opens in that step, whose read ``rank`` sends and the consumer does not hold.

    Example:
        >>> import torch, shardsync
        >>> schedule(shardsync.plan({"w": torch.zeros(3)}), frozenset(), 0)
        [[]]
    """
    out: list[list[Push]] = []
    for step in plan.steps:
        pushes = []
        for t in step.opens:
            if t not in pushed:
                continue
            tp = plan.targets[t]
            for c in tp.consumers:
                if c == rank:
                    continue
                for cp in tp.copies:
                    r = plan.reads[cp.read]
                    if r.sender == rank and c in r.receivers:
                        pushes.append(Push(t, c, cp))
        out.append(pushes)
    return out


def pushed_bytes(plan: Plan, pushed: frozenset[int]) -> tuple[list[int], list[int]]:
    """Bytes each rank writes into other ranks' targets, and bytes written into each rank's targets
    by other ranks (pieces in target form), by group rank.

    Example:
        >>> import torch, shardsync
        >>> pushed_bytes(shardsync.plan({"w": torch.zeros(3)}), frozenset())
        ([0], [0])
    """
    sent, received = [0] * plan.world_size, [0] * plan.world_size
    for rank in range(plan.world_size):
        for pushes in schedule(plan, pushed, rank):
            for p in pushes:
                n = piece_bytes(plan, p)
                sent[rank] += n
                received[p.consumer] += n
    return sent, received


def writers(plan: Plan, pushed: frozenset[int], rank: int) -> dict[int, tuple[int, ...]]:
    """Pushed target ``rank`` consumes -> the ranks that write pieces of it into ``rank``'s memory.

    Example:
        >>> import torch, shardsync
        >>> writers(shardsync.plan({"w": torch.zeros(3)}), frozenset(), 0)
        {}
    """
    out = {}
    for t in sorted(pushed):
        tp = plan.targets[t]
        if rank in tp.consumers:
            reads = [plan.reads[cp.read] for cp in tp.copies]
            senders = tuple(sorted({r.sender for r in reads if rank in r.receivers and r.sender is not None}))
            if senders:  # else it builds the target from data it holds, in memory of its own
                out[t] = senders
    return out


def allocations(plan: Plan, mine: Collection[int], window: int) -> tuple[list[list[int]], int]:
    """The targets of ``mine`` (pushed ones a consumer allocates) it allocates when it starts each
    step: those that open in it, and those of the next steps while all that is allocated before its
    step holds at most ``window`` bytes and :data:`PUSH_AHEAD_TARGETS` targets; and the most bytes so
    held at once.

    Example:
        >>> import torch, shardsync
        >>> allocations(shardsync.plan({"w": torch.zeros(3)}), (), 1 << 20)
        ([[]], 0)
    """
    opening = [[t for t in step.opens if t in mine] for step in plan.steps]
    out: list[list[int]] = [[] for _ in plan.steps]
    early = [(0, 0)] * (len(plan.steps) + 1)  # (bytes, targets) allocated before step k, for step k
    ahead = count = most = 0
    j = -1  # the last step whose targets are allocated
    for k in range(len(plan.steps)):
        ahead, count = ahead - early[k][0], count - early[k][1]
        if j < k:
            j = k
            out[k] += opening[k]
        while j + 1 < len(plan.steps):
            need, n = sum(plan.targets[t].nbytes for t in opening[j + 1]), len(opening[j + 1])
            if ahead + need > window or count + n > PUSH_AHEAD_TARGETS:
                break
            j += 1
            out[k] += opening[j]
            early[j] = (need, n)
            ahead, count = ahead + need, count + n
            most = max(most, ahead)
    return out, most


def relays(plan: Plan, p: Push, rank: int) -> bool:
    """Whether ``rank`` copies pushed piece ``p`` from its own target rather than from its source: the
    piece casts or permutes, and ``rank`` builds that target too (so each piece is cast and permuted
    once, by the rank that holds it).

    Example:
        >>> import torch, shardsync
        >>> plan = shardsync.plan({"w": torch.zeros(2, 3)}, "w^T -> wt")
        >>> relays(plan, Push(0, 1, plan.targets[0].copies[0]), 0)
        True
    """
    piece = p.copy.piece
    return (piece.permutes or bool(piece.casts)) and rank in plan.targets[p.target].consumers


class Schedule(NamedTuple):
    """What a rank pushes and allocates over a stream of a plan (see :class:`~shardsync.exec.push.Pusher`).

    Example:
        >>> import torch, shardsync
        >>> Schedule.of(shardsync.plan({"w": torch.zeros(3)}), NO_PUSHING, 0).direct
        [[]]
    """

    direct: list[list[Push]]  # per step: pieces copied from its source
    relayed: list[list[Push]]  # per step: pieces copied from its own target
    takes: Counter[int]  # read -> pieces of it copied from its source
    pieces: Counter[tuple[int, int]]  # (target, consumer) -> pieces this rank writes there
    writers: dict[int, tuple[int, ...]]  # pushed target it consumes -> ranks that write into it
    allocations: list[list[int]]  # per step: the pushed targets it allocates
    first: list[list[int]]  # the same on the plan's first stream (PUSH_AHEAD_FIRST_BYTES ahead at most)

    @classmethod
    def of(cls, plan: Plan, pushing: Pushing, rank: int) -> Schedule:
        steps = schedule(plan, pushing.targets, rank)
        relayed = [[relays(plan, p, rank) for p in pushes] for pushes in steps]
        direct = [[p for p, r in zip(ps, rs) if not r] for ps, rs in zip(steps, relayed)]
        mine = writers(plan, pushing.targets, rank)
        return cls(
            direct,
            [[p for p, r in zip(ps, rs) if r] for ps, rs in zip(steps, relayed)],
            Counter(p.copy.read for pushes in direct for p in pushes),
            Counter((p.target, p.consumer) for ps in steps for p in ps),
            mine,
            allocations(plan, mine, pushing.window)[0],
            allocations(plan, mine, min(pushing.window, PUSH_AHEAD_FIRST_BYTES))[0],
        )
