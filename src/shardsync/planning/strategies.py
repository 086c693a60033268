"""The strategies a plan can be built for: one table, from which names, checks and messages derive.

A strategy is a schedule (moved reads -> steps of packets) plus two facts the option checks need:
whether it delivers every target to every rank, and whether it needs a 2-D mesh. The step kinds it
produces are costed by :data:`shardsync.planning.costs.STEP_COSTS` and moved by the transport that
:data:`shardsync.exec.registry.TRANSPORTS` registers under the same name. Adding a strategy: its name
in :data:`~shardsync.planning.model.Strategy`, an entry here with its schedule function, and its
transport there (each table checks at import that it covers the others).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, get_args

from .destinations import schedule_multicast
from .mesh import Topology, schedule_mesh
from .model import Read, Strategy, StrategyChoice
from .schedule import RawStep, schedule_broadcast, schedule_bucketed, schedule_p2p

__all__ = ["ScheduleArgs", "StrategySpec", "STRATEGIES", "STRATEGY_CHOICES", "strategy_problems"]


class ScheduleArgs(NamedTuple):
    """What a schedule may use besides the reads.

    Attributes:
        cap: most bytes per packet (bucket cap).
        solo: reads of at least this many bytes travel alone (under ``"auto"``), or None.
        topology: mesh rows of group ranks, or None.
        mesh_threshold: most bytes a mesh batch may grow every rank's memory by.

    Example:
        >>> ScheduleArgs(cap=1024, solo=None, topology=None, mesh_threshold=8 << 30).cap
        1024
    """

    cap: int
    solo: int | None
    topology: Topology | None
    mesh_threshold: int


#: reads, args -> (raw steps, step index of each moved read)
Schedule = Callable[[Sequence[Read], ScheduleArgs], tuple[list[RawStep], dict[int, int]]]


@dataclass(frozen=True, slots=True)
class StrategySpec:
    """One strategy: how it schedules, and what it needs from the options.

    Attributes:
        name: the name callers pass as ``strategy=``.
        schedule: builds the steps.
        every_rank: it delivers every target to every rank, so ``consumers`` cannot be used with it.
        needs_mesh: it needs ``mesh=`` (a topology).
        summary: one line for docs and error messages.

    Example:
        >>> STRATEGIES["p2p"].every_rank
        False
    """

    name: Strategy
    schedule: Schedule
    every_rank: bool
    needs_mesh: bool
    summary: str


def _mesh(reads: Sequence[Read], a: ScheduleArgs) -> tuple[list[RawStep], dict[int, int]]:
    if a.topology is None:
        raise ValueError("mesh2d scheduled without a topology; the option checks should have caught it")
    return schedule_mesh(reads, a.topology, a.mesh_threshold)


#: Every strategy, by name.
STRATEGIES: dict[str, StrategySpec] = {
    s.name: s
    for s in (
        StrategySpec(
            "broadcast",
            lambda reads, a: schedule_broadcast(reads),
            every_rank=True,
            needs_mesh=False,
            summary="one broadcast per moved read",
        ),
        StrategySpec(
            "bucketed",
            lambda reads, a: schedule_bucketed(reads, a.cap, a.solo),
            every_rank=True,
            needs_mesh=False,
            summary="per-sender buckets of at most bucket_bytes, broadcast",
        ),
        StrategySpec(
            "mesh2d",
            _mesh,
            every_rank=True,
            needs_mesh=True,
            summary="down the mesh columns, then all_gather across the rows",
        ),
        StrategySpec(
            "p2p",
            lambda reads, a: schedule_p2p(reads, a.cap, a.solo),
            every_rank=False,
            needs_mesh=False,
            summary="point to point, to the consumers only",
        ),
        StrategySpec(
            "multicast",
            lambda reads, a: schedule_multicast(reads, a.cap, a.solo),
            every_rank=False,
            needs_mesh=False,
            summary="one message or subgroup broadcast per read, to the ranks that want it (load, reshard)",
        ),
    )
}
#: What ``strategy=`` accepts: ``"auto"`` and every strategy.
STRATEGY_CHOICES: tuple[str, ...] = ("auto", *STRATEGIES)

if set(get_args(Strategy)) != set(STRATEGIES) or set(get_args(StrategyChoice)) != set(STRATEGY_CHOICES):
    raise ImportError(
        f"the Strategy names {get_args(Strategy)} and the STRATEGIES table "
        f"{list(STRATEGIES)} disagree: add a new strategy to both"
    )


def strategy_problems(strategy: str, consumers: bool, mesh: bool) -> list[str]:
    """What is wrong with asking for ``strategy`` (with consumers, with a mesh); empty if nothing.

    Example:
        >>> strategy_problems("bucketed", consumers=True, mesh=False)
        ["strategy 'bucketed' delivers to every rank; with consumers use one of ['auto', 'p2p', 'multicast']"]
    """
    if strategy == "auto":
        return []
    spec = STRATEGIES.get(strategy)
    if spec is None:
        return [f"strategy {strategy!r} is unknown; use one of {['auto', *STRATEGIES]}"]
    problems = []
    if consumers and spec.every_rank:
        subset = ["auto"] + [s.name for s in STRATEGIES.values() if not s.every_rank]
        problems.append(f"strategy {strategy!r} delivers to every rank; with consumers use one of {subset}")
    if spec.needs_mesh and not mesh:
        problems.append(f"strategy {strategy!r} needs mesh=(horizontal group, vertical group) or a 2-D DeviceMesh")
    return problems
