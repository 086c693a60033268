"""Senders write their pieces straight into their consumers' targets (the same-host transport).

Through shared memory as :mod:`shardsync.exec.shm` first built it, a sender copies each read it sends
into its segment and every receiver copies it from there into its targets: on two ranks that are both
consumers of every target, each rank copies 1.5 times its targets' bytes. When a consumer's targets
lie in shared memory themselves, a sender can write its pieces straight into them: every rank then
copies its own pieces into its own targets and into every other consumer's, and nothing else - as
many bytes as the targets hold, the memcpy ceiling's volume.

That is what this module does, for each *pushed* target (:func:`pushed_targets`: a target of
:data:`PUSH_MIN_BYTES` or more that some consumer builds from other ranks' data, when the destination
gives targets fresh memory). Its consumers allocate it in a block of shared memory
(:func:`shardsync.exec.memory.shm_block`) when the target opens; the ranks that send its pieces
write them there in the same step, each piece cast and permuted on the way. The ranks agree through
a *board* per rank, a small block of shared memory every peer maps, and no collective:

* ``posted[t]``: the number of the stream once this rank, a consumer of target ``t``, has its memory
  (and where: descriptor, inode, bytes - a peer maps it through ``/proc/<pid>/fd/<fd>``);
* ``done[t, w]``: the stream's number once rank ``w`` has written all its pieces of ``t`` there;
* ``closed``: the last stream this rank finished; ``failed``: a stream in which it failed.

A sender waits for ``posted`` before it writes; a consumer waits for every sender's ``done`` before it
yields a target; at the end every rank waits for every other's ``closed`` (no rank starts the next
stream's writes while another still reads this one's data). Waits sleep between looks (they spin no
core) and end with a :class:`~shardsync.roll_call.TransportFailure` naming the rank they wait for
when its process ended, when it failed (its ``failed`` word), or after the group's timeout; the data
phase then names the rank at fault on every rank.

A rank failing while others write into its memory loses nothing: every mapping keeps the memory it
maps alive, and the kernel frees a block when its last mapping goes.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

import numpy as np
import torch

from ..dist import GroupRanks
from ..layout.dtypes import itemsize, to_torch_dtype
from ..liveness import ProcessRecord, is_gone
from ..planning.model import Copy, Plan
from ..roll_call import TransportFailure
from .memory import POOL_MIN_BYTES, BlockHandle, handle
from .stats import Stats

__all__ = [
    "PUSH_MIN_BYTES",
    "PUSH_AHEAD_BYTES",
    "Pushing",
    "NO_PUSHING",
    "Push",
    "Board",
    "Pusher",
    "pushed_targets",
    "pushed_bytes",
    "schedule",
    "allocations",
    "LOOK_SECONDS",
]

#: Smallest target pushed: smaller ones come from the process's heap (warm, private) and their
#: senders publish their reads for the consumers to copy.
PUSH_MIN_BYTES = POOL_MIN_BYTES
#: Most bytes of pushed targets a consumer allocates (and shows its writers) before the step they
#: open in: ranks whose work differs from step to step (one writes all of ``q``, the other all of
#: ``v``) then each go at their own pace instead of waiting for each other at every step. Less under
#: a ``memory_budget`` that has no room for it.
PUSH_AHEAD_BYTES = 64 << 20
#: How often a wait checks the ranks it waits for (process gone, failed) and the timeout.
LOOK_SECONDS = 0.05
_WORDS = 16  # the board's header: int32 words, then the arrays
_CLOSED, _FAILED = 0, 1


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


def pushed_targets(plan: Plan) -> frozenset[int]:
    """The targets whose consumers allocate them in shared memory and whose senders write their
    pieces into them: those of :data:`PUSH_MIN_BYTES` or more that some consumer builds from data it
    does not hold.

    Example:
        >>> import torch, shardsync
        >>> pushed_targets(shardsync.plan({"w": torch.zeros(256, 256)}))   # one process: none
        frozenset()
    """
    out = set()
    for t, tp in enumerate(plan.targets):
        if tp.nbytes >= PUSH_MIN_BYTES and any(
            c in plan.reads[cp.read].receivers for c in tp.consumers for cp in tp.copies
        ):
            out.add(t)
    return frozenset(out)


def _piece_bytes(plan: Plan, p: Push) -> int:
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
                n = _piece_bytes(plan, p)
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
            out[t] = tuple(sorted({r.sender for r in reads if rank in r.receivers and r.sender is not None}))
    return out


def allocations(plan: Plan, mine: Collection[int], window: int) -> tuple[list[list[int]], int]:
    """The targets of ``mine`` (pushed ones a consumer allocates) it allocates when it starts each
    step: those that open in it, and those of the next steps while all that is allocated before its
    step holds at most ``window`` bytes; and the most bytes so held at once.

    Example:
        >>> import torch, shardsync
        >>> allocations(shardsync.plan({"w": torch.zeros(3)}), (), 1 << 20)
        ([[]], 0)
    """
    opening = [[t for t in step.opens if t in mine] for step in plan.steps]
    out: list[list[int]] = [[] for _ in plan.steps]
    early = [0] * (len(plan.steps) + 1)  # bytes allocated before step k, for step k
    ahead = most = 0
    j = -1  # the last step whose targets are allocated
    for k in range(len(plan.steps)):
        ahead -= early[k]
        if j < k:
            j = k
            out[k] += opening[k]
        while j + 1 < len(plan.steps):
            need = sum(plan.targets[t].nbytes for t in opening[j + 1])
            if ahead + need > window:
                break
            j += 1
            out[k] += opening[j]
            early[j] += need
            ahead += need
            most = max(most, ahead)
    return out, most


def _aligned8(n: int) -> int:
    return (n + 7) // 8 * 8


class Board:
    """A rank's board: where its targets lie and who finished writing them (see the module doc).

    Args:
        memory: the board's bytes (flat uint8, shared memory), ``Board.nbytes(targets, world)`` long.
        targets: the plan's targets; world: ranks in the group.

    Example:
        >>> b = Board(torch.zeros(Board.nbytes(2, 2), dtype=torch.uint8), 2, 2)
        >>> b.done.shape
        (2, 2)
    """

    def __init__(self, memory: torch.Tensor, targets: int, world: int) -> None:
        self.memory = memory  # keeps the mapping alive
        raw = memory.numpy()
        self.shape = (targets, world)
        off = 4 * _WORDS
        self.words = raw[:off].view(np.int32)
        self.posted = raw[off : off + 4 * targets].view(np.int32)
        off = _aligned8(off + 4 * targets)
        self.where = raw[off : off + 24 * targets].view(np.int64).reshape(targets, 3)  # fd, inode, bytes
        off += 24 * targets
        self.done = raw[off : off + 4 * targets * world].view(np.int32).reshape(targets, world)

    @staticmethod
    def nbytes(targets: int, world: int) -> int:
        """Bytes of a board for ``targets`` targets and ``world`` ranks."""
        return _aligned8(4 * _WORDS + 4 * targets) + 24 * targets + 4 * targets * world

    def post(self, t: int, block: BlockHandle, gen: int) -> None:
        """Target ``t``'s memory is ``block``, for stream ``gen`` (where first, then the flag)."""
        self.where[t] = (block.fd, block.inode, block.nbytes)
        _fence()
        self.posted[t] = gen


_lock = threading.Lock()


def _fence() -> None:
    # A lock taken and given back orders this thread's memory accesses around it on every
    # architecture (x86 keeps stores in order anyway): data before a flag, a flag before the data.
    with _lock:
        pass


class Pusher:
    """One rank's side of pushing, for one stream (see the module doc).

    Call sequence, on every rank of the group, after :meth:`attach` (the transport's setup):
    :meth:`post` for each pushed target this rank allocates (``allocations[k]`` when it starts step
    ``k``: up to ``window`` bytes ahead of their step); :meth:`outbound` per step
    (in step order: the consumers' memory of what this rank writes in it, waited for), then
    :meth:`mark` once those copies are written; :meth:`await_target` before yielding a pushed
    target; :meth:`close` after the last step; :meth:`fail` instead on a rank whose stream failed.

    Args:
        ranks: the stream's group and this rank's place in it.
        plan: the agreed plan.
        pushing: the plan's pushed targets and window (:class:`Pushing`).
    """

    def __init__(self, ranks: GroupRanks, plan: Plan, pushing: Pushing) -> None:
        self.ranks, self.plan, self.window = ranks, plan, pushing.window
        self.shape = (len(plan.targets), ranks.world)  # of every board
        me = ranks.rank
        self.steps = schedule(plan, pushing.targets, me)
        # takes[i]: pieces of read i this rank writes into other consumers' targets
        self.takes: Counter[int] = Counter(p.copy.read for pushes in self.steps for p in pushes)
        # writers[t]: the ranks that write pieces of pushed target t into this rank's memory
        self.writers = writers(plan, pushing.targets, me)
        # allocations[k]: the pushed targets this rank allocates when it starts step k
        self.allocations = allocations(plan, self.writers, self.window)[0]
        self.gen = 0
        self.boards: list[Board] = []
        self.records: list[ProcessRecord | None] = []
        self.blocks: dict[tuple[int, int, int], torch.Tensor] = {}  # (rank, fd, inode) -> mapped bytes
        self.opener: Callable[[BlockHandle], torch.Tensor] | None = None
        self.timeout = 1800.0
        self.used: set[tuple[int, int, int]] = set()

    def mine(self, t: int) -> bool:
        """Whether this rank allocates target ``t`` in shared memory (others write into it)."""
        return t in self.writers

    def attach(
        self,
        gen: int,
        boards: Sequence[Board],
        records: Sequence[ProcessRecord | None],
        blocks: dict[tuple[int, int, int], torch.Tensor],
        opener: Callable[[BlockHandle], torch.Tensor],
        timeout: float,
    ) -> None:
        """Set up (by the transport, every board mapped): ``gen`` numbers this stream (the same on
        every rank, larger than any earlier stream's of the group), ``boards`` and ``records`` are
        every rank's, ``blocks`` the peers' blocks mapped so far (kept between streams), ``opener``
        maps a peer's block, ``timeout`` is the group's."""
        self.gen, self.boards, self.records = gen, list(boards), list(records)
        self.blocks, self.opener, self.timeout = blocks, opener, timeout

    def post(self, t: int, tensor: torch.Tensor) -> None:
        """This rank's memory for pushed target ``t`` is ``tensor`` (a block of shared memory)."""
        block = handle(tensor)
        if block is None:
            raise RuntimeError(f"target {self._name(t)} is not in a block of shared memory; this is a bug")
        self.boards[self.ranks.rank].post(t, block, self.gen)

    def _target(self, t: int, c: int) -> torch.Tensor:
        """Consumer ``c``'s memory for target ``t`` in this stream (waits until it has some)."""
        board = self.boards[c]
        self._await(lambda: int(board.posted[t]) == self.gen, (c,), f"its memory for target {self._name(t)}")
        fd, inode, nbytes = (int(x) for x in board.where[t])
        key = (c, fd, inode)
        self.used.add(key)
        data = self.blocks.get(key)
        if data is None:
            record = self.records[c]
            assert self.opener is not None and record is not None
            try:
                data = self.blocks[key] = self.opener(BlockHandle(record.pid, fd, inode, nbytes))
            except (OSError, RuntimeError) as exc:
                why = self._lost(c)
                if why:  # it died (or failed) since it showed its memory: name it, not this rank
                    raise TransportFailure(f"{self.ranks.label(c)} {why}, while opening its memory") from exc
                raise
        tp = self.plan.targets[t]
        dtype = to_torch_dtype(tp.dtype)
        return data[: math.prod(tp.shape) * dtype.itemsize].view(dtype).view(tp.shape)

    def outbound(self, k: int, stats: Stats) -> list[tuple[torch.Tensor, Push]]:
        """The pieces this rank writes into other consumers' targets in step ``k``, each with the
        consumer's target (waited for: its consumer allocates it by the time it starts the step)."""
        out = []
        for p in self.steps[k]:
            out.append((self._target(p.target, p.consumer), p))
            stats.bytes_sent += _piece_bytes(self.plan, p)
        return out

    def mark(self, k: int) -> None:
        """Step ``k``'s pieces are written: tell their consumers (after the data: a fence first)."""
        _fence()
        for p in self.steps[k]:
            self.boards[p.consumer].done[p.target, self.ranks.rank] = self.gen

    def await_target(self, t: int, stats: Stats) -> None:
        """Wait until every rank that writes pieces of target ``t`` into this rank's memory did."""
        writers = self.writers[t]
        done = self.boards[self.ranks.rank].done[t]
        self._await(lambda: all(int(done[w]) == self.gen for w in writers), writers, f"target {self._name(t)}")
        _fence()
        tp = self.plan.targets[t]
        for cp in tp.copies:
            if self.ranks.rank in self.plan.reads[cp.read].receivers:
                stats.bytes_received += cp.piece.target_box.numel * itemsize(tp.dtype)

    def close(self) -> None:
        """After the last step: this rank is done with the stream; wait until every rank is."""
        me = self.ranks.rank
        self.boards[me].words[_CLOSED] = self.gen
        others = tuple(r for r in range(self.ranks.world) if r != me)
        self._await(lambda: all(int(self.boards[r].words[_CLOSED]) >= self.gen for r in others), others, "the end")
        for key in [k for k in self.blocks if k not in self.used]:  # blocks this stream did not write
            del self.blocks[key]

    def fail(self) -> None:
        """This rank's stream failed (or was left): ranks waiting for it stop waiting."""
        if self.boards:
            self.boards[self.ranks.rank].words[_FAILED] = self.gen

    def _name(self, t: int) -> str:
        return repr(self.plan.targets[t].name)

    def _await(self, ready: Callable[[], bool], ranks: Sequence[int], what: str) -> None:
        """Return once ``ready()``; raise :class:`TransportFailure` when a rank of ``ranks`` (the ones
        that make it true) failed or its process ended, or after the group's timeout."""
        if ready():
            return
        start = time.monotonic()
        look, pause = start + LOOK_SECONDS, 20e-6
        while not ready():
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
            now = time.monotonic()
            if now < look:
                continue
            look = now + LOOK_SECONDS
            for r in ranks:
                why = self._lost(r)
                if why:
                    raise TransportFailure(f"{self.ranks.label(r)} {why}, while waiting for {what}", now - start)
            if now - start > self.timeout:
                labels = ", ".join(self.ranks.label(r) for r in ranks)
                raise TransportFailure(
                    f"Timed out after {self.timeout:.0f} s waiting for {labels}: {what}", now - start
                )

    def _lost(self, rank: int) -> str:
        """Why ``rank`` will not make progress: it failed, or its process ended ("" when neither)."""
        if int(self.boards[rank].words[_FAILED]) == self.gen:
            return "failed"
        record = self.records[rank]
        if record is not None and is_gone(record):
            return "ended: its process is gone"
        return ""
