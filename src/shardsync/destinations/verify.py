"""``load``/``reshard(..., verify=True)``: check what was written against what the source holds.

After the transfer, each rank hashes the destination boxes it holds (every replica: each holder checks
its own copy), and the source side hashes the copies that built them, each read by one of its holders
(:mod:`shardsync.exec.digests`); one ``all_gather_object`` carries both. Both are taken in the frame
of the destination box, so no global shape is needed and no tensor data moves. A mismatch raises
:class:`~shardsync.errors.VerifyError` on every rank, naming each tensor, box and rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import phases
from ..dist import agree
from ..errors import VerifyError
from ..exec.box_hash import MASK, box_sum
from ..exec.digests import local_sums, owners, plan_parts
from ..layout.box import Box
from ..planning import Plan
from ..sources import Source
from .state import Shards

__all__ = ["check_written", "VERIFY_PHASE"]

#: The agreed phase that compares the written boxes with the source's.
VERIFY_PHASE = phases.VERIFY

#: Most mismatching boxes an error lists (it names every tensor).
_LISTED = 20


def _sums(plan: Plan, boxes: Sequence[tuple[str, Box]], source: Source, dest: Shards,
          rank: int) -> tuple[list[int], dict[int, int]]:
    """This rank's share of the source sums per plan target, and the sums of the boxes it holds."""
    sent = local_sums(plan_parts(plan), plan.reads, owners(plan.reads, plan.world_size), source, rank,
                      len(plan.targets))
    written = {t: box_sum(dest.memory(*boxes[t]), target.shape, (0,) * len(target.shape))
               for t, target in enumerate(plan.targets) if rank in target.consumers}
    return sent, written


def check_written(plan: Plan, boxes: Sequence[tuple[str, Box]], source: Source, dest: Shards,
                  rank: int, group: Any) -> None:
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
    bad = [(boxes[t], r) for r, (_, written) in enumerate(agreed.all)
           for t, value in sorted(written.items()) if value != sent[t]]
    if not bad:
        return
    names = sorted({key for (key, _), _ in bad})
    listed = "; ".join(f"{key!r} box {box} on rank {r}" for (key, box), r in bad[:_LISTED])
    more = f" (and {len(bad) - _LISTED} more)" if len(bad) > _LISTED else ""
    raise VerifyError(f"verify: {len(names)} tensor(s) written differ from the source: {names}: {listed}"
                      f"{more}. The destination memory was changed during the transfer (another thread "
                      "or stream writing to it) or the transfer is broken; rerun, and report it if it "
                      "persists", names)
