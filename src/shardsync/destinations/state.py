"""This rank's destination: the shards of an existing state (or module), to be written in place."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Union

import torch

from ..errors import LayoutError
from ..layout.box import Box
from ..layout.dtypes import dtype_name
from ..layout.meta import LayoutEntry
from ..layout.sharded import ShardedTensor, StateValue, local_shards
from ..sources import LocalSource, Source, open_source
from ..sources.fingerprint import ReplicaCheck
from ..sources.megatron import megatron_module_error

__all__ = ["Destination", "DestinationLike", "SourceLike", "as_source", "module_state", "self_overlapping"]

#: What ``load``/``reshard`` write into: a state dict, a module (its state dict), or None (nothing).
DestinationLike = Union[Mapping[str, StateValue], torch.nn.Module, None]
#: What they read from: a Source, a live state dict, a module, or None (nothing on this rank).
SourceLike = Union[Source, Mapping[str, StateValue], torch.nn.Module, str, os.PathLike, None]


def _identity(t: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...]] | None:
    """Where a tensor's data lives (None for no data: empty tensors are never tied)."""
    local = t.to_local() if type(t).__name__ == "DTensor" else t  # type: ignore[attr-defined]
    if local.numel() == 0:
        return None
    return (local.untyped_storage().data_ptr(), int(local.storage_offset()), tuple(t.shape),
            tuple(local.stride()))


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


def module_state(module: torch.nn.Module) -> dict[str, Any]:
    """A module's tensors by state-dict key (sharing memory with its parameters and buffers).

    Non-tensor entries (``_extra_state``) are left out, and so is a key whose tensor is another key's
    (tied weights, e.g. ``lm_head.weight`` tied to the embeddings): it is filled through the first.

    Example:
        >>> sorted(module_state(torch.nn.Linear(2, 3)))
        ['bias', 'weight']
    """
    out: dict[str, Any] = {}
    seen: set[Any] = set()
    for k, v in module.state_dict().items():
        where = _identity(v) if isinstance(v, torch.Tensor) else None
        if isinstance(v, torch.Tensor) and (where is None or where not in seen):
            seen.add(where)
            out[k] = v
    return out


def _state(value: Any, what: str) -> Mapping[str, StateValue]:
    if value is None:
        return {}
    if isinstance(value, torch.nn.Module):
        error = megatron_module_error(value, what)
        if error is not None:
            raise error
        return module_state(value)
    if isinstance(value, Mapping):
        return value
    raise LayoutError(f"{what} is a {type(value).__name__}; pass a state dict (tensors, ShardedTensor, "
                      "DTensor), an nn.Module, a Source, or None for nothing on this rank")


def as_source(value: SourceLike, replica_check: ReplicaCheck = "sampled") -> Source:
    """``value`` as a :class:`~shardsync.sources.Source` (a live state is read in place, its
    replicas checked per ``replica_check``).

    Raises:
        LayoutError: ``value`` is none of the accepted kinds.

    Example:
        >>> as_source({"w": torch.zeros(2)}).entries()[0].shape
        (2,)
    """
    if value is None or isinstance(value, torch.nn.Module):
        return LocalSource(_state(value, "the source"), replica_check)
    return open_source(value, replica_check)  # a path is not spread: every rank reads its own boxes of the files


class Destination:
    """This rank's shards of the destination, by key; targets are written into their memory.

    Args:
        dst: a state dict (tensors, ShardedTensor, DTensor, lists of ShardedTensor), an ``nn.Module``
            (its state dict: parameters and buffers written in place), or None (nothing here).

    Example:
        >>> w = torch.zeros(2)
        >>> d = Destination({"w": ShardedTensor(w, (4,), (2,))})
        >>> d.entries()[0].box, d.memory("w", Box((2,), (2,))).data_ptr() == w.data_ptr()
        (Box(offsets=(2,), sizes=(2,)), True)

    Raises:
        LayoutError: ``dst`` is not a destination, or a tensor of it shares memory between its own
            elements (an ``expand``-ed, stride-0 tensor), which no write can fill element by element.
    """

    def __init__(self, dst: DestinationLike) -> None:
        state = _state(dst, "the destination")
        self.shards: dict[str, list[ShardedTensor]] = {k: local_shards(k, v) for k, v in state.items()}
        aliased = sorted({k for k, shards in self.shards.items() for s in shards if self_overlapping(s.local)})
        if aliased:
            raise LayoutError(f"destination tensors {aliased} have elements that share memory (made by "
                              "expand() or a stride-0 view), so they cannot be written in place; pass "
                              "tensors that own their memory, e.g. t.expand(...).clone()")

    def entries(self) -> list[LayoutEntry]:
        """This rank's destination entries ``(key, global shape, dtype, box)``, sorted by key."""
        return [LayoutEntry(key, s.global_shape, dtype_name(s.dtype), s.box)
                for key in sorted(self.shards) for s in self.shards[key]]

    def memory(self, key: str, box: Box) -> torch.Tensor:
        """The tensor holding ``box`` of ``key`` on this rank, detached (writes land in the state):
        a shard with that box, or the view of ``box`` in a shard holding it.

        Raises:
            LayoutError: this rank holds no shard containing that box (the state changed after its
                layout was gathered).
        """
        for s in self.shards.get(key, ()):
            if s.box == box:
                return s.local.detach()
            if s.box.contains(box):  # the part of a shard that a shorter (padded) target fills
                return s.local.detach()[box.relative_to(s.box).slices()]
        raise LayoutError(f"{key!r}: this rank holds no destination shard {box}; the destination "
                          "changed after its layout was gathered")
