"""Run buckets against live tensors: look them up, check them, exchange, write the results back.

Every tensor of a phase is looked up and checked against the agreed layout before the first
collective, so a local problem is raised (and published to the peers by ``data_phase``) before data
moves. Results are written back in place (``copy_`` casts back to the tensor's dtype); a grad that
exists on other ranks but not here is created, and a grad absent on the broadcast source is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..dist import data_phase
from ..errors import ReplicaError
from ..layout import dtype_name
from .buckets import Bucket, Item, Member, Op, exchange, make_buckets
from .replicated import ReplicatedParam, get_tensor, kind_order, local, set_grad

__all__ = ["SyncStats", "items_for", "build_buckets", "run_buckets", "global_src"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SyncStats:
    """Counters since construction: optimizer steps seen, syncs run, collectives and bytes moved."""

    steps: int = 0
    grad_syncs: int = 0
    param_syncs: int = 0
    collectives: int = 0
    bytes: int = 0


def items_for(
    replicated: Sequence[ReplicatedParam], wanted: Sequence[tuple[str, Op]], optimizer: Any, *, missing_ok: bool = False
) -> list[Item]:
    """Items for each replicated parameter and each (kind, op) in ``wanted``, in rank-stable order.

    Args:
        replicated: sorted by name.
        wanted: the kinds to move and how.
        optimizer: for optimizer states.
        missing_ok: skip absent tensors (else they are an error for every kind but grads).

    Raises:
        ReplicaError: a wanted tensor is absent.
    """
    order = kind_order([k for k, _ in wanted])
    wanted = sorted(wanted, key=lambda kw: order[kw[0]])
    items: list[Item] = []
    for rp in replicated:
        for kind, op in wanted:
            # a grad is laid out like its owner, whether or not it exists right now
            t = local(rp.owner) if kind == "grad" else get_tensor(rp, kind, optimizer)
            if t is None:
                if missing_ok:
                    continue
                raise ReplicaError(f"{rp.name} has no {kind} tensor to sync")
            items.append(Item(op, str(t.device), t.dtype, Member(rp.name, kind, tuple(t.shape))))
    return items


def build_buckets(items: Sequence[Item], bucket_bytes: int) -> tuple[Bucket, ...]:
    """Bucket items; grad buckets carry presence flags, the others do not mix with them."""
    grads = [it for it in items if it.member.kind == "grad"]
    rest = [it for it in items if it.member.kind != "grad"]
    return make_buckets(rest, bucket_bytes) + make_buckets(grads, bucket_bytes, flags=True)


def global_src(group: Any, src: int) -> int:
    """The global rank of group rank ``src`` (what ``dist.broadcast`` takes)."""
    return src if group is None else dist.get_global_rank(group, src)


def _lookup(
    buckets: Sequence[Bucket], by_name: Mapping[str, ReplicatedParam], optimizer: Any
) -> tuple[list[list[torch.Tensor | None]], list[str]]:
    tensors: list[list[torch.Tensor | None]] = []
    problems: list[str] = []
    for bucket in buckets:
        row: list[torch.Tensor | None] = []
        for m in bucket.members:
            t = get_tensor(by_name[m.name], m.kind, optimizer)
            if t is None and not bucket.flags:
                problems.append(f"{m.name} ({m.kind}) is gone")
            elif t is not None and tuple(t.shape) != m.shape:
                problems.append(f"{m.name} ({m.kind}) has shape {list(t.shape)}, agreed {list(m.shape)}")
            elif t is not None and str(t.device) != bucket.device:
                problems.append(f"{m.name} ({m.kind}) moved to {t.device} from {bucket.device}")
            row.append(t)
        tensors.append(row)
    return tensors, problems


def _write_back(
    bucket: Bucket,
    tensors: Sequence[torch.Tensor | None],
    results: Sequence[torch.Tensor | None],
    by_name: Mapping[str, ReplicatedParam],
) -> None:
    for m, t, r in zip(bucket.members, tensors, results):
        if r is None:
            if t is not None:  # absent on the broadcast source: absent everywhere
                set_grad(by_name[m.name], None)
        elif t is None:
            set_grad(by_name[m.name], r)
        else:
            t.copy_(r)


def run_buckets(
    phase: str,
    buckets: Sequence[Bucket],
    by_name: Mapping[str, ReplicatedParam],
    optimizer: Any,
    *,
    group: Any,
    src: int,
    rank: int,
    world: int,
    stats: SyncStats,
) -> None:
    """Move every bucket (one collective each) and write the results back.

    Args:
        phase: name for errors and logs.
        buckets: the agreed buckets (same on every rank).
        by_name: the replicated parameters by name.
        optimizer: for optimizer states.
        group: process group; src: broadcast source (group rank); rank, world: of this rank.
        stats: counters to update.

    Raises:
        DistributedError: a tensor changed since the layout was agreed (on this rank), or a peer failed.
    """
    tensors, problems = _lookup(buckets, by_name, optimizer)
    src_global = global_src(group, src)
    with data_phase(phase, group) as roll, torch.no_grad():  # params are leaves that require grad
        if problems:
            raise ReplicaError(
                f"{phase}: replicated tensors changed since the ranks agreed on them: "
                f"{problems}; build a new ReplicaSync after replacing parameters, or "
                "call broadcast_now() after loading optimizer state"
            )
        for bucket, row in zip(buckets, tensors):
            results = exchange(bucket, row, group=group, src=src_global, world=world, roll=roll)
            stats.collectives += 1
            stats.bytes += bucket.nbytes
            if bucket.op == "broadcast" and rank == src:
                continue  # the source keeps its own values
            _write_back(bucket, row, results, by_name)
    log.debug(
        "%s: %d bucket(s), %d bytes (%s)",
        phase,
        len(buckets),
        sum(b.nbytes for b in buckets),
        ", ".join(sorted({dtype_name(b.dtype) for b in buckets})),
    )
