"""Transports: how the packets of one plan step move between ranks, behind one Protocol.

Every packet travels as a flat ``uint8`` buffer (reads at aligned offsets), so one collective carries
reads of any dtypes. Senders get their bytes from the executor (the shard itself when it is one
contiguous read, else a packed copy); receivers land a packet straight in a target when it would be
copied there unchanged, else in a buffer the executor allocates and accounts for.

A transport *starts* a step (posts its collectives, asynchronously where the backend allows) and
hands back a :class:`Pending` to wait on later, so that the executor can copy and yield one step
while the next one is on the wire.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

from ..dist import GroupRanks, transport_errors, wait_for
from ..layout.dtypes import to_torch_dtype
from ..mapping.pieces import Piece
from ..planning.model import Packet, Read, Step
from .copies import Copies
from .stats import Stats

if TYPE_CHECKING:
    from ..roll_call import RollCall
    from .push import Pusher

__all__ = [
    "Transport",
    "Plain",
    "Pending",
    "PacketIO",
    "Received",
    "Posted",
    "unpack",
    "BroadcastTransport",
    "P2PTransport",
    "LocalTransport",
    "broadcast_packet",
    "gloo_for_gpus",
]


class Received(NamedTuple):
    """A packet and the buffer this rank received it in.

    Example:
        >>> Received(Packet(0, -1, (0,), (0,), 4), torch.zeros(4, dtype=torch.uint8)).buffer.numel()
        4
    """

    packet: Packet
    buffer: torch.Tensor
    #: a one-read packet's read, already viewed in its dtype and box shape (a transport that keeps
    #: such views between streams); None: :func:`unpack` views it
    data: torch.Tensor | None = None


class PacketIO(Protocol):
    """The executor's side of a transport: where packet bytes come from and where they land; ``roll``
    is the roll call of the data phase, for a transport whose collectives complete in ``start``
    (:func:`shardsync.dist.wait_for`).

    Example:
        >>> pending = BroadcastTransport(ranks).start(step, io, stats)   # doctest: +SKIP
    """

    roll: RollCall | None

    def fill(self, packet: Packet) -> torch.Tensor:
        """A sender's bytes for ``packet`` (flat uint8, contiguous)."""
        ...

    def send_once(self, read: int) -> torch.Tensor:
        """The data of a read this rank sends, for a transport that publishes each read once instead
        of filling the plan's packets (those packets are then never filled)."""
        ...

    def prearranged(self, read: int, pieces: dict[Piece, torch.Tensor]) -> None:
        """Where a transport holds ``read``'s pieces already cast and permuted into target form (as
        their copies would write them): the copies of those pieces, on this rank, read them there."""
        ...

    def sink(self, packet: Packet) -> torch.Tensor | None:
        """Flat uint8 memory a receiver may receive ``packet`` into directly (a region of a target
        it would be copied to unchanged), or None."""
        ...

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A fresh flat uint8 receive buffer, accounted to the step being started."""
        ...

    def copy(self, batch: Copies) -> None:
        """Run ``batch`` now, on this rank's copy threads (its share of the machine's cores)."""
        ...


class Pending(Protocol):
    """A started step. ``wait(roll)`` blocks until its collectives finish; returns what this rank
    got. ``roll``: the roll call of the data phase it runs in (:func:`shardsync.dist.wait_for`).

    Example:
        >>> received = transport.start(step, io, stats).wait()   # doctest: +SKIP
    """

    def wait(self, roll: RollCall | None = None) -> list[Received]: ...


@dataclass
class Posted:
    """A started step: the async works to wait on and the packets this rank receives.

    Example:
        >>> Posted().wait()
        []
    """

    works: list[dist.Work] = field(default_factory=list)
    watched: bool = False  # the works are broadcasts: their waits may look at the roll call
    got: list[Received] = field(default_factory=list)
    # (host buffer on the wire, the GPU buffer it is copied into after the wait, or None for a send):
    # gloo's send and recv move host memory only
    staged: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)

    def wait(self, roll: RollCall | None = None) -> list[Received]:
        with transport_errors():
            for work in self.works:
                wait_for(work, roll if self.watched else None)
        for host, device in self.staged:
            if device is not None:
                device.copy_(host)
        self.works, self.staged = [], []
        return self.got


def landing(packet: Packet, io: PacketIO) -> torch.Tensor:
    """Where this rank receives ``packet``: straight into a target if possible, else a buffer."""
    direct = io.sink(packet)
    return direct if direct is not None else io.buffer(packet.nbytes)


def unpack(received: Received, reads: Sequence[Read], only: Sequence[int] | None = None) -> dict[int, torch.Tensor]:
    """Views of each read in a received packet (or of those in ``only``), in the read's dtype and box
    shape: the one its transport kept (``received.data``), or cut from its buffer.

    Example:
        >>> views = unpack(received, plan.reads)   # doctest: +SKIP
    """
    packet, buf, data = received
    out = {}
    for i, off in zip(packet.reads, packet.offsets):
        if only is not None and i not in only:
            continue
        r = reads[i]
        out[i] = data if data is not None else buf[off : off + r.nbytes].view(to_torch_dtype(r.dtype)).view(r.box.sizes)
    return out


class Transport(Protocol):
    """Moves the packets of plan steps.

    Call sequence: once the plan is agreed, every rank of the group calls :meth:`setup` once (before
    the data phase: a transport may run agreed phases of its own there), then :meth:`start` once per
    step of the plan, in plan order - also ranks with nothing to send or receive in that step, and
    also for ``local`` steps (which move nothing) - and later ``wait()`` on each returned
    :class:`Pending`, in the same order, then :meth:`close` once after the last step (inside the data
    phase). Transports with nothing to set up or close inherit :class:`Plain`'s no-ops. Collectives
    are issued in packet order, so all ranks match them. Senders take
    their bytes from ``io.fill``; receivers land packets where ``io.sink`` says or in ``io.buffer``.
    Implementations count ``bytes_sent``, ``bytes_received`` and ``collectives`` in ``stats``.

    Attributes:
        push: the shared-memory transport's :class:`~shardsync.exec.push.Pusher` (senders write
            pieces straight into their consumers' targets; the executor calls it as its docstring
            says), or None.
        sends: how many times this rank takes each read from its source to send it (None: once per
            packet of the plan holding it, through ``io.fill``).

    Example:
        >>> for k, step in enumerate(plan.steps):              # doctest: +SKIP
        ...     transport.start(step, io, stats).wait()
    """

    def setup(self, io: PacketIO, stats: Stats) -> None:
        """Before the first step, on every rank."""
        ...

    def start(self, step: Step, io: PacketIO, stats: Stats) -> Pending:
        """Post ``step``'s packets; the returned handle's ``wait()`` gives what this rank received."""
        ...

    def close(self, stats: Stats) -> None:
        """After the last step, on every rank."""
        ...

    def abandon(self) -> bool:
        """This rank's stream failed: tell peers that wait for it without a collective; returns
        whether they do. Before the data phase (between ``prepare`` and the end of :meth:`setup`),
        True means they started the data phase: the failure is this rank's in it."""
        ...

    @property
    def push(self) -> Pusher | None: ...

    @property
    def sends(self) -> Counter[int] | None: ...


class Plain:
    """The :class:`Transport` members of a transport that sets nothing up, holds nothing after the
    last step, pushes nothing and sends each packet it fills.

    Example:
        >>> Plain().setup(None, None), Plain().close(None), Plain().abandon(), Plain().push
        (None, None, False, None)
    """

    push: Pusher | None = None
    sends: Counter[int] | None = None

    def setup(self, io: PacketIO, stats: Stats) -> None:
        """Nothing to set up."""

    def close(self, stats: Stats) -> None:
        """Nothing to release."""

    def abandon(self) -> bool:
        """Nothing to tell: every wait of a peer is a collective this rank's next call meets."""
        return False


def broadcast_packet(pk: Packet, io: PacketIO, stats: Stats, posted: Posted, ranks: GroupRanks, group: Any) -> None:
    """Post ``pk`` as one async broadcast over ``group`` (which holds its sender and this rank): the
    sender's bytes, or where this rank receives them.

    Example:
        >>> broadcast_packet(pk, io, stats, posted, ranks, ranks.group)   # doctest: +SKIP
    """
    if pk.src == ranks.rank:
        buf = io.fill(pk)
        stats.bytes_sent += pk.nbytes
    else:
        buf = landing(pk, io)
        stats.bytes_received += pk.nbytes
        posted.got.append(Received(pk, buf))
    with transport_errors():
        posted.works.append(dist.broadcast(buf, src=ranks.to_global(pk.src), group=group, async_op=True))
    stats.collectives += 1


class BroadcastTransport(Plain):
    """``broadcast`` and ``bucketed`` steps: one async broadcast per packet over the whole group.

    Example:
        >>> transport = BroadcastTransport(GroupRanks.of(None))  # doctest: +SKIP
    """

    def __init__(self, ranks: GroupRanks) -> None:
        self.ranks = ranks

    def start(self, step: Step, io: PacketIO, stats: Stats) -> Pending:
        posted = Posted(watched=True)
        for pk in step.packets:
            broadcast_packet(pk, io, stats, posted, self.ranks, self.ranks.group)
        return posted


def gloo_for_gpus(backend: str) -> bool:
    """Whether a group of ``backend`` (``dist.get_backend(group)``) moves GPU tensors over gloo: it is
    ``gloo``, or names gloo for ``cuda``.

    Example:
        >>> gloo_for_gpus("gloo"), gloo_for_gpus("cpu:gloo,cuda:nccl"), gloo_for_gpus("cpu:gloo,cuda:gloo")
        (True, False, True)
    """
    per_device = dict(p.split(":", 1) for p in backend.split(",")) if ":" in backend else {"cuda": backend}
    return per_device.get("cuda") == "gloo"


class P2PTransport(Plain):
    """``p2p`` steps: every packet is one message from its sender to its receiver; all messages of a
    step are posted together (``batch_isend_irecv``), so no pair waits on another.

    Example:
        >>> transport = P2PTransport(GroupRanks.of(None))   # doctest: +SKIP
    """

    def __init__(self, ranks: GroupRanks) -> None:
        self.ranks = ranks
        self._host_only: bool | None = None  # looked up on the first step (the group exists by then)

    def stages(self, buf: torch.Tensor) -> bool:
        """Whether ``buf`` travels through a host copy: a GPU tensor that the group sends over gloo,
        which hands its pointer to a socket ("Bad address"): gloo's send and recv move host memory
        only (its broadcast and all_gather stage GPU tensors themselves)."""
        if buf.device.type == "cpu":
            return False
        if self._host_only is None:
            self._host_only = gloo_for_gpus(str(dist.get_backend(self.ranks.group)))
        return self._host_only

    def _wire(self, buf: torch.Tensor, posted: Posted, receive: bool) -> torch.Tensor:
        """What goes on the wire for ``buf``: itself, or a host copy where :meth:`stages` says so."""
        if not self.stages(buf):
            return buf
        host = torch.empty_like(buf, device="cpu") if receive else buf.to("cpu", copy=True)
        posted.staged.append((host, buf if receive else None))
        return host

    def start(self, step: Step, io: PacketIO, stats: Stats) -> Pending:
        me, group = self.ranks.rank, self.ranks.group
        ops, posted = [], Posted()
        for pk in step.packets:
            if pk.src == me:
                wire = self._wire(io.fill(pk), posted, receive=False)
                ops.append(dist.P2POp(dist.isend, wire, self.ranks.to_global(pk.dst), group))
                stats.bytes_sent += pk.nbytes
            elif pk.dst == me:
                buf = landing(pk, io)
                ops.append(
                    dist.P2POp(dist.irecv, self._wire(buf, posted, receive=True), self.ranks.to_global(pk.src), group)
                )
                stats.bytes_received += pk.nbytes
                posted.got.append(Received(pk, buf))
        if ops:
            with transport_errors():
                posted.works = list(dist.batch_isend_irecv(ops))
            stats.collectives += len(ops)
        return posted


class LocalTransport(Plain):
    """A single process: steps carry no packets (every read is local), so nothing moves.

    Example:
        >>> LocalTransport().start(Step("local", (), (), ()), None, None).wait()
        []
    """

    def start(self, step: Step, io: PacketIO, stats: Stats) -> Pending:
        if step.packets:
            raise RuntimeError("a single-process plan has packets to move; this is a planner bug")
        return Posted()
