"""Fill sharded destinations in place: :func:`load` (from any source) and :func:`reshard` (live to live).

Both run the one protocol of :mod:`shardsync.pipeline` into an :class:`InPlace` destination: the
mapping is resolved over the sources with the destination layout (for ``*`` and re-blocking), the
targets are checked against the destinations (missing, unexpected, shape, dtype), cut to the
destination boxes ranks hold and planned with each box's holders as consumers; execution writes
straight into the destination shards. A rank receives or reads only the boxes of its own destination
shards. Plans are cached per gathered layout, and a call whose inputs did not change on any rank
takes the fast path (one small collective, replicas compared all the same).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
import torch.distributed as dist

from .. import phases
from ..dist import abandon, is_distributed
from ..errors import PlanError, ShardsyncError
from ..exec import Stats
from ..exec.shm_plan import TransportChoice
from ..layout.box import Box
from ..layout.meta import GlobalLayout, LayoutEntry
from ..mapping import Mapping, MappingLike
from ..options import Options
from ..pipeline import Call, Planned, Prepared, first_phase, resolve_checked, run
from ..planning import DEFAULT_BUCKET_BYTES, Plan, PlanOptions, build_plan
from ..planning.destinations import box_targets
from ..planning.mesh import Topology
from ..quant.fp8 import Block, check_fp8_casts, check_fp8_fills
from ..sources import Source, SourceLike
from ..sources.fingerprint import ReplicaCheck
from ..sources.fp8_quantized import for_destination
from .check import Mismatch, Report, check_targets, describe, load_error, provenance
from .state import DestinationLike, Shards
from .verify import check_written

__all__ = [
    "load",
    "reshard",
    "LoadResult",
    "InPlace",
    "DestinationStrategy",
    "CHECK_PHASE",
    "LOAD_PHASE",
    "RESHARD_PHASE",
]

#: ``"auto"``: a box several ranks want goes by one broadcast among them (when the group is the whole
#: world), else point to point; ``"p2p"``: always one message per receiving rank.
DestinationStrategy = Literal["auto", "p2p"]
#: The phase of every call that checks whether any rank's layout changed since the last call.
CHECK_PHASE = phases.CHECK
#: The data phases of :func:`load` and :func:`reshard`, as errors name them.
LOAD_PHASE, RESHARD_PHASE = phases.LOAD, phases.RESHARD


@dataclass
class LoadResult:
    """What a :func:`load` or :func:`reshard` did (the same lists on every rank).

    Attributes:
        missing: destination keys nothing was loaded into (empty unless ``strict=False``).
        unexpected: targets of the source and mapping with no destination (skipped).
        mismatched: targets whose shape or dtype does not fit their destination (skipped).
        plan: the plan that ran (the same object on a call that reused the cached plan).
        stats: this rank's counters (bytes sent and received, collectives, seconds).

    Example:
        >>> r = load({"w": torch.zeros(3)}, {"w": torch.ones(3)})
        >>> r.missing, r.stats.bytes_received
        ((), 0)
    """

    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    mismatched: tuple[Mismatch, ...]
    plan: Plan = field(repr=False)
    stats: Stats = field(repr=False)


@dataclass(frozen=True)
class _Notes:
    report: Report
    problems: tuple[str, ...]
    boxes: tuple[tuple[str, Box], ...]  # per plan target: its destination key and box


class InPlace:
    """The destination "shards of an existing state, written in place" (a :class:`~shardsync.pipeline.Sink`).

    Args:
        dst: this rank's destination (state dict, module, or None); read when the layout is gathered,
            so a bad one fails on every rank.
        strict: raise on any missing, unexpected or mismatched target before anything is written.
        phase: the data phase's name (``"load"`` or ``"reshard"``).
        verify: compare every written box with the source's values afterwards.

    Example:
        >>> InPlace({"w": torch.zeros(2)}, strict=True, phase="load").entries()[0].shape
        (2,)
    """

    spreads = False

    def __init__(self, dst: DestinationLike, *, strict: bool, phase: str, verify: bool = False) -> None:
        self.dst, self.phase, self.verify = dst, phase, verify
        self.strict = bool(strict)
        self.settings: Hashable = ("strict", bool(strict))
        self._shards: Shards | None = None
        self._source: Source | None = None

    @property
    def shards(self) -> Shards:
        if self._shards is None:
            self._shards = Shards(self.dst)
        return self._shards

    def adapt(self, source: Source) -> Source:
        self._source = for_destination(source, self.shards.entries())
        return self._source

    def entries(self) -> Sequence[LayoutEntry]:
        return self.shards.entries()

    @staticmethod
    def plan(
        mapping: Mapping | None,
        layout: GlobalLayout,
        dest: GlobalLayout,
        options: PlanOptions,
        topology: Topology | None,
        settings: Hashable,
        block: Block,
    ) -> Planned:
        """Resolve with the destination layout, check the fit, cut to destination boxes and plan."""
        targets = resolve_checked(mapping, layout, block, dest)
        why = provenance(mapping if mapping is not None else Mapping.parse([]), layout.keys(), dest.keys())
        fit, report = check_targets(targets, dest, why)
        boxes = box_targets(fit, dest, layout)
        dtypes = {k: layout[k].dtype for k in layout.keys()}
        check_fp8_casts([b.spec for b in boxes], dtypes)  # the destination's dtype adds casts
        check_fp8_fills([(b.name, b.spec) for b in boxes], dtypes, dest.keys())
        plan = build_plan([b.spec for b in boxes], layout, replace(options, destinations=tuple(b.ranks for b in boxes)))
        notes = _Notes(report, describe(report, targets, why), tuple((b.name, b.box) for b in boxes))
        return Planned(plan, plan.fingerprint(), notes)

    def into(self, planned: Planned) -> Callable[[int], torch.Tensor]:
        boxes = planned.notes.boxes
        return lambda t: self.shards.memory(*boxes[t])

    def start(self, prepared: Prepared) -> None:
        notes = prepared.planned.notes
        if self.strict and not notes.report.ok:
            raise load_error(notes.report, notes.problems)  # the same lists on every rank

    def take(self, name: str, tensor: torch.Tensor) -> None:
        """Nothing to do: the target was written into the destination's memory."""

    def finish(self, prepared: Prepared, stats: Stats) -> LoadResult:
        notes = prepared.planned.notes
        if self.verify:
            assert self._source is not None
            check_written(
                prepared.planned.plan, notes.boxes, self._source, self.shards, prepared.rank, prepared.call.group
            )
        r = notes.report
        return LoadResult(r.missing, r.unexpected, r.mismatched, prepared.plan, stats)

    def abort(self) -> None:
        """Nothing to release: what was written stays written (the error says the load failed)."""


def _transfer(
    source: SourceLike,
    dst: DestinationLike,
    mapping: MappingLike | None,
    group: Any,
    reverse: bool,
    strict: bool,
    phase: str,
    verify: bool,
    **options: Any,
) -> LoadResult:
    """Check the arguments (raised here; the peers waiting in the first phase learn why), then run."""
    try:
        opts = _options(group, **options)
    except ShardsyncError as exc:
        abandon(first_phase(group), group, exc)
        raise
    sink = InPlace(dst, strict=strict, phase=phase, verify=verify)
    return run(Call(source, mapping, sink, opts, group, reverse=bool(reverse)), sink)


def _options(group: Any, strategy: DestinationStrategy, **options: Any) -> Options:
    if strategy not in ("auto", "p2p"):
        raise PlanError(f"strategy {strategy!r} is unknown for load/reshard; use 'auto' or 'p2p'")
    if is_distributed(group) and dist.get_world_size(group) != dist.get_world_size():
        strategy = "p2p"  # subgroups for broadcasts must be created by the whole world
    return Options.of(group, strategy=strategy, in_place=True, **options)


def load(
    dst: DestinationLike,
    source: SourceLike,
    mapping: MappingLike | None = None,
    *,
    group: Any = None,
    reverse: bool = False,
    strict: bool = True,
    memory_budget: int | str | None = None,
    bucket_bytes: int | str = DEFAULT_BUCKET_BYTES,
    strategy: DestinationStrategy = "auto",
    transport: TransportChoice = "auto",
    replica_check: ReplicaCheck = "sampled",
    verify: bool = False,
) -> LoadResult:
    """Fill ``dst`` in place from ``source``, through ``mapping`` in the load direction; call on every
    rank of the group.

    Each rank receives or reads only the boxes of its own destination shards: from a file source,
    which every rank can read, it reads them itself; from live sharded state it receives them from a
    rank holding them (replicas share the sending).

    Args:
        dst: this rank's destination: a state dict (tensors, LocalShard, DTensor, lists of
            LocalShard), an ``nn.Module`` (parameters and buffers written in place, no
            re-allocation), or None when this rank holds none of it.
        source: a :class:`~shardsync.sources.Source`, or this rank's live state (state dict or module)
            on the group, or None.
        mapping: None (names match as they are) or a program written checkpoint names -> model names:
            casts, transposes, fused QKV / gate-up (re-blocked for the destination's shard count),
            ``$LAYER_ID`` macros, ``*`` on either side, ``_ -> y`` to leave ``y`` as it is.
        group: process group; None means the default group when torch.distributed is initialised.
        reverse: run a mapping written for export (model -> checkpoint) backwards.
        strict: raise on any missing, unexpected or mismatched target before anything is written;
            False loads what fits and returns the rest in the result.
        memory_budget: most bytes of buffers any rank may hold at once (destinations are not counted:
            they are written in place); reads are cut to fit, or planning fails naming the shortfall.
            Bytes or a string (``"64MiB"``; see :func:`shardsync.sizes.parse_size`).
        bucket_bytes: largest packed message (bytes or a string, as ``memory_budget``).
        strategy: ``"auto"``: a box several ranks want travels by one broadcast among them and its
            sender (when ``group`` is the whole world), else point to point; ``"p2p"``: always one
            message per receiving rank.
        transport: ``"auto"``: boxes move through shared memory when every rank is on one host and
            the destinations are on CPU (the colocated case), else through the group's backend;
            ``"shm"`` insists on shared memory; ``"backend"``: always the group's collectives.
        verify: after writing, compare the digest of every destination box (each replica on its
            own rank) with the source's values for it (docs/digests.md); one extra small collective
            and one hashing pass over the bytes on each side.
        replica_check: how ranks holding the same box of a live source are checked to hold the same
            values: ``"sampled"`` (16 elements per tensor), ``"exact"`` (every byte hashed; only
            digests travel) or ``"off"``, as for :func:`~shardsync.full_params`.

    Returns:
        a :class:`LoadResult`: the missing/unexpected/mismatched lists, the plan and this rank's stats.

    Raises:
        LoadError: ``strict`` and the source does not fit the destination (every problem listed).
        MappingError: the mapping is wrong.
        LayoutError: the source cannot serve the destination (holes), or a bad argument.
        DistributedError: a rank failed during a phase (raised on every rank, naming phase and ranks).
        VerifyError: ``verify`` and a written box differs from the source (on every rank, naming
            each tensor).

    Example:
        >>> model = torch.nn.Linear(3, 2)
        >>> ckpt = {"w": torch.arange(6.).reshape(3, 2), "b": torch.zeros(2)}
        >>> _ = load(model, ckpt, ["w^T -> weight", "b -> bias"])
        >>> model.weight.tolist()
        [[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]]
    """
    return _transfer(
        source,
        dst,
        mapping,
        group,
        reverse,
        strict,
        LOAD_PHASE,
        verify,
        strategy=strategy,
        memory_budget=memory_budget,
        bucket_bytes=bucket_bytes,
        transport=transport,
        replica_check=replica_check,
    )


def reshard(
    src_state: SourceLike,
    dst_state: DestinationLike,
    mapping: MappingLike | None = None,
    *,
    group: Any = None,
    reverse: bool = False,
    strict: bool = True,
    memory_budget: int | str | None = None,
    bucket_bytes: int | str = DEFAULT_BUCKET_BYTES,
    strategy: DestinationStrategy = "auto",
    transport: TransportChoice = "auto",
    replica_check: ReplicaCheck = "sampled",
    verify: bool = False,
) -> LoadResult:
    """Move live sharded state into another live sharded layout, in place; call on every rank.

    Ranks may hold sources only (trainers: ``dst_state=None``), destinations only (inference workers:
    ``src_state=None``), or both (colocated). Each destination box comes from a rank holding it,
    replicas sharing the sending, point to point; a rank receives only its own shards' bytes. The
    plan is cached per gathered layout: a loop that reshards the same layouts every step plans once
    (``result.plan`` is then the same object).

    Args:
        src_state: this rank's source state (state dict, module or Source), or None.
        dst_state: this rank's destination (state dict or module), or None.
        mapping, group, reverse, strict, memory_budget, bucket_bytes, strategy, transport,
            replica_check, verify: as for :func:`load`.

    Returns:
        a :class:`LoadResult`.

    Raises:
        LoadError, MappingError, LayoutError, DistributedError, VerifyError: as for :func:`load`.

    Example:
        >>> dst = {"w": torch.zeros(2, 3)}
        >>> _ = reshard({"w": torch.ones(3, 2)}, dst, ["w^T -> w"])
        >>> dst["w"].sum().item()
        6.0
    """
    return _transfer(
        src_state,
        dst_state,
        mapping,
        group,
        reverse,
        strict,
        RESHARD_PHASE,
        verify,
        strategy=strategy,
        memory_budget=memory_budget,
        bucket_bytes=bucket_bytes,
        transport=transport,
        replica_check=replica_check,
    )
