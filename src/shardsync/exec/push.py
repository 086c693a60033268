"""Senders write their pieces straight into their consumers' targets (the same-host transport).

Through shared memory as :mod:`shardsync.exec.shm` first built it, a sender copied each read it sends
into its segment and every receiver copied it from there into its targets: on two ranks that are both
consumers of every target, each rank copied 1.5 times its targets' bytes. When a consumer's targets
lie in shared memory themselves, a sender can write its pieces straight into them: every rank then
copies its own pieces into its own targets and into every other consumer's, and nothing else - as
many bytes as the targets hold, the memcpy ceiling's volume.

This module is the runtime side of that, for the *pushed* targets
(:mod:`~shardsync.exec.push_schedule` says which, and who writes and allocates what when). A consumer
allocates a pushed target in a block of shared memory (:func:`shardsync.exec.memory.shm_block`, from
a pool that recycles them like private ones) up to a window ahead of the step it opens in; the
ranks that send its pieces write them there, each piece cast and permuted on the way - or, when the
sender builds the same target itself, copied from its own copy once built, so that each piece is
cast and permuted once. The ranks agree through a *board* per rank, a small block of shared memory
every peer maps, and no collective:

* ``posted[t]``: the number of the stream once this rank, a consumer of target ``t``, has its memory
  (and where: descriptor, inode, bytes - a peer maps it through ``/proc/<pid>/fd/<fd>``);
* ``done[t, w]``: the stream's number once rank ``w`` has written all its pieces of ``t`` there;
* ``closed``: the last stream this rank finished; ``failed``: a stream in which it failed;
* ``sleeping``: how many of this rank's threads sleep in a wait (on any board) - a rank that changes a
  word wakes the ranks that may wait for it only when one of them sleeps (a wake-up is a system call).

A sender waits for ``posted`` before it writes; a consumer waits for every sender's ``done`` before it
yields a target - and meanwhile writes its own pieces of later steps into other consumers' targets
already posted, so that ranks whose work differs from step to step do not wait for each other at
every step; at the end every rank waits for every other's ``closed`` (no rank starts the next
stream's writes while another still reads this one's data). A wait sleeps in the kernel until the
word it waits for is written (:mod:`~shardsync.exec.futex`: no core spins), looks every
:data:`LOOK_SECONDS` at the ranks it waits for, and ends with a
:class:`~shardsync.roll_call.TransportFailure` naming one when its process ended or it failed (its
``failed`` word), or after the group's timeout; the data phase then names the rank at fault on every
rank.

A rank failing while others write into its memory loses nothing: every mapping keeps the memory it
maps alive, and the kernel frees a block when its last mapping goes.
"""

from __future__ import annotations

import platform
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..dist import GroupRanks
from ..layout.dtypes import itemsize
from ..liveness import ProcessRecord, is_gone
from ..planning.model import Plan
from ..roll_call import TransportFailure
from . import futex, push_schedule
from .push_schedule import Push, Pushing, Schedule, per_plan, piece_bytes
from .shm_blocks import BlockHandle, handle
from .stats import Stats

__all__ = ["Board", "Pusher", "LOOK_SECONDS"]

#: How often a wait checks the ranks it waits for (process gone, failed) and the timeout.
LOOK_SECONDS = 0.05
_WORDS = 16  # the board's header: int32 words, then the arrays
_WHERE = 5  # int64 fields of where a target lies
_CLOSED, _FAILED, _SLEEPING = 0, 1, 2
#: Whether a waker may skip the wake-up call when no peer sleeps (see :meth:`Pusher._wake`): where a
#: lock is a full memory barrier (x86: a locked instruction), the waker's store of the word and its
#: look at the sleepers are ordered; elsewhere every change wakes.
_SKIP_WAKES = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


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
        # fd, inode, bytes, kept (its owner's pool hands it out again), seal (see :meth:`lies`)
        self.where = raw[off : off + 8 * _WHERE * targets].view(np.int64).reshape(targets, _WHERE)
        off += 8 * _WHERE * targets
        self.done = raw[off : off + 4 * targets * world].view(np.int32).reshape(targets, world)
        # where the words are (futexes sleep on addresses)
        self.at_words, self.at_posted = futex.address(self.words), futex.address(self.posted)
        self.at_done = futex.address(self.done)

    @staticmethod
    def nbytes(targets: int, world: int) -> int:
        """Bytes of a board for ``targets`` targets and ``world`` ranks."""
        return _aligned8(4 * _WORDS + 4 * targets) + 8 * _WHERE * targets + 4 * targets * world

    def post(self, t: int, block: BlockHandle, kept: bool, gen: int) -> None:
        """Target ``t``'s memory is ``block`` (``kept``: its owner hands the block out again, so peers
        keep their mapping of it), for stream ``gen`` - where first, then the flag."""
        self.where[t] = (block.fd, block.inode, block.nbytes, int(kept), _seal(gen, block, kept))
        _fence()
        self.posted[t] = gen

    def lies(self, t: int, gen: int) -> tuple[BlockHandle, bool] | None:
        """Where target ``t`` lies in stream ``gen`` (its block, pid 0, and whether it is kept), or
        None until it is posted. The record is sealed with a checksum of its fields and ``gen``: a
        record seen half written (a processor that makes stores visible out of order) does not pass."""
        if int(self.posted[t]) != gen:
            return None
        _fence()
        fd, inode, nbytes, kept, seal = (int(x) for x in self.where[t])
        block = BlockHandle(0, fd, inode, nbytes)
        return (block, bool(kept)) if seal == _seal(gen, block, bool(kept)) else None


def _seal(gen: int, block: BlockHandle, kept: bool) -> int:
    h = (gen * 0x9E3779B97F4A7C15) ^ (block.fd << 48) ^ block.inode ^ (block.nbytes << 7) ^ int(kept)
    return (h & (2**63 - 1)) or 1


_lock = threading.Lock()
_sleepers = threading.Lock()  # this process's count of sleepers on its board


def _fence() -> None:
    # A lock taken and given back orders this thread's memory accesses around it on every
    # architecture (x86 keeps stores in order anyway): data before a flag, a flag before the data.
    with _lock:
        pass


class Pusher:
    """One rank's side of pushing, for one stream (see the module doc).

    The pieces this rank writes in each step are ``direct[k]`` (copied from its source) and
    ``relayed[k]`` (cast or permuted pieces of targets it builds too: copied from its own target once
    built, so that each is cast and permuted once).

    Call sequence, on every rank of the group, after :meth:`begin` and :meth:`attach` (the
    transport's setup): :meth:`post` for each pushed target this rank allocates (``allocations[k]``
    when it starts step ``k``: up to ``window`` bytes ahead of their step; on fresh blocks up to
    :data:`~shardsync.exec.push_schedule.PUSH_AHEAD_FIRST_BYTES`, see :meth:`begin`);
    :meth:`outbound` for ``direct[k]`` of every step in step order, by the time the step starts or
    earlier, while waiting for other ranks (``ahead`` counts the steps done; :meth:`placed` says
    whether it would wait), and for ``relayed[k]`` when step ``k`` starts; :meth:`mark` once the
    copies of what it returned are written; :meth:`await_target` before yielding a pushed target;
    :meth:`close` after the last step; :meth:`fail` instead on a rank whose stream failed.

    Args:
        ranks: the stream's group and this rank's place in it.
        plan: the agreed plan.
        pushing: the plan's pushed targets and window (:class:`Pushing`).
    """

    def __init__(self, ranks: GroupRanks, plan: Plan, pushing: Pushing) -> None:
        self.ranks, self.plan, self.pushing = ranks, plan, pushing
        self.shape = (len(plan.targets), ranks.world)  # of every board
        mine = per_plan(plan, ("pusher", pushing, ranks.rank), lambda: Schedule.of(plan, pushing, ranks.rank))
        self.direct, self.relayed, self.takes = mine.direct, mine.relayed, mine.takes
        self.writers, self.allocations, self.schedule = mine.writers, mine.first, mine
        self.left = Counter(mine.pieces)  # written as the stream goes
        self.ahead = 0  # steps whose direct pieces this rank has started to write (in order)
        self.gen = 0
        self.boards: list[Board] = []
        self.records: list[ProcessRecord | None] = []
        self.blocks: dict[tuple[int, int], torch.Tensor] = {}  # (rank, inode) -> mapped bytes
        self.opener: Callable[[BlockHandle], torch.Tensor] | None = None
        self.timeout = 1800.0
        self.used: set[tuple[int, int]] = set()

    def mine(self, t: int) -> bool:
        """Whether this rank allocates target ``t`` in shared memory (others write into it)."""
        return t in self.writers

    def relays(self, p: Push) -> bool:
        """Whether pushed piece ``p`` casts or permutes and this rank builds its target too (then it
        is copied from there)."""
        return push_schedule.relays(self.plan, p, self.ranks.rank)

    def begin(self, recycled: bool) -> None:
        """This rank starts a stream of the plan (``recycled``: its pushed targets come from a pool
        that recycles blocks). The plan's later streams with recycled blocks allocate up to the window
        ahead; its first one in this process, or one on fresh blocks only (``reuse="never"``), up to
        :data:`~shardsync.exec.push_schedule.PUSH_AHEAD_FIRST_BYTES`: running further ahead on fresh
        memory cost time."""
        streams = per_plan(self.plan, ("streams", self.ranks.rank), lambda: [0])  # begun on this rank
        self.allocations = self.schedule.allocations if recycled and streams[0] else self.schedule.first
        streams[0] += 1

    def attach(
        self,
        gen: int,
        boards: Sequence[Board],
        records: Sequence[ProcessRecord | None],
        blocks: dict[tuple[int, int], torch.Tensor],
        opener: Callable[[BlockHandle], torch.Tensor],
        timeout: float,
    ) -> None:
        """Set up (by the transport, every board mapped): ``gen`` numbers this stream (the same on
        every rank, larger than any earlier stream's of the group), ``boards`` and ``records`` are
        every rank's, ``blocks`` the peers' blocks mapped so far that their owners hand out again
        (kept between streams; those no piece was written into in a stream are unmapped at its end),
        ``opener`` maps a peer's block, ``timeout`` is the group's."""
        self.gen, self.boards, self.records = gen, list(boards), list(records)
        self.blocks, self.opener, self.timeout = blocks, opener, timeout

    def post(self, t: int, tensor: torch.Tensor, kept: bool) -> None:
        """This rank's memory for pushed target ``t`` is ``tensor`` (a block of shared memory;
        ``kept``: the block is handed out again, so writers may keep their mapping of it)."""
        block = handle(tensor)
        if block is None:
            raise RuntimeError(f"target {self._name(t)} is not in a block of shared memory; this is a bug")
        self.boards[self.ranks.rank].post(t, block, kept, self.gen)
        self._wake(self.boards[self.ranks.rank].at_posted + 4 * t, self.writers[t])

    def _target(self, t: int, c: int) -> np.ndarray:
        """Consumer ``c``'s memory for target ``t`` in this stream, its bytes (waits until it has some)."""
        board = self.boards[c]
        word = board.at_posted + 4 * t

        def pending() -> tuple[int, int] | None:
            seen = int(board.posted[t])  # read once: a sleep on a value read later would miss its wake-up
            return (word, seen) if seen != self.gen or board.lies(t, self.gen) is None else None

        self._await(pending, (c,), f"its memory for {self._name(t)}")
        found = board.lies(t, self.gen)
        assert found is not None
        block, kept = found
        key = (c, block.inode)
        data = self.blocks.get(key)
        if data is None:
            record = self.records[c]
            assert self.opener is not None and record is not None
            try:
                data = self.opener(block._replace(pid=record.pid))
            except (OSError, RuntimeError) as exc:
                why = self._lost(c)
                if why:  # it died (or failed) since it showed its memory: name it, not this rank
                    raise TransportFailure(
                        f"{self.ranks.label(c)} {why}, while opening its memory",
                        culprit=(c, f"{why}, while {self.ranks.label(self.ranks.rank)} opened its memory"),
                    ) from exc
                raise
            if kept:  # its owner hands it out again: mapped once for every stream
                self.blocks[key] = data
        if kept:
            self.used.add(key)
        return data.numpy()[: self.plan.targets[t].nbytes]

    def outbound(self, pushes: Sequence[Push], stats: Stats) -> list[tuple[np.ndarray, Push]]:
        """Each of ``pushes`` with the bytes of the consumer's target it is written into (waited for: a
        consumer allocates a target by the time it starts the step it opens in)."""
        out = []
        for p in pushes:
            out.append((self._target(p.target, p.consumer), p))
            stats.bytes_sent += piece_bytes(self.plan, p)
        return out

    def mark(self, pushes: Sequence[Push]) -> None:
        """``pushes`` are written: tell each consumer whose target has all of this rank's pieces now
        (after the data: a fence first)."""
        _fence()
        me, world = self.ranks.rank, self.ranks.world
        for p in pushes:
            key = (p.target, p.consumer)
            self.left[key] -= 1
            if not self.left[key]:
                board = self.boards[p.consumer]
                board.done[p.target, me] = self.gen
                self._wake(board.at_done + 4 * (p.target * world + me), (p.consumer,))

    def placed(self, pushes: Sequence[Push]) -> bool:
        """Whether the consumers of every one of ``pushes`` have shown where it goes."""
        return all(self.boards[p.consumer].lies(p.target, self.gen) is not None for p in pushes)

    def await_target(self, t: int, stats: Stats, idle: Callable[[], bool] | None = None) -> None:
        """Wait until every rank that writes pieces of target ``t`` into this rank's memory did;
        ``idle()`` meanwhile, as long as it finds work (it returns whether it did some)."""
        writers, board = self.writers[t], self.boards[self.ranks.rank]
        done, at = board.done[t], board.at_done + 4 * t * self.ranks.world

        def pending() -> tuple[int, int] | None:
            for w in writers:
                seen = int(done[w])  # read once (see _target)
                if seen != self.gen:
                    return at + 4 * w, seen
            return None

        self._await(
            pending,
            writers,
            f"target {self._name(t)}",
            idle,
        )
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
        self._wake(self.boards[me].at_words + 4 * _CLOSED, others)

        def pending() -> tuple[int, int] | None:
            for r in others:
                seen = int(self.boards[r].words[_CLOSED])  # read once (see _target)
                if seen < self.gen:
                    return self.boards[r].at_words + 4 * _CLOSED, seen
            return None

        self._await(pending, others, "the end")
        for key in [k for k in self.blocks if k not in self.used]:  # blocks this stream did not write
            del self.blocks[key]

    def fail(self) -> None:
        """This rank's stream failed (or was left): ranks waiting for it stop waiting."""
        if self.boards:
            self.boards[self.ranks.rank].words[_FAILED] = self.gen

    def _name(self, t: int) -> str:
        return repr(self.plan.targets[t].name)

    def _wake(self, word: int, ranks: Sequence[int]) -> None:
        """Word ``word`` changed: wake whoever sleeps on it, unless none of ``ranks`` (the ranks that
        may wait for it) has a thread asleep. The store of the word, a full barrier, then the look at
        their ``sleeping`` words; a sleeper counts itself before the kernel compares the word (with a
        full barrier between): one of the two sees the other's store."""
        if _SKIP_WAKES:
            _fence()
            if not any(int(self.boards[r].words[_SLEEPING]) for r in ranks):
                return
        futex.wake(word)

    def _sleep(self, word: int, seen: int, fallback: float) -> None:
        """Sleep until ``word`` no longer holds ``seen`` (or is woken, or :data:`LOOK_SECONDS` pass),
        counted in this rank's ``sleeping``."""
        words = self.boards[self.ranks.rank].words
        with _sleepers:
            words[_SLEEPING] += 1
        try:
            futex.wait(word, seen, LOOK_SECONDS, fallback=fallback)
        finally:
            with _sleepers:
                words[_SLEEPING] -= 1

    def _await(
        self,
        pending: Callable[[], tuple[int, int] | None],
        ranks: Sequence[int],
        what: str,
        idle: Callable[[], bool] | None = None,
    ) -> None:
        """Return once ``pending()`` - a word of a board not yet as awaited (its address, and what it
        held when ``pending`` read it to decide: one read, else a change between two reads is slept
        through) - is None; raise :class:`TransportFailure` when a rank of ``ranks`` (the ones that write those
        words) failed or its process ended, or after the group's timeout. Meanwhile ``idle()``, while
        it finds work; else sleep until the word changes (:func:`~shardsync.exec.futex.wait`)."""
        word = pending()
        if word is None:
            return
        start = time.monotonic()
        look, pause = start + LOOK_SECONDS, 20e-6  # pause: where there are no futexes
        while word is not None:
            if idle is None or not idle():
                self._sleep(*word, fallback=pause)
                pause = min(2 * pause, 1e-3)
            word = pending()  # first: a rank may write the word and then end (or fail) at once
            now = time.monotonic()
            if word is not None and now >= look:
                look = now + LOOK_SECONDS
                for r in ranks:
                    why = self._lost(r)
                    if why and pending() is not None:  # (it may have written the word just before)
                        raise TransportFailure(
                            f"{self.ranks.label(r)} {why}, while waiting for {what}",
                            now - start,
                            culprit=(r, f"{why}, while {self.ranks.label(self.ranks.rank)} waited for {what}"),
                        )
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
