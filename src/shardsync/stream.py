"""Stream full (mapped) tensors out of sharded state: :func:`full_params` and :func:`plan`.

The protocol, on every rank of the group: gather the layout (one ``all_gather_object``) -> resolve the
mapping into targets -> plan (split, consumers, reads, strategy, steps, memory) -> validate and agree
that every rank built the same plan (a second ``all_gather_object``) -> execute, yielding targets as
they complete. With no process group (or a group of one) the same path runs locally with no
collectives. Arguments are checked when :func:`full_params` is called; everything else happens while
the stream is iterated.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Union

import torch
import torch.distributed as dist

from .dist import GroupRanks, abandon, agree, group_size, is_distributed
from .errors import LayoutError, PlanError, ShardsyncError
from .exec import (MeshGroups, MeshLike, MeshPlace, Stats, Transport, choose_transport, execute,
                   local_mesh_info, mesh_groups, run_device)
from .exec.digests import checked, plan_digests
from .exec.hosts import host_info
from .exec.memory import REUSE_MODES, Reuse
from .exec.shm import HostChoice, TransportChoice, cached_token, check_transport
from .layout import GlobalLayout
from .layout.meta import LayoutEntry, check_replicas, without_values
from .mapping import Mapping as ParsedMapping
from .mapping import MappingLike, resolve
from .planning import (DEFAULT_BUCKET_BYTES, DEFAULT_MESH_THRESHOLD_BYTES, Plan, PlanOptions, SplitBy,
                       StrategyChoice, build_plan, check_options)
from .planning.mesh import build_topology
from .sizes import sizes_in
from .quant.fp8 import DEFAULT_BLOCK, Block, Fp8Quantize, check_fp8_casts
from .sources import Source, SourceLike, open_source, spread
from .sources.fp8 import fp8_block
from .sources.fingerprint import ReplicaCheck, check_replica_mode

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["full_params", "plan", "ParamStream", "Consumers", "TransportChoice", "GATHER_PHASE", "PLAN_PHASE",
           "release_plans"]

log = logging.getLogger(__name__)

#: Who receives targets: every rank, one rank, or ranks that split the targets among them.
Consumers = Union[Literal["all"], int, Sequence[int]]
#: Names of the agreed phases, as they appear in errors (the data phase is ``exec.STREAM_PHASE``).
GATHER_PHASE, PLAN_PHASE = "gather layout", "plan"


class _RankLayout(NamedTuple):
    """What one rank contributes to the gathered layout: its shards, its place in the mesh, and its
    host with its ``transport=`` choice (left out of the plan's cache key)."""

    entries: tuple[LayoutEntry, ...]
    mesh: MeshPlace | None
    host: HostChoice | None = None


@dataclass(frozen=True)
class _Request:
    """The checked arguments of one call."""

    state: SourceLike
    mapping: MappingLike | None
    group: ProcessGroup | None
    groups: MeshGroups | None
    options: PlanOptions
    transport: TransportChoice = "auto"
    reuse: Reuse = "dropped"
    replica_check: ReplicaCheck = "sampled"
    verify: bool = False
    quantize: Fp8Quantize | None = None


@dataclass(frozen=True)
class _Context:
    plan: Plan
    source: Source
    transport: Transport
    rank: int
    device: torch.device
    kind: str  # how data moves, for stats: "local", "shm", or the backend's name


def _request(state: Any, mapping: MappingLike | None, group: ProcessGroup | None, mesh: MeshLike | None,
             consumers: Consumers, transport: Any = "auto", reuse: Any = "dropped",
             replica_check: Any = "sampled", verify: bool = False,
             quantize: tuple[Any, Any, Any] = (None, DEFAULT_BLOCK, None), **options: Any) -> _Request:
    """Check the arguments on this rank, before anything runs (a caller mistake raises here)."""
    if group is not None and dist.is_initialized() and dist.get_rank(group) < 0:
        raise PlanError(f"global rank {dist.get_rank()} is not in the group it passed; call this on the "
                        "group's ranks only")
    try:
        if isinstance(state, torch.nn.Module):
            raise LayoutError(f"got a module ({type(state).__name__}), not its state; pass "
                              "model.state_dict()")
        if not isinstance(state, (Mapping, Source, str, os.PathLike)):
            raise LayoutError(f"state must be a mapping of names to tensors, a Source or a checkpoint "
                              f"path, got {type(state).__name__}; pass model.state_dict() or a dict")
        check_transport(transport)
        if reuse not in REUSE_MODES:
            raise PlanError(f"reuse={reuse!r}: use one of {list(REUSE_MODES)}")
        check_replica_mode(replica_check)
        _check_multicast(options.get("strategy"), group)
        groups = mesh_groups(mesh) if mesh is not None else None
        opts = PlanOptions(consumers=_consumer_ranks(consumers), backend=_backend(group),
                           **sizes_in(options))
        check_options(opts, group_size(group), meshed=mesh is not None)
        fp8 = Fp8Quantize.of(*quantize)
    except ShardsyncError as exc:
        abandon(GATHER_PHASE, group, exc)  # peers already waiting in the phase learn why
        raise
    return _Request(state, mapping, group, groups, opts, transport, reuse, replica_check, bool(verify), fp8)


def _check_multicast(strategy: object, group: ProcessGroup | None) -> None:
    # its subgroups are made by new_group, which every rank of the world must call
    if strategy == "multicast" and is_distributed(group) and group_size(group) != dist.get_world_size():
        raise PlanError(f"strategy='multicast' broadcasts on subgroups, which every rank of the whole world "
                        f"must create, and this group has {group_size(group)} of the "
                        f"{dist.get_world_size()} ranks; use strategy='p2p' (or 'auto') on a subgroup")


def _consumer_ranks(consumers: object) -> tuple[int, ...] | None:
    # the ranks themselves are checked with the other options, against the group's size
    if consumers == "all":
        return None
    if isinstance(consumers, int) and not isinstance(consumers, bool):
        return (consumers,)
    if isinstance(consumers, Sequence) and not isinstance(consumers, str):
        return tuple(consumers)
    raise PlanError(f"consumers={consumers!r}: use 'all', a rank, or a list of ranks")


def _backend(group: ProcessGroup | None) -> str:
    return str(dist.get_backend(group)) if is_distributed(group) else "none"


class _Built(NamedTuple):
    plan: Plan
    fingerprint: str


@functools.lru_cache(maxsize=8)
def _planned(gathered: tuple[_RankLayout, ...], mapping: ParsedMapping | None, options: PlanOptions,
             meshed: bool, block: Block = DEFAULT_BLOCK) -> _Built:
    """The plan and its fingerprint for a gathered layout. Cached: a training loop that streams the
    same layout every step plans once (a plan is immutable, and equal inputs give equal plans)."""
    layout = GlobalLayout.merge([r.entries for r in gathered])
    topology = build_topology(*zip(*[r.mesh for r in gathered])) if meshed else None
    targets = resolve(mapping, layout, fp8_block=block)
    check_fp8_casts(targets, {k: layout[k].dtype for k in layout.keys()})
    plan = build_plan(targets, layout, options, topology)
    return _Built(plan, plan.fingerprint())


def release_plans() -> None:
    """Forget the plans :func:`full_params` cached (see :func:`shardsync.release`)."""
    _planned.cache_clear()


def _agree_on_plan(gathered: list[_RankLayout], request: _Request, block: Block) -> Plan:
    # Every rank plans from the same gathered layout; a caller mistake raises the same error on all
    # ranks, a failure on some ranks a DistributedError, and different arguments a PlanError.
    def build() -> _Built:
        parsed = None if request.mapping is None else ParsedMapping.parse(request.mapping)
        check_replicas([r.entries for r in gathered])
        # values (fingerprints) change every training step, the layout does not: plan once
        key = tuple(_RankLayout(without_values(r.entries), r.mesh) for r in gathered)
        return _planned(key, parsed, request.options, request.groups is not None, block)

    agreed = agree(PLAN_PHASE, build, request.group, share=lambda built: built.fingerprint,
                   unanimous=True)
    if len(set(agreed.all)) > 1:
        raise PlanError(f"ranks built different plans (fingerprints by rank: {agreed.all}); pass the "
                        "same mapping and options on every rank of the group")
    return agreed.mine.plan


def _open_source(request: _Request, ranks: GroupRanks | None) -> Source:
    """This rank's source, opened once inside the agreed phase. Files every rank sees are spread:
    each rank reads its own share of the boxes."""
    source = open_source(request.state, request.replica_check)
    return spread(source, ranks.rank, ranks.world) if ranks is not None else source


def _rank_layout(source: Source, request: _Request, ranks: GroupRanks | None) -> _RankLayout:
    groups = request.groups
    device = run_device(request.options.backend, source).type
    host = ((host_info(cached_token(request.group), device), request.transport) if ranks is not None
            else None)
    if groups is None:
        place = None
    elif ranks is None:  # a single process is a 1 x 1 mesh
        place = MeshPlace((0,), (0,))
    else:
        place = local_mesh_info(groups, ranks)
    return _RankLayout(tuple(source.entries()), place, host)


def _prepare(request: _Request) -> _Context:
    """Gather the layout -> resolve, plan, validate and agree -> pick the transport."""
    ranks = GroupRanks.of(request.group) if is_distributed(request.group) else None
    layout = agree(GATHER_PHASE, lambda: _open_source(request, ranks), request.group,
                   share=lambda source: _rank_layout(source, request, ranks), unanimous=True)
    plan = _agree_on_plan(layout.all, request, fp8_block(layout.mine))
    source = layout.mine
    device = run_device(request.options.backend, source)
    hosts = [r.host for r in layout.all if r.host is not None]
    chosen = choose_transport(plan, ranks, request.groups, hosts, request.options.backend,
                              request.options.memory_budget)
    return _Context(chosen.plan, source, chosen.transport, ranks.rank if ranks else 0, device, chosen.kind)


class ParamStream:
    """The iterable :func:`full_params` returns: iterate once, on every rank, to the end.

    The arguments were checked when it was made; the first ``next()`` gathers the layout and plans
    (collective), and each later ``next()`` runs the steps up to the next target.

    Leaving early is safe: when the iterator is closed before the end (``break`` out of a ``for``
    loop drops it; :meth:`close`; the end of a ``with`` block), this rank finishes its part of the
    stream's collectives, discarding what it would have received, so the other ranks get all their
    targets and the group stays usable. An iterator kept alive after ``break`` stays open: close it
    before this rank's next collective of its own.

    Attributes:
        plan: the plan, once iteration has started (None before).
        stats: this rank's counters (bytes, collectives, peak memory, seconds), filled while iterating.
        digests: with ``verify=True``, ``{target name: digest}`` of every target of the plan, taken on
            the senders' side before anything moves (None before iteration, or without ``verify``).

    Example:
        >>> import torch
        >>> stream = full_params({"w": torch.arange(4.0), "b": torch.ones(2)})
        >>> [name for name, _ in stream], stream.stats.targets, stream.stats.collectives
        (['b', 'w'], 2, 0)
    """

    def __init__(self, request: _Request) -> None:
        self._request = request
        # weak: dropping the caller's iterator (``break`` out of a for loop) must close it
        self._iterator: weakref.ref[Generator[tuple[str, torch.Tensor], None, None]] | None = None
        self.plan: Plan | None = None
        self.stats = Stats()
        self.digests: dict[str, str] | None = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._iterator is not None:
            raise RuntimeError("a ParamStream is iterated once; call full_params again for a new pass")
        iterator = self._run()
        self._iterator = weakref.ref(iterator)
        return iterator

    def __enter__(self) -> ParamStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop iterating: finish this rank's part of the collectives (the other ranks get all their
        targets), discarding the rest. A no-op for a stream never iterated or already finished."""
        iterator = self._iterator() if self._iterator is not None else None
        if iterator is not None:
            iterator.close()

    def _run(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        start = time.perf_counter()
        ctx = _prepare(self._request)
        self.plan = ctx.plan
        self.stats.plan_seconds = time.perf_counter() - start
        self.stats.transport = ctx.kind
        targets = execute(ctx.plan, ctx.source, ctx.transport, ctx.rank, self.stats,
                          group=self._request.group, device=ctx.device, reuse=self._request.reuse)
        if self._request.verify:
            self.digests = plan_digests(ctx.plan, ctx.source, ctx.rank, self._request.group)
            targets = checked(targets, self.digests, ctx.rank, self._request.group)
        fp8 = self._request.quantize
        taken = 0
        try:
            for name, tensor in targets:
                if fp8 is None:
                    yield name, tensor
                else:  # each quantised weight, then its scales
                    yield from fp8.split(name, tensor)
                taken += 1
        except GeneratorExit:
            self._finish(targets, taken, ctx.rank)
            raise
        log.debug("full_params done: %s", self.stats.summary())

    def _finish(self, targets: Iterator[tuple[str, torch.Tensor]], taken: int, rank: int) -> None:
        """The caller left before the end: run the remaining steps (collectives) anyway, so no peer is
        left waiting in one this rank never enters."""
        if not is_distributed(self._request.group):
            return
        mine = sum(1 for t in self.plan.targets if rank in t.consumers) if self.plan else 0
        log.warning("full_params: the caller stopped iterating after %d of %d targets; finishing this "
                    "rank's part of the stream so the other ranks are not left waiting", taken, mine)
        self.stats.abandoned = True
        for _ in targets:
            pass


def full_params(state: SourceLike, mapping: MappingLike | None = None, *,
                group: ProcessGroup | None = None, strategy: StrategyChoice = "auto",
                mesh: MeshLike | None = None, num_splits: int = 1, split_index: int = 0,
                split_by: SplitBy = "count", consumers: Consumers = "all",
                bucket_bytes: int | str = DEFAULT_BUCKET_BYTES, memory_budget: int | str | None = None,
                mesh_threshold_bytes: int | str = DEFAULT_MESH_THRESHOLD_BYTES, copy: bool = True,
                transport: TransportChoice = "auto", reuse: Reuse = "dropped",
                replica_check: ReplicaCheck = "sampled", verify: bool = False,
                quantize: Literal["fp8"] | None = None, quantize_block: tuple[int, int] = DEFAULT_BLOCK,
                quantize_patterns: Sequence[str] | None = None) -> ParamStream:
    """Stream full (mapped) tensors out of sharded state; call on every rank of the group.

    Args:
        state: this rank's state dict (``model.state_dict()``, not the model: values are tensors (full
            or replicated), ShardedTensor, DTensor, or lists of ShardedTensor; keys are strings), a
            :class:`~shardsync.sources.Source`, or a checkpoint path (safetensors file or directory,
            or torch DCP directory; see :func:`~shardsync.sources.open_source`). Every rank of a
            group sees a checkpoint's files: each reads its own share of the boxes.
        mapping: None (every source is a target) or a mapping program (statements, text, dict, path).
        group: process group; None means the default group when torch.distributed is initialised,
            and a single process otherwise.
        strategy: ``"auto"`` or a name in :data:`shardsync.planning.STRATEGIES` (``"broadcast"``,
            ``"bucketed"``, ``"mesh2d"``, ``"p2p"``).
        mesh: for mesh2d, ``(horizontal group, vertical group)`` or a 2-D DeviceMesh.
        num_splits: divide the sorted targets into this many contiguous parts ...
        split_index: ... and stream only this one (e.g. one part per data-parallel replica).
        split_by: balance parts (and consumers' shares) by target ``"count"`` or ``"bytes"``.
        consumers: ``"all"``, or a rank or ranks (of ``group``) that receive targets, each its own
            contiguous part; the other ranks only send.
        bucket_bytes: most bytes per packed buffer (bucketed, p2p). This and the other sizes are
            bytes or a string (``"64MiB"``, ``"2GB"``; see :func:`shardsync.sizes.parse_size`).
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
        verify: take every target's digest on the senders' side first (``stream.digests``; one small
            collective, no data moves), hash each target a consumer receives before yielding it, and
            after the last one raise :class:`~shardsync.errors.VerifyError` on every rank if any
            differs (docs/digests.md).
        replica_check: how ranks holding the same box of a state dict's tensor are checked to hold
            the same values before anything moves: ``"sampled"`` (16 elements per tensor: cheap,
            blind to a difference elsewhere), ``"exact"`` (every byte hashed on each rank; only
            digests travel) or ``"off"`` (docs/megatron.md, "Replica check").
        quantize: ``"fp8"``: each selected target is yielded as block-FP8 codes (``float8_e4m3fn``)
            followed by its scales, ``<name>_scale_inv`` (fp32, ``amax / 448`` per block), for FP8
            rollout engines (docs/fp8.md).
        quantize_block: rows x columns of a block (with ``quantize``).
        quantize_patterns: regular expressions of the targets to quantise; None: the Linear weights
            (every ``*.weight`` of 2 or more dims but embeddings, norms, ``lm_head`` and routers).

    Returns:
        a :class:`ParamStream`: iterate it for ``(name, tensor)``; ``.stats`` and ``.plan`` after.

    Raises:
        PlanError: bad arguments (raised here, by this call; a size string that cannot be read is a
            FormatError); while iterating, a memory budget that
            cannot be met, or ranks that built different plans.
        LayoutError: a module instead of its state (raised here); while iterating, holes, conflicting
            overlaps, shape/dtype disagreements, meta tensors, keys that are not strings, FP8 codes
            cast to another dtype without their scales (read them through ``Fp8Source``).
        FormatError: (while iterating) a checkpoint path that is missing, incomplete or corrupt.
        MappingError: the mapping is wrong (while iterating).
        DistributedError: a rank failed, died, or never came during a phase (raised on every rank,
            naming the phase and the ranks).
        VerifyError: (after the last target, ``verify``) a consumer received a target whose digest
            is not the senders'.

    Example:
        >>> import torch
        >>> from shardsync.layout import shard_dim
        >>> full = torch.arange(34.).reshape(17, 2)
        >>> shards = [shard_dim(full, 0, r, 2) for r in range(2)]   # both shards, one process
        >>> for name, tensor in full_params({"w": shards}, "w^T -> w_t"):
        ...     print(name, tuple(tensor.shape), torch.equal(tensor, full.T))
        w_t (2, 17) True
    """
    return ParamStream(_request(state, mapping, group, mesh, consumers, transport, reuse, replica_check,
                                strategy=strategy,
                                num_splits=num_splits, split_index=split_index, split_by=split_by,
                                bucket_bytes=bucket_bytes, memory_budget=memory_budget,
                                mesh_threshold_bytes=mesh_threshold_bytes, copy=copy, verify=verify,
                                quantize=(quantize, quantize_block, quantize_patterns)))


def plan(state: SourceLike, mapping: MappingLike | None = None, *,
         group: ProcessGroup | None = None, mesh: MeshLike | None = None, consumers: Consumers = "all",
         **options: Any) -> Plan:
    """The plan :func:`full_params` would run, for inspection (collective: call on every rank).

    Takes the same arguments as :func:`full_params`; moves no tensor data.

    Example:
        >>> import torch
        >>> p = plan({"w": torch.zeros(4, 3), "b": torch.zeros(3)}, strategy="bucketed")
        >>> p.strategy, p.order
        ('bucketed', ('b', 'w'))
    """
    quantize = (options.pop("quantize", None), options.pop("quantize_block", DEFAULT_BLOCK),
                options.pop("quantize_patterns", None))  # checked; the plan is the same either way
    return _prepare(_request(state, mapping, group, mesh, consumers, quantize=quantize, **options)).plan
