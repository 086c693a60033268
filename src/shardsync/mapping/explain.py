"""explain(): how each target of a mapping is built, for debugging a mapping."""

from __future__ import annotations

from typing import Any

from ..layout.meta import GlobalLayout
from .pieces import Piece, TargetSpec
from .program import MappingLike
from .resolver import resolve

__all__ = ["explain", "describe_targets"]


def _piece_line(p: Piece) -> str:
    line = f"    {p.source}{p.source_box} -> {p.target_box}"
    if p.perm is not None and (len(p.perm) != p.source_box.ndim or -1 in p.perm):
        line += f"  view {['new' if d < 0 else d for d in p.perm]}"  # unit dims dropped or added
    elif p.perm is not None:
        line += f"  permute {list(p.perm)}"
    if p.casts:
        line += "  cast " + " -> ".join(p.casts)
    return line


def describe_targets(targets: list[TargetSpec]) -> str:
    """A readable listing: each target's name, shape and dtype, then its pieces."""
    lines = []
    total = 0
    for t in targets:
        total += t.nbytes
        srcs = ", ".join(t.sources)
        lines.append(
            f"{t.name}  {list(t.shape)} {t.dtype}  ({len(t.pieces)} piece"
            f"{'s' if len(t.pieces) != 1 else ''} from {srcs or 'nothing'})"
        )
        lines += [_piece_line(p) for p in t.pieces]
    lines.append(f"{len(targets)} targets, {total / 2**20:.2f} MiB")
    return "\n".join(lines)


def explain(state_or_layout: Any, mapping: MappingLike | None = None, *, reverse: bool | None = None) -> str:
    """Describe how every target of ``mapping`` is built from ``state_or_layout``.

    Args:
        state_or_layout: a :class:`GlobalLayout`, or anything
            :func:`~shardsync.sources.open_source` takes: a state dict (this process's tensors), a
            Source, or a checkpoint path (safetensors or DCP; only headers or metadata are read).
        mapping: anything :meth:`Mapping.parse` takes; None means identity.
        reverse: overrides the mapping's reverse flag.

    Returns:
        one block per target: ``name [shape] dtype`` then a line per piece,
        ``source[box] -> [target box]`` with its permutation and casts.

    Raises:
        MappingError: the mapping does not resolve against the layout.
        FormatError: a checkpoint path that is missing, incomplete or corrupt.

    Example:
        >>> import torch
        >>> print(explain({"w": torch.zeros(4, 2)}, ["w^T -> wt"]).splitlines()[0])
        wt  [2, 4] float32  (1 piece from w)
    """
    if isinstance(state_or_layout, GlobalLayout):
        layout = state_or_layout
    else:
        from ..sources import open_source  # sources sit below the mapping layer; only explain needs them

        layout = GlobalLayout.merge([open_source(state_or_layout).entries()])
    return describe_targets(resolve(mapping, layout, reverse=reverse))
