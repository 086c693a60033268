"""``shardsync plan``: what ``convert --nproc N`` would do, computed without starting any process.

The checkpoint's boxes are spread over N workers as the streamers spread them
(:func:`~shardsync.sources.assign_boxes`), the mapping is resolved against that layout and the
planner runs with the options ``convert`` uses (each worker receives a contiguous share of the
targets, balanced by bytes). Printed: each target's pieces and worker, then per worker the bytes it
reads, writes, sends and receives, its collectives and its estimated peak memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..exec.hosts import host_info
from ..exec.shm_plan import pushes, shm_costs, use_shm
from ..layout.box import Box
from ..layout.meta import GlobalLayout, LayoutEntry
from ..planning import Plan, PlanOptions, build_plan
from ..sources import assign_boxes, open_source
from .common import MappingFlags, source_dir, workers_flag
from .table import Row, fold, json_text, render, render_ints
from .units import human_bytes

__all__ = ["PlanConfig", "dry_run", "run_plan", "plan_document"]


@dataclass(frozen=True)
class PlanConfig:
    """``shardsync plan``: the source, the mapping flags, the workers and the budget."""

    source: Path
    flags: MappingFlags = MappingFlags()
    nproc: int = 1
    memory_budget: int | None = None
    as_json: bool = False


def spread_layout(entries: list[LayoutEntry], world: int) -> GlobalLayout:
    """The layout ``world`` workers reading one checkpoint see: each box held by the worker that
    :func:`~shardsync.sources.assign_boxes` gives it.

    Example:
        >>> e = [LayoutEntry(k, (n,), "float32", Box((0,), (n,))) for k, n in (("a", 4), ("b", 3))]
        >>> [s.rank for s in spread_layout(e, 2)["b"].shards]
        [1]
    """
    owner = assign_boxes(entries, world)
    return GlobalLayout.merge([[e for e, r in zip(entries, owner) if r == rank] for rank in range(world)])


def dry_run(cfg: PlanConfig) -> Plan:
    """The plan ``convert --nproc N`` would run (reads headers only; starts no process).

    Raises:
        UsageError: a bad ``--nproc``; MappingError, FormatError, PlanError as ``convert``.
    """
    workers_flag(cfg.nproc)
    source = open_source(cfg.source)
    layout = spread_layout(source.entries(), cfg.nproc)
    _, targets = cfg.flags.resolve(layout, source_dir(cfg.source))
    options = PlanOptions(
        consumers=tuple(range(cfg.nproc)) if cfg.nproc > 1 else None,
        split_by="bytes",
        memory_budget=cfg.memory_budget,
        copy=False,
        backend="gloo" if cfg.nproc > 1 else "none",
    )
    plan = build_plan(targets, layout, options)
    # the workers start on this host: where they move data through shared memory, so do the costs
    here = [(host_info(), "auto")] * cfg.nproc
    pushing = pushes(plan, True, [h for h, _ in here], cfg.memory_budget)  # workers stream into files: fresh memory
    if cfg.nproc > 1 and use_shm(plan, here, cfg.memory_budget, pushing):
        plan = dataclasses.replace(plan, costs=shm_costs(plan, pushing))
    return plan


def _box(b: Box) -> dict[str, list[int]]:
    return {"offsets": list(b.offsets), "sizes": list(b.sizes)}


def _reads_by(plan: Plan) -> list[int]:
    """Bytes each worker reads from the checkpoint."""
    out = [0] * plan.world_size
    for r in plan.reads:
        reader = r.sender if r.sender is not None else r.holders[0]
        out[reader] += r.nbytes
    return out


def plan_document(plan: Plan, source: Path) -> dict[str, Any]:
    """The JSON document ``plan --json`` prints: every target with its pieces, and per-worker costs."""
    c = plan.costs
    reads = _reads_by(plan)
    targets = [
        {
            "name": t.name,
            "shape": list(t.shape),
            "dtype": t.dtype,
            "bytes": t.nbytes,
            "workers": list(t.consumers),
            "pieces": [
                {
                    "source": cp.piece.source,
                    "source_box": _box(cp.piece.source_box),
                    "target_box": _box(cp.piece.target_box),
                    "read_by": plan.reads[cp.read].sender
                    if plan.reads[cp.read].sender is not None
                    else plan.reads[cp.read].holders[0],
                }
                for cp in t.copies
            ],
        }
        for t in plan.targets
    ]
    workers = [
        {
            "worker": r,
            "reads_bytes": reads[r],
            "writes_bytes": sum(t.nbytes for t in plan.targets if r in t.consumers),
            "sent_bytes": c.bytes_sent[r],
            "received_bytes": c.bytes_received[r],
            "collectives": c.collectives[r],
            "peak_bytes": c.peak_bytes[r],
        }
        for r in range(plan.world_size)
    ]
    return {
        "source": str(source),
        "workers": plan.world_size,
        "strategy": plan.strategy,
        "bucket_bytes": plan.bucket_bytes,
        "steps": len(plan.steps),
        "targets": targets,
        "per_worker": workers,
    }


def table(doc: dict[str, Any]) -> str:
    """The text ``plan`` prints for a :func:`plan_document` document."""
    rows = [
        Row(
            (t["name"], ", ".join(dict.fromkeys(p["source"] for p in t["pieces"]))),
            (tuple(t["shape"]), t["dtype"], len(t["pieces"])),
            1,
            t["bytes"],
            (frozenset(t["workers"]),),
        )
        for t in doc["targets"]
    ]
    body = [
        (
            names[0],
            str(row.count),
            str(list(row.same[0])),
            str(row.same[1]),
            str(row.same[2]),
            names[1],
            render_ints(row.sets[0]) if row.sets[0] else "-",
            human_bytes(row.nbytes),
        )
        for names, row in fold(rows)
    ]
    total = sum(t["bytes"] for t in doc["targets"])
    n = doc["workers"]
    steps = doc["steps"]
    head = (
        f"plan: {doc['source']} with {n} worker{'s' if n > 1 else ''}: {len(doc['targets'])} targets "
        f"({human_bytes(total)}), strategy {doc['strategy']}, {steps} step{'s' if steps != 1 else ''}"
    )
    targets = render(("target", "n", "shape", "dtype", "pieces", "from", "worker", "bytes"), body, right=(1, 4, 7))
    per = [
        (
            str(w["worker"]),
            human_bytes(w["reads_bytes"]),
            human_bytes(w["writes_bytes"]),
            human_bytes(w["sent_bytes"]),
            human_bytes(w["received_bytes"]),
            str(w["collectives"]),
            human_bytes(w["peak_bytes"]),
        )
        for w in doc["per_worker"]
    ]
    workers = render(
        ("worker", "reads", "writes", "sends", "receives", "collectives", "peak memory"), per, right=(1, 2, 3, 4, 5, 6)
    )
    return "\n".join((head, targets, "", workers))


def run_plan(cfg: PlanConfig) -> str:
    """What ``shardsync plan`` prints."""
    doc = plan_document(dry_run(cfg), cfg.source)
    return json_text(doc) if cfg.as_json else table(doc)
