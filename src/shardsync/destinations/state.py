"""This rank's destination: the shards of an existing state (or module), to be written in place."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Union

import torch

from ..errors import LayoutError
from ..layout.box import Box
from ..layout.dtypes import dtype_name
from ..layout.meta import LayoutEntry
from ..layout.sharded import LocalShard, StateValue, local_shards
from ..sources.modules import state_of

__all__ = ["Shards", "DestinationLike", "self_overlapping"]

#: What ``load``/``reshard`` write into: a state dict, a module (its state dict), or None (nothing).
DestinationLike = Union[Mapping[str, StateValue], torch.nn.Module, None]


def self_overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may be one memory location: taken dim by dim from the smallest
    stride, each stride must step past everything the smaller ones reach (true of every view made by
    slicing, transposing or reshaping a tensor that owns its memory; false of ``expand``).

    Example:
        >>> a = torch.zeros(3, 4)
        >>> self_overlapping(a.T[::2]), self_overlapping(torch.zeros(1, 4).expand(3, 4))
        (False, True)
    """
    if t.numel() == 0:
        return False
    reach = 0
    for stride, size in sorted((abs(st), n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


class Shards:
    """This rank's shards of the destination, by key; targets are written into their memory.

    Args:
        dst: a state dict (tensors, LocalShard, DTensor, lists of LocalShard), an ``nn.Module``
            (its state dict: parameters and buffers written in place), or None (nothing here).

    Example:
        >>> w = torch.zeros(2)
        >>> d = Shards({"w": LocalShard(w, (4,), (2,))})
        >>> d.entries()[0].box, d.memory("w", Box((2,), (2,))).data_ptr() == w.data_ptr()
        (Box(offsets=(2,), sizes=(2,)), True)

    Raises:
        LayoutError: ``dst`` is not a destination, or a tensor of it shares memory between its own
            elements (an ``expand``-ed, stride-0 tensor), which no write can fill element by element.
    """

    def __init__(self, dst: DestinationLike) -> None:
        state = state_of(dst, "the destination")
        self.shards: dict[str, list[LocalShard]] = {k: local_shards(k, v) for k, v in state.items()}
        aliased = sorted({k for k, shards in self.shards.items() for s in shards if self_overlapping(s.local)})
        if aliased:
            raise LayoutError(
                f"destination tensors {aliased} have elements that share memory (made by "
                "expand() or a stride-0 view), so they cannot be written in place; pass "
                "tensors that own their memory, e.g. t.expand(...).clone()"
            )

    def entries(self) -> list[LayoutEntry]:
        """This rank's destination entries ``(key, global shape, dtype, box)``, sorted by key."""
        return [
            LayoutEntry(key, s.global_shape, dtype_name(s.dtype), s.box)
            for key in sorted(self.shards)
            for s in self.shards[key]
        ]

    def memory(self, key: str, box: Box) -> torch.Tensor:
        """The tensor holding ``box`` of ``key`` on this rank, detached (writes land in the state):
        a shard with that box, or the view of ``box`` in a shard holding it.

        Raises:
            LayoutError: this rank holds no shard containing that box (the state changed after its
                layout was gathered).
        """
        for s in self.shards.get(key, ()):
            if s.box.contains(box):  # all of it, or the part that a shorter (padded) target fills
                return box.cut(s.local.detach(), s.box)
        raise LayoutError(
            f"{key!r}: this rank holds no destination shard {box}; the destination "
            "changed after its layout was gathered"
        )
