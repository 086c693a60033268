"""The orchestrator: the one protocol behind every verb, and the :class:`Destination` role.

Every verb (:func:`~shardsync.full_params`, :func:`~shardsync.load`, :func:`~shardsync.reshard`,
:func:`~shardsync.save_hf`, :func:`~shardsync.save_dcp`) checks its arguments into a :class:`Call`
and hands it here, with a :class:`Destination` that says where the targets go. On every rank of the
group, in this order (phase names from :mod:`shardsync.phases`):

1. open this rank's source (a live state, a module, a Source or a path; files every rank sees are
   spread when the destination asks) and the destination's shards; a failure here is raised in the
   next phase, on every rank;
2. the fast path (:data:`~shardsync.phases.CHECK`, once the group has a last call): one small
   collective of (changed?, host, replicas' values); when no rank's inputs changed, the last plan runs
   again, the replicas compared all the same;
3. else gather the layout (:data:`~shardsync.phases.GATHER`), check replicas, resolve the mapping and
   plan (cached by layout), and agree that every rank built the same plan
   (:data:`~shardsync.phases.PLAN`);
4. choose the transport (shared memory on one host, else the group's backend);
5. execute into the destination (its data phase: ``stream``, ``load``, ``reshard``, ...).

:func:`prepare` runs 1-4, :func:`execute_into` runs 5 lazily (a stream to a caller), :func:`run`
runs them all into a :class:`Sink` (a destination that takes every target itself).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import torch
import torch.distributed as dist

from . import phases
from .dist import GroupRanks, agree, is_distributed
from .errors import PlanError
from .exec import MeshGroups, MeshPlace, Stats, Transport, choose_transport, execute, local_mesh_info, run_device
from .exec.copies import copy_threads
from .exec.hosts import host_info, neighbours
from .exec.shm_plan import HostChoice
from .exec.shm_segments import cached_token
from .layout import GlobalLayout
from .layout.box import Box
from .layout.meta import LayoutEntry, check_replicas, without_values
from .mapping import Mapping as ParsedMapping
from .mapping import MappingLike, TargetSpec, resolve
from .options import Options
from .planning import Plan, PlanOptions
from .planning.mesh import Topology, build_topology
from .quant.fp8 import DEFAULT_BLOCK, Block, check_fp8_casts
from .sources import FileSource, LocalSource, Source, SourceLike, open_path, open_source, spread
from .sources.fp8 import fp8_block

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "Destination",
    "Sink",
    "Planned",
    "Call",
    "Prepared",
    "prepare",
    "execute_into",
    "run",
    "first_phase",
    "release_plans",
    "resolve_checked",
]

R = TypeVar("R", covariant=True)


class Planned(NamedTuple):
    """A destination's plan for one gathered layout: the plan, its fingerprint, and the
    destination's own (immutable) notes on it (load: the report and each target's box)."""

    plan: Plan
    fingerprint: str
    notes: Any = None


class Destination(Protocol):
    """Where the targets of one call go: whole tensors to consumers, shards written in place, files.

    Call sequence (the orchestrator's, on every rank of the group; a verb calls none of these):

    1. ``adapt(source)`` once, right after this rank's source is opened: the source to read from.
    2. ``entries()`` once, while the layout is gathered: this rank's destination shards (empty when
       the targets are new tensors).
    3. ``plan(...)`` (a static function of its arguments: the orchestrator caches it by them) on
       every rank, only when some rank's layout changed since the group's last call; ``block`` is
       the block of the sources' block-FP8 weights (:func:`resolve_checked` takes it).
    4. ``into(planned)`` once before data moves: the memory target ``t`` is written into, or None for
       fresh memory (yielded to the consumer).

    The verbs' destinations: :class:`~shardsync.stream.ToConsumers` (``full_params``, ``plan``),
    :class:`~shardsync.destinations.InPlace` (``load``, ``reshard``), and the sinks
    :class:`~shardsync.io.save_hf.Files` (``save_hf``) and :class:`~shardsync.io.save_dcp.DcpFiles`
    (``save_dcp``).

    Attributes:
        phase: the name of the data phase (:mod:`shardsync.phases`).
        spreads: True: a source every rank sees (files) is read once, each rank its share of the
            boxes; False: each rank reads the boxes it consumes itself.
        settings: what besides the layouts, mapping and options shapes the plan (hashable; part of
            the plan cache's key and of the agreed fingerprint).
    """

    phase: str
    spreads: bool
    settings: Hashable

    def adapt(self, source: Source) -> Source:
        """The source the targets are read from (e.g. FP8 weights read as values)."""
        ...

    def entries(self) -> Sequence[LayoutEntry]:
        """This rank's destination entries, sorted by key (empty: none)."""
        ...

    @staticmethod
    def plan(
        mapping: ParsedMapping | None,
        layout: GlobalLayout,
        dest: GlobalLayout,
        options: PlanOptions,
        topology: Topology | None,
        settings: Hashable,
        block: Block,
    ) -> Planned:
        """Resolve ``mapping`` over ``layout`` for ``dest`` and plan it (pure: the same on every rank)."""
        ...

    def into(self, planned: Planned) -> Callable[[int], torch.Tensor] | None:
        """The memory each target (by index in the plan) is written into; None: fresh memory."""
        ...


class Sink(Destination, Protocol[R]):
    """A destination that takes every target itself (:func:`run`); after :class:`Destination`'s calls:

    5. ``start(prepared)`` on every rank once the plan is agreed, before data moves (a check that
       raises here raises the same error on every rank: the plan is the same on all);
    6. ``take(name, tensor)`` for each target this rank consumes, as it completes;
    7. ``finish(prepared, stats)`` on every rank after the last step: the call's result (it may run
       agreed phases of its own, e.g. the writers' commit);
    8. ``abort()`` instead, on a rank where any step failed: free what the sink holds.
    """

    def start(self, prepared: Prepared) -> None:
        """The plan is agreed; last checks before data moves."""
        ...

    def take(self, name: str, tensor: torch.Tensor) -> None:
        """A target this rank consumes, complete."""
        ...

    def finish(self, prepared: Prepared, stats: Stats) -> R:
        """Every step ran: the result."""
        ...

    def abort(self) -> None:
        """A step failed: release what was taken."""
        ...


@dataclass(frozen=True)
class Call:
    """The checked arguments of one verb's call: what to read, how to map it, where it goes."""

    source: SourceLike
    mapping: MappingLike | None
    destination: Destination
    options: Options
    group: ProcessGroup | None = None
    groups: MeshGroups | None = None
    reverse: bool | None = None

    def parse(self) -> ParsedMapping | None:
        if self.mapping is None and self.reverse is None:
            return None
        mapping, reverse = self.mapping if self.mapping is not None else [], True if self.reverse else None
        if isinstance(mapping, (list, tuple)) and all(isinstance(x, str) for x in mapping):
            return _parse_program(tuple(mapping), reverse)
        if isinstance(mapping, str) and "->" in mapping:
            return _parse_program(mapping, reverse)
        return ParsedMapping.parse(mapping, reverse=reverse)  # a file or a name: read each call


@functools.lru_cache(maxsize=64)
def _parse_program(program: str | tuple[str, ...], reverse: bool | None) -> ParsedMapping:
    """A program given as text, parsed once (a parsed mapping is immutable): a stream called every
    step with the same statements parses them once."""
    return ParsedMapping.parse(list(program) if isinstance(program, tuple) else program, reverse=reverse)


@dataclass(frozen=True)
class Prepared:
    """What a call agreed on and runs with, on this rank."""

    call: Call
    planned: Planned
    plan: Plan  # with the chosen transport's costs
    source: Source
    transport: Transport
    kind: str  # how data moves, for stats: "local", "shm", or the backend's name
    rank: int
    device: torch.device
    seconds: float
    files: FileSource | None = None  # the source this call opened from a path: closed with the call
    neighbours: int = 1  # processes copying on this machine at once (copy threads are shared out)

    def close(self) -> None:
        """Close the files this call opened (a no-op for a source the caller passed)."""
        if self.files is not None:
            self.files.close()


class _RankLayout(NamedTuple):
    """What one rank contributes to the gathered layout; ``host`` is left out of the cache key."""

    entries: tuple[LayoutEntry, ...]
    dest: tuple[LayoutEntry, ...]
    mesh: MeshPlace | None
    block: Block = DEFAULT_BLOCK  # of the source's block-FP8 weights (config.json's, or 128 x 128)
    host: HostChoice | None = None

    def key(self) -> _RankLayout:
        return _RankLayout(without_values(self.entries), without_values(self.dest), self.mesh, self.block)


class _Opened(NamedTuple):
    source: Source
    layout: _RankLayout
    files: FileSource | None  # opened here from a path: closed when the call ends
    live: LocalSource | None = None  # the live state read, whose entries are fingerprinted on demand

    def fingerprinted(self, entries: Sequence[LayoutEntry]) -> tuple[LayoutEntry, ...]:
        """``entries`` with the fingerprints of the live shards they are (for the replica check):
        all of them when the layout is gathered, the replicated ones on the fast path."""
        return self.live.fingerprinted(entries) if self.live is not None else tuple(entries)

    def close(self) -> None:
        if self.files is not None:
            self.files.close()


class _Last(NamedTuple):
    """A group's last call on this rank: its inputs, the plan they agreed on, and the source boxes
    several ranks hold (replicas, whose values are compared again on every call)."""

    inputs: Any
    planned: Planned
    replicated: frozenset[tuple[str, Box]]


#: The last call per group (weakly: a group made after ``destroy_process_group`` starts afresh).
_last: weakref.WeakKeyDictionary[Any, _Last] = weakref.WeakKeyDictionary()


def _group_key(group: ProcessGroup | None) -> Any:
    return group if group is not None else dist.distributed_c10d._get_default_group()


def first_phase(group: ProcessGroup | None) -> str:
    """The first phase a call on ``group`` enters (where peers learn of a bad argument on this rank).

    Example:
        >>> first_phase(None)
        'gather layout'
    """
    if is_distributed(group) and _group_key(group) in _last:
        return phases.CHECK
    return phases.GATHER


def release_plans() -> None:
    """Forget every group's last call and the planning cache (see :func:`shardsync.release`)."""
    _last.clear()
    _planned.cache_clear()
    _parse_program.cache_clear()


def _open(call: Call, ranks: GroupRanks | None) -> _Opened:
    files = open_path(call.source) if isinstance(call.source, (str, os.PathLike)) else None
    # replicas are compared across ranks: a single process has none to sample
    opened = files or open_source(
        call.source, call.options.replica_check if ranks is not None else "off", deferred=True
    )
    block = fp8_block(opened)  # before adapt: a source read as values hides its blocks
    source = call.destination.adapt(opened)
    if ranks is not None and call.destination.spreads:
        source = spread(source, ranks.rank, ranks.world)
    backend = call.options.plan.backend
    host = None
    if ranks is not None:
        host = (host_info(cached_token(call.group), run_device(backend, source).type), call.options.transport)
    place = None
    if call.groups is not None:  # a single process is a 1 x 1 mesh
        place = local_mesh_info(call.groups, ranks) if ranks is not None else MeshPlace((0,), (0,))
    layout = _RankLayout(tuple(source.entries()), tuple(call.destination.entries()), place, block, host)
    return _Opened(source, layout, files, opened if isinstance(opened, LocalSource) and opened.deferred else None)


def _inputs(call: Call, layout: _RankLayout) -> Any:
    return (layout.key(), call.parse(), call.options.plan, call.destination.settings, type(call.destination))


def _fast_path(
    call: Call, ranks: GroupRanks, opened: _Opened | None, inputs: Any, last: _Last
) -> tuple[Planned | None, list[HostChoice]]:
    """One small agreed phase: every rank's host and whether its inputs changed since the last call
    (None: it failed to open); the last plan when no rank's did. Replicas' values are compared."""
    device = run_device(call.options.plan.backend, opened.source if opened else None).type
    changed = inputs is None or last.inputs != inputs
    entries = opened.layout.entries if opened is not None else ()
    replicas = tuple(e for e in entries if (e.key, e.box) in last.replicated)
    host = (host_info(cached_token(ranks.group), device), call.options.transport)

    def mine() -> tuple[bool, HostChoice, tuple[LayoutEntry, ...]]:
        # only the replicas' values are compared: only theirs are sampled, inside the phase (a
        # shard that cannot be read is this rank's failure, raised on every rank)
        return changed, host, opened.fingerprinted(replicas) if opened is not None else replicas

    agreed = agree(phases.CHECK, mine, ranks.group)
    hosts = [h for _, h, _ in agreed.all]
    if any(c for c, _, _ in agreed.all):
        return None, hosts
    check_replicas([r for _, _, r in agreed.all])  # the same lists on every rank: raised on all
    return last.planned, hosts


@functools.lru_cache(maxsize=8)
def _planned(
    plan: Callable[..., Planned],
    gathered: tuple[_RankLayout, ...],
    mapping: ParsedMapping | None,
    options: PlanOptions,
    settings: Hashable,
    meshed: bool,
) -> Planned:
    """The destination's plan for a gathered layout. Cached: a training loop that moves the same
    layout every step plans once (a plan is immutable, and equal inputs give equal plans)."""
    layout = GlobalLayout.merge([r.entries for r in gathered])
    dest = GlobalLayout.merge([r.dest for r in gathered])
    topology = build_topology(*zip(*[r.mesh for r in gathered])) if meshed else None
    blocks = {r.block for r in gathered if r.entries}
    if len(blocks) > 1:
        raise PlanError(
            f"the ranks' sources have block-FP8 weights in different blocks {sorted(blocks)}; "
            "give every rank the same checkpoint (config.json's weight_block_size)"
        )
    return plan(mapping, layout, dest, options, topology, settings, blocks.pop() if blocks else DEFAULT_BLOCK)


def resolve_checked(
    mapping: ParsedMapping | None, layout: GlobalLayout, block: Block, dest: GlobalLayout | None = None
) -> list[TargetSpec]:
    """The targets of ``mapping`` over ``layout`` (for ``dest``, when given), block-FP8 weights cut in
    blocks of ``block``: what every destination plans from.

    Raises:
        MappingError: the mapping is wrong.
        LayoutError: a target casts FP8 codes to another dtype without their scales.

    Example:
        >>> import torch
        >>> from shardsync.layout import local_layout
        >>> layout = GlobalLayout.merge([local_layout({"w": torch.ones(2)})])
        >>> [t.name for t in resolve_checked(None, layout, DEFAULT_BLOCK)]
        ['w']
    """
    targets = resolve(mapping, layout, dest=dest, fp8_block=block)
    check_fp8_casts(targets, {k: layout[k].dtype for k in layout.keys()})  # codes are not values
    return targets


def _agree_on_plan(gathered: list[_RankLayout], call: Call) -> Planned:
    # Every rank plans from the same gathered layout; a caller mistake raises the same error on all
    # ranks, a failure on some ranks a DistributedError, and different arguments a PlanError.
    dest = call.destination

    def build() -> Planned:
        parsed = call.parse()
        check_replicas([r.entries for r in gathered])  # values: checked on every gather, never cached
        key = tuple(r.key() for r in gathered)
        return _planned(type(dest).plan, key, parsed, call.options.plan, dest.settings, call.groups is not None)

    agreed = agree(phases.PLAN, build, call.group, share=lambda p: f"{p.fingerprint} {dest.settings!r}", unanimous=True)
    if len(set(agreed.all)) > 1:
        raise PlanError(
            f"ranks built different plans (fingerprints by rank: {agreed.all}); pass the "
            "same mapping and options on every rank of the group"
        )
    return agreed.mine


def _replicated(gathered: list[_RankLayout]) -> frozenset[tuple[str, Box]]:
    seen: dict[tuple[str, Box], int] = {}
    for r in gathered:
        for e in r.entries:
            seen[(e.key, e.box)] = seen.get((e.key, e.box), 0) + 1
    return frozenset(k for k, n in seen.items() if n > 1)


def prepare(call: Call) -> Prepared:
    """Open the source, take the fast path or gather, plan and agree, choose the transport
    (collective: every rank of ``call.group``).

    Raises:
        DistributedError: a rank failed, died or never came (on every rank, naming the phase).
        ShardsyncError: the same caller mistake on every rank (its own class: LayoutError...).
    """
    start = time.perf_counter()
    ranks = GroupRanks.of(call.group) if is_distributed(call.group) else None
    opened, inputs = None, None
    with contextlib.suppress(Exception):  # a failure here is raised by the phases below, on every rank
        opened = _open(call, ranks)
        inputs = _inputs(call, opened.layout)
    planned: Planned | None = None
    hosts: list[HostChoice] = []
    last = _last.get(_group_key(call.group)) if ranks is not None else None
    try:
        if ranks is not None and last is not None:
            planned, hosts = _fast_path(call, ranks, opened, inputs, last)
        if planned is None or opened is None:
            gathered = agree(
                phases.GATHER,
                lambda: opened if opened is not None else _open(call, ranks),
                call.group,
                share=lambda o: o.layout._replace(entries=o.fingerprinted(o.layout.entries)),
                unanimous=True,
            )
            opened = gathered.mine
            hosts = hosts or [r.host for r in gathered.all if r.host is not None]
            planned = _agree_on_plan(gathered.all, call)
            if ranks is not None:  # on every rank, so that every rank takes the same path next time
                _last[_group_key(call.group)] = _Last(inputs, planned, _replicated(gathered.all))
        backend = call.options.plan.backend
        fresh = call.destination.into(planned) is None
        budget = call.options.plan.memory_budget
        chosen = choose_transport(planned.plan, ranks, call.groups, hosts, backend, budget, fresh)
    except BaseException:
        if opened is not None:
            opened.close()
        raise
    return Prepared(
        call,
        planned,
        chosen.plan,
        opened.source,
        chosen.transport,
        chosen.kind,
        ranks.rank if ranks is not None else 0,
        run_device(backend, opened.source),
        time.perf_counter() - start,
        opened.files,
        neighbours([h for h, _ in hosts], ranks.rank if ranks is not None else 0),
    )


def execute_into(prepared: Prepared, stats: Stats) -> Iterator[tuple[str, torch.Tensor]]:
    """Run the plan on this rank in the destination's data phase; yield each target this rank
    consumes (written into the destination's memory where it has some). Iterate to the end."""
    call = prepared.call
    stats.plan_seconds = prepared.seconds
    stats.transport = prepared.kind
    return execute(
        prepared.plan,
        prepared.source,
        prepared.transport,
        prepared.rank,
        stats,
        group=call.group,
        device=prepared.device,
        into=call.destination.into(prepared.planned),
        reuse=call.options.reuse,
        phase=call.destination.phase,
        threads=copy_threads(prepared.neighbours),
    )


def run(call: Call, sink: Sink[R]) -> R:
    """The whole protocol into ``sink`` (``call.destination``); collective, every rank.

    Example:
        >>> from shardsync.destinations.transfer import InPlace
        >>> dst = {"w": torch.zeros(3)}
        >>> sink = InPlace(dst, strict=True, phase="load")
        >>> run(Call({"w": torch.ones(3)}, None, sink, Options(), reverse=False), sink).missing
        ()
    """
    try:
        prepared = prepare(call)
    except BaseException:
        sink.abort()
        raise
    try:
        sink.start(prepared)
        stats = Stats()
        for name, tensor in execute_into(prepared, stats):
            sink.take(name, tensor)
    except BaseException:
        sink.abort()
        prepared.close()
        raise
    prepared.close()  # every read is done; the sink may still write (and commit)
    return sink.finish(prepared, stats)
