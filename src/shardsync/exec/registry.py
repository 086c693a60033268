"""The transport of each strategy: one table, keyed like :data:`shardsync.planning.STRATEGIES`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from ..dist import GroupRanks
from ..errors import PlanError
from ..planning import STRATEGIES, Plan
from ..sources import Source
from .mesh import MeshGroups, MeshTransport
from .multicast import MulticastTransport
from .push_schedule import Pushing
from .shm import ShmTransport
from .shm_plan import HostChoice, pushes, shm_costs, use_shm
from .transport import BroadcastTransport, LocalTransport, P2PTransport, Transport

__all__ = ["TRANSPORTS", "transport_for", "Chosen", "choose_transport", "run_device"]


def _mesh(ranks: GroupRanks, plan: Plan, groups: MeshGroups | None) -> Transport:
    if groups is None or plan.topology is None:
        raise PlanError("strategy 'mesh2d' needs mesh=(horizontal group, vertical group) or a 2-D DeviceMesh")
    return MeshTransport(ranks, groups, plan.topology)


#: strategy name -> (this rank's group, the plan, the mesh groups or None) -> its transport.
TRANSPORTS: dict[str, Callable[[GroupRanks, Plan, MeshGroups | None], Transport]] = {
    "broadcast": lambda ranks, plan, groups: BroadcastTransport(ranks),
    "bucketed": lambda ranks, plan, groups: BroadcastTransport(ranks),
    "mesh2d": _mesh,
    "p2p": lambda ranks, plan, groups: P2PTransport(ranks),
    "multicast": lambda ranks, plan, groups: MulticastTransport(ranks, plan),
}
if set(TRANSPORTS) != set(STRATEGIES):
    raise ImportError(f"TRANSPORTS {sorted(TRANSPORTS)} must move every strategy {sorted(STRATEGIES)}")


def transport_for(plan: Plan, ranks: GroupRanks | None, groups: MeshGroups | None) -> Transport:
    """The transport that runs ``plan`` on this rank (a single process: one that moves nothing).

    Example:
        >>> import torch, shardsync
        >>> plan = shardsync.plan({"w": torch.zeros(3)})
        >>> type(transport_for(plan, None, None)).__name__
        'LocalTransport'
    """
    if ranks is None:
        return LocalTransport()
    return TRANSPORTS[plan.strategy](ranks, plan, groups)


def run_device(backend: str, source: Source | None) -> torch.device:
    """Where a rank's targets and buffers live: its GPU under NCCL, else where its source is.

    Example:
        >>> run_device("gloo", None)
        device(type='cpu')
    """
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return source.device() if source is not None else torch.device("cpu")


class Chosen(NamedTuple):
    """The transport a plan runs on, the plan with that transport's costs, and what to call it."""

    transport: Transport
    plan: Plan
    kind: str  # "local", "shm", or the backend's name


def choose_transport(
    plan: Plan,
    ranks: GroupRanks | None,
    groups: MeshGroups | None,
    hosts: Sequence[HostChoice],
    backend: str,
    budget: int | None = None,
    fresh: bool = True,
) -> Chosen:
    """Shared memory where every rank is on one host and ``transport=`` allows it (see
    :func:`~shardsync.exec.shm_plan.use_shm`), else the strategy's transport on the group's ``backend``.

    ``hosts`` is every rank's host (with the device type of its targets) and choice, gathered with the
    layout: every rank decides the same.
    ``budget`` is the stream's ``memory_budget`` (segments count against it).
    ``fresh``: the destination gives targets fresh memory (not memory of its own): through shared
    memory, senders then write pieces of large targets straight into them
    (:func:`~shardsync.exec.shm_plan.pushes`).

    Example:
        >>> import torch, shardsync
        >>> plan = shardsync.plan({"w": torch.zeros(3)})
        >>> choose_transport(plan, None, None, [], "none").kind
        'local'
    """
    if ranks is None:
        return Chosen(LocalTransport(), plan, "local")
    infos = [h for h, _ in hosts]
    pushing = pushes(plan, fresh, infos, budget)
    if use_shm(plan, hosts, budget, pushing):
        shm_plan = _with_shm_costs(plan, pushing)
        return Chosen(ShmTransport(ranks, shm_plan, infos, pushing), shm_plan, "shm")
    return Chosen(transport_for(plan, ranks, groups), plan, backend)


_shm_plans: dict[tuple[int, Pushing], tuple[Plan, Plan]] = {}  # (id(plan), pushing) -> (plan, with shm costs)


def release_shm_plans() -> None:
    """Forget the plans with shared-memory costs kept for cached plans."""
    _shm_plans.clear()


def _with_shm_costs(plan: Plan, pushing: Pushing) -> Plan:
    # The same object for the same (cached) plan: a loop that reuses its plan sees one plan.
    key = (id(plan), pushing)
    hit = _shm_plans.get(key)
    if hit is not None and hit[0] is plan:
        return hit[1]
    if len(_shm_plans) >= 8:
        del _shm_plans[next(iter(_shm_plans))]
    shm_plan = dataclasses.replace(plan, costs=shm_costs(plan, pushing))
    _shm_plans[key] = (plan, shm_plan)
    return shm_plan
