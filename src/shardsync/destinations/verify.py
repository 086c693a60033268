"""``load``/``reshard(..., verify=True)``: check what was written against what the source holds.

After the transfer, each rank hashes the destination boxes it holds (every replica: each holder checks
its own copy), and the source side hashes the copies that built them, each read by one of its holders
(:mod:`shardsync.exec.digests`); one gather carries both. A copy whose source this rank
hashes and whose destination box only this rank holds (a local copy) is compared bit for bit instead,
and left out of both sums when equal (when not, both sides hash it, and the sums differ). Both are taken in the frame
of the destination box, so no global shape is needed and no tensor data moves. A mismatch raises
:class:`~shardsync.errors.VerifyError` on every rank, naming each tensor, box and rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import phases
from ..dist import agree
from ..errors import VerifyError
from ..exec.assemble import piece_view
from ..exec.box_hash import MASK, box_sum
from ..exec.digests import Part, local_sums, owners, plan_parts
from ..layout.box import Box
from ..layout.dtypes import BITS, to_torch_dtype
from ..planning import Plan
from ..sources import Source
from .state import Shards

__all__ = ["check_written", "VERIFY_PHASE"]

#: The agreed phase that compares the written boxes with the source's.
VERIFY_PHASE = phases.VERIFY

#: Most mismatching boxes an error lists (it names every tensor).
_LISTED = 20


def _sums(
    plan: Plan, boxes: Sequence[tuple[str, Box]], source: Source, dest: Shards, rank: int
) -> tuple[list[int], dict[int, int]]:
    """This rank's share of the source sums per plan target, and the sums of the boxes it holds.

    A copy that this rank both hashes on the source side and alone holds the destination box of is
    compared here, bit for bit, and when equal left out of both sums: one pass instead of two hashes.
    """
    parts, owner = plan_parts(plan), owners(plan.reads, plan.world_size)
    by_target: dict[int, list[int]] = {}
    for i, part in enumerate(parts):
        by_target.setdefault(part.target, []).append(i)
    equal = {
        i
        for i, part in enumerate(parts)
        if owner[part.read] == rank
        and plan.targets[part.target].consumers == (rank,)
        and _landed(part, plan, boxes, source, dest)
    }
    sent = local_sums(
        [p for i, p in enumerate(parts) if i not in equal], plan.reads, owner, source, rank, len(plan.targets)
    )
    written = {}
    for t, target in enumerate(plan.targets):
        if rank not in target.consumers:
            continue
        memory, mine = dest.memory(*boxes[t]), by_target.get(t, [])
        if not any(i in equal for i in mine):  # hashed whole: one run over the box
            written[t] = box_sum(memory, target.shape, (0,) * len(target.shape))
            continue
        rest = [parts[i].piece.target_box for i in mine if i not in equal]
        written[t] = sum(box_sum(memory[b.slices()], target.shape, b.offsets) for b in rest) & MASK
    return sent, written


def _landed(part: Part, plan: Plan, boxes: Sequence[tuple[str, Box]], source: Source, dest: Shards) -> bool:
    """Whether the destination holds exactly the bits of ``part``'s source values (cast, arranged)."""
    read, p = plan.reads[part.read], part.piece
    view = piece_view(source.read(read.source, read.box), read.box, p)
    casts = p.casts if p.casts and p.casts[-1] == part.dtype else (*p.casts, part.dtype)
    for c in casts:
        view = view.to(to_torch_dtype(c))
    got = dest.memory(*boxes[part.target])[p.target_box.slices()]
    return got.dtype == view.dtype and torch.equal(_as_bits(got), _as_bits(view.to(got.device)))


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns as integers of its width (NaNs compare by payload, -0.0 differs from 0.0)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(BITS[t.element_size()]) if t.dtype != torch.bool else t.view(torch.uint8)


def check_written(
    plan: Plan, boxes: Sequence[tuple[str, Box]], source: Source, dest: Shards, rank: int, group: Any
) -> None:
    """Compare every destination box the plan wrote with the source's values for it; on every rank.

    Args:
        plan: the plan that ran (its targets are destination boxes, in their own frame).
        boxes: per plan target, its destination key and box.
        source: this rank's source.
        dest: this rank's destination.
        rank: this rank's group rank.
        group: the process group.

    Raises:
        VerifyError: a box whose written values differ from the source's (the same on every rank).
        DistributedError: a rank failed while hashing.

    Example:
        >>> import torch, shardsync
        >>> r = shardsync.load({"w": torch.zeros(3)}, {"w": torch.ones(3)}, verify=True)
    """
    agreed = agree(VERIFY_PHASE, lambda: _sums(plan, boxes, source, dest, rank), group, unanimous=True)
    sent = [sum(column) & MASK for column in zip(*(s for s, _ in agreed.all))]
    bad = [
        (boxes[t], r)
        for r, (_, written) in enumerate(agreed.all)
        for t, value in sorted(written.items())
        if value != sent[t]
    ]
    if not bad:
        return
    names = sorted({key for (key, _), _ in bad})
    listed = "; ".join(f"{key!r} box {box} on rank {r}" for (key, box), r in bad[:_LISTED])
    more = f" (and {len(bad) - _LISTED} more)" if len(bad) > _LISTED else ""
    raise VerifyError(
        f"verify: {len(names)} tensor(s) written differ from the source: {names}: {listed}"
        f"{more}. The destination memory was changed during the transfer (another thread "
        "or stream writing to it) or the transfer is broken; rerun, and report it if it "
        "persists",
        names,
    )
