"""The transport of ``multicast`` plans (load, reshard): point to point where one rank receives a
box, one broadcast among the sender and the receivers where several do.

A broadcast among a subset of the group runs on a process group of just those ranks. Those are
created when the first step starts (inside the executor's data phase, so a failure there fails
every rank), by every rank in plan order, as ``new_group`` requires: the plan's group must therefore
be the whole world (``load``/``reshard`` plan point to point otherwise). Gloo hangs when overlapping
subgroups are created with ``use_local_synchronization``, so that is not used. Subgroups are cached
per set of ranks: a loop that reshards the same layouts every step creates them once.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch.distributed as dist

from ..dist import GroupRanks
from ..planning.model import Packet, Plan, Step
from .stats import Stats
from .transport import P2PTransport, PacketIO, Pending, Plain, Posted, broadcast_packet

__all__ = ["MulticastTransport", "multicast_members", "release_subgroups"]

#: Per default group (weakly: a group made after ``destroy_process_group`` starts afresh): subgroups
#: by their global ranks.
_subgroups: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], Any]] = weakref.WeakKeyDictionary()


def multicast_members(plan: Plan, packet: Packet) -> tuple[int, ...]:
    """Group ranks taking part in a multicast packet: its sender and its reads' receivers, sorted.

    Example:
        >>> members = multicast_members(plan, plan.steps[0].packets[0])   # doctest: +SKIP
    """
    return tuple(sorted({packet.src, *plan.reads[packet.reads[0]].receivers}))


def _subgroup(ranks: GroupRanks, members: tuple[int, ...]) -> Any:
    if len(members) == ranks.world:
        return ranks.group
    global_ranks = tuple(ranks.to_global(r) for r in members)
    made = _subgroups.setdefault(dist.distributed_c10d._get_default_group(), {})
    if global_ranks not in made:  # every rank of the world calls new_group, members or not
        made[global_ranks] = dist.new_group(list(global_ranks))
    return made[global_ranks]


def release_subgroups() -> None:
    """Forget the subgroups made for multicast plans (a later plan makes them again).

    Example:
        >>> release_subgroups()
    """
    _subgroups.clear()


class MulticastTransport(Plain):
    """``p2p`` steps as batched point-to-point messages; ``multicast`` steps as one async broadcast
    per packet on the subgroup of its members (ranks outside it skip the packet).

    Args:
        ranks: the group and this rank's place in it.
        plan: the plan to run; its subgroups are created when the first step starts (collective over
            the whole world: the group must span it).

    Example:
        >>> transport = MulticastTransport(GroupRanks.of(None), plan)   # doctest: +SKIP
    """

    def __init__(self, ranks: GroupRanks, plan: Plan) -> None:
        self.ranks, self.plan, self.p2p = ranks, plan, P2PTransport(ranks)
        self.groups: dict[tuple[int, ...], Any] | None = None

    def _create_groups(self) -> dict[tuple[int, ...], Any]:
        groups: dict[tuple[int, ...], Any] = {}
        for step in self.plan.steps:
            for pk in step.packets if step.kind == "multicast" else ():
                members = multicast_members(self.plan, pk)
                if members not in groups:
                    groups[members] = _subgroup(self.ranks, members)
        return groups

    def start(self, step: Step, io: PacketIO, stats: Stats) -> Pending:
        if self.groups is None:
            self.groups = self._create_groups()
        if step.kind != "multicast":
            return self.p2p.start(step, io, stats)
        posted, me = Posted(watched=True), self.ranks.rank
        for pk in step.packets:
            members = multicast_members(self.plan, pk)
            if me not in members:
                continue
            broadcast_packet(pk, io, stats, posted, self.ranks, self.groups[members])
        return posted
