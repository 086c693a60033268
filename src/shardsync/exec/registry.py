"""The transport of each strategy: one table, keyed like :data:`shardsync.planning.STRATEGIES`."""

from __future__ import annotations

from collections.abc import Callable

from ..dist import GroupRanks
from ..errors import PlanError
from ..planning import STRATEGIES, Plan
from .mesh import MeshGroups, MeshTransport
from .multicast import MulticastTransport
from .transport import BroadcastTransport, LocalTransport, P2PTransport, Transport

__all__ = ["TRANSPORTS", "transport_for"]


def _mesh(ranks: GroupRanks, plan: Plan, groups: MeshGroups | None) -> Transport:
    if groups is None or plan.topology is None:
        raise PlanError("strategy 'mesh2d' needs mesh=(horizontal group, vertical group) or a 2-D "
                        "DeviceMesh")
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
