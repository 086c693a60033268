"""Coalesced collectives: tensors flattened into buckets, one collective per bucket.

A bucket holds tensors that share (op, device, communication dtype), in rank-stable order, up to
``bucket_bytes``. Sum and mean move low-precision floats (bf16, fp16, fp8) in fp32, so the sum is
taken in fp32 and rounded once; broadcast moves every tensor in its own dtype, so it is exact. gloo has
no AVG: mean is a SUM followed by a division by the group size. A bucket may carry one presence flag
per tensor (grads: a rank without a grad contributes zeros, and a tensor absent on every rank stays
absent).

Planning (:func:`make_buckets`) is pure; :func:`exchange` runs one bucket's collective.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch
import torch.distributed as dist

from ..dist import transport_errors, wait_for
from ..errors import ReplicaError
from ..layout import dtype_name

if TYPE_CHECKING:
    from ..roll_call import RollCall

__all__ = ["Op", "Member", "Item", "Bucket", "PhasePlan", "SyncPlan", "comm_dtype", "make_buckets", "exchange"]

log = logging.getLogger(__name__)

#: What a bucket's collective does to its tensors.
Op = Literal["broadcast", "sum", "mean"]


@dataclass(frozen=True, slots=True)
class Member:
    """One tensor in a bucket: its name, kind (param, master, grad or a state key) and shape."""

    name: str
    kind: str
    shape: tuple[int, ...]
    numel: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        n = 1
        for s in self.shape:
            n *= s
        object.__setattr__(self, "numel", n)  # frozen: set once, read on every exchange


class Item(NamedTuple):
    """One tensor to move, before bucketing: how, on which device, in which dtype."""

    op: Op
    device: str
    dtype: torch.dtype
    member: Member


@dataclass(frozen=True, slots=True)
class Bucket:
    """Tensors moved by one collective: same op, device and communication dtype."""

    op: Op
    device: str
    dtype: torch.dtype
    members: tuple[Member, ...]
    flags: bool = False

    @property
    def numel(self) -> int:
        return sum(m.numel for m in self.members)

    @property
    def nbytes(self) -> int:
        """Bytes moved per rank, flags included."""
        return (self.numel + (len(self.members) if self.flags else 0)) * self.dtype.itemsize


def comm_dtype(dtype: torch.dtype, op: Op) -> torch.dtype:
    """The dtype a tensor travels in: its own for broadcast, at least fp32 for sum and mean."""
    if op != "broadcast" and dtype.is_floating_point and dtype.itemsize < 4:
        return torch.float32
    return dtype


def make_buckets(items: Sequence[Item], bucket_bytes: int, *, flags: bool = False) -> tuple[Bucket, ...]:
    """Group items into buckets of the same (op, device, communication dtype), keeping their order.

    A bucket closes when the next tensor would take it past ``bucket_bytes``; a tensor larger than
    that gets a bucket of its own.

    Raises:
        ReplicaError: sum or mean asked of a non-floating tensor.

    Example:
        >>> m = Member("ln.weight", "param", (17,))
        >>> [len(b.members) for b in make_buckets([Item("mean", "cpu", torch.bfloat16, m)] * 3, 1 << 20)]
        [3]
    """
    bad = sorted(
        {
            f"{m.name} ({m.kind}, {dtype_name(dt)})"
            for op, _, dt, m in items
            if op != "broadcast" and not dt.is_floating_point
        }
    )
    if bad:
        raise ReplicaError(f"cannot sum or average non-floating tensors {bad}; use broadcast for them")
    open_: dict[tuple[Op, str, torch.dtype], list[Member]] = {}
    closed: list[Bucket] = []
    for op, device, dtype, member in items:
        key = (op, device, comm_dtype(dtype, op))
        current = open_.setdefault(key, [])
        size = (sum(m.numel for m in current) + member.numel) * key[2].itemsize
        if current and size > bucket_bytes:
            closed.append(Bucket(op, device, key[2], tuple(current), flags))
            current = open_[key] = []
        current.append(member)
    closed += [Bucket(op, dev, dt, tuple(ms), flags) for (op, dev, dt), ms in open_.items() if ms]
    return tuple(closed)


def exchange(
    bucket: Bucket,
    tensors: Sequence[torch.Tensor | None],
    *,
    group: Any,
    src: int,
    world: int,
    roll: RollCall | None = None,
) -> list[torch.Tensor | None]:
    """Run one bucket's collective; return each member's result as a view of the received buffer.

    Args:
        bucket: the bucket.
        tensors: this rank's tensor per member (None: absent, sent as zeros with flag 0).
        group: the process group.
        src: global rank of the broadcast source.
        world: group size (mean divides by it).
        roll: the roll call of the data phase it runs in (``data_phase`` yields it): the wait looks at
            it (:func:`~shardsync.dist.wait_for`), so a peer that failed or lost a peer is seen.

    Returns:
        per member, the result (in the bucket's dtype), or None where the member is absent on every
        rank (sum, mean) or on the source (broadcast); without flags every member has a result.
    """
    sizes = [m.numel for m in bucket.members]
    numel = sum(sizes)
    n = len(sizes)
    buf = torch.empty(numel + (n if bucket.flags else 0), dtype=bucket.dtype, device=bucket.device)
    segments = buf.split(sizes + [n] if bucket.flags else sizes)
    for seg, t in zip(segments, tensors):
        if t is None:
            seg.zero_()
        else:
            seg.copy_(t.reshape(-1))
    if bucket.flags:
        segments[n].copy_(torch.tensor([t is not None for t in tensors], dtype=bucket.dtype))
    with transport_errors():
        if bucket.op == "broadcast":
            work = dist.broadcast(buf, src=src, group=group, async_op=True)
        else:
            work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group, async_op=True)
        wait_for(work, roll)
    if bucket.op == "mean":
        buf[:numel].div_(world)
    present = segments[n].tolist() if bucket.flags else [1] * n
    return [seg.view(m.shape) if flag else None for seg, m, flag in zip(segments, bucket.members, present)]


@dataclass(frozen=True, slots=True)
class PhasePlan:
    """One sync phase: when it runs and the buckets it moves."""

    phase: str
    when: str
    buckets: tuple[Bucket, ...]

    @property
    def tensors(self) -> int:
        return sum(len(b.members) for b in self.buckets)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def collectives(self) -> int:
        return len(self.buckets)


@dataclass(frozen=True, slots=True)
class SyncPlan:
    """What :class:`~shardsync.replicas.ReplicaSync` moves on a synced step (a dry run).

    Attributes:
        phases: the grad phase (before ``optimizer.step``) and the param phase (after it).
        world: group size; with 1 nothing moves.
        interval: steps between syncs.
        pending: a note when the optimizer-state layout is not fixed yet (before the first step).
    """

    phases: tuple[PhasePlan, ...]
    world: int
    interval: int
    pending: str = ""

    @property
    def tensors(self) -> int:
        return sum(p.tensors for p in self.phases)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.phases)

    @property
    def collectives_per_step(self) -> int:
        """Collectives on a synced step (one per bucket); 0 with one rank."""
        return sum(p.collectives for p in self.phases) if self.world > 1 else 0

    def __str__(self) -> str:
        lines = [
            f"replica sync over {self.world} rank(s), every {self.interval} step(s): "
            f"{self.tensors} tensors, {self.nbytes} bytes, {self.collectives_per_step} "
            "collectives per synced step"
        ]
        for p in self.phases:
            lines.append(f"  {p.phase} ({p.when}): {p.tensors} tensors, {p.nbytes} bytes, {p.collectives} bucket(s)")
            for b in p.buckets:
                kinds = sorted({m.kind for m in b.members})
                lines.append(
                    f"    {b.op:<9} {b.device:<6} {dtype_name(b.dtype):<8} "
                    f"{len(b.members):>5} tensors {b.nbytes:>12} bytes  {','.join(kinds)}"
                )
        if self.pending:
            lines.append(f"  note: {self.pending}")
        return "\n".join(lines)
