"""ReplicaSync: keep tensor-parallel replicated parameters identical across the group.

Call sequence (every rank of ``group`` makes the same calls, in the same order)::

    sync = ReplicaSync(model, optimizer, group)   # preflight: one all_gather_object of the layout
    sync.broadcast_now()                           # after init or checkpoint load
    handle = sync.attach()                         # optimizer hooks, every `interval` steps:
        # pre-step:  grads (mean / sum / broadcast), unless sync_grads() already ran this step
        # post-step: params + fp32 masters + optimizer states (broadcast / mean)
    sync.sync_grads()                              # optional, before grad clipping
    handle.remove()

Three operations are kept apart (see the design notes): summing partial grads (correctness, every
step), averaging grads of redundant replicas (a safety net), and repairing params, masters and moments
(broadcast, exact and idempotent, or mean). A parameter and its master stay consistent: broadcast moves
both; mean averages the master in fp32 and re-derives the parameter (``param.copy_(master)``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ReplicaError
from ..dist import agree, group_rank, group_size, is_distributed
from .buckets import Bucket, Op, PhasePlan, SyncPlan
from .engine import Item, SyncStats, build_buckets, items_for, run_buckets
from .select import SelectorLike, Selection, resolve_selector
from .targets import (Entry, MasterParams, Target, check_same, describe, kind_order, local,
                      resolve_targets)

__all__ = ["ReplicaSync", "HookHandle", "SyncMode", "GradMode", "SYNC_BUCKET_BYTES",
           "DEFAULT_STATES", "check_group"]

log = logging.getLogger(__name__)

SyncMode = Literal["broadcast", "mean"]
GradMode = Literal["mean", "sum", "broadcast"]
#: Most bytes per bucket of a replica-sync collective (not the streaming bucket cap,
#: :data:`shardsync.planning.DEFAULT_BUCKET_BYTES`).
SYNC_BUCKET_BYTES = 64 << 20
DEFAULT_STATES: tuple[str, ...] = ("exp_avg", "exp_avg_sq")


class HookHandle:
    """Removes the optimizer hooks installed by :meth:`ReplicaSync.attach` (also a context manager)."""

    def __init__(self, handles: Sequence[Any], on_remove: Any) -> None:
        self._handles = list(handles)
        self._on_remove = on_remove

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._on_remove()

    def __enter__(self) -> HookHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def check_group(group: Any) -> None:
    """Raise ReplicaError when ``group`` cannot be used from this process."""
    if group is not None and not (dist.is_available() and dist.is_initialized()):
        raise ReplicaError("a group was given but torch.distributed is not initialized; call "
                           "init_process_group first, or pass group=None for a single process")
    if group is not None and dist.get_rank(group) < 0:
        raise ReplicaError("this process is not a member of the given group; build ReplicaSync "
                           "only on the group's ranks")


def _validate(params: Any, grads: Any, states_mode: Any, states: Any, src: Any, world: int,
              interval: Any, bucket_bytes: Any) -> None:
    problems = []
    if params not in ("broadcast", "mean", None):
        problems.append(f"params={params!r}: use 'broadcast', 'mean' or None")
    if grads not in (None, "mean", "sum", "broadcast"):
        problems.append(f"grads={grads!r}: use None, 'mean', 'sum' or 'broadcast'")
    if states_mode not in ("broadcast", "mean", None):
        problems.append(f"states_mode={states_mode!r}: use 'broadcast', 'mean' or None (as params)")
    if isinstance(states, str) or not all(isinstance(k, str) for k in states):
        problems.append(f"optimizer_states={states!r}: use a tuple of state keys like {DEFAULT_STATES}")
    elif {"param", "master", "grad"} & set(states):
        problems.append(f"optimizer_states={states!r} names a non-state kind")
    if not isinstance(src, int) or not 0 <= src < world:
        problems.append(f"src={src!r}: must be a rank of the group, 0..{world - 1}")
    if not isinstance(interval, int) or interval < 1:
        problems.append(f"interval={interval!r}: must be an int >= 1")
    elif grads == "sum" and interval != 1:
        problems.append(f"grads='sum' with interval={interval}: partial grads must be summed on "
                        "every step; use interval=1 (or grads='mean' for a periodic safety net)")
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        problems.append(f"bucket_bytes={bucket_bytes!r}: must be an int >= 1")
    if problems:
        raise ReplicaError("invalid ReplicaSync arguments:\n  " + "\n  ".join(problems))


def _owner_entries(targets: Sequence[Target]) -> list[Entry]:
    """Which tensor the optimizer steps (and whose grad and states sync), per target."""
    return [(t.name, "stepped", (), "master" if t.owner is t.master else "param", "-", True)
            for t in targets]


class ReplicaSync:
    """Coalesced sync of TP-replicated params, fp32 masters, grads and optimizer states.

    Constructing it is collective: every rank of ``group`` must construct it, and each rank's
    selection (names, shapes, dtypes) is checked against the others' before anything moves.

    Args:
        model: the module on this rank.
        optimizer: the optimizer that steps the model (or its masters); needed for ``attach()`` and
            optimizer states.
        group: the TP process group; None is the default group. With one rank nothing moves.
        selector: a :class:`Selection`, a predicate ``(name, param) -> bool``, or None for
            ``select_replicated(model)``.
        params: ``"broadcast"`` (from ``src``, exact), ``"mean"`` (sum in fp32, then divide), or None
            (no param/master sync after the step).
        src: the broadcast source, a rank of ``group``.
        master_params: fp32 master per param: ``{param or name: master}``, ``callable(param) ->
            master | None``, None, or ``"auto"`` (``optimizer._master_weights`` if it exists).
        grads: None, ``"sum"`` (partial grads: every step), ``"mean"`` or ``"broadcast"``, before the step.
        optimizer_states: state keys synced with the params (of the master when the optimizer steps
            the master); ``()`` for none.
        states_mode: how states are synced; None follows ``params``.
        interval: sync every this many optimizer steps.
        bucket_bytes: bucket size limit (in communication bytes).
        mesh_dim: TP dim of multi-dim DTensor meshes, for the default selection.

    Raises:
        ReplicaError: bad arguments or masters (on every rank together).
        LayoutError: the ranks selected different tensors (names, shapes or dtypes differ).

    Example:
        >>> sync = ReplicaSync(model, optimizer, tp_group, grads="mean")  # doctest: +SKIP
        >>> sync.broadcast_now()                                            # doctest: +SKIP
        >>> handle = sync.attach()                                          # doctest: +SKIP
        >>> print(sync.plan())                                              # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 group: Any = None, *, selector: SelectorLike = None, params: SyncMode | None = "broadcast",
                 src: int = 0, master_params: MasterParams = "auto", grads: GradMode | None = None,
                 optimizer_states: Sequence[str] = DEFAULT_STATES, states_mode: SyncMode | None = None,
                 interval: int = 1, bucket_bytes: int = SYNC_BUCKET_BYTES,
                 mesh_dim: int | str | None = None) -> None:
        check_group(group)
        self.model, self.optimizer, self.group = model, optimizer, group
        self.rank, self.world = group_rank(group), group_size(group)
        self.params, self.grads, self.src, self.interval = params, grads, src, interval
        self.states = tuple(optimizer_states) if not isinstance(optimizer_states, str) else ()
        self.states_op: SyncMode | None = states_mode if states_mode is not None else params
        self.bucket_bytes = bucket_bytes
        self.stats = SyncStats()

        def preflight() -> tuple[Selection, list[Target]]:
            _validate(params, grads, states_mode, optimizer_states, src, self.world, interval,
                      bucket_bytes)
            selection = resolve_selector(model, selector, mesh_dim)
            return selection, resolve_targets(model, selection.names, optimizer, master_params)

        def entries(found: tuple[Selection, list[Target]]) -> list[Entry]:
            _, targets = found
            return describe(targets, ("param", "master"), optimizer) + _owner_entries(targets)

        agreed = agree("replica sync: preflight", preflight, group, share=entries, unanimous=True)
        check_same("replica sync preflight", agreed.all)
        self.selection, self._targets = agreed.mine
        self._by_name = {t.name: t for t in self._targets}
        self._grad_buckets = (build_buckets(items_for(self._targets, [("grad", grads)], optimizer),
                                            bucket_bytes) if grads is not None else ())
        # the agreed layout: every later exchange is checked against it, never rebuilt from live tensors
        self._agreed: dict[tuple[str, str], Item] = {}
        self._remember([("param", "broadcast"), ("master", "broadcast")])
        self._states_fixed = False
        self._post_buckets = build_buckets(self._post_items(self.params, None), bucket_bytes)
        self._stepped = self._due = self._grads_done = False
        self._handle: HookHandle | None = None
        log.info("replica sync: %d parameters over %d rank(s), %d collectives per synced step",
                 len(self._targets), self.world, self.plan().collectives_per_step)

    # --- what moves ---------------------------------------------------------------------------
    def _remember(self, wanted: list[tuple[str, Op]]) -> None:
        """Record the layout of these kinds as it is now (after the ranks agreed on it)."""
        for item in items_for(self._targets, wanted, self.optimizer, missing_ok=True):
            self._agreed[(item[3].name, item[3].kind)] = item

    def _post_items(self, op: Op | None, state_op: Op | None) -> list[Item]:
        """Items of the post-step phase, from the agreed layout: params/masters per ``op``, then
        the agreed optimizer states per ``state_op``."""
        items: list[Item] = []
        for t in self._targets:
            wanted: list[tuple[str, Op]] = []
            if op == "broadcast":
                wanted += [("param", "broadcast"), ("master", "broadcast")]
            elif op == "mean":  # average the master and re-derive the param, or the param alone
                wanted.append(("master", "mean") if t.master is not None else ("param", "mean"))
            if state_op is not None:
                wanted += [(k, state_op) for k in self.states]
            for kind, how in wanted:
                known = self._agreed.get((t.name, kind))
                if known is not None:  # absent on every rank otherwise
                    items.append((how, known[1], known[2], known[3]))
        return items

    def _ensure_states(self) -> None:
        """Agree once on which optimizer states exist (after the optimizer has stepped)."""
        if self._states_fixed or not self.states or self.optimizer is None:
            return
        per_rank = agree("replica sync: optimizer states",
                         lambda: describe(self._targets, self.states, self.optimizer), self.group).all
        check_same("replica sync: optimizer states", per_rank)
        for key in [k for k in self._agreed if k[1] in self.states]:
            del self._agreed[key]
        if self._stepped or any(e[5] for entries in per_rank for e in entries):
            self._remember([(k, "broadcast") for k in self.states])
            self._states_fixed = True  # else the optimizer has not stepped yet: try again next time
        self._post_buckets = build_buckets(self._post_items(self.params, self.states_op),
                                           self.bucket_bytes)

    # --- explicit calls -----------------------------------------------------------------------
    def sync_grads(self) -> None:
        """Sync grads now (call before grad clipping); the pre-step hook then skips them this step.

        After this call the grads count as synced until the next ``optimizer.step()`` completes, so
        in-place changes (clipping, unscaling) are never synced twice.

        Raises:
            ReplicaError: ``grads=None``.
            DistributedError: a rank failed during the exchange (raised on every rank).
        """
        if self.grads is None:
            raise ReplicaError("sync_grads() with grads=None: pass grads='sum', 'mean' or 'broadcast'")
        self.stats.grad_syncs += 1
        if is_distributed(self.group):
            run_buckets("replica sync: grads", self._grad_buckets, self._by_name, self.optimizer,
                        group=self.group, src=self.src, rank=self.rank, world=self.world,
                        stats=self.stats)
        self._grads_done = True  # clipping may rescale them in place: never sync them twice

    def sync_params(self) -> None:
        """Sync params, masters and optimizer states now, as the post-step hook does."""
        self.stats.param_syncs += 1
        if not is_distributed(self.group):
            return
        if self.states_op is not None:
            self._ensure_states()
        run_buckets("replica sync: params", self._post_buckets, self._by_name, self.optimizer,
                    group=self.group, src=self.src, rank=self.rank, world=self.world, stats=self.stats)
        if self.params == "mean":
            with torch.no_grad():
                for t in self._targets:
                    if t.master is not None:
                        local(t.param).copy_(local(t.master))

    def broadcast_now(self) -> None:
        """Broadcast params, masters and optimizer states from ``src`` (after init or checkpoint load).

        The optimizer-state layout is agreed again, since a checkpoint load replaces the states.
        """
        if not is_distributed(self.group):
            return
        self._states_fixed = False
        self._ensure_states()
        items = self._post_items("broadcast", "broadcast")
        run_buckets("replica sync: broadcast", build_buckets(items, self.bucket_bytes), self._by_name,
                    self.optimizer, group=self.group, src=self.src, rank=self.rank, world=self.world,
                    stats=self.stats)

    def plan(self) -> SyncPlan:
        """Tensors, bytes, buckets and collectives of a synced step (local, moves nothing)."""
        post, pending = self._post_buckets, ""
        if not self._states_fixed and self.states and self.states_op is not None:
            states = items_for(self._targets, [(k, self.states_op) for k in self.states],
                               self.optimizer, missing_ok=True)
            order = kind_order(("param", "master", *self.states))
            items = sorted(self._post_items(self.params, None) + states,
                           key=lambda it: (it[3].name, order[it[3].kind]))
            post = build_buckets(items, self.bucket_bytes)
            pending = ("optimizer states are counted as present on this rank now; their layout is "
                       "fixed at the first synced step")
        phases = (PhasePlan("grads", "before optimizer.step", self._grad_buckets),
                  PhasePlan("params", "after optimizer.step", post))
        return SyncPlan(phases, self.world, self.interval, pending)

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """The buckets of a synced step (grads, then params), as agreed so far."""
        return tuple(self._grad_buckets) + tuple(self._post_buckets)

    # --- hooks --------------------------------------------------------------------------------
    def attach(self) -> HookHandle:
        """Install the optimizer step hooks; return a handle whose ``remove()`` uninstalls them.

        Raises:
            ReplicaError: no optimizer was given, or the hooks are already attached.
        """
        if self.optimizer is None:
            raise ReplicaError("attach() needs the optimizer: ReplicaSync(model, optimizer, ...)")
        if self._handle is not None:
            raise ReplicaError("already attached; call remove() on the handle first")
        pre = self.optimizer.register_step_pre_hook(self._pre_step)
        post = self.optimizer.register_step_post_hook(self._post_step)
        self._handle = HookHandle((pre, post), self._detached)
        return self._handle

    def detach(self) -> None:
        """Remove the hooks installed by :meth:`attach` (no-op when not attached)."""
        if self._handle is not None:
            self._handle.remove()

    def _detached(self) -> None:
        self._handle = None

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.stats.steps += 1
        self._due = self.stats.steps % self.interval == 0
        if self._due and self.grads is not None and not self._grads_done:
            self.sync_grads()

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._stepped = True
        self._grads_done = False
        if self._due and (self.params is not None or (self.states and self.states_op is not None)):
            self.sync_params()

    def __repr__(self) -> str:
        return (f"ReplicaSync({len(self._targets)} params, world={self.world}, params={self.params!r}, "
                f"grads={self.grads!r}, states={self.states}, interval={self.interval})")
