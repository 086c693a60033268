"""Drift detection: are the TP replicas of params, masters and optimizer moments still identical?

Call sequence (every rank of the group calls :func:`detect_drift` together):

1. Every rank fingerprints its tensors (two position-weighted integer sums of the raw bits, on the
   tensor's device) and one gather carries the layout and fingerprints of all ranks.
2. For the tensors whose fingerprints differ, and only those, the exact max abs diff across ranks is
   computed with coalesced ``all_reduce`` MAX and MIN (one pair per communication dtype).
3. The report is the same on every rank, so ``on_drift="raise"`` raises on every rank together, and
   ``"repair"`` broadcasts the drifting names from ``src`` in coalesced buckets.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from .. import phases
from ..dist import agree, data_phase, group_rank, group_size, is_distributed, transport_errors, wait_for
from ..errors import ReplicaError
from ..layout import to_torch_dtype
from ..layout.dtypes import BITS
from .buckets import Item, Member
from .engine import SyncStats, build_buckets, run_buckets
from .preflight import GroupLike, resolve_group
from .replicated import (
    Entry,
    MasterParams,
    ReplicatedParam,
    check_same,
    describe,
    get_tensor,
    local,
    resolve_replicated,
)
from .report import DriftReport, DriftRow
from .select import SelectorLike, resolve_selector
from .sync import SYNC_BUCKET_BYTES

__all__ = ["DEFAULT_WHAT", "OnDrift", "detect_drift", "fingerprint", "DriftWatch", "watch_drift"]

log = logging.getLogger(__name__)

#: The kinds :func:`detect_drift` compares by default: the persistent state. Grads are transient and
#: may differ legitimately (``grads="broadcast"`` or no grad sync, the params repaired after the
#: step); compare them with ``what=(*DEFAULT_WHAT, "grad")``.
DEFAULT_WHAT: tuple[str, ...] = ("param", "master", "exp_avg", "exp_avg_sq")
OnDrift = Literal["warn", "raise", "repair"]

_CHUNK = 1 << 20  # bounds the position-weight temporaries


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums over the raw bits of ``t``: plain and position-weighted (wrapping arithmetic).

    Integer sums are exact and order-independent, so equal bits give equal fingerprints on any rank.

    Example:
        >>> a = torch.arange(17.0)
        >>> bool((fingerprint(a) == fingerprint(a.clone())).all())
        True
        >>> bool((fingerprint(a) == fingerprint(a.flip(0))).all())
        False
    """
    flat = t.detach().contiguous().view(-1)
    if flat.dtype == torch.bool or flat.dtype.itemsize not in BITS:
        flat = flat.view(torch.uint8)
    bits = flat.view(BITS[flat.dtype.itemsize])
    out = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), _CHUNK):
        x = bits[start : start + _CHUNK].to(torch.int64)
        w = torch.arange(start + 1, start + 1 + x.numel(), dtype=torch.int64, device=x.device)
        out[0] += x.sum()
        out[1] += (x * w).sum()
    return out


def _validate(what: Any, on_drift: Any, atol: Any, src: Any, world: int) -> None:
    problems = []
    if isinstance(what, str) or not what or not all(isinstance(k, str) for k in what):
        problems.append(f"what={what!r}: use a non-empty tuple of kinds like {DEFAULT_WHAT}")
    if on_drift not in (None, "warn", "raise", "repair"):
        problems.append(f"on_drift={on_drift!r}: use None, 'warn', 'raise' or 'repair'")
    if not isinstance(atol, (int, float)) or not atol >= 0:
        problems.append(f"atol={atol!r}: must be a number >= 0")
    if not isinstance(src, int) or not 0 <= src < world:
        problems.append(f"src={src!r}: must be a rank of the group, 0..{world - 1}")
    if problems:
        raise ReplicaError("invalid detect_drift arguments:\n  " + "\n  ".join(problems))


def _local_view(
    replicated: Sequence[ReplicatedParam], what: Sequence[str], optimizer: Any
) -> list[tuple[Entry, tuple[int, int] | None]]:
    entries = describe(replicated, what, optimizer)
    by_name = {rp.name: rp for rp in replicated}
    tensors = [get_tensor(by_name[e.name], e.kind, optimizer) if e.present else None for e in entries]
    fps: dict[int, tuple[int, int]] = {}
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t is not None:
            by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():  # one host transfer per device
        stacked = torch.stack([fingerprint(tensors[i]) for i in idx]).tolist()  # type: ignore[arg-type]
        fps.update({i: (a, b) for i, (a, b) in zip(idx, stacked)})
    return [(e, fps.get(i)) for i, e in enumerate(entries)]


def _reference(fps: Sequence[Any], present: Sequence[int], src: int) -> set[int]:
    """Ranks holding the reference value: the most common; ties go to ``src``, then the lowest rank."""
    counts = Counter(fps[r] for r in present)
    top = max(counts.values())
    tied = [fp for fp, c in counts.items() if c == top]
    pick = fps[src] if src in present and fps[src] in tied else next(fps[r] for r in present if fps[r] in tied)
    return {r for r in present if fps[r] == pick}


def _exact_diffs(
    indices: Sequence[int], agreed: Sequence[Entry], by_name: dict[str, ReplicatedParam], optimizer: Any, group: Any
) -> dict[int, float]:
    """Max over elements of (max over ranks - min over ranks), via coalesced all_reduce MAX and MIN."""
    groups: dict[tuple[str, torch.dtype], list[int]] = {}
    for i in indices:
        dt = to_torch_dtype(agreed[i].dtype)
        comm = torch.float64 if dt == torch.float64 or not dt.is_floating_point else torch.float32
        groups.setdefault((agreed[i].device, comm), []).append(i)
    out: dict[int, float] = {}
    with data_phase(phases.DRIFT_EXACT, group) as roll:
        for (device_type, comm), members in groups.items():
            local_ts = [get_tensor(by_name[agreed[i].name], agreed[i].kind, optimizer) for i in members]
            device = next((t.device for t in local_ts if t is not None), torch.device(device_type))
            numels = [math.prod(agreed[i].shape) for i in members]
            hi = _flat(local_ts, numels, -torch.inf, comm, device)
            lo = _flat(local_ts, numels, torch.inf, comm, device)
            with transport_errors():
                wait_for(dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group, async_op=True), roll)
                wait_for(dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group, async_op=True), roll)
            spans = (hi.double() - lo.double()).split(numels)
            for i, span in zip(members, spans):
                out[i] = float(span.max()) if span.numel() else 0.0
    return out


def _flat(
    tensors: Sequence[torch.Tensor | None], numels: Sequence[int], fill: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """One flat buffer of ``tensors``; a missing one is ``fill`` (it must not win the MAX or MIN)."""
    return torch.cat(
        [
            t.detach().reshape(-1).to(device, dtype)
            if t is not None
            else torch.full((n,), fill, dtype=dtype, device=device)
            for t, n in zip(tensors, numels)
        ]
    )


def _analyse(
    per_rank: Sequence[Sequence[tuple[Entry, Any]]], src: int
) -> tuple[list[Entry], list[tuple[int, tuple[int, ...], tuple[int, ...]]], int]:
    """Agreed entries, (index, differing ranks, missing ranks) per drifting entry, tensors checked."""
    world = len(per_rank)
    agreed: list[Entry] = []
    drifting = []
    checked = 0
    for i, (entry, _) in enumerate(per_rank[0]):
        fps = [per_rank[r][i][1] for r in range(world)]
        present = [r for r in range(world) if fps[r] is not None]
        agreed.append(per_rank[present[0]][i][0] if present else entry)
        if not present:
            continue
        checked += 1
        missing = tuple(r for r in range(world) if fps[r] is None)
        ref = _reference(fps, present, src)
        differing = tuple(r for r in present if r not in ref)
        if differing or missing:
            drifting.append((i, differing, missing))
    return agreed, drifting, checked


def _repair(
    rows: Sequence[DriftRow],
    what: Sequence[str],
    agreed: Sequence[Entry],
    per_rank: Sequence[Sequence[tuple[Entry, Any]]],
    by_name: dict[str, ReplicatedParam],
    optimizer: Any,
    group: Any,
    src: int,
) -> None:
    """Broadcast every kind in ``what`` of each drifting name from ``src`` (coalesced)."""
    names = {r.name for r in rows}
    items: list[Item] = []
    for i, entry in enumerate(agreed):
        name, kind = entry.name, entry.kind
        held = [per_rank[r][i][1] is not None for r in range(len(per_rank))]
        # grads travel with presence flags; a state missing on some rank cannot be created here
        if name not in names or kind not in what or not (all(held) or (kind == "grad" and any(held))):
            continue
        t = get_tensor(by_name[name], kind, optimizer)
        device = str(t.device) if t is not None else str(local(by_name[name].owner).device)
        items.append(Item("broadcast", device, to_torch_dtype(entry.dtype), Member(name, kind, entry.shape)))
    run_buckets(
        "drift repair",
        build_buckets(items, SYNC_BUCKET_BYTES),
        by_name,
        optimizer,
        group=group,
        src=src,
        rank=group_rank(group),
        world=group_size(group),
        stats=SyncStats(),
    )


def _warn_unknown_states(what: Sequence[str], per_rank: Sequence[Sequence[tuple[Entry, Any]]], optimizer: Any) -> None:
    """A state key that no tensor has, once the optimizer has state, is likely a typo."""
    if optimizer is None or not optimizer.state:
        return
    seen = {e.kind for view in per_rank for e, fp in view if fp is not None}
    unknown = [k for k in what if k not in ("param", "master", "grad") and k not in seen]
    if unknown:
        log.warning(
            "drift check: no selected tensor has optimizer state %s (state keys look like %s)",
            unknown,
            sorted({k for st in optimizer.state.values() for k in st})[:8],
        )


def detect_drift(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    group: GroupLike = None,
    selector: SelectorLike = None,
    what: Sequence[str] = DEFAULT_WHAT,
    master_params: MasterParams = "auto",
    src: int = 0,
    on_drift: OnDrift | None = None,
    atol: float = 0.0,
    mesh_dim: int | str | None = None,
) -> DriftReport:
    """Compare the replicated tensors across the group; report each one that differs.

    Args:
        model: the module on this rank.
        optimizer: for grads of masters and optimizer states (``optimizer.state[owner][kind]``).
        group: the TP process group or device mesh, as for :class:`~shardsync.replicas.ReplicaSync`
            (None: the default group). With one rank nothing is compared.
        selector: as for :class:`~shardsync.replicas.ReplicaSync`.
        what: kinds to compare: ``param``, ``master``, ``grad`` and optimizer state keys. The
            default, :data:`DEFAULT_WHAT`, is the persistent state (no grads).
        master_params: as for :class:`~shardsync.replicas.ReplicaSync`.
        src: the rank a repair broadcasts from, and the reference on a tie.
        on_drift: None (just report), ``"warn"`` (log a warning), ``"raise"`` (DriftError on every
            rank) or ``"repair"`` (broadcast the drifting names from ``src``), for rows beyond ``atol``.
        atol: tolerance for ``on_drift``.
        mesh_dim: TP mesh axis of multi-dim device meshes (of ``group``, and for the default selection).

    Returns:
        a :class:`DriftReport`, the same on every rank.

    Raises:
        ReplicaError: bad arguments (on every rank together).
        LayoutError: the ranks selected different tensors, or shapes/dtypes differ.
        DriftError: ``on_drift="raise"`` and a tensor differs beyond ``atol``.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        >>> report = detect_drift(model)  # on each rank: group=tp_group
        >>> print(report)
        no drift: 3 tensors identical on 1 rank(s)
        >>> report.raise_if(atol=0.0)
    """
    group = resolve_group(group, mesh_dim)
    world = group_size(group)

    def local_replicated() -> list[ReplicatedParam]:
        _validate(what, on_drift, atol, src, world)
        selection = resolve_selector(model, selector, mesh_dim)
        return resolve_replicated(model, selection.names, optimizer, master_params)

    views = agree(
        phases.DRIFT_FINGERPRINTS,
        local_replicated,
        group,
        share=lambda found: _local_view(found, tuple(what), optimizer),
        unanimous=True,
    )
    per_rank = views.all
    check_same("drift check", [[e for e, _ in view] for view in per_rank], presence=False)
    agreed, drifting, checked = _analyse(per_rank, src)
    _warn_unknown_states(what, per_rank, optimizer)
    by_name = {rp.name: rp for rp in views.mine}
    exact_for = [i for i, differing, _ in drifting if differing]
    diffs = _exact_diffs(exact_for, agreed, by_name, optimizer, group) if exact_for else {}
    rows = tuple(
        DriftRow(
            agreed[i].name, agreed[i].kind, agreed[i].shape, agreed[i].dtype, differing, diffs.get(i, 0.0), missing
        )
        for i, differing, missing in drifting
    )
    report = DriftReport(rows, checked, world)
    bad = report.exceeding(atol)
    if bad and on_drift == "warn":
        log.warning("replica drift:\n%s", report.table(bad))
    elif bad and on_drift == "raise":
        report.raise_if(atol)
    elif bad and on_drift == "repair" and is_distributed(group):
        _repair(bad, tuple(what), agreed, per_rank, by_name, optimizer, group, src)
        log.warning("replica drift repaired from rank %d:\n%s", src, report.table(bad))
        report = DriftReport(rows, checked, world, repaired=True)
    return report


class DriftWatch:
    """Runs :func:`detect_drift` from an optimizer post-step hook every ``every`` steps.

    Attributes:
        last: the latest report (None before the first check).
        checks: how many checks ran.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, every: int, kwargs: dict[str, Any]) -> None:
        self.model, self.optimizer, self.every, self.kwargs = model, optimizer, every, kwargs
        self.last: DriftReport | None = None
        self.checks = 0
        self._steps = 0
        self._hook = optimizer.register_step_post_hook(self._post_step)

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._steps += 1
        if self._steps % self.every == 0:
            self.checks += 1
            self.last = detect_drift(self.model, self.optimizer, **self.kwargs)

    def remove(self) -> None:
        """Stop checking."""
        self._hook.remove()


def watch_drift(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, every: int = 100, on_drift: OnDrift = "warn", **kwargs: Any
) -> DriftWatch:
    """Check drift every ``every`` optimizer steps (after the step) with :func:`detect_drift`.

    Args:
        model: the module; optimizer: the optimizer whose steps are counted.
        every: steps between checks.
        on_drift: what to do with drift (``"warn"``, ``"raise"`` or ``"repair"``).
        **kwargs: more :func:`detect_drift` arguments (group, selector, what, atol, ...).

    Returns:
        a :class:`DriftWatch`; call ``remove()`` to stop.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        >>> optimizer = torch.optim.SGD(model.parameters())
        >>> watch = watch_drift(model, optimizer, every=500, on_drift="repair")
        >>> watch.remove()
    """
    if not isinstance(every, int) or every < 1:
        raise ReplicaError(f"every={every!r}: must be an int >= 1")
    if on_drift not in ("warn", "raise", "repair"):
        raise ReplicaError(f"on_drift={on_drift!r}: use 'warn', 'raise' or 'repair'")
    return DriftWatch(model, optimizer, every, {**kwargs, "on_drift": on_drift})
