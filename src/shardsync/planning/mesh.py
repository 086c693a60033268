"""The 2-D mesh strategy (Paddle's H/V path): topology checks and batching of reads.

The group is laid out as rows (horizontal groups) and columns (vertical groups):
``topology[row][column]`` is a group rank. A batch moves one read per column, all of the same byte size:
each read is broadcast down its column from its sender, then one all_gather across every row hands all
of them to every rank. Columns with no fitting read contribute padding. A read whose batch would grow
every rank's memory by more than ``threshold`` bytes (``nbytes * columns``) moves alone in a two-stage
broadcast instead: down its column, then across every row.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from ..errors import PlanError
from .model import Packet, Read
from .schedule import RawStep

__all__ = ["Topology", "build_topology", "schedule_mesh", "WINDOW_PER_COLUMN"]

#: Rows of group ranks: ``topology[row][column]``.
Topology = tuple[tuple[int, ...], ...]
#: How far ahead (in moved reads per column) a batch may look for reads to fill its other columns.
WINDOW_PER_COLUMN = 8


def build_topology(h_groups: Sequence[Sequence[int]], v_groups: Sequence[Sequence[int]]) -> Topology:
    """The mesh from each rank's horizontal and vertical group (group ranks, in group-rank order).

    Args:
        h_groups: ``h_groups[r]``: the ranks of rank r's horizontal group; r's column is its index there.
        v_groups: ``v_groups[r]``: the ranks of r's vertical group; r's row is its index there.

    Raises:
        PlanError: the groups do not form a grid (every problem listed).

    Example:
        >>> build_topology([(0, 1), (0, 1), (2, 3), (2, 3)], [(0, 2), (1, 3), (0, 2), (1, 3)])
        ((0, 1), (2, 3))
    """
    world = len(h_groups)
    ncols, nrows = len(h_groups[0]), len(v_groups[0])
    problems = []
    if ncols * nrows != world:
        problems.append(
            f"horizontal groups of {ncols} ranks and vertical groups of {nrows} ranks do not "
            f"tile a group of {world} ranks"
        )
    grid: dict[tuple[int, int], int] = {}
    for r in range(world):
        if r not in h_groups[r] or r not in v_groups[r]:
            problems.append(f"rank {r} is not in its own horizontal/vertical group")
            continue
        cell = (list(v_groups[r]).index(r), list(h_groups[r]).index(r))
        if cell in grid:
            problems.append(f"ranks {grid[cell]} and {r} both sit at row {cell[0]}, column {cell[1]}")
        grid[cell] = r
    rows = tuple(tuple(grid.get((i, j), -1) for j in range(ncols)) for i in range(nrows))
    for r in range(world):
        i, j = next(((i, j) for (i, j), x in grid.items() if x == r), (None, None))
        if i is None or j is None:
            continue
        if tuple(h_groups[r]) != rows[i] or tuple(v_groups[r]) != tuple(row[j] for row in rows):
            problems.append(
                f"rank {r}: horizontal group {list(h_groups[r])} / vertical group "
                f"{list(v_groups[r])} disagree with the mesh rows {[list(x) for x in rows]}"
            )
    if problems:
        raise PlanError(
            "the mesh is not a 2-D grid of the group:\n  "
            + "\n  ".join(problems)
            + "\nfix: pass (horizontal group, vertical group) of the same 2-D DeviceMesh on "
            "every rank"
        )
    return rows


def _column_of(topology: Topology) -> dict[int, int]:
    return {r: j for row in topology for j, r in enumerate(row)}


def schedule_mesh(
    reads: Sequence[Read],
    topology: Topology,
    threshold: int,
) -> tuple[list[RawStep], dict[int, int]]:
    """Batch the moved reads into mesh steps (in read order; fillers come from a bounded window).

    Returns:
        the steps and each moved read's step index.

    Example:
        >>> steps, step_of = schedule_mesh(reads, ((0, 1), (2, 3)), 8 << 30)   # doctest: +SKIP
    """
    col = _column_of(topology)
    ncols = len(topology[0])
    moved = [i for i, r in enumerate(reads) if r.receivers]
    queues: dict[tuple[int, int], deque[int]] = {}
    for pos, i in enumerate(moved):
        queues.setdefault((reads[i].nbytes, col[reads[i].sender or 0]), deque()).append(pos)
    taken = [False] * len(moved)
    steps: list[RawStep] = []
    step_of: dict[int, int] = {}
    for pos, head in enumerate(moved):
        if taken[pos]:
            continue
        taken[pos] = True
        n, c = reads[head].nbytes, col[reads[head].sender or 0]
        step_of[head] = len(steps)
        if ncols == 1 or n * ncols > threshold:
            steps.append(("mesh_global", (Packet(reads[head].sender or 0, -1, (head,), (0,), n),)))
            continue
        batch: list[int | None] = [None] * ncols
        batch[c] = head
        for j in range(ncols):
            q = queues.get((n, j))
            while q and taken[q[0]]:
                q.popleft()
            if batch[j] is None and q and q[0] <= pos + WINDOW_PER_COLUMN * ncols:
                k = q.popleft()
                taken[k] = True
                batch[j] = moved[k]
                step_of[moved[k]] = len(steps)
        packets = tuple(
            Packet(-1, -1, (), (), n) if i is None else Packet(reads[i].sender or 0, -1, (i,), (0,), n) for i in batch
        )
        steps.append(("mesh_hv", packets))
    return steps, step_of
