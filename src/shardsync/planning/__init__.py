"""Layer 3: who sends which box to whom, in what order - a frozen, validated plan.

Build with :func:`build_plan` (pure, same result on every rank); inspect the :class:`Plan` it returns.
"""

from __future__ import annotations

from .costs import STEP_COSTS, estimate_costs, is_zero_copy
from .mesh import Topology, build_topology
from .model import Copy, Costs, Packet, Plan, Read, SplitBy, Step, StepKind, Strategy, StrategyChoice, TargetPlan
from .planner import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_MESH_THRESHOLD_BYTES,
    MIN_BUCKET_BYTES,
    PlanOptions,
    build_plan,
    check_options,
    choose_strategy,
    select_split,
    split_ranges,
)
from .strategies import STRATEGIES, STRATEGY_CHOICES, ScheduleArgs, StrategySpec

__all__ = [
    "Copy",
    "Costs",
    "Packet",
    "Plan",
    "Read",
    "SplitBy",
    "Step",
    "StepKind",
    "Strategy",
    "StrategyChoice",
    "TargetPlan",
    "PlanOptions",
    "build_plan",
    "check_options",
    "choose_strategy",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_MESH_THRESHOLD_BYTES",
    "MIN_BUCKET_BYTES",
    "Topology",
    "build_topology",
    "estimate_costs",
    "is_zero_copy",
    "select_split",
    "split_ranges",
    "STRATEGIES",
    "STRATEGY_CHOICES",
    "ScheduleArgs",
    "StrategySpec",
    "STEP_COSTS",
]
