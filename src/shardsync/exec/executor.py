"""The executor: runs a plan's steps on this rank and yields finished targets.

Steps are pipelined ``plan.depth`` deep: step k+1 is *started* (its targets allocated, its packets
packed and posted, the copies of this rank's own pieces into its targets handed to the copy threads)
before step k is *finished* (wait, copies of received pieces, buffers dropped, completed targets
yielded). So while this rank copies - or its caller consumes a target - the next packets are already
on the wire and the copy threads are filling the next targets. A target built from this rank's own
data alone is built when it is due, or while the caller has the one before it
(:func:`~shardsync.planning.costs.builds_ahead`). Every copy of a run goes through one
:class:`~shardsync.exec.copies.Lane` (its threads take the oldest batch first; a copy needed now
is done by this thread without waiting behind them). Memory held is the open targets plus the buffers of
the steps in flight, as :func:`shardsync.planning.estimate_costs` assumes.

On CPU, targets and buffers come from a :class:`~shardsync.exec.memory.BlockPool` (``reuse``): memory
of earlier targets the caller dropped is written again instead of faulting in fresh pages, and a
target starts as its largest piece from this rank's source does, modulo 64 bytes (:meth:`_Run.align`:
its rows copy at full speed). Targets
other ranks write pieces into (the shared-memory transport's pushed targets, see
:mod:`shardsync.exec.push`) come from a pool of shared-memory blocks the same way.
"""

from __future__ import annotations

import logging
import math
import operator
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from .. import phases
from ..dist import data_phase
from ..layout.dtypes import to_torch_dtype
from ..mapping.pieces import Piece
from ..planning.costs import builds_ahead, is_zero_copy
from ..planning.model import Packet, Plan, Step
from ..sources import Source
from .assemble import copy_bits, copy_piece
from .copies import TORCH_GRAIN, Copies, Lane, int_array, ints, no_grad
from .memory import ALIGN, BlockPool, Reuse, contiguous_strides, over, process_pool, shm_block
from .push import Pusher
from .push_schedule import Push, per_plan
from .shm_blocks import seal
from .stats import Stats
from .transport import Pending, Received, Transport, unpack

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from ..roll_call import RollCall

__all__ = ["execute", "STREAM_PHASE"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Name of the data phase, as it appears in errors.
STREAM_PHASE = phases.STREAM


def _step_tag(k: int) -> int:
    return -(k + 1)  # memory-accounting tag of step k's buffers (targets use their index)


def _sends(plan: Plan, rank: int) -> Counter[int]:
    """How many packets ``rank`` sends holding each read."""
    sends: Counter[int] = Counter()
    for step in plan.steps:
        for pk in step.packets:
            if pk.src == rank:
                sends.update(pk.reads)
    return sends


def _read_uses(plan: Plan, rank: int, sends: Counter[int]) -> Counter[int]:
    """How many times ``rank`` takes each read from its source: ``sends`` (to send it), once per copy
    into a target it builds from its own data, once per target it yields as a view."""
    uses = Counter(sends)
    for tp in plan.targets:
        if rank not in tp.consumers:
            continue
        if is_zero_copy(tp, plan.reads, rank, plan.copy):
            uses[tp.copies[0].read] += 1
        else:
            uses.update(c.read for c in tp.copies if rank in plan.reads[c.read].holders)
    return uses


def _remote(plan: Plan, rank: int, push: Pusher | None) -> dict[int, list[tuple[int, Piece]]]:
    """Read -> the (target, piece) pairs ``rank`` builds from it and receives it for (not pushed)."""
    remote: dict[int, list[tuple[int, Piece]]] = {}
    for t, tp in enumerate(plan.targets):
        if rank in tp.consumers and not (push is not None and push.mine(t)):
            for c in tp.copies:
                if rank not in plan.reads[c.read].holders:
                    remote.setdefault(c.read, []).append((t, c.piece))
    return remote


class _Run:
    """One rank's state while executing a plan; also the :class:`PacketIO` its transport uses. Its
    steps run with autograd off (:func:`execute` turns it off once per target, not once per piece)."""

    def __init__(
        self,
        plan: Plan,
        source: Source,
        rank: int,
        stats: Stats,
        device: torch.device,
        into: Callable[[int], torch.Tensor] | None = None,
        pool: BlockPool | None = None,
        threads: int | None = None,
        transport: Transport | None = None,
        shm_pool: BlockPool | None = None,
    ) -> None:
        self.plan, self.source, self.rank, self.stats, self.device = plan, source, rank, stats, device
        self.into, self.pool, self.shm_pool = into, pool, shm_pool
        # pushing: other ranks write their pieces of some targets straight into this rank's memory
        self.push: Pusher | None = transport.push if transport is not None else None
        self.open: dict[int, torch.Tensor] = {}
        # the open targets shardsync allocated, as integers (copies.ints): ordinary pieces are
        # copied into them with numpy (assemble.copy_bits); not the small ones (_numpy_copies)
        self.ints: dict[int, np.ndarray] = {}
        self.lane = Lane(threads)  # copies under way on the copy threads
        self.ahead: dict[int, int] = {}  # target built from local data -> its copies' ticket
        self.local: dict[int, list[int]] = {}  # step -> ticket of the copies of its targets' own pieces
        self.pushing: dict[int, list[int]] = {}  # step -> ticket of the copies of the pieces it pushes
        self.direct: set[int] = set()  # reads received straight into their target
        self.posting = 0  # the step being started: its buffers are held under its tag
        self.roll: RollCall | None = None  # the data phase's roll call (its waits look at it)
        # remote[i]: (target, piece) pairs this rank builds from read i, which it receives
        pushed = self.push.pushing.targets if self.push is not None else None
        self.remote = per_plan(plan, ("remote", rank, pushed), lambda: _remote(plan, rank, self.push))
        # A read is taken from the source once (a file source loads it) and kept until its last use.
        sends = transport.sends if transport is not None else None
        self.uses = _read_uses(plan, rank, sends if sends is not None else _sends(plan, rank))
        self.cache: dict[int, tuple[torch.Tensor, np.ndarray | None]] = {}  # read -> data, as integers
        # read -> its pieces already cast and permuted into target form, by the transport (see
        # :meth:`prearranged`): their copies are plain ones from there
        self.arranged: dict[int, dict[Piece, torch.Tensor]] = {}
        self.made = False  # whether the target last taken is memory this run allocated (not a view)

    def read(self, i: int) -> torch.Tensor:
        """The data of read ``i`` from this rank's source: read on first use, dropped after the last."""
        return self.read_as(i, None)[0]

    def read_as(self, i: int, dtype: torch.dtype | None) -> tuple[torch.Tensor, np.ndarray | None]:
        """:meth:`read`, and the data as integers (:func:`~shardsync.exec.copies.ints`, viewed once
        per read) when it is of ``dtype`` (None: not asked for)."""
        data, bits = self.cache.pop(i, (None, None))
        if data is None:
            data = self._load(i)
        wanted = dtype is not None and data.dtype == dtype
        if bits is None and wanted:
            bits = ints(data)
        self.uses[i] -= 1
        if self.uses[i] > 0:
            self.cache[i] = (data, bits)
        return data, bits if wanted else None

    def _load(self, i: int) -> torch.Tensor:
        r = self.plan.reads[i]
        data = self.source.read(r.source, r.box)
        self.stats.bytes_read += r.nbytes
        if data.device != self.device:  # a file source reads into CPU memory; nccl sends from GPU
            data = data.to(self.device)
        return data

    def peek(self, i: int) -> torch.Tensor:
        """The data of read ``i``, read now if it was not (kept for its uses: none is used up)."""
        got = self.cache.get(i)
        if got is None:
            got = self.cache[i] = (self._load(i), None)
        return got[0]

    def send_once(self, i: int) -> torch.Tensor:
        return self.read(i)  # counted once in the transport's ``sends``

    def prearranged(self, i: int, pieces: dict[Piece, torch.Tensor]) -> None:
        """Read ``i``'s pieces are also held in target form (each cast and permuted as its copy
        would); the copies of those pieces take them from there."""
        self.arranged[i] = pieces

    def _skip(self, i: int) -> None:
        """One use of read ``i`` that needs not its data (a copy from its arranged pieces)."""
        self.uses[i] -= 1
        if self.uses[i] <= 0:
            self.cache.pop(i, None)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, align: int = 0) -> torch.Tensor:
        if self.pool is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        return self.pool.empty(shape, dtype, align)

    def align(self, t: int) -> int:
        """Where target ``t`` is to start, modulo :data:`~shardsync.exec.memory.ALIGN` bytes: where its
        largest piece that this rank copies from its own source as rows (no cast, no permutation)
        starts there, less that piece's offset in the target; 0 without such a piece. The piece's
        first row then starts in the target as it does in the source, modulo 64 bytes, where glibc's
        ``memcpy`` runs at full speed (:mod:`~shardsync.exec.memory`), and so does every row where
        the source's and the target's rows agree modulo 64 bytes (rows of a multiple of 64 bytes: the
        widths of models). Where the transport arranges the read later (its pieces copied from there),
        only the speed of that copy differs."""
        tp, best, most = self.plan.targets[t], 0, 0
        for c in tp.copies:
            r, piece = self.plan.reads[c.read], c.piece
            n = piece.target_box.numel
            if n <= most or piece.casts or piece.perm is not None or self.rank not in r.holders:
                continue
            src = piece.source_box.cut(self.peek(c.read), r.box)
            dst = sum(map(operator.mul, piece.target_box.offsets, contiguous_strides(tp.shape)))
            best, most = (src.data_ptr() - dst * src.element_size()) % ALIGN, n
        return best

    def mine(self, t: int) -> bool:
        return self.rank in self.plan.targets[t].consumers

    def allocate(self, t: int) -> None:
        """Allocate target ``t`` (unless it will be a view of this rank's own data, or is written into
        memory the caller gave): in shared memory, shown to the ranks that write into it, when pushed."""
        tp = self.plan.targets[t]
        if self.into is not None:
            self.open[t] = self.into(t)
            return
        if self.push is not None and self.push.mine(t):
            shape, dtype, pool = tp.shape, to_torch_dtype(tp.dtype), self.shm_pool
            self.open[t] = pool.empty(shape, dtype) if pool is not None else shm_block(shape, dtype)
            self.push.post(t, self.open[t], kept=pool is not None and pool.holds(self.open[t]))
        elif not is_zero_copy(tp, self.plan.reads, self.rank, self.plan.copy):
            align = self.align(t) if self.pool is not None and _numpy_copies(tp.shape) else 0
            self.open[t] = self.empty(tp.shape, to_torch_dtype(tp.dtype), align)
        else:
            return
        self.stats.hold(tp.nbytes, tag=t)
        view = ints(self.open[t]) if _numpy_copies(tp.shape) else None
        if view is not None:
            self.ints[t] = view

    def copy_local(self, t: int, batch: Copies) -> None:
        """Add to ``batch`` a copy into target ``t`` of every piece whose data this rank holds."""
        if t not in self.open:
            return
        out, out_ints = self.open[t], self.ints.get(t)
        for c in self.plan.targets[t].copies:
            r = self.plan.reads[c.read]
            if self.rank not in r.holders:
                continue
            arranged = self.arranged.get(c.read, {}).get(c.piece)
            if arranged is None:
                data, bits = self.read_as(c.read, out.dtype if out_ints is not None else None)
                copy_piece(out, data, r.box, c.piece, batch, out_ints, bits)
            else:
                self._skip(c.read)
                batch.add(out[c.piece.target_box.slices()], arranged)

    def written(self, tensor: torch.Tensor) -> None:
        """No rank writes into pushed target ``tensor`` any more: its block's descriptor may close."""
        if self.shm_pool is not None:
            self.shm_pool.written(tensor)
        else:
            seal(tensor)

    def abandon(self) -> None:
        """The stream failed: other ranks may still write into this rank's open pushed targets, so
        their blocks are never handed out again."""
        if self.push is not None and self.shm_pool is not None:
            for t, tensor in self.open.items():
                if self.push.mine(t):
                    self.shm_pool.discard(tensor)

    def build(self, t: int) -> None:
        """Allocate target ``t`` (built from this rank's own data) and start its copies on the pool."""
        if t in self.open or t in self.ahead:
            return
        self.allocate(t)
        if t in self.open:
            batch = Copies()
            self.copy_local(t, batch)
            self.ahead[t] = self.lane.start(batch)

    def copy(self, batch: Copies) -> None:
        """Run ``batch`` now, on the lane (not behind the copies started ahead)."""
        self.lane.wait(self.lane.start(batch))

    def settle(self) -> None:
        """Wait for every copy started ahead (the stream ends or is left): nothing writes after."""
        self.ahead.clear()
        self.local.clear()
        self.pushing.clear()
        self.lane.settle()

    def buffer(self, nbytes: int) -> torch.Tensor:
        self.stats.hold(nbytes, _step_tag(self.posting))
        return self.empty((nbytes,), torch.uint8)

    def fill(self, pk: Packet) -> torch.Tensor:
        """The bytes of a packet this rank sends: the shard itself when it is one contiguous read."""
        only = self.read(pk.reads[0]) if len(pk.reads) == 1 else None
        if only is not None and only.is_contiguous():
            return only.detach().reshape(-1).view(torch.uint8)
        buf, batch = self.buffer(pk.nbytes), Copies()
        for i, off in zip(pk.reads, pk.offsets):
            r = self.plan.reads[i]
            dst = buf[off : off + r.nbytes].view(to_torch_dtype(r.dtype)).view(r.box.sizes)
            batch.add(dst, only if only is not None else self.read(i))
        self.copy(batch)
        return buf

    def sink(self, pk: Packet) -> torch.Tensor | None:
        """Target memory to receive a one-read packet into, when the read lands there unchanged."""
        if len(pk.reads) != 1 or len(self.remote.get(pk.reads[0], ())) != 1:
            return None
        i = pk.reads[0]
        ((t, piece),) = self.remote[i]
        if piece.permutes or piece.casts or piece.source_box != self.plan.reads[i].box or t not in self.open:
            return None
        region = self.open[t][piece.target_box.slices()]
        if not region.is_contiguous() or region.device != self.device:
            return None
        self.direct.add(i)
        return region.reshape(-1).view(torch.uint8)

    def deliver(self, received: list[Received]) -> None:
        """Copy every received read into the targets that read it (unless it landed there)."""
        batch = Copies()
        for rec in received:
            pk = rec.packet
            if all(i in self.direct for i in pk.reads):
                continue
            for i in pk.reads:
                if i in self.arranged:  # its sender published its pieces in target form
                    for t, piece in self.remote.get(i, ()):
                        batch.add(self.open[t][piece.target_box.slices()], self.arranged[i][piece])
            raw = [i for i in pk.reads if i not in self.arranged]
            for i, data in unpack(rec, self.plan.reads, raw).items():
                bits = None  # the data as integers, viewed for the first target that takes them
                for t, piece in self.remote.get(i, ()):
                    out, out_ints = self.open[t], self.ints.get(t)
                    if out_ints is not None and out.dtype == data.dtype:
                        bits = ints(data) if bits is None else bits
                        copy_piece(out, data, self.plan.reads[i].box, piece, batch, out_ints, bits)
                    else:
                        copy_piece(out, data, self.plan.reads[i].box, piece, batch)
        self.copy(batch)

    def take(self, t: int) -> tuple[str, torch.Tensor]:
        """Hand target ``t`` to the caller once its copies are done (a view of this rank's own source
        when it is zero copy)."""
        tp = self.plan.targets[t]
        ticket = self.ahead.pop(t, None)
        if ticket is not None:
            self.lane.wait(ticket)
        if self.push is not None and self.push.mine(t):  # the pieces other ranks write into it
            self.push.await_target(t, self.stats, self.push_ahead)
            self.written(self.open[t])
        self.made = t in self.open  # else a view of the caller's memory: never this run's to give up
        if self.made:
            tensor = self.open.pop(t)
            self.ints.pop(t, None)
            self.stats.release(tag=t)
        else:  # zero copy: a view of this rank's own source
            c = tp.copies[0]
            tensor = c.piece.source_box.cut(self.read(c.read), self.plan.reads[c.read].box)
        self.stats.targets += 1
        self.stats.bytes_yielded += tp.nbytes
        return tp.name, tensor

    def start(self, k: int, step: Step, transport: Transport) -> Pending:
        self.posting = k
        if self.push is not None:  # targets other ranks write into: shown to them ahead of their step
            for t in self.push.allocations[k]:
                self.allocate(t)
        mine = [t for t in step.opens if self.mine(t)]
        for t in mine:
            if t not in self.open:
                self.allocate(t)
        pending = transport.start(step, self, self.stats)  # packed and posted first
        batch = Copies()
        for t in mine:
            self.copy_local(t, batch)
        # runs while packets are on the wire and the caller has the targets of earlier steps
        self.local[k] = [self.lane.start(batch)]
        push = self.push
        if push is not None:  # this rank's pieces of other consumers' targets, up to this step
            while push.ahead <= k:
                push.ahead += 1
                self.push_pieces(push.ahead - 1, push.direct[push.ahead - 1], push)
            self.push_pieces(k, push.relayed[k], push)
        return pending

    def push_pieces(self, k: int, pushes: list[Push], push: Pusher) -> None:
        """Write ``pushes`` (pieces of step ``k``) into other consumers' targets (their memory waited
        for: their consumers show it by the time they start the step); :meth:`finish` waits for the
        copies. Relayed pieces are copied from this rank's own target once the step's own copies are
        written: cast and permuted once, not once per consumer."""
        if not pushes:
            return
        batch = Copies()
        relayed = False
        for raw, p in push.outbound(pushes, self.stats):
            tp, i = self.plan.targets[p.target], p.copy.read
            dtype = to_torch_dtype(tp.dtype)
            out = int_array(raw, dtype, tp.shape) if _numpy_copies(tp.shape) else None  # as integers
            if push.relays(p):
                if not relayed:
                    self.lane.wait(self.local[k][0])  # this rank's own pieces, relayed from its targets
                    relayed = True
                box, own = p.copy.piece.target_box.slices() + (...,), self.ints.get(p.target)  # (copy_bits)
                if out is None or own is None or not batch.add_ints(out[box], own[box]):
                    batch.add(over(raw, tp.shape, dtype)[box], self.open[p.target][box])
            else:
                (data, bits), origin = self.read_as(i, dtype if out is not None else None), self.plan.reads[i].box
                if out is None or bits is None or not copy_bits(out, bits, origin, p.copy.piece, batch):
                    copy_piece(over(raw, tp.shape, dtype), data, origin, p.copy.piece, batch)
        self.pushing.setdefault(k, []).append(self.lane.start(batch, then=lambda: push.mark(pushes)))

    def push_ahead(self) -> bool:
        """While this rank waits for others: write the direct pieces of the next step if their
        consumers have shown where (returns whether it moved on)."""
        push = self.push
        if push is None or push.ahead >= len(self.plan.steps) or not push.placed(push.direct[push.ahead]):
            return False
        push.ahead += 1
        self.push_pieces(push.ahead - 1, push.direct[push.ahead - 1], push)
        return True

    def finish(self, k: int, step: Step, pending: Pending) -> Iterator[tuple[str, torch.Tensor]]:
        received = pending.wait(self.roll)
        for ticket in self.local.pop(k) + self.pushing.pop(k, []):
            self.lane.wait(ticket)
        self.deliver(received)
        self.stats.release(tag=_step_tag(k))
        ready = [t for t in step.ready if self.mine(t)]
        for j, t in enumerate(ready):
            self.build(t)
            if j + 1 < len(ready) and builds_ahead(self.plan.targets[ready[j + 1]], self.plan.depth):
                self.build(ready[j + 1])  # copied while the caller has target t
            yield self.take(t)

    def steps(self, transport: Transport) -> Iterator[tuple[str, torch.Tensor]]:
        """Every step, started ``plan.depth`` ahead of its finish; the targets this rank consumes."""
        inflight: deque[tuple[int, Step, Pending]] = deque()
        last = len(self.plan.steps) - 1
        for k, step in enumerate(self.plan.steps):
            inflight.append((k, step, self.start(k, step, transport)))
            while len(inflight) >= self.plan.depth or (inflight and k == last):
                yield from self.finish(*inflight.popleft())


def _numpy_copies(shape: tuple[int, ...]) -> bool:
    """Whether the ordinary pieces of a target of ``shape`` are copied through numpy views
    (:func:`~shardsync.exec.assemble.copy_bits`): above torch's grain, where the views cost less than
    the tensor path's checks and cuts; a small piece is one ``copy_`` that costs less than the views
    (``bench_targets.py``, 4096 targets of 8 KiB on 2 ranks: 88 us a target with them, 69 without)."""
    return math.prod(shape) > TORCH_GRAIN


def _without_grad(items: Iterator[T]) -> Iterator[T]:
    """``items``, each made with autograd off where the caller has it on (:func:`no_grad` around
    ``next``: one switch per item, not one per piece copied); the caller's own setting holds while it
    has an item."""
    while (item := _next_without_grad(items, None)) is not None:
        yield item


_next_without_grad = no_grad(next)


def _pool(plan: Plan, rank: int, device: torch.device, reuse: Reuse, window: int | None = None) -> BlockPool | None:
    # Room for what the plan holds at once, the caller's current target and the one before it (and,
    # with a push ``window``, a pool of shared memory: the targets allocated ahead of their step).
    if reuse == "never" or device.type != "cpu":
        return None
    largest = max((t.nbytes for t in plan.targets if rank in t.consumers), default=0)
    capacity = plan.costs.peak_bytes[rank] + 2 * largest + (window or 0)
    return process_pool(capacity, shm=window is not None)


def execute(
    plan: Plan,
    source: Source,
    transport: Transport,
    rank: int,
    stats: Stats,
    *,
    group: ProcessGroup | None = None,
    device: torch.device | None = None,
    into: Callable[[int], torch.Tensor] | None = None,
    reuse: Reuse = "dropped",
    phase: str = STREAM_PHASE,
    threads: int | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Run ``plan`` on this rank; yield ``(name, tensor)`` for each target this rank consumes.

    ``into(t)``, when given, is the memory target ``t`` is written into (a destination shard, written
    in place: load and reshard) instead of a fresh allocation; it is what is yielded.

    Every rank of the group must call this with the same plan and iterate to the end: the steps are
    collective. A failure on any rank is raised on every rank as a
    :class:`~shardsync.errors.DistributedError` naming ``phase`` (``stream``; ``load`` and ``reshard``
    name their own); a rank that stops
    iterating makes the others fail within the group timeout. ``reuse`` says when the memory of a
    yielded target may hold a later one (see :data:`~shardsync.exec.memory.Reuse`). The transport's
    ``setup(io, stats)`` is called before the data phase (it may run agreed phases of its own), its
    ``close(stats)`` after the last step, inside the phase. ``threads``: how many threads copy on this
    rank (the caller's included; default :func:`~shardsync.exec.copies.copy_threads`).

    Example:
        >>> for name, tensor in execute(plan, LocalSource(state), transport, rank, Stats()):  # doctest: +SKIP
        ...     save(name, tensor)
    """
    try:
        device = device or source.device()
        pool = _pool(plan, rank, device, reuse)  # targets and buffers, or buffers only with ``into``
        push = transport.push
        # targets others write into, allocated up to the push window ahead of their step
        shm_pool = _pool(plan, rank, device, reuse, push.pushing.window) if push is not None and push.writers else None
        if push is not None:
            push.begin(recycled=shm_pool is not None)
        run = _Run(plan, source, rank, stats, device, into, pool, threads, transport, shm_pool)
        reused = (pool.reused if pool is not None else 0) + (shm_pool.reused if shm_pool is not None else 0)
        start = time.perf_counter()
        transport.setup(run, stats)
    except BaseException:
        if not transport.abandon():
            raise
        # its peers started the data phase without a collective: this is its failure in that phase
        # (its report names it to them, and its group is given up, as for a failure inside)
        with data_phase(phase, group):
            raise
    with data_phase(phase, group) as run.roll:
        try:
            for item in _without_grad(run.steps(transport)):
                stats.seconds = time.perf_counter() - start
                yield item
                start = time.perf_counter() - stats.seconds  # time spent in the caller not counted
                if reuse == "until-next" and into is None and run.made:
                    for p in (pool, shm_pool):
                        if p is not None:
                            p.release(item[1])
        except BaseException:
            transport.abandon()  # ranks waiting for this one without a collective stop waiting
            run.abandon()
            raise
        finally:
            run.settle()
        transport.close(stats)
    run.cache.clear()
    stats.reused_blocks = sum(p.reused for p in (pool, shm_pool) if p is not None) - reused
    stats.seconds = time.perf_counter() - start
    log.debug("rank %d stream done: %s", rank, stats.summary())
