"""Stream full (mapped) tensors out of sharded state: :func:`full_params` and :func:`plan`.

The protocol, on every rank of the group: gather the layout (one ``all_gather_object``) -> resolve the
mapping into targets -> plan (split, consumers, reads, strategy, steps, memory) -> validate and agree
that every rank built the same plan (a second ``all_gather_object``) -> execute, yielding targets as
they complete. With no process group (or a group of one) the same path runs locally with no
collectives.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

import torch
import torch.distributed as dist

from .errors import PlanError
from .dist import GroupRanks, agree, is_distributed
from .exec import (BroadcastTransport, LocalTransport, MeshTransport, P2PTransport, Stats, Transport,
                   execute, local_mesh_info, mesh_groups)
from .exec.memory import REUSE_MODES, Reuse
from .exec.mesh import MeshGroups
from .exec.hosts import HostInfo, host_info
from .exec.shm import ShmTransport, cached_token, shm_costs, use_shm
from .layout import GlobalLayout, StateValue
from .layout.meta import check_replicas
from .mapping import Mapping as ParsedMapping
from .mapping import MappingLike, resolve
from .planning import DEFAULT_BUCKET_BYTES, Plan, PlanOptions, SplitBy, StrategyChoice, build_plan
from .planning.mesh import build_topology
from .sources import LocalSource, Source

__all__ = ["full_params", "plan", "ParamStream", "Consumers", "TransportChoice"]

log = logging.getLogger(__name__)

#: Who receives targets: every rank, one rank, or ranks that split the targets among them.
Consumers = Union[Literal["all"], int, Sequence[int]]
#: How data moves between ranks: ``"shm"`` through shared memory (every rank on one host, CPU),
#: ``"backend"`` through the process group's collectives, ``"auto"``: shm where it applies.
TransportChoice = Literal["auto", "shm", "backend"]


@dataclass
class _Context:
    plan: Plan
    source: Source
    transport: Transport
    rank: int
    device: torch.device
    kind: str  # how data moves, for stats: "local", "shm", or the backend's name


def _check_exec(transport: str, reuse: str) -> None:
    if transport not in ("auto", "shm", "backend"):
        raise PlanError(f"transport={transport!r}: use 'auto', 'shm' or 'backend'")
    if reuse not in REUSE_MODES:
        raise PlanError(f"reuse={reuse!r}: use one of {list(REUSE_MODES)}")


def _options(group: Any, consumers: Consumers, **kw: Any) -> PlanOptions:
    if group is not None and dist.is_initialized() and dist.get_rank(group) < 0:
        raise PlanError(f"rank {dist.get_rank()} is not in the group it passed; call full_params on "
                        "the group's ranks only")
    if isinstance(consumers, str) and consumers != "all":
        raise PlanError(f"consumers={consumers!r}: use 'all', a rank, or a list of ranks")
    who = None if consumers == "all" else (consumers,) if isinstance(consumers, int) else tuple(consumers)
    backend = str(dist.get_backend(group)) if is_distributed(group) else "none"
    return PlanOptions(consumers=who, backend=backend, **kw)


def _local_info(source: Source, groups: MeshGroups | None,
                ranks: GroupRanks | None) -> tuple[Any, Any]:
    """What this rank contributes to the layout: its shards, and its place in the mesh."""
    info = None if groups is None else local_mesh_info(groups, ranks) if ranks is not None else ((0,), (0,))
    return source.entries(), info


@functools.lru_cache(maxsize=8)
def _planned(gathered: tuple[tuple[Any, Any], ...], mapping: ParsedMapping | None, options: PlanOptions,
             meshed: bool) -> tuple[Plan, str]:
    """The plan and its fingerprint for a gathered layout. Cached: a training loop that streams the
    same layout every step plans once (a plan is immutable, and equal inputs give equal plans)."""
    layout = GlobalLayout.merge([entries for entries, _ in gathered])
    topology = build_topology(*zip(*[info for _, info in gathered])) if meshed else None
    plan = build_plan(resolve(mapping, layout), layout, options, topology)
    return plan, plan.fingerprint()


def _agree_on_plan(gathered: list[tuple[Any, Any]], mapping: Any, options: PlanOptions, meshed: bool,
                   group: Any) -> Plan:
    # Every rank plans from the same gathered layout; a caller mistake raises the same error on all
    # ranks, a failure on some ranks a DistributedError, and different arguments a PlanError.
    built: list[Plan] = []

    def build_and_print() -> str:
        parsed = None if mapping is None else ParsedMapping.parse(mapping)
        check_replicas([entries for entries, _ in gathered])
        # values (fingerprints) change every training step, the layout does not: plan once
        key = tuple((tuple(e[:4] for e in entries), info) for entries, info in gathered)
        plan, fingerprint = _planned(key, parsed, options, meshed)
        built.append(plan)
        return fingerprint

    prints = agree("plan", build_and_print, group, unanimous=True)
    if len(set(prints)) > 1:
        raise PlanError(f"ranks built different plans (fingerprints {prints}); pass the same mapping "
                        "and options on every rank of the group")
    return built[0]


def _transport(plan: Plan, ranks: GroupRanks | None, groups: MeshGroups | None, source: Source,
               hosts: list[tuple[HostInfo, str]], device: torch.device,
               budget: int | None) -> tuple[Transport, str, Plan]:
    if ranks is None:
        return LocalTransport(), "local", plan
    if use_shm(plan, hosts, device, budget):
        plan = dataclasses.replace(plan, costs=shm_costs(plan))
        return ShmTransport(ranks, plan, source, [h for h, _ in hosts]), "shm", plan
    kind = str(dist.get_backend(ranks.group))
    if plan.strategy == "mesh2d" and groups is not None and plan.topology is not None:
        return MeshTransport(ranks, groups, plan.topology), kind, plan
    return (P2PTransport(ranks) if plan.strategy == "p2p" else BroadcastTransport(ranks)), kind, plan


def _prepare(state: Mapping[str, StateValue], mapping: Any, group: Any, mesh: Any,
             options: PlanOptions, transport: TransportChoice = "auto") -> _Context:
    """Gather the layout (and hosts) -> resolve -> plan, validate and agree -> pick the transport."""
    ranks = GroupRanks.of(group) if is_distributed(group) else None
    groups = mesh_groups(mesh) if mesh is not None else None
    sources: list[LocalSource] = []

    def local() -> tuple[Any, Any, Any]:  # the state is normalised once, inside the agreed phase
        sources.append(LocalSource(state))
        return (*_local_info(sources[0], groups, ranks), (host_info(cached_token(group)), transport))

    gathered = agree("gather layout", local, group)
    hosts = [g[2] for g in gathered]
    plan = _agree_on_plan([g[:2] for g in gathered], mapping, options, groups is not None, group)
    source = sources[0]
    device = (torch.device("cuda", torch.cuda.current_device()) if options.backend == "nccl"
              else source.device())
    moved, kind, plan = _transport(plan, ranks, groups, source, hosts, device, options.memory_budget)
    return _Context(plan, source, moved, ranks.rank if ranks else 0, device, kind)


class ParamStream:
    """The iterable :func:`full_params` returns: iterate once, on every rank, to the end.

    Nothing happens until the first ``next()``: that gathers the layout and plans (collective), and
    each later ``next()`` runs the steps up to the next target.

    Attributes:
        plan: the plan, once iteration has started (None before).
        stats: this rank's counters (bytes, collectives, peak memory, seconds), filled while iterating.

    Example:
        >>> stream = full_params(state)          # doctest: +SKIP
        >>> names = [name for name, _ in stream]  # doctest: +SKIP
        >>> stream.stats.collectives              # doctest: +SKIP
        4
    """

    def __init__(self, state: Mapping[str, StateValue], mapping: Any, group: Any, mesh: Any,
                 options: PlanOptions, transport: TransportChoice = "auto", reuse: Reuse = "dropped",
                 ) -> None:
        self._args = (state, mapping, group, mesh, options, transport)
        self._reuse = reuse
        self._started = False
        self.plan: Plan | None = None
        self.stats = Stats()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._started:
            raise RuntimeError("a ParamStream is iterated once; call full_params again for a new pass")
        self._started = True
        return self._run()

    def _run(self) -> Iterator[tuple[str, torch.Tensor]]:
        start = time.perf_counter()
        ctx = _prepare(*self._args)
        self.plan = ctx.plan
        self.stats.plan_seconds = time.perf_counter() - start
        self.stats.transport = ctx.kind
        yield from execute(ctx.plan, ctx.source, ctx.transport, ctx.rank, self.stats,
                           group=self._args[2], device=ctx.device, reuse=self._reuse)
        log.debug("full_params done: %s", self.stats.summary())


def full_params(state: Mapping[str, StateValue], mapping: MappingLike | None = None, *, group: Any = None,
                strategy: StrategyChoice = "auto", mesh: Any = None, num_splits: int = 1,
                split_index: int = 0, split_by: SplitBy = "count", consumers: Consumers = "all",
                bucket_bytes: int = DEFAULT_BUCKET_BYTES, memory_budget: int | None = None,
                mesh_threshold_bytes: int = 8 << 30, copy: bool = True,
                transport: TransportChoice = "auto", reuse: Reuse = "dropped") -> ParamStream:
    """Stream full (mapped) tensors out of sharded state; call on every rank of the group.

    Args:
        state: this rank's state dict: values are tensors (full or replicated), ShardedTensor,
            DTensor, or lists of ShardedTensor.
        mapping: None (every source is a target) or a mapping program (statements, text, dict, path).
        group: process group; None means the default group when torch.distributed is initialised,
            and a single process otherwise.
        strategy: ``"broadcast"``, ``"bucketed"``, ``"mesh2d"``, ``"p2p"`` or ``"auto"``.
        mesh: for mesh2d, ``(horizontal group, vertical group)`` or a 2-D DeviceMesh.
        num_splits: divide the sorted targets into this many contiguous parts ...
        split_index: ... and stream only this one (e.g. one part per data-parallel replica).
        split_by: balance parts (and consumers' shares) by target ``"count"`` or ``"bytes"``.
        consumers: ``"all"``, or a rank or ranks (of ``group``) that receive targets, each its own
            contiguous part; the other ranks only send.
        bucket_bytes: most bytes per packed buffer (bucketed, p2p).
        memory_budget: most bytes the streamer may hold at once on any rank; buckets shrink and large
            reads are cut to fit, or planning fails naming the shortfall.
        mesh_threshold_bytes: mesh2d moves a read alone by two-stage broadcast when batching it would
            grow every rank's memory by more than this (Paddle's ``memory_growth_threshold``).
        copy: False returns targets that are an unchanged local source as views of it (zero copy).
        transport: ``"auto"`` moves data through shared memory when every rank is on one host and
            the targets are on CPU (else through the group's backend), ``"shm"`` insists on shared
            memory, ``"backend"`` always uses the group's collectives (docs/performance.md).
        reuse: ``"dropped"``: a target's memory is reused for a later target only once no tensor,
            view or storage of it is alive; ``"until-next"``: each target is valid only until the
            next one is requested (its memory is then reused even if still referenced);
            ``"never"``: fresh memory for each target.

    Returns:
        a :class:`ParamStream`: iterate it for ``(name, tensor)``; ``.stats`` and ``.plan`` after.

    Raises:
        LayoutError: holes, conflicting overlaps, shape/dtype disagreements (on every rank together).
        PlanError: bad options, or a memory budget that cannot be met.
        MappingError: the mapping is wrong.
        DistributedError: a rank failed during a phase (raised on every rank, naming phase and ranks).

    Example:
        >>> for name, tensor in full_params({"w": shard_dim(torch.arange(34.).reshape(17, 2), 0, rank, 2)}):
        ...     print(name, tensor.shape)     # doctest: +SKIP
        w torch.Size([17, 2])
    """
    _check_exec(transport, reuse)
    options = _options(group, consumers, strategy=strategy, num_splits=num_splits,
                       split_index=split_index, split_by=split_by, bucket_bytes=bucket_bytes,
                       memory_budget=memory_budget, mesh_threshold_bytes=mesh_threshold_bytes, copy=copy)
    return ParamStream(state, mapping, group, mesh, options, transport, reuse)


def plan(state: Mapping[str, StateValue], mapping: MappingLike | None = None, *, group: Any = None,
         mesh: Any = None, consumers: Consumers = "all", transport: TransportChoice = "auto",
         **options: Any) -> Plan:
    """The plan :func:`full_params` would run, for inspection (collective: call on every rank).

    Takes the same arguments as :func:`full_params`; moves no tensor data.

    Example:
        >>> p = shardsync.plan(state, strategy="bucketed")    # doctest: +SKIP
        >>> print(p.summary())                                 # doctest: +SKIP
    """
    _check_exec(transport, "never")
    return _prepare(state, mapping, group, mesh, _options(group, consumers, **options), transport).plan
