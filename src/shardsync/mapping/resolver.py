"""Resolver: a mapping program plus a layout -> every target as pieces of source boxes."""

from __future__ import annotations

from ..layout.box import Box
from ..layout.meta import GlobalLayout
from .pieces import Piece, TargetSpec

__all__ = ["resolve"]


def resolve(mapping: object | None, layout: GlobalLayout) -> list[TargetSpec]:
    """Resolve ``mapping`` against ``layout``; returns targets sorted by name.

    With ``mapping=None`` every source key is a target of its own (identity).
    """
    if mapping is None:
        return [TargetSpec(k, m.shape, m.dtype, (Piece(k, Box.full(m.shape), Box.full(m.shape)),))
                for k, m in sorted(layout.tensors.items())]
    raise TypeError("mapping programs are resolved by the mapping layer (in progress)")
