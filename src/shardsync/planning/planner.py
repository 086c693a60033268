"""The planner: resolved targets + gathered layout + options -> a validated, frozen :class:`Plan`.

Pure and deterministic: every rank calls :func:`build_plan` with the same inputs and gets the same
plan, without talking to the others. Steps: select the split (``num_splits``/``split_index``), give
each target its consumers, build reads, pick the strategy, schedule steps, estimate costs and fit the
memory budget, validate.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import PlanError
from ..layout.meta import GlobalLayout
from ..mapping.pieces import TargetSpec
from .costs import estimate_costs
from .mesh import Topology
from .model import Plan, SplitBy, Strategy, StrategyChoice, TargetPlan
from .reads import build_reads
from .schedule import attach_targets
from .strategies import STRATEGIES, ScheduleArgs, strategy_problems
from .validate import check_inputs, check_plan

__all__ = [
    "PlanOptions",
    "build_plan",
    "check_options",
    "choose_strategy",
    "split_ranges",
    "select_split",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_MESH_THRESHOLD_BYTES",
    "MIN_BUCKET_BYTES",
    "MAX_CHUNKS",
    "SOLO_READ_BYTES",
    "PIPELINE_DEPTH",
]

log = logging.getLogger(__name__)

#: Default bucket cap, for gloo on CPU: a broadcast's fixed cost (~0.5 ms) is under a tenth of it,
#: and it stays below glibc's 32 MiB mmap ceiling, so freed buffers come back warm (64 MiB buckets
#: measured ~40% slower). On NCCL, buckets of 512 MiB and more are the usual choice.
DEFAULT_BUCKET_BYTES = 16 << 20
#: Under "auto", reads this big travel alone, the smaller ones in buckets: from about here, packing
#: (a copy on each side) costs more than the gloo broadcast overhead (~0.5 ms) it saves.
SOLO_READ_BYTES = 1 << 20
#: mesh2d moves a read alone (two-stage broadcast) when batching it would grow every rank's memory by
#: more than this (Paddle's ``memory_growth_threshold`` default).
DEFAULT_MESH_THRESHOLD_BYTES = 8 << 30
#: Smallest cap the planner goes down to when fitting a memory budget.
MIN_BUCKET_BYTES = 256
#: Most pieces the planner cuts the largest read into when fitting a memory budget.
MAX_CHUNKS = 1024
#: Steps in flight at once (step k+1 is on the wire while step k is copied and yielded).
PIPELINE_DEPTH = 2


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """Everything about a stream besides the state and the mapping (see :func:`shardsync.full_params`).

    ``consumers=None`` means every rank receives every target; a tuple of ranks splits the targets
    among them (part i to ``consumers[i]``) and the other ranks only send. ``destinations`` instead
    names the receiving ranks of each target, in target order (load and reshard: the holders of each
    destination box); ``in_place`` says targets are written into memory the caller already holds, so
    they count toward no rank's peak.

    Example:
        >>> PlanOptions(strategy="p2p", consumers=(0,)).bucket_bytes
        16777216
    """

    strategy: StrategyChoice = "auto"
    num_splits: int = 1
    split_index: int = 0
    split_by: SplitBy = "count"
    consumers: tuple[int, ...] | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    memory_budget: int | None = None
    mesh_threshold_bytes: int = DEFAULT_MESH_THRESHOLD_BYTES
    copy: bool = True
    backend: str = "gloo"
    destinations: tuple[tuple[int, ...], ...] | None = None
    in_place: bool = False


# -- dividing the sorted targets into contiguous parts (num_splits, consumers) -----------------------


def _by_count(total: int, parts: int) -> list[range]:
    # Paddle's split: the first ``total % parts`` parts get one more target.
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append(range(start, stop))
        start = stop
    return out


def _by_bytes(sizes: Sequence[int], parts: int) -> list[range]:
    # Cut k goes where the running total is closest to k/parts of the whole; cuts never go backwards.
    total = sum(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    cuts = [0]
    for k in range(1, parts):
        goal = total * k / parts
        lo = cuts[-1]
        best = min(range(lo, len(sizes) + 1), key=lambda i: (abs(prefix[i] - goal), i))
        cuts.append(best)
    cuts.append(len(sizes))
    return [range(cuts[i], cuts[i + 1]) for i in range(parts)]


def split_ranges(sizes: Sequence[int], parts: int, by: SplitBy = "count") -> list[range]:
    """Cut ``len(sizes)`` ordered items into ``parts`` contiguous ranges.

    Args:
        sizes: bytes of each item, in order (only used when ``by == "bytes"``).
        parts: number of ranges (some may be empty when there are fewer items than parts).
        by: ``"count"``: the first ``n % parts`` ranges get one more item (Paddle's rule);
            ``"bytes"``: each cut falls where the running byte total is closest to its share.

    Returns:
        ``parts`` ranges covering ``range(len(sizes))`` in order.

    Example:
        >>> split_ranges([1] * 5, 2)
        [range(0, 3), range(3, 5)]
        >>> split_ranges([8, 1, 1, 1, 1], 2, "bytes")
        [range(0, 1), range(1, 5)]
    """
    if parts < 1:
        raise PlanError(f"cannot split into {parts} parts; use num_splits >= 1")
    if by == "count":
        return _by_count(len(sizes), parts)
    if by == "bytes":
        return _by_bytes(sizes, parts)
    raise PlanError(f"unknown split_by {by!r}; use 'count' or 'bytes'")


def select_split(sizes: Sequence[int], parts: int, index: int, by: SplitBy = "count") -> range:
    """The ``index``-th of :func:`split_ranges` (validated).

    Raises:
        PlanError: ``index`` outside ``[0, parts)``.

    Example:
        >>> select_split([1] * 5, 2, 1)
        range(3, 5)
    """
    if not 0 <= index < max(parts, 1):
        raise PlanError(f"split_index {index} outside [0, {parts}); use 0 <= split_index < num_splits")
    return split_ranges(sizes, parts, by)[index]


# -- options, strategy, fitting ------------------------------------------------------------------


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_options(o: PlanOptions, world: int, meshed: bool) -> None:
    """Check the options of a stream over ``world`` ranks (with a mesh or not), before anything runs.

    Raises:
        PlanError: every problem at once, each with its fix.

    Example:
        >>> check_options(PlanOptions(strategy="broadcast", consumers=(0,)), world=2, meshed=False)
        Traceback (most recent call last):
        ...
        shardsync.errors.PlanError: invalid stream options:
          strategy 'broadcast' delivers to every rank; with consumers use one of ['auto', 'p2p', 'multicast']
    """
    p = strategy_problems(o.strategy, o.consumers is not None, meshed)
    if not (_is_int(o.num_splits) and _is_int(o.split_index) and 0 <= o.split_index < o.num_splits):
        p.append(
            f"num_splits={o.num_splits!r}, split_index={o.split_index!r}: use integers with "
            "num_splits >= 1 and 0 <= split_index < num_splits"
        )
    if o.split_by not in ("count", "bytes"):
        p.append(f"split_by {o.split_by!r} is unknown; use 'count' or 'bytes'")
    sizes = {"bucket_bytes": o.bucket_bytes, "mesh_threshold_bytes": o.mesh_threshold_bytes}
    if o.memory_budget is not None:
        sizes["memory_budget"] = o.memory_budget
    p += [
        f"{name}={value!r}: use a positive number of bytes"
        for name, value in sizes.items()
        if not (_is_int(value) and value >= 1)
    ]
    if o.consumers is not None:
        bad = [r for r in o.consumers if not (_is_int(r) and 0 <= r < world)]
        if bad or len(set(o.consumers)) != len(o.consumers) or not o.consumers:
            p.append(f"consumers {list(o.consumers)}: use distinct ranks in [0, {world})")
    if o.destinations is not None:
        if o.consumers is not None or o.num_splits != 1:
            p.append("destinations name each target's ranks; do not combine them with consumers or num_splits")
        if any(not (_is_int(r) and 0 <= r < world) for ranks in o.destinations for r in ranks):
            p.append(f"destinations name ranks outside [0, {world})")
        if o.strategy != "auto" and STRATEGIES[o.strategy].every_rank:
            p.append(
                f"strategy {o.strategy!r} delivers to every rank; with destinations use 'auto', 'p2p' or 'multicast'"
            )
    if p:
        raise PlanError("invalid stream options:\n  " + "\n  ".join(p))


def choose_strategy(o: PlanOptions, topology: Topology | None) -> Strategy:
    """Resolve ``"auto"``: ``multicast`` for per-target destinations (load, reshard); ``p2p`` for a
    consumer subset; ``mesh2d`` on NCCL when a mesh is given (gloo's all_gather is several times
    slower than its broadcast); ``bucketed`` otherwise. Under ``auto``, bucketed, p2p and multicast
    send reads of :data:`SOLO_READ_BYTES` or more alone.

    Example:
        >>> choose_strategy(PlanOptions(consumers=(0,)), None)
        'p2p'
    """
    if o.strategy != "auto":
        return o.strategy
    if o.destinations is not None:
        return "multicast"
    if o.consumers is not None:
        return "p2p"
    if topology is not None and o.backend == "nccl":
        return "mesh2d"
    return "bucketed"


def _consumers(selected: Sequence[TargetSpec], o: PlanOptions, world: int) -> list[tuple[int, ...]]:
    if o.destinations is not None:
        if len(o.destinations) != len(selected):
            raise PlanError(
                f"{len(o.destinations)} destinations for {len(selected)} targets; give one tuple of ranks per target"
            )
        return list(o.destinations)
    if o.consumers is None:
        return [tuple(range(world))] * len(selected)
    parts = split_ranges([t.nbytes for t in selected], len(o.consumers), o.split_by)
    out: list[tuple[int, ...]] = [()] * len(selected)
    for rank, part in zip(o.consumers, parts):
        for i in part:
            out[i] = (rank,)
    return out


def _attempt(
    selected: Sequence[TargetSpec],
    consumers: list[tuple[int, ...]],
    layout: GlobalLayout,
    world: int,
    o: PlanOptions,
    topology: Topology | None,
    cap: int,
    strategy: Strategy | None,
    depth: int,
) -> Plan:
    chunked = cap if o.memory_budget is not None else None
    reads, copies = build_reads(selected, consumers, layout, world, max_read_bytes=chunked, merge=not o.in_place)
    strategy = strategy or choose_strategy(o, topology)
    args = ScheduleArgs(cap, SOLO_READ_BYTES if o.strategy == "auto" else None, topology, o.mesh_threshold_bytes)
    raw, step_of = STRATEGIES[strategy].schedule(reads, args)
    targets = tuple(TargetPlan(t.name, t.shape, t.dtype, c, tuple(cp)) for t, c, cp in zip(selected, consumers, copies))
    steps = attach_targets(raw, step_of, copies)
    costs = estimate_costs(steps, reads, targets, world, topology, o.copy, depth, in_place=o.in_place)
    return Plan(
        strategy,
        world,
        targets,
        tuple(reads),
        tuple(steps),
        cap,
        costs,
        topology if STRATEGIES[strategy].needs_mesh else None,
        o.copy,
        depth,
    )


def build_plan(
    targets: Sequence[TargetSpec], layout: GlobalLayout, options: PlanOptions, topology: Topology | None = None
) -> Plan:
    """Plan the stream of ``targets`` (all resolved targets, sorted by name) out of ``layout``.

    Selects split ``split_index`` of ``num_splits``, assigns consumers, builds reads, picks the
    strategy, schedules steps, and lowers the bucket cap (cutting large reads) until the estimated
    peak memory of every rank fits ``memory_budget``.

    Raises:
        LayoutError: holes or overlapping shards in what the selected targets read.
        PlanError: bad options, malformed targets, a budget that cannot be met, or (a bug) a plan that
            fails its own validation.

    Example:
        >>> opts = PlanOptions(strategy="bucketed")
        >>> plan = build_plan(resolve(None, layout), layout, opts)  # doctest: +SKIP
    """
    world = layout.world_size
    check_options(options, world, topology is not None)
    sizes = [t.nbytes for t in targets]
    selected = [targets[i] for i in select_split(sizes, options.num_splits, options.split_index, options.split_by)]
    check_inputs(selected, layout)
    consumers = _consumers(selected, options, world)
    plan = _fit(selected, consumers, layout, options, topology)
    check_plan(plan, layout)
    log.debug("%s", plan.summary())
    return plan


def _fit(
    selected: Sequence[TargetSpec],
    consumers: list[tuple[int, ...]],
    layout: GlobalLayout,
    o: PlanOptions,
    topology: Topology | None,
) -> Plan:
    # Without a budget: PIPELINE_DEPTH steps in flight. With one: halve the cap (cutting reads to it)
    # until the estimated peak fits - a few times two steps deep, then one step deep down to the
    # floor (MIN_BUCKET_BYTES, or reads cut in more than MAX_CHUNKS pieces). Give up at once when a
    # target alone exceeds the budget.
    budget = o.memory_budget
    world = layout.world_size
    if budget is None:
        return _attempt(selected, consumers, layout, world, o, topology, o.bucket_bytes, None, PIPELINE_DEPTH)
    strategy: Strategy | None = None
    floor = MIN_BUCKET_BYTES
    for depth, tries in ((PIPELINE_DEPTH, 3), (1, 64)):
        cap = max(MIN_BUCKET_BYTES, min(o.bucket_bytes, budget))
        for _ in range(tries):
            plan = _attempt(selected, consumers, layout, world, o, topology, cap, strategy, depth)
            if strategy is None:
                strategy = plan.strategy
                floor = max(MIN_BUCKET_BYTES, max((r.nbytes for r in plan.reads), default=0) // MAX_CHUNKS)
            if max(plan.costs.peak_bytes, default=0) <= budget:
                return plan
            whole = 0 if o.in_place else max((t.nbytes for t in plan.targets), default=0)
            if whole > budget or cap <= floor:
                break
            cap = max(floor, cap // 2)
    raise PlanError(_budget_message(plan, budget, o.in_place))


def _budget_message(plan: Plan, budget: int, in_place: bool) -> str:
    rank = max(range(plan.world_size), key=lambda r: plan.costs.peak_bytes[r])
    need = plan.costs.peak_bytes[rank]
    largest = None if in_place else max(plan.targets, key=lambda t: t.nbytes, default=None)
    if largest is not None and largest.nbytes > budget:
        return (
            f"memory_budget={budget} B cannot be met: target {largest.name!r} ({largest.nbytes} B) is "
            f"held whole while it is built; raise memory_budget above {largest.nbytes} B (the "
            f"smallest plan tried needs {need} B)"
        )
    return (
        f"memory_budget={budget} B cannot be met: even with {plan.bucket_bytes} B buckets and reads "
        f"cut to that size, rank {rank} holds up to {need} B (targets being built plus buffers in "
        f"flight); raise memory_budget to {need} B or more"
    )
