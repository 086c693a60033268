"""ReplicaSync: keep tensor-parallel replicated parameters identical across the group.

Call sequence (every rank of ``group`` makes the same calls, in the same order)::

    sync = ReplicaSync(model, optimizer, group)   # preflight: one gather of the layout
    sync.broadcast_now()                           # after init or checkpoint load
    handle = sync.attach()                         # optimizer hooks, every `interval` steps:
        # pre-step:  grads (mean / sum / broadcast), unless sync_grads() already ran this step
        # post-step: params + fp32 masters + optimizer states (broadcast / mean)
    sync.sync_grads()                              # optional, before grad clipping
    handle.remove()

Each sync first checks whether the optimizer's parameter groups or ``_master_weights`` changed since
the ranks agreed, and that every rank's did the same (one ``all_reduce`` of two integers); if they
changed the ranks agree again (one more gather), so masters added after ``attach()`` have
their grads and states synced. A group added on some ranks only is an error on every rank.

Three operations are kept apart (see the design notes): summing partial grads (correctness, every
step), averaging grads of redundant replicas (a safety net), and repairing params, masters and moments
(broadcast, exact and idempotent, or mean). A parameter and its master stay consistent: broadcast moves
both; mean averages the master in fp32 and re-derives the parameter (``param.copy_(master)``).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .. import phases
from ..dist import agree, group_rank, group_size, is_distributed
from ..errors import ReplicaError
from ..sizes import parse_size
from .buckets import Bucket, Item, Op, PhasePlan, SyncPlan
from .engine import SyncStats, build_buckets, items_for, run_buckets
from .preflight import (
    DEFAULT_STATES,
    GradMode,
    GroupLike,
    SyncMode,
    check_signatures,
    optimizer_signature,
    resolve_group,
    validate_sync_args,
)
from .replicated import (
    MasterParams,
    ReplicatedParam,
    check_requires_grad,
    check_same,
    describe,
    kind_order,
    layout_entries,
    local,
    resolve_replicated,
)
from .select import Selection, SelectorLike, resolve_selector

__all__ = ["ReplicaSync", "HookHandle", "SyncMode", "GradMode", "SYNC_BUCKET_BYTES", "DEFAULT_STATES"]

log = logging.getLogger(__name__)

#: Bucket size limit of replica sync, in communication bytes.
#: Most bytes per bucket of a replica-sync collective (not the streaming bucket cap,
#: :data:`shardsync.planning.SYNC_BUCKET_BYTES`).
SYNC_BUCKET_BYTES = 64 << 20
#: The attached ReplicaSync of each model and optimizer: a second one would sync everything twice
#: (``grads="sum"`` would sum the sums).
#: Weak both ways: the optimizer's hooks keep an attached ReplicaSync alive, and nothing else.
_ATTACHED: weakref.WeakKeyDictionary[Any, weakref.ref[ReplicaSync]] = weakref.WeakKeyDictionary()


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


class ReplicaSync:
    """Coalesced sync of TP-replicated params, fp32 masters, grads and optimizer states.

    Constructing it is collective: every rank of ``group`` must construct it, and each rank's
    selection (names, shapes, dtypes, ``requires_grad``) is checked against the others' before
    anything moves. Parameters or masters added to the optimizer later (``add_param_group``, Paddle's
    ``_master_weights`` created at the first step) are taken up at the next sync: the ranks agree
    again, and grads and states are then the masters'. Every rank must add them at the same step.

    Args:
        model: the module on this rank.
        optimizer: the optimizer that steps the model (or its masters); needed for ``attach()`` and
            optimizer states.
        group: the TP process group, or a device mesh: a 1-D one (``mesh["tp"]``), or a multi-dim one
            whose TP mesh axis is ``mesh_dim``; None is the default group. With one rank nothing moves.
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
        bucket_bytes: bucket size limit (in communication bytes): bytes or a size such as ``"4MiB"``.
        mesh_dim: TP mesh axis (name or index) of multi-dim device meshes: of ``group``, and of the
            DTensors' meshes for the default selection; by default the dim named ``"tp"``.

    Raises:
        ReplicaError: bad arguments or masters, or a parameter frozen (``requires_grad=False``) on
            some ranks only (on every rank together).
        LayoutError: the ranks selected different tensors (names, shapes or dtypes differ).

    Example:
        One process (no group): everything is checked, nothing moves.

        >>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> sync = ReplicaSync(model, optimizer, grads="mean")  # on each rank: group=tp_group
        >>> sync.broadcast_now()
        >>> handle = sync.attach()
        >>> sync.selection.names
        ('0.bias', '1.bias', '1.weight')
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        group: GroupLike = None,
        *,
        selector: SelectorLike = None,
        params: SyncMode | None = "broadcast",
        src: int = 0,
        master_params: MasterParams = "auto",
        grads: GradMode | None = None,
        optimizer_states: Sequence[str] = DEFAULT_STATES,
        states_mode: SyncMode | None = None,
        interval: int = 1,
        bucket_bytes: int | str = SYNC_BUCKET_BYTES,
        mesh_dim: int | str | None = None,
    ) -> None:
        group = resolve_group(group, mesh_dim)
        self.model, self.optimizer, self.group = model, optimizer, group
        self.rank, self.world = group_rank(group), group_size(group)
        self.params, self.grads, self.src, self.interval = params, grads, src, interval
        self.states = tuple(optimizer_states) if not isinstance(optimizer_states, str) else ()
        self.states_op: SyncMode | None = states_mode if states_mode is not None else params
        self.bucket_bytes = 0  # set once the ranks agreed that it is a size
        self.stats = SyncStats()
        self._master_params = master_params
        self._signature = optimizer_signature(optimizer)

        def preflight() -> tuple[Selection, list[ReplicatedParam]]:
            validate_sync_args(params, grads, states_mode, optimizer_states, src, self.world, interval, bucket_bytes)
            selection = resolve_selector(model, selector, mesh_dim)
            return selection, resolve_replicated(model, selection.names, optimizer, master_params)

        agreed = agree(
            phases.SYNC_PREFLIGHT,
            preflight,
            group,
            share=lambda found: layout_entries(found[1], optimizer),
            unanimous=True,
        )
        check_same("replica sync preflight", agreed.all)
        check_requires_grad("replica sync preflight", agreed.all)
        self.bucket_bytes = parse_size(bucket_bytes)
        self.selection: Selection = agreed.mine[0]
        self._use(agreed.mine[1])
        self._stepped = self._due = self._grads_done = False
        self._handle: HookHandle | None = None
        log.info(
            "replica sync: %d parameters over %d rank(s), %d collectives per synced step",
            len(self._replicated),
            self.world,
            self.plan().collectives_per_step,
        )

    # --- what moves ---------------------------------------------------------------------------
    def _use(self, replicated: list[ReplicatedParam]) -> None:
        """Sync these parameters (as the ranks agreed on them) from now on."""
        self._replicated = replicated
        self._by_name = {rp.name: rp for rp in replicated}
        self._grad_buckets = (
            build_buckets(items_for(replicated, [("grad", self.grads)], self.optimizer), self.bucket_bytes)
            if self.grads is not None
            else ()
        )
        # the agreed layout: every later exchange is checked against it, never rebuilt from live tensors
        self._agreed: dict[tuple[str, str], Item] = {}
        self._remember([("param", "broadcast"), ("master", "broadcast")])
        self._states_fixed = False
        self._post_buckets = build_buckets(self._post_items(self.params, None), self.bucket_bytes)

    def _refresh(self) -> None:
        """Agree again on what is synced when the optimizer's parameters changed since the ranks
        last agreed (masters added, Paddle's masters created at the first step). Every rank must
        have made the same change: checked first, with one small collective."""
        signature = optimizer_signature(self.optimizer)
        check_signatures(signature, self.group)
        if signature == self._signature:
            return

        def rescan() -> list[ReplicatedParam]:
            return resolve_replicated(self.model, self.selection.names, self.optimizer, self._master_params)

        agreed = agree(
            phases.SYNC_OPTIMIZER_CHANGED,
            rescan,
            self.group,
            share=lambda found: layout_entries(found, self.optimizer),
            unanimous=True,
        )
        check_same("replica sync: optimizer changed", agreed.all)
        check_requires_grad("replica sync: optimizer changed", agreed.all)
        self._signature = signature
        self._use(agreed.mine)
        log.info(
            "replica sync: the optimizer's parameters changed; the optimizer steps %d master(s) "
            "of replicated parameters",
            sum(rp.owner is rp.master for rp in self._replicated),
        )

    def _remember(self, wanted: list[tuple[str, Op]]) -> None:
        """Record the layout of these kinds as it is now (after the ranks agreed on it)."""
        for item in items_for(self._replicated, wanted, self.optimizer, missing_ok=True):
            self._agreed[(item.member.name, item.member.kind)] = item

    def _post_items(self, op: Op | None, state_op: Op | None) -> list[Item]:
        """Items of the post-step phase, from the agreed layout: params/masters per ``op``, then
        the agreed optimizer states per ``state_op``."""
        items: list[Item] = []
        for rp in self._replicated:
            wanted: list[tuple[str, Op]] = []
            if op == "broadcast":
                wanted += [("param", "broadcast"), ("master", "broadcast")]
            elif op == "mean":  # average the master and re-derive the param, or the param alone
                wanted.append(("master", "mean") if rp.master is not None else ("param", "mean"))
            if state_op is not None:
                wanted += [(k, state_op) for k in self.states]
            for kind, how in wanted:
                known = self._agreed.get((rp.name, kind))
                if known is not None:  # absent on every rank otherwise
                    items.append(known._replace(op=how))
        return items

    def _ensure_states(self) -> None:
        """Agree once on which optimizer states exist (after the optimizer has stepped)."""
        if self._states_fixed or not self.states or self.optimizer is None:
            return
        per_rank = agree(
            phases.SYNC_OPTIMIZER_STATES, lambda: describe(self._replicated, self.states, self.optimizer), self.group
        ).all
        check_same("replica sync: optimizer states", per_rank)
        for key in [k for k in self._agreed if k[1] in self.states]:
            del self._agreed[key]
        if self._stepped or any(e.present for entries in per_rank for e in entries):
            self._remember([(k, "broadcast") for k in self.states])
            self._states_fixed = True  # else the optimizer has not stepped yet: try again next time
        self._post_buckets = build_buckets(self._post_items(self.params, self.states_op), self.bucket_bytes)

    # --- explicit calls -----------------------------------------------------------------------
    def sync_grads(self) -> None:
        """Sync grads now (call before grad clipping); the pre-step hook then skips them this step.

        After this call the grads count as synced until the next ``optimizer.step()`` completes, so
        in-place changes (clipping, unscaling) are never synced twice.

        Raises:
            ReplicaError: ``grads=None``.
            LayoutError: the optimizer changed and the ranks now step different tensors.
            DistributedError: a rank failed during the exchange (raised on every rank).
        """
        if self.grads is None:
            raise ReplicaError("sync_grads() with grads=None: pass grads='sum', 'mean' or 'broadcast'")
        self._refresh()
        self.stats.grad_syncs += 1
        if is_distributed(self.group):
            self._exchange("replica sync: grads", self._grad_buckets)
        self._grads_done = True  # clipping may rescale them in place: never sync them twice

    def sync_params(self) -> None:
        """Sync params, masters and optimizer states now, as the post-step hook does.

        Raises:
            LayoutError: the optimizer changed and the ranks now step different tensors, or hold
                different optimizer states.
            DistributedError: a rank failed during the exchange (raised on every rank).
        """
        self._refresh()
        self.stats.param_syncs += 1
        if not is_distributed(self.group):
            return
        if self.states_op is not None:
            self._ensure_states()
        self._exchange("replica sync: params", self._post_buckets)
        if self.params == "mean":
            with torch.no_grad():
                for rp in self._replicated:
                    if rp.master is not None:
                        local(rp.param).copy_(local(rp.master))

    def broadcast_now(self) -> None:
        """Broadcast params, masters and optimizer states from ``src`` (after init or checkpoint load).

        The optimizer-state layout is agreed again, since a checkpoint load replaces the states.
        """
        self._refresh()
        if not is_distributed(self.group):
            return
        self._states_fixed = False
        self._ensure_states()
        items = self._post_items("broadcast", "broadcast")
        self._exchange("replica sync: broadcast", build_buckets(items, self.bucket_bytes))

    def _exchange(self, what: str, buckets: Sequence[Bucket]) -> None:
        """Run ``buckets``' collectives on this group (``what`` names them in errors)."""
        run_buckets(
            what,
            buckets,
            self._by_name,
            self.optimizer,
            group=self.group,
            src=self.src,
            rank=self.rank,
            world=self.world,
            stats=self.stats,
        )

    def plan(self) -> SyncPlan:
        """Tensors, bytes, buckets and collectives of a synced step (local, moves nothing)."""
        post, pending = self._post_buckets, ""
        if not self._states_fixed and self.states and self.states_op is not None:
            states = items_for(
                self._replicated, [(k, self.states_op) for k in self.states], self.optimizer, missing_ok=True
            )
            order = kind_order(("param", "master", *self.states))
            items = sorted(
                self._post_items(self.params, None) + states, key=lambda it: (it.member.name, order[it.member.kind])
            )
            post = build_buckets(items, self.bucket_bytes)
            pending = (
                "optimizer states are counted as present on this rank now; their layout is "
                "fixed at the first synced step"
            )
        phases = (
            PhasePlan("grads", "before optimizer.step", self._grad_buckets),
            PhasePlan("params", "after optimizer.step", post),
        )
        return SyncPlan(phases, self.world, self.interval, pending)

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """The buckets of a synced step (grads, then params), as agreed so far."""
        return tuple(self._grad_buckets) + tuple(self._post_buckets)

    # --- hooks --------------------------------------------------------------------------------
    def attach(self) -> HookHandle:
        """Install the optimizer step hooks; return a handle whose ``remove()`` uninstalls them.

        Raises:
            ReplicaError: no optimizer was given, the hooks are already attached, or another
                ReplicaSync is attached to the same model or optimizer (it would sync everything
                twice: summed grads summed again).
        """
        if self.optimizer is None:
            raise ReplicaError("attach() needs the optimizer: ReplicaSync(model, optimizer, ...)")
        if self._handle is not None:
            raise ReplicaError("already attached; call remove() on the handle first")
        for what, obj in (("optimizer", self.optimizer), ("model", self.model)):
            ref = _ATTACHED.get(obj)
            other = ref() if ref is not None else None
            if other is not None:
                raise ReplicaError(
                    f"another ReplicaSync ({other!r}) is attached to this {what}; two would "
                    "sync it twice (grads='sum' would double the grads): call detach() on "
                    "the other one first, or keep one ReplicaSync per model and optimizer"
                )
        pre = self.optimizer.register_step_pre_hook(self._pre_step)
        post = self.optimizer.register_step_post_hook(self._post_step)
        self._handle = HookHandle((pre, post), self._detached)
        _ATTACHED[self.optimizer] = _ATTACHED[self.model] = weakref.ref(self)
        return self._handle

    def detach(self) -> None:
        """Remove the hooks installed by :meth:`attach` (no-op when not attached)."""
        if self._handle is not None:
            self._handle.remove()

    def _detached(self) -> None:
        self._handle = None
        for obj in (self.optimizer, self.model):
            ref = _ATTACHED.get(obj)
            if ref is not None and ref() is self:
                del _ATTACHED[obj]

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
        return (
            f"ReplicaSync({len(self._replicated)} params, world={self.world}, params={self.params!r}, "
            f"grads={self.grads!r}, states={self.states}, interval={self.interval})"
        )
