"""The options every verb shares, checked once into one frozen :class:`Options`.

The verbs keep their keyword arguments (``memory_budget=``, ``strategy=``, ``transport=``...); each
turns them into an :class:`Options` when it is called (a caller mistake raises there, before any
collective) and hands that to the orchestrator (:mod:`shardsync.pipeline`), which threads it through
every phase. What shapes the plan lives in :attr:`Options.plan` (a
:class:`~shardsync.planning.PlanOptions`, part of the plan cache's key); the rest says how the plan
runs and is checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from .dist import group_size, is_distributed
from .errors import PlanError
from .exec.memory import REUSE_MODES, Reuse
from .exec.shm_plan import TransportChoice, check_transport
from .planning import PlanOptions, check_options
from .quant.fp8 import DEFAULT_BLOCK, Fp8Quantize
from .sizes import sizes_in
from .sources.fingerprint import ReplicaCheck, check_replica_mode

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["Options", "backend_of"]


def backend_of(group: ProcessGroup | None) -> str:
    """The group's backend name, ``"none"`` for a single process.

    Example:
        >>> backend_of(None)
        'none'
    """
    return str(dist.get_backend(group)) if is_distributed(group) else "none"


@dataclass(frozen=True)
class Options:
    """How one call plans, moves and checks its targets (see :func:`shardsync.full_params`).

    Attributes:
        plan: what shapes the plan (strategy, sizes, consumers, splits, the group's backend).
        transport: ``"auto"``, ``"shm"`` or ``"backend"``.
        replica_check: how replicas of a live source are compared (``"sampled"``, ``"exact"``, ``"off"``).
        verify: compare digests of what moved with the senders' (docs/digests.md).
        quantize: block-FP8 output, or None.
        reuse: when a target's memory may hold a later one (streams to a consumer only).
        progress: a progress bar on rank 0 (the writers).

    Example:
        >>> o = Options.of(None, memory_budget="1MiB", transport="backend")
        >>> o.plan.memory_budget, o.transport, o.replica_check
        (1048576, 'backend', 'sampled')
    """

    plan: PlanOptions = field(default_factory=PlanOptions)
    transport: TransportChoice = "auto"
    replica_check: ReplicaCheck = "sampled"
    verify: bool = False
    quantize: Fp8Quantize | None = None
    reuse: Reuse = "dropped"
    progress: bool = False

    @classmethod
    def of(
        cls,
        group: ProcessGroup | None,
        *,
        meshed: bool = False,
        transport: Any = "auto",
        replica_check: Any = "sampled",
        verify: bool = False,
        reuse: Any = "dropped",
        quantize: Any = None,
        quantize_block: Any = DEFAULT_BLOCK,
        quantize_patterns: Any = None,
        progress: bool = False,
        **plan: Any,
    ) -> Options:
        """The checked options of one call on ``group``; ``plan`` holds
        :class:`~shardsync.planning.PlanOptions` fields (sizes as bytes or strings like ``"64MiB"``).

        Raises:
            PlanError: an unknown transport, strategy or reuse mode, bad sizes or splits,
                ``strategy="multicast"`` on a group smaller than the world, bad ``quantize`` options.
            LayoutError: an unknown ``replica_check``.
            FormatError: a size string that cannot be read.
        """
        check_transport(transport)
        if reuse not in REUSE_MODES:
            raise PlanError(f"reuse={reuse!r}: use one of {list(REUSE_MODES)}")
        check_replica_mode(replica_check)
        _check_multicast(plan.get("strategy"), group)
        options = PlanOptions(backend=backend_of(group), **sizes_in(plan))
        check_options(options, group_size(group), meshed=meshed)
        fp8 = Fp8Quantize.of(quantize, quantize_block, None if quantize_patterns is None else tuple(quantize_patterns))
        return cls(options, transport, replica_check, bool(verify), fp8, reuse, bool(progress))


def _check_multicast(strategy: object, group: ProcessGroup | None) -> None:
    # its subgroups are made by new_group, which every rank of the world must call
    if strategy == "multicast" and is_distributed(group) and group_size(group) != dist.get_world_size():
        raise PlanError(
            f"strategy='multicast' broadcasts on subgroups, which every rank of the whole world "
            f"must create, and this group has {group_size(group)} of the "
            f"{dist.get_world_size()} ranks; use strategy='p2p' (or 'auto') on a subgroup"
        )
