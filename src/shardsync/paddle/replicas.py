"""``add_extra_synchronization`` for eager PyTorch, on :class:`~shardsync.replicas.ReplicaSync`.

Paddle's ``tensor_parallel_utils.add_extra_synchronization(program, ...)`` inserts, into a static
program, one broadcast (or all_reduce SUM + scale) per selected tensor after each optimizer op. This
entry keeps its arguments and defaults and runs on :class:`~shardsync.replicas.ReplicaSync`: the same
tensors are synced, in coalesced buckets, from optimizer step hooks. Differences, all deliberate:

* ``program`` becomes ``(model, optimizer)``; the ring id becomes ``group``; the TP degree is the size
  of ``group``.
* ``params_filter_fn`` takes ``(name, param)``; the default is :func:`select_replicated`'s selection,
  which contains Paddle's rules (:func:`paddle_filter` applies exactly those).
* ``"average"`` averages the fp32 master and re-derives the parameter from it, instead of averaging
  both separately (which breaks ``param == cast(master)``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from .. import phases
from ..dist import agree
from ..errors import ReplicaError
from ..replicas.preflight import DEFAULT_STATES, GroupLike, SyncMode, resolve_group
from ..replicas.select import tp_sharding
from ..replicas.sync import ReplicaSync

__all__ = ["add_extra_synchronization", "paddle_filter"]

log = logging.getLogger(__name__)


def paddle_filter(
    name: str, param: torch.Tensor, pos_emb: bool = True, layer_norm: bool = True, bias: bool = True
) -> bool:
    """Paddle's ``tensor_parallel_sync_filter_fn`` rules, on PyTorch parameter names.

    A name component starting with ``pos_embedding``; a name ending with ``_layer_norm_scale`` or
    ``_layer_norm_bias``; or a bias (``.b_`` in the name, Paddle's naming, or a ``bias`` leaf) that
    is not sharded on TP.

    Example:
        >>> paddle_filter("encoder.pos_embedding", torch.zeros(3))
        True
        >>> paddle_filter("fc.weight", torch.zeros(3))
        False
    """
    parts = name.split(".")
    if pos_emb and any(p.startswith("pos_embedding") for p in parts):
        return True
    if layer_norm and name.endswith(("_layer_norm_scale", "_layer_norm_bias")):
        return True
    return bias and (".b_" in name or parts[-1] == "bias") and tp_sharding(param) is None


def add_extra_synchronization(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    group: GroupLike = None,
    params_filter_fn: Callable[[str, torch.Tensor], bool] | None = None,
    sync_mode: Literal["broadcast", "average"] = "broadcast",
    sync_param: bool = True,
    sync_grad: bool = False,
    sync_moment: bool = False,
    src_rank: int = 0,
) -> ReplicaSync:
    """Keep TP-replicated tensors in sync after every optimizer step, like Paddle's function.

    Args:
        model: the module on this rank.
        optimizer: its optimizer (step hooks are installed on it).
        group: the TP process group, or a 1-D device mesh (None: the default group).
        params_filter_fn: ``(name, param) -> bool``; None selects with ``select_replicated(model)``.
        sync_mode: ``"broadcast"`` from ``src_rank``, or ``"average"`` (SUM then divide by the size).
        sync_param: sync params and their fp32 masters after the step.
        sync_grad: sync grads before the step (with ``sync_mode``).
        sync_moment: sync Adam moments (``exp_avg``, ``exp_avg_sq``) after the step.
        src_rank: broadcast source, a rank of ``group``.

    Returns:
        the attached :class:`ReplicaSync` (``detach()`` removes its hooks).

    Raises:
        ReplicaError: bad arguments (on every rank together).

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        >>> optimizer = torch.optim.SGD(model.parameters())
        >>> sync = add_extra_synchronization(model, optimizer)  # on each rank: group=tp_group
        >>> sync.selection.names
        ('0.bias', '1.bias', '1.weight')
    """
    group = resolve_group(group)

    def validate() -> None:
        problems = []
        if sync_mode not in ("broadcast", "average"):
            problems.append(f"sync_mode={sync_mode!r}: Paddle's modes are 'broadcast' and 'average'")
        if params_filter_fn is not None and not callable(params_filter_fn):
            problems.append("params_filter_fn must be callable(name, param) -> bool or None")
        if optimizer is None:
            problems.append("an optimizer is needed: the sync runs from its step hooks")
        if problems:
            raise ReplicaError("add_extra_synchronization:\n  " + "\n  ".join(problems))

    agree(phases.PADDLE_ARGUMENTS, validate, group, unanimous=True)
    mode: SyncMode = "mean" if sync_mode == "average" else "broadcast"
    sync = ReplicaSync(
        model,
        optimizer,
        group,
        selector=params_filter_fn,
        params=mode if sync_param else None,
        src=src_rank,
        grads=mode if sync_grad else None,
        optimizer_states=DEFAULT_STATES if sync_moment else (),
        states_mode=mode,
    )
    log.info(
        "extra synchronization (%s) of %d parameters: %s",
        sync_mode,
        len(sync.selection),
        ", ".join(sync.selection.names),
    )
    sync.attach()
    return sync
