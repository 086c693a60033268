"""Where a DTensor's local shard lies in the global tensor, for ``Shard`` and ``_StridedShard``.

A DTensor's placements are applied left to right over the mesh dims, each cutting the part of a
tensor dim the rank holds so far, like ``torch.chunk`` (pieces of ``ceil(n / parts)``, the last ones
smaller or empty). ``_StridedShard(dim, split_factor=f)`` (FSDP2 over tensor parallelism) first cuts
the part into ``f`` pieces, then takes the rank's chunk of each piece and joins them: the rank holds
several runs of that dim. The local tensor holds the runs one after the other, so the rank's region is
a union of boxes (one per combination of runs of every dim), each a slice of the local tensor.

This module is plain data and arithmetic (no torch.distributed); :func:`~shardsync.layout.sharded.
dtensor_shards` reads the placements and mesh coordinates of a live DTensor into :class:`Split`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from .box import Box

__all__ = ["Split", "Run", "dim_runs", "shard_boxes"]

#: A run of one tensor dim: ``(global start, length)``.
Run = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Split:
    """One shard placement on one mesh dim: tensor dim ``dim`` cut in ``parts``, this rank's ``index``.

    Attributes:
        dim: the tensor dim the placement shards.
        parts: the size of the mesh dim.
        index: this rank's coordinate on that mesh dim.
        split_factor: ``_StridedShard``'s split factor (1 for ``Shard``).

    Example:
        >>> Split(0, 2, 1, split_factor=2)
        Split(dim=0, parts=2, index=1, split_factor=2)
    """

    dim: int
    parts: int
    index: int
    split_factor: int = 1

    def __post_init__(self) -> None:
        if self.parts < 1 or not 0 <= self.index < self.parts or self.split_factor < 1:
            raise ValueError(f"{self}: needs parts >= 1, 0 <= index < parts and split_factor >= 1")


def _chunk(n: int, parts: int, index: int) -> tuple[int, int]:
    """Positions ``[lo, hi)`` of piece ``index`` of ``n`` cut like ``torch.chunk`` (empty ones filled)."""
    step = -(-n // parts)
    lo = min(index * step, n)
    return lo, min(lo + step, n)


def _take(runs: Sequence[Run], lo: int, hi: int) -> list[Run]:
    """The runs covering positions ``[lo, hi)`` of the sequence the runs make."""
    out: list[Run] = []
    pos = 0
    for start, length in runs:
        a, b = max(lo, pos), min(hi, pos + length)
        if a < b:
            out.append((start + a - pos, b - a))
        pos += length
    return out


def _merge(runs: Sequence[Run]) -> list[Run]:
    """Adjacent runs joined (a run that starts where the previous one stops continues it)."""
    out: list[Run] = []
    for start, length in runs:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((start, length))
    return out


def _apply(runs: list[Run], split: Split) -> list[Run]:
    n = sum(length for _, length in runs)
    out: list[Run] = []
    for p_lo, p_hi in (_chunk(n, split.split_factor, j) for j in range(split.split_factor)):
        lo, hi = _chunk(p_hi - p_lo, split.parts, split.index)
        out += _take(runs, p_lo + lo, p_lo + hi)
    return _merge(out)


def dim_runs(size: int, splits: Sequence[Split]) -> list[Run]:
    """The runs of a tensor dim of ``size`` that this rank holds, in local order.

    Args:
        size: the global size of the dim.
        splits: the placements that shard this dim, in mesh-dim order.

    Example:
        >>> dim_runs(17, [Split(0, 2, 0, split_factor=2)])   # FSDP rank 0 over TP=2
        [(0, 5), (9, 4)]
        >>> dim_runs(17, [Split(0, 2, 0, split_factor=2), Split(0, 2, 1)])
        [(9, 4)]
    """
    runs: list[Run] = [(0, size)] if size else []
    for split in splits:
        runs = _apply(runs, split)
    return runs


def shard_boxes(shape: Sequence[int], splits: Sequence[Split]) -> list[tuple[Box, Box]]:
    """This rank's region of a tensor of ``shape`` as ``(global box, local box)`` pairs.

    The local box is where the global box lies in the rank's local tensor. Each combination of runs
    of every dim is one box, in local order. A rank holding nothing of some dim gets one empty box
    (at the end of that dim, like torch's ``compute_local_shape_and_global_offset``).

    Example:
        >>> [(str(g), str(l)) for g, l in shard_boxes((5, 2), [Split(0, 2, 1, split_factor=2)])]
        [('[2:3, 0:2]', '[0:1, 0:2]'), ('[4:5, 0:2]', '[1:2, 0:2]')]
    """
    per_dim = [dim_runs(n, [s for s in splits if s.dim == d]) for d, n in enumerate(shape)]
    if any(not runs for runs in per_dim):
        offsets = tuple(runs[0][0] if runs else n for runs, n in zip(per_dim, shape))
        local = tuple(sum(length for _, length in runs) for runs in per_dim)
        return [(Box(offsets, local), Box((0,) * len(shape), local))]
    local_starts = [list(itertools.accumulate((length for _, length in runs[:-1]), initial=0)) for runs in per_dim]
    out = []
    for combo in itertools.product(*(range(len(runs)) for runs in per_dim)):
        runs = [per_dim[d][i] for d, i in enumerate(combo)]
        sizes = tuple(length for _, length in runs)
        out.append(
            (
                Box(tuple(start for start, _ in runs), sizes),
                Box(tuple(local_starts[d][i] for d, i in enumerate(combo)), sizes),
            )
        )
    return out
