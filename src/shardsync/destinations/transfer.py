"""Fill sharded destinations in place: :func:`load` (from any source) and :func:`reshard` (live to live).

The protocol, on every rank of the group: gather the source and destination layouts (one
``all_gather_object``) -> resolve the mapping over the sources, with the destination layout for
``*`` and re-blocking -> check the targets against the destinations (missing, unexpected, shape,
dtype) -> cut each target to the destination boxes ranks hold and plan them with each box's holders
as consumers -> agree that every rank built the same plan -> execute, writing straight into the
destination shards. A rank receives or reads only the boxes of its own destination shards. Plans are
cached per gathered layout, so a loop that reshards the same layouts plans once.
"""

from __future__ import annotations

import contextlib
from collections import deque
import functools
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist

from ..dist import GroupRanks, abandon, agree, is_distributed
from ..errors import LayoutError, PlanError
from ..exec import Stats, choose_transport, execute, run_device
from ..exec.hosts import host_info
from ..exec.shm import HostChoice, TransportChoice, cached_token, check_transport
from ..layout.box import Box
from ..layout.meta import GlobalLayout, LayoutEntry, check_replicas, without_values
from ..mapping import Mapping, MappingLike, resolve
from ..planning import DEFAULT_BUCKET_BYTES, Plan, PlanOptions, build_plan
from ..planning.destinations import box_targets
from ..quant.fp8 import check_fp8_casts, check_fp8_fills
from ..sizes import sizes_in
from .check import Mismatch, Report, check_targets, describe, load_error, provenance
from ..sources import Source
from ..sources.fingerprint import ReplicaCheck, check_replica_mode
from ..sources.fp8_quantized import for_destination
from .state import Destination, DestinationLike, SourceLike, as_source
from .verify import check_written

__all__ = ["load", "reshard", "LoadResult", "DestinationStrategy", "CHECK_PHASE", "LOAD_PHASE",
           "RESHARD_PHASE", "release_plans"]

#: ``"auto"``: a box several ranks want goes by one broadcast among them (when the group is the whole
#: world), else point to point; ``"p2p"``: always one message per receiving rank.
DestinationStrategy = Literal["auto", "p2p"]
#: The phase of every call that checks whether any rank's layout changed since the last call.
CHECK_PHASE = "check layout"
#: The data phases of :func:`load` and :func:`reshard`, as errors name them.
LOAD_PHASE, RESHARD_PHASE = "load", "reshard"
#: This rank's (source entries, destination entries), as gathered.
_Local = tuple[tuple[LayoutEntry, ...], tuple[LayoutEntry, ...]]


class _Ends(NamedTuple):
    """This rank's source, destination and plan options."""

    source: Source
    dest: Destination
    options: PlanOptions

    def entries(self) -> _Local:
        return tuple(self.source.entries()), tuple(self.dest.entries())


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
class _Prepared:
    plan: Plan
    fingerprint: str
    report: Report
    problems: tuple[str, ...]
    boxes: tuple[tuple[str, Box], ...]  # per plan target: its destination key and box


@functools.lru_cache(maxsize=8)
def _prepare(gathered: tuple[_Local, ...], mapping: Mapping, options: PlanOptions) -> _Prepared:
    """Resolve, check and plan for a gathered layout. Cached: the same layouts plan once."""
    layout = GlobalLayout.merge([src for src, _ in gathered])
    dest = GlobalLayout.merge([dst for _, dst in gathered])
    targets = resolve(mapping, layout, dest=dest)
    why = provenance(mapping, layout.keys(), dest.keys())
    fit, report = check_targets(targets, dest, why)
    boxes = box_targets(fit, dest, layout)
    dtypes = {k: layout[k].dtype for k in layout.keys()}
    check_fp8_casts([b.spec for b in boxes], dtypes)
    check_fp8_fills([(b.name, b.spec) for b in boxes], dtypes, dest.keys())
    plan = build_plan([b.spec for b in boxes], layout,
                      replace(options, destinations=tuple(b.ranks for b in boxes)))
    return _Prepared(plan, plan.fingerprint(), report, describe(report, targets, why),
                     tuple((b.name, b.box) for b in boxes))


def _parse(mapping: MappingLike | None, reverse: bool) -> Mapping:
    return Mapping.parse(mapping if mapping is not None else [], reverse=True if reverse else None)


def _agree_on_plan(gathered: list[_Local], mapping: MappingLike | None, reverse: bool, strict: bool,
                   options: PlanOptions, group: Any) -> _Prepared:
    def build() -> _Prepared:
        check_replicas([src for src, _ in gathered])  # values: checked on every gather, never cached
        key = tuple((without_values(src), without_values(dst)) for src, dst in gathered)
        return _prepare(key, _parse(mapping, reverse), options)

    agreed = agree("plan", build, group,
                   share=lambda built: f"{built.fingerprint} strict={strict}", unanimous=True)
    if len(set(agreed.all)) > 1:
        raise PlanError(f"ranks built different plans ({agreed.all}); pass the same mapping and options "
                        "on every rank of the group")
    return agreed.mine


class _Last(NamedTuple):
    """A group's last call on this rank: its inputs, the plan they agreed on, and the source boxes
    several ranks hold (replicas, whose values are compared again on every call)."""

    inputs: Any
    prepared: _Prepared
    replicated: frozenset[tuple[str, Box]]


#: Per default group (weakly: one made after ``destroy_process_group`` starts afresh) and group (by
#: its global ranks): the last call (the fast path).
_last: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], _Last]] = weakref.WeakKeyDictionary()


def _slot(ranks: GroupRanks) -> dict[tuple[int, ...], _Last]:
    return _last.setdefault(dist.distributed_c10d._get_default_group(), {})


def _replicated(gathered: list[_Local]) -> frozenset[tuple[str, Box]]:
    seen: dict[tuple[str, Box], int] = {}
    for src, _ in gathered:
        for e in src:
            seen[(e.key, e.box)] = seen.get((e.key, e.box), 0) + 1
    return frozenset(k for k, n in seen.items() if n > 1)


def release_plans() -> None:
    """Forget the plans ``load``/``reshard`` keep for their fast path, and the planning cache."""
    _last.clear()
    _prepare.cache_clear()


def _check(ranks: GroupRanks, inputs: Any, sources: tuple[LayoutEntry, ...], transport: TransportChoice,
           device: str) -> tuple[_Prepared | None, list[HostChoice]]:
    """One small agreed phase on every call: the last call's plan when no rank's inputs changed since
    (the RL loop skips both gathers; None when any rank's did, or failed to be read: ``inputs``
    None), and every rank's host (with ``device``, the type of its destinations' device) and
    ``transport=`` choice. Every rank of a group makes the same
    calls, so all hold the same last plan. The values of replicas (``sources``, this rank's entries
    with their fingerprints) are compared on every call, as on a gather."""
    last = _slot(ranks).get(ranks.global_ranks)
    changed = inputs is None or last is None or last.inputs != inputs
    replicas = tuple(e for e in sources if (e.key, e.box) in last.replicated) if last is not None else ()
    agreed = agree(CHECK_PHASE, lambda: (changed, (host_info(cached_token(ranks.group), device), transport),
                                         replicas), ranks.group)
    hosts = [host for _, host, _ in agreed.all]
    if last is None or any(c for c, _, _ in agreed.all):
        return None, hosts
    check_replicas([r for _, _, r in agreed.all])  # the same lists on every rank: raised on all
    return last.prepared, hosts


def _transfer(source: SourceLike, dst: DestinationLike, mapping: MappingLike | None, group: Any,
              reverse: bool, strict: bool, plan_args: tuple[DestinationStrategy, int | str | None, int | str],
              transport: TransportChoice, phase: str, replica_check: ReplicaCheck,
              verify: bool = False) -> LoadResult:
    start = time.perf_counter()
    ranks = GroupRanks.of(group) if is_distributed(group) else None
    try:
        check_transport(transport)
        check_replica_mode(replica_check)
    except (PlanError, LayoutError) as exc:  # before any phase; peers waiting in the first learn why
        abandon(CHECK_PHASE, group, exc)
        raise
    def open_ends() -> _Ends:  # normalised inside the phase: a bad argument fails on every rank
        dest = Destination(dst)
        return _Ends(for_destination(as_source(source, replica_check), dest.entries()), dest,
                     _options(group, *plan_args))

    ends: _Ends | None = None
    inputs = None
    sources: tuple[LayoutEntry, ...] = ()
    with contextlib.suppress(Exception):  # a failure here is raised by the phases below, on every rank
        ends = open_ends()
        sources, dests = ends.entries()
        inputs = ((without_values(sources), without_values(dests)), _parse(mapping, reverse), ends.options,
                  strict)
    hosts: list[HostChoice] = []
    prepared = None
    if ranks is not None:
        on = run_device(str(dist.get_backend(ranks.group)), ends.source if ends is not None else None)
        prepared, hosts = _check(ranks, inputs, sources, transport, on.type)
    if prepared is None or ends is None:
        opened = agree("gather layout", lambda: ends if ends is not None else open_ends(), group,
                       share=_Ends.entries, unanimous=True)
        ends = opened.mine
        prepared = _agree_on_plan(opened.all, mapping, reverse, strict, ends.options, group)
        if ranks is not None and inputs is not None:
            _slot(ranks)[ranks.global_ranks] = _Last(inputs, prepared, _replicated(opened.all))
    src, dest, options = ends
    if strict and not prepared.report.ok:
        raise load_error(prepared.report, prepared.problems)  # same lists on every rank
    stats = Stats(plan_seconds=time.perf_counter() - start)
    device = run_device(options.backend, src)
    chosen = choose_transport(prepared.plan, ranks, None, hosts, options.backend, options.memory_budget)
    stats.transport = chosen.kind
    rank = ranks.rank if ranks is not None else 0
    # run every step: the targets are written into the destination's memory as they complete
    deque(execute(chosen.plan, src, chosen.transport, rank, stats, group=group, device=device,
                  into=lambda t: dest.memory(*prepared.boxes[t]), phase=phase), maxlen=0)
    if verify:
        check_written(prepared.plan, prepared.boxes, src, dest, rank, group)
    r = prepared.report
    return LoadResult(r.missing, r.unexpected, r.mismatched, chosen.plan, stats)


def _options(group: Any, strategy: DestinationStrategy, memory_budget: int | str | None,
             bucket_bytes: int | str) -> PlanOptions:
    if strategy not in ("auto", "p2p"):
        raise PlanError(f"strategy {strategy!r} is unknown for load/reshard; use 'auto' or 'p2p'")
    backend = "none"
    if is_distributed(group):
        backend = str(dist.get_backend(group))
        if dist.get_world_size(group) != dist.get_world_size():
            strategy = "p2p"  # subgroups for broadcasts must be created by the whole world
    sizes = sizes_in({"memory_budget": memory_budget, "bucket_bytes": bucket_bytes})
    return PlanOptions(strategy=strategy, backend=backend, in_place=True, **sizes)


def load(dst: DestinationLike, source: SourceLike, mapping: MappingLike | None = None, *,
         group: Any = None, reverse: bool = False, strict: bool = True,
         memory_budget: int | str | None = None, bucket_bytes: int | str = DEFAULT_BUCKET_BYTES,
         strategy: DestinationStrategy = "auto", transport: TransportChoice = "auto",
         replica_check: ReplicaCheck = "sampled", verify: bool = False) -> LoadResult:
    """Fill ``dst`` in place from ``source``, through ``mapping`` in the load direction; call on every
    rank of the group.

    Each rank receives or reads only the boxes of its own destination shards: from a file source,
    which every rank can read, it reads them itself; from live sharded state it receives them from a
    rank holding them (replicas share the sending).

    Args:
        dst: this rank's destination: a state dict (tensors, ShardedTensor, DTensor, lists of
            ShardedTensor), an ``nn.Module`` (parameters and buffers written in place, no
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
    return _transfer(source, dst, mapping, group, reverse, strict,
                     (strategy, memory_budget, bucket_bytes), transport, LOAD_PHASE, replica_check, verify)


def reshard(src_state: SourceLike, dst_state: DestinationLike, mapping: MappingLike | None = None, *,
            group: Any = None, reverse: bool = False, strict: bool = True,
            memory_budget: int | str | None = None, bucket_bytes: int | str = DEFAULT_BUCKET_BYTES,
            strategy: DestinationStrategy = "auto", transport: TransportChoice = "auto",
            replica_check: ReplicaCheck = "sampled", verify: bool = False) -> LoadResult:
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
    return _transfer(src_state, dst_state, mapping, group, reverse, strict,
                     (strategy, memory_budget, bucket_bytes), transport, RESHARD_PHASE, replica_check,
                     verify)
