"""Layout-independent digests: :func:`digest` and :func:`verify`.

The protocol, on every rank of the group: open the source and gather the layout, with each rank's
mapping (one gather) -> resolve the mapping into targets and cut them into reads (the
planner's, so replicas are read once) -> every read goes to one of its holders -> each rank hashes the
boxes it was given, where they lie, and one gather of one integer per target adds the
sums (:mod:`shardsync.exec.digests`). No tensor data moves. The digest of a target depends only on its
shape, dtype and values (:mod:`shardsync.exec.box_hash`; docs/digests.md).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from . import phases
from .dist import GroupRanks, agree, is_distributed
from .errors import LayoutError, PlanError
from .exec.box_hash import finish
from .exec.digests import Part, combine, local_sums, owners
from .layout import GlobalLayout
from .layout.meta import LayoutEntry, check_replicas, without_values
from .mapping import Mapping as ParsedMapping
from .mapping import MappingLike
from .pipeline import resolve_checked
from .planning.model import Read
from .planning.reads import build_reads
from .planning.validate import check_inputs
from .quant.fp8 import DEFAULT_BLOCK, Block
from .sources import Source, SourceLike, open_source, spread
from .sources.fp8 import fp8_block

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["digest", "verify", "VerifyReport", "DIGEST_GATHER_PHASE"]

#: The agreed phase that gathers the layout and the mappings (the sums are added in ``"digest"``).
DIGEST_GATHER_PHASE = phases.DIGEST_GATHER


class _Opened(NamedTuple):
    source: Source
    mapping: ParsedMapping | None

    def shared(self) -> tuple[tuple[LayoutEntry, ...], str | None]:
        key = None if self.mapping is None else hashlib.sha256(repr(self.mapping).encode()).hexdigest()
        return tuple(self.source.entries()), key


class _Job(NamedTuple):
    """What a gathered layout and mapping give every rank: the targets and who hashes what."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    parts: tuple[Part, ...]
    reads: tuple[Read, ...]
    owners: tuple[int, ...]


@functools.lru_cache(maxsize=8)
def _job(
    gathered: tuple[tuple[LayoutEntry, ...], ...], mapping: ParsedMapping | None, block: Block = DEFAULT_BLOCK
) -> _Job:
    # Cached: a loop that digests the same layout every step resolves and cuts once.
    layout = GlobalLayout.merge(gathered)
    targets = resolve_checked(mapping, layout, block)
    check_inputs(targets, layout)
    reads, copies = build_reads(targets, [()] * len(targets), layout, layout.world_size)
    parts = tuple(Part(ti, c.read, c.piece, t.shape, t.dtype) for ti, t in enumerate(targets) for c in copies[ti])
    return _Job(
        tuple(t.name for t in targets),
        tuple(t.shape for t in targets),
        tuple(t.dtype for t in targets),
        parts,
        tuple(reads),
        owners(reads, layout.world_size),
    )


def _agreed_job(
    gathered: list[tuple[tuple[LayoutEntry, ...], str | None]],
    mapping: ParsedMapping | None,
    block: Block = DEFAULT_BLOCK,
) -> _Job:
    """The job of the gathered layout, after checking that every rank passed the same mapping and
    that replicas agree."""
    if len({key for _, key in gathered}) > 1:
        raise PlanError("ranks passed different mappings to digest; pass the same mapping on every rank of the group")
    per_rank = [entries for entries, _ in gathered]
    check_replicas(per_rank)
    return _job(tuple(without_values(e) for e in per_rank), mapping, block)


def _check_state(state: object) -> None:
    if isinstance(state, torch.nn.Module):
        raise LayoutError(f"got a module ({type(state).__name__}), not its state; pass model.state_dict()")
    if not isinstance(state, (Mapping, Source, str, os.PathLike)):
        raise LayoutError(
            f"state must be a mapping of names to tensors, a Source or a checkpoint path, "
            f"got {type(state).__name__}; pass model.state_dict() or a path"
        )


def digest(
    state: SourceLike, mapping: MappingLike | None = None, *, group: ProcessGroup | None = None
) -> dict[str, str]:
    """The digest of every target of ``state`` under ``mapping``; call on every rank of the group.

    A target's digest depends only on its shape, dtype and values in target coordinates: the same
    for any sharding (TP/EP/FSDP shards, replicas), any files (one or many, safetensors or DCP) and
    any number of ranks, and different when any element's bits differ. Each rank hashes only the
    boxes it holds (a replica is hashed by one of its holders); the ranks then exchange one integer per
    target. Not a cryptographic MAC: it detects corruption and bugs, not a forger (docs/digests.md).

    Args:
        state: this rank's state dict (tensors, LocalShard, DTensor, lists of LocalShard), a
            :class:`~shardsync.sources.Source`, or a checkpoint path (safetensors or DCP; every rank
            of a group hashes its own share of the files).
        mapping: None (every source is a target) or a mapping program; its transposes, splits,
            concatenations, fused forms and casts apply: the digest is of the target values.
        group: process group; None means the default group when torch.distributed is initialised,
            and a single process otherwise.

    Returns:
        ``{target name: 16 hex digits}``, sorted by name, the same on every rank.

    Raises:
        LayoutError: a module instead of its state, or a layout that cannot serve the targets.
        MappingError: the mapping is wrong.
        PlanError: ranks passed different mappings.
        DistributedError: a rank failed during a phase (raised on every rank, naming it).

    Example:
        >>> import torch
        >>> from shardsync.layout import shard_dim
        >>> full = torch.arange(34.).reshape(17, 2)
        >>> shards = [shard_dim(full, 1, r, 2) for r in range(2)]
        >>> digest({"w": shards}, "w^T -> w_t") == digest({"w_t": full.T.contiguous()})
        True
    """
    ranks = GroupRanks.of(group) if is_distributed(group) else None

    def open_() -> _Opened:  # inside the phase: a bad argument on any rank fails on every rank at once
        _check_state(state)
        source = open_source(state)
        parsed = None if mapping is None else ParsedMapping.parse(mapping)
        return _Opened(spread(source, ranks.rank, ranks.world) if ranks is not None else source, parsed)

    opened = agree(DIGEST_GATHER_PHASE, open_, group, share=_Opened.shared, unanimous=True)
    rank = ranks.rank if ranks is not None else 0
    block = fp8_block(opened.mine.source)

    def mine() -> list[int]:  # inside the phase: a bad mapping or layout fails on every rank together
        job = _agreed_job(opened.all, opened.mine.mapping, block)
        return local_sums(job.parts, job.reads, job.owners, opened.mine.source, rank, len(job.names))

    sums = combine(mine, group)
    job = _agreed_job(opened.all, opened.mine.mapping, block)  # cached: ``mine``'s
    return {n: finish(s, shape, dtype) for n, s, shape, dtype in zip(job.names, sums, job.shapes, job.dtypes)}


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` found: the digests of both sides, and per tensor equal / different /
    missing on one side.

    Example:
        >>> r = VerifyReport({"w": "01", "b": "02"}, {"w": "01", "c": "03"})
        >>> r.equal, r.different, r.only_a, r.only_b, r.ok
        (('w',), (), ('b',), ('c',), False)
    """

    a: dict[str, str]
    b: dict[str, str]

    @property
    def equal(self) -> tuple[str, ...]:
        """Names on both sides with equal digests."""
        return tuple(n for n in sorted(self.a) if n in self.b and self.a[n] == self.b[n])

    @property
    def different(self) -> tuple[str, ...]:
        """Names on both sides whose digests differ (values, shape or dtype)."""
        return tuple(n for n in sorted(self.a) if n in self.b and self.a[n] != self.b[n])

    @property
    def only_a(self) -> tuple[str, ...]:
        """Targets of A (under the mapping) missing from B."""
        return tuple(n for n in sorted(self.a) if n not in self.b)

    @property
    def only_b(self) -> tuple[str, ...]:
        """Tensors of B missing from A's targets."""
        return tuple(n for n in sorted(self.b) if n not in self.a)

    @property
    def ok(self) -> bool:
        """Whether both sides hold the same names with the same digests."""
        return not (self.different or self.only_a or self.only_b)

    def status(self, name: str) -> str:
        """``"equal"``, ``"different"``, ``"missing in b"`` or ``"missing in a"``."""
        if name in self.a and name in self.b:
            return "equal" if self.a[name] == self.b[name] else "different"
        return "missing in b" if name in self.a else "missing in a"

    def to_json(self) -> str:
        """The report as JSON: ``ok`` and, per tensor, its status and both digests."""
        names = sorted({*self.a, *self.b})
        return json.dumps(
            {
                "ok": self.ok,
                "tensors": {n: {"status": self.status(n), "a": self.a.get(n), "b": self.b.get(n)} for n in names},
            },
            indent=1,
        )


def verify(
    a: SourceLike, b: SourceLike, mapping: MappingLike | None = None, *, group: ProcessGroup | None = None
) -> VerifyReport:
    """Compare two sources of any layouts by digest, ``a`` under ``mapping``; call on every rank.

    Args:
        a: a state dict, Source or checkpoint path (as for :func:`digest`).
        b: the same kinds; its tensors are compared as they are (no mapping).
        mapping: applied to ``a`` (e.g. a Megatron -> HF program when ``b`` is the HF export).
        group: process group (as for :func:`digest`).

    Returns:
        a :class:`VerifyReport` (the same on every rank); ``report.ok`` when everything matches.

    Raises:
        LayoutError, MappingError, PlanError, DistributedError: as for :func:`digest`.

    Example:
        >>> import torch
        >>> w = torch.arange(6.).reshape(2, 3)
        >>> verify({"w": w}, {"w_t": w.T.contiguous()}, "w^T -> w_t").ok
        True
    """
    return VerifyReport(digest(a, mapping, group=group), digest(b, group=group))
