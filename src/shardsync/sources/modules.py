"""A module as a state: its tensors by state-dict key, sharing memory with its parameters and buffers.

Every verb takes an ``nn.Module`` where it takes a state dict (:data:`~shardsync.sources.SourceLike`);
this is what it reads or writes. A Megatron-style module, whose own state dict holds local shapes, is
refused with the call that places it (:func:`~shardsync.from_megatron`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import LayoutError
from ..layout.sharded import StateValue
from .megatron import megatron_module_error

__all__ = ["module_state", "state_of"]


def _identity(t: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...]] | None:
    """Where a tensor's data lives (None for no data: empty tensors are never tied)."""
    local = t.to_local() if type(t).__name__ == "DTensor" else t  # type: ignore[attr-defined]
    if local.numel() == 0:
        return None
    return (local.untyped_storage().data_ptr(), int(local.storage_offset()), tuple(t.shape), tuple(local.stride()))


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


def state_of(value: object, what: str) -> Mapping[str, StateValue]:
    """``value`` (a state dict, a module, or None for nothing on this rank) as a state dict.

    Raises:
        LayoutError: a Megatron-style module (use ``from_megatron``), or ``value`` is none of these.

    Example:
        >>> state_of(None, "the destination")
        {}
    """
    if value is None:
        return {}
    if isinstance(value, torch.nn.Module):
        error = megatron_module_error(value, what)
        if error is not None:
            raise error
        return module_state(value)
    if isinstance(value, Mapping):
        return value
    raise LayoutError(
        f"{what} is a {type(value).__name__}; pass a state dict (tensors, LocalShard, "
        "DTensor), an nn.Module, a Source, or None for nothing on this rank"
    )
