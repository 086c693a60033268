"""Stream full (mapped) tensors out of sharded state: :func:`full_params` and :func:`plan`.

Both run the one protocol of :mod:`shardsync.pipeline` (fast path or gather the layout -> resolve ->
plan, cached by layout -> agree -> choose the transport -> execute) into :class:`ToConsumers`, the
destination "whole tensors, yielded to the ranks that consume them". With no process group (or a
group of one) the same path runs locally with no collectives. Arguments are checked when
:func:`full_params` is called; everything else happens while the stream is iterated.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Generator, Hashable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Union

import torch

from . import phases
from .dist import abandon, is_distributed
from .errors import LayoutError, PlanError, ShardsyncError
from .exec import MeshLike, Stats, mesh_groups
from .exec.digests import checked, plan_digests
from .exec.memory import Reuse
from .exec.shm_plan import TransportChoice
from .layout import GlobalLayout
from .layout.meta import LayoutEntry
from .mapping import Mapping as ParsedMapping
from .mapping import MappingLike
from .options import Options
from .pipeline import Call, Planned, Prepared, execute_into, first_phase, prepare, resolve_checked
from .planning import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_MESH_THRESHOLD_BYTES,
    Plan,
    PlanOptions,
    SplitBy,
    StrategyChoice,
    build_plan,
)
from .planning.mesh import Topology
from .quant.fp8 import DEFAULT_BLOCK, Block
from .sources import Source, SourceLike
from .sources.fingerprint import ReplicaCheck

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "full_params",
    "plan",
    "ParamStream",
    "ToConsumers",
    "Consumers",
    "TransportChoice",
    "GATHER_PHASE",
    "PLAN_PHASE",
]

log = logging.getLogger(__name__)

#: Who receives targets: every rank, one rank, or ranks that split the targets among them.
Consumers = Union[Literal["all"], int, Sequence[int]]
#: Names of the agreed phases, as they appear in errors (see :mod:`shardsync.phases`).
GATHER_PHASE, PLAN_PHASE = phases.GATHER, phases.PLAN


class ToConsumers:
    """The destination "whole targets, each yielded on the ranks that consume it" (a
    :class:`~shardsync.pipeline.Destination`): new tensors, so no destination layout; a checkpoint
    every rank sees is read once, each rank its share of the boxes.

    Example:
        >>> ToConsumers().entries(), ToConsumers.phase
        ((), 'stream')
    """

    phase = phases.STREAM
    spreads = True

    settings: Hashable = "whole targets"

    def adapt(self, source: Source) -> Source:
        return source

    def entries(self) -> Sequence[LayoutEntry]:
        return ()

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
        """Resolve the mapping into targets and plan them for their consumers."""
        targets = resolve_checked(mapping, layout, block)
        plan = build_plan(targets, layout, options, topology)
        return Planned(plan, plan.fingerprint())

    def into(self, planned: Planned) -> None:
        return None


def _call(
    state: Any,
    mapping: MappingLike | None,
    group: ProcessGroup | None,
    mesh: MeshLike | None,
    consumers: Consumers,
    **options: Any,
) -> Call:
    """Check the arguments on this rank, before anything runs (a caller mistake raises here, and the
    peers already waiting in the first phase learn why)."""
    if group is not None and is_distributed() and torch.distributed.get_rank(group) < 0:
        raise PlanError(
            f"global rank {torch.distributed.get_rank()} is not in the group it passed; call "
            "this on the group's ranks only"
        )
    try:
        if state is not None and not isinstance(state, (Mapping, Source, str, os.PathLike, torch.nn.Module)):
            raise LayoutError(
                f"state must be a mapping of names to tensors, a Source, a module or a "
                f"checkpoint path, got {type(state).__name__}; pass model.state_dict() or a dict "
                "(None: nothing on this rank)"
            )
        groups = mesh_groups(mesh) if mesh is not None else None
        opts = Options.of(group, meshed=mesh is not None, consumers=_consumer_ranks(consumers), **options)
    except ShardsyncError as exc:
        abandon(first_phase(group), group, exc)
        raise
    return Call(state, mapping, ToConsumers(), opts, group, groups)


def _consumer_ranks(consumers: object) -> tuple[int, ...] | None:
    # the ranks themselves are checked with the other options, against the group's size
    if consumers == "all":
        return None
    if isinstance(consumers, int) and not isinstance(consumers, bool):
        return (consumers,)
    if isinstance(consumers, Sequence) and not isinstance(consumers, str):
        return tuple(consumers)
    raise PlanError(f"consumers={consumers!r}: use 'all', a rank, or a list of ranks")


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

    def __init__(self, call: Call) -> None:
        self._call = call
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
        prepared = prepare(self._call)
        self.plan = prepared.plan
        try:
            yield from self._targets(prepared)
        finally:
            prepared.close()  # the files it opened from a path
        log.debug("full_params done: %s", self.stats.summary())

    def _targets(self, prepared: Prepared) -> Generator[tuple[str, torch.Tensor], None, None]:
        targets = execute_into(prepared, self.stats)
        group = self._call.group
        if self._call.options.verify:
            self.digests = plan_digests(prepared.plan, prepared.source, prepared.rank, group)
            targets = checked(targets, self.digests, prepared.rank, group)
        fp8 = self._call.options.quantize
        taken = 0
        try:
            for name, tensor in targets:
                if fp8 is None:
                    yield name, tensor
                else:  # each quantised weight, then its scales
                    yield from fp8.split(name, tensor)
                taken += 1
        except GeneratorExit:
            self._finish(targets, taken, prepared.rank)
            raise

    def _finish(self, targets: Iterator[tuple[str, torch.Tensor]], taken: int, rank: int) -> None:
        """The caller left before the end: run the remaining steps (collectives) anyway, so no peer is
        left waiting in one this rank never enters."""
        if not is_distributed(self._call.group):
            return
        mine = sum(1 for t in self.plan.targets if rank in t.consumers) if self.plan else 0
        log.warning(
            "full_params: the caller stopped iterating after %d of %d targets; finishing this "
            "rank's part of the stream so the other ranks are not left waiting",
            taken,
            mine,
        )
        self.stats.abandoned = True
        for _ in targets:
            pass


def full_params(
    state: SourceLike,
    mapping: MappingLike | None = None,
    *,
    group: ProcessGroup | None = None,
    strategy: StrategyChoice = "auto",
    mesh: MeshLike | None = None,
    num_splits: int = 1,
    split_index: int = 0,
    split_by: SplitBy = "count",
    consumers: Consumers = "all",
    bucket_bytes: int | str = DEFAULT_BUCKET_BYTES,
    memory_budget: int | str | None = None,
    mesh_threshold_bytes: int | str = DEFAULT_MESH_THRESHOLD_BYTES,
    copy: bool = True,
    transport: TransportChoice = "auto",
    reuse: Reuse = "dropped",
    replica_check: ReplicaCheck = "sampled",
    verify: bool = False,
    quantize: Literal["fp8"] | None = None,
    quantize_block: tuple[int, int] = DEFAULT_BLOCK,
    quantize_patterns: Sequence[str] | None = None,
) -> ParamStream:
    """Stream full (mapped) tensors out of sharded state; call on every rank of the group.

    Args:
        state: this rank's state dict (values are tensors (full or replicated), LocalShard, DTensor,
            or lists of LocalShard; keys are strings), an ``nn.Module`` (its tensors, read in
            place), a :class:`~shardsync.sources.Source`, None (nothing on this rank), or a
            checkpoint path (safetensors file or directory,
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
        LayoutError: a state of no accepted kind (raised here); while iterating, holes, conflicting
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
    return ParamStream(
        _call(
            state,
            mapping,
            group,
            mesh,
            consumers,
            strategy=strategy,
            num_splits=num_splits,
            split_index=split_index,
            split_by=split_by,
            bucket_bytes=bucket_bytes,
            memory_budget=memory_budget,
            mesh_threshold_bytes=mesh_threshold_bytes,
            copy=copy,
            transport=transport,
            reuse=reuse,
            replica_check=replica_check,
            verify=verify,
            quantize=quantize,
            quantize_block=quantize_block,
            quantize_patterns=quantize_patterns,
        )
    )


def plan(
    state: SourceLike,
    mapping: MappingLike | None = None,
    *,
    group: ProcessGroup | None = None,
    mesh: MeshLike | None = None,
    consumers: Consumers = "all",
    **options: Any,
) -> Plan:
    """The plan :func:`full_params` would run, for inspection (collective: call on every rank).

    Takes the same arguments as :func:`full_params`; moves no tensor data.

    Example:
        >>> import torch
        >>> p = plan({"w": torch.zeros(4, 3), "b": torch.zeros(3)}, strategy="bucketed")
        >>> p.strategy, p.order
        ('bucketed', ('b', 'w'))
    """
    prepared = prepare(_call(state, mapping, group, mesh, consumers, **options))
    prepared.close()
    return prepared.plan
