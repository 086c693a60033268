"""The plan: frozen data saying which rank sends which box to whom, in which step, and what it costs.

A :class:`Plan` is built identically on every rank from the gathered layout (see
:func:`shardsync.planning.build_plan`) and executed by :mod:`shardsync.exec`. Ranks are numbered within the
process group the plan was built for (group ranks, not global ranks).

Vocabulary:

* a :class:`Read` is one box of one source moved (or read in place) as a unit;
* a :class:`Copy` is a piece restricted to one read: where that read's data lands in a target;
* a :class:`Packet` is a flat byte buffer of reads from one sender, carried by one collective or one
  point-to-point message;
* a :class:`Step` is what all ranks do together between two yields: its packets, then the targets it
  completes.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Literal

from ..layout.box import Box
from ..layout.dtypes import itemsize
from ..mapping.pieces import Piece

__all__ = [
    "Strategy",
    "StrategyChoice",
    "SplitBy",
    "StepKind",
    "Read",
    "Copy",
    "TargetPlan",
    "Packet",
    "Step",
    "Costs",
    "Plan",
]

#: A communication strategy a plan is built for.
Strategy = Literal["broadcast", "bucketed", "mesh2d", "p2p", "multicast"]
#: What callers may ask for; ``"auto"`` picks one of :data:`Strategy` by backend and sizes.
StrategyChoice = Literal["auto", "broadcast", "bucketed", "mesh2d", "p2p", "multicast"]
#: How targets are divided into parts (``num_splits``, several consumers): equal counts or bytes.
SplitBy = Literal["count", "bytes"]
#: ``local``: no communication; ``broadcast``: one broadcast per packet; ``p2p``: batched send/recv;
#: ``mesh_hv``: vertical broadcast then horizontal all_gather; ``mesh_global``: two-stage broadcast;
#: ``multicast``: one broadcast per packet among its sender and the receivers of its reads.
StepKind = Literal["local", "broadcast", "p2p", "mesh_hv", "mesh_global", "multicast"]


@dataclass(frozen=True, slots=True)
class Read:
    """One box of one source, moved from ``sender`` to ``receivers`` or read in place by holders.

    Attributes:
        source: source key.
        box: region of the source, global coordinates; inside the shard box of every holder.
        dtype: dtype name of the source.
        holders: ranks holding a shard that contains ``box`` (replicas).
        readers: ranks that need the data (consumers of targets built from it).
        receivers: readers that do not hold it: they get it over the wire.
        sender: the holder that sends it, chosen to balance load; None when no rank receives it.

    Example:
        >>> Read("w", Box((0, 0), (2, 3)), "float32", (0,), (0, 1), (1,), 0).nbytes
        24
    """

    source: str
    box: Box
    dtype: str
    holders: tuple[int, ...]
    readers: tuple[int, ...]
    receivers: tuple[int, ...]
    sender: int | None
    #: bytes of the box, computed once (the executor asks per piece, every stream)
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", self.box.numel * itemsize(self.dtype))


@dataclass(frozen=True, slots=True)
class Copy:
    """A piece restricted to one read: ``piece.source_box`` lies inside ``reads[read].box``.

    Example:
        >>> Copy(0, Piece("w", Box((2,), (2,)), Box((0,), (2,)))).piece.target_box
        Box(offsets=(0,), sizes=(2,))
    """

    read: int
    piece: Piece


@dataclass(frozen=True, slots=True)
class TargetPlan:
    """A target, the ranks that receive it, and the copies that build it (they tile it exactly).

    Example:
        >>> TargetPlan("w", (2, 3), "bfloat16", (0,), ()).nbytes
        12
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    consumers: tuple[int, ...]
    copies: tuple[Copy, ...]
    #: bytes of the target, computed once
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", math.prod(self.shape) * itemsize(self.dtype))


@dataclass(frozen=True, slots=True)
class Packet:
    """A flat byte buffer of reads from one sender.

    Attributes:
        src: sending rank; -1 for a padding packet of a mesh step (no data).
        dst: receiving rank of a point-to-point message; -1 for a collective.
        reads: read indices packed in the buffer.
        offsets: byte offset of each read (aligned so that every dtype can be viewed in place).
        nbytes: buffer size in bytes.

    Example:
        >>> Packet(src=1, dst=-1, reads=(0, 1), offsets=(0, 16), nbytes=28).reads
        (0, 1)
    """

    src: int
    dst: int
    reads: tuple[int, ...]
    offsets: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class Step:
    """What every rank of the group does together: move ``packets``, then yield ``ready``.

    Attributes:
        kind: how the packets move (see :data:`StepKind`).
        packets: for ``mesh_hv`` one per mesh column, in column order (padding has ``src == -1``).
        opens: targets allocated in this step because their first moved data arrives in it (targets
            built only from data their consumers hold are allocated right before they are yielded).
        ready: target indices complete after this step, in yield order.

    Example:
        >>> Step("local", (), opens=(), ready=(0, 1)).ready
        (0, 1)
    """

    kind: StepKind
    packets: tuple[Packet, ...]
    opens: tuple[int, ...]
    ready: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Costs:
    """Per-rank totals of a plan (index = group rank); the executor's stats match them.

    ``peak_bytes`` is an upper bound on what the streamer holds at once: open targets plus the step's
    buffers (a sender whose data is already contiguous sends without packing and holds less).

    Example:
        >>> Costs((8, 0), (0, 8), (1, 1), (16, 8)).bytes_received[1]
        8
    """

    bytes_sent: tuple[int, ...]
    bytes_received: tuple[int, ...]
    collectives: tuple[int, ...]
    peak_bytes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything a stream does, decided before any data moves; identical on every rank.

    Attributes:
        strategy: the strategy the steps were built for.
        world_size: ranks in the group.
        targets: every target this plan yields (on some rank), indexed by the steps.
        reads: every read, indexed by copies and packets.
        steps: in execution order; targets are yielded in the order of ``steps[*].ready``.
        bucket_bytes: the bucket cap the steps were built with (lowered to fit a memory budget).
        costs: per-rank bytes, collectives and estimated peak memory.
        topology: mesh rows of group ranks (``topology[row][column]``) for ``mesh2d``, else None.
        copy: whether targets that are an unchanged local source are cloned (else returned as views).
        depth: steps in flight at once: step k+1 is posted before step k is finished (1: none).

    Example:
        >>> import torch, shardsync
        >>> plan = shardsync.plan({"w": torch.zeros(4, 4), "b": torch.zeros(4)})
        >>> plan.costs.bytes_received[0], len(plan.steps), plan.order
        (0, 1, ('b', 'w'))
    """

    strategy: Strategy
    world_size: int
    targets: tuple[TargetPlan, ...]
    reads: tuple[Read, ...]
    steps: tuple[Step, ...]
    bucket_bytes: int
    costs: Costs
    topology: tuple[tuple[int, ...], ...] | None = None
    copy: bool = True
    depth: int = 2

    @property
    def order(self) -> tuple[str, ...]:
        """Target names in yield order."""
        return tuple(self.targets[t].name for s in self.steps for t in s.ready)

    @property
    def pieces(self) -> int:
        """Number of copies (pieces restricted to reads) that build the targets."""
        return sum(len(t.copies) for t in self.targets)

    def targets_of(self, rank: int) -> tuple[str, ...]:
        """Names ``rank`` yields, in yield order."""
        return tuple(self.targets[t].name for s in self.steps for t in s.ready if rank in self.targets[t].consumers)

    def fingerprint(self) -> str:
        """A digest of the whole plan; equal on two ranks iff they built the same plan."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]

    def summary(self) -> str:
        """A few human-readable lines: strategy, sizes, and per-rank costs."""
        moved = sum(r.nbytes * len(r.receivers) for r in self.reads)
        lines = [
            f"plan: strategy={self.strategy} ranks={self.world_size} targets={len(self.targets)} "
            f"reads={len(self.reads)} pieces={self.pieces} steps={len(self.steps)} "
            f"bucket={self.bucket_bytes} B depth={self.depth} moved={moved} B"
        ]
        c = self.costs
        for r in range(self.world_size):
            lines.append(
                f"  rank {r}: sent {c.bytes_sent[r]} B, received {c.bytes_received[r]} B, "
                f"{c.collectives[r]} collectives, peak <= {c.peak_bytes[r]} B"
            )
        return "\n".join(lines)
