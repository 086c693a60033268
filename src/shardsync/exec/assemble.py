"""Local assembly: copy pieces (read from a source) into targets.

Every piece is one copy (:func:`~shardsync.exec.copies.copy_into`, on shardsync's copy threads) from
a view of its data (permuted as a view) straight into the target's memory: a cast and a permutation
cost one pass and no temporary. A chain of several casts (f32 -> bf16 -> f32) goes through
intermediate dtypes chunk by chunk, so that it rounds exactly as applying the casts in order does,
with temporaries of at most :data:`CHAIN_CHUNK_ELEMENTS` elements.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..layout.box import Box
from ..layout.dtypes import to_torch_dtype
from ..mapping.pieces import Piece
from .copies import Copies, copy_into, no_grad

__all__ = ["copy_piece", "copy_bits", "cast_into", "arrange", "piece_view", "CHAIN_CHUNK_ELEMENTS"]

#: Largest temporary (in elements) of a multi-cast chain.
CHAIN_CHUNK_ELEMENTS = 1 << 20


def _chain(x: torch.Tensor, casts: Sequence[str]) -> torch.Tensor:
    for c in casts:
        x = x.to(to_torch_dtype(c))
    return x


def cast_into(dst: torch.Tensor, src: torch.Tensor, casts: Sequence[str], batch: Copies | None = None) -> None:
    """``dst.copy_(src cast through casts)``, rounding exactly as applying each cast in order.

    The last cast is ``dst``'s dtype and is done by ``copy_`` itself; earlier ones are applied to
    chunks along dim 0 of at most :data:`CHAIN_CHUNK_ELEMENTS` elements, now (their temporaries are
    bounded that way). A single cast is added to ``batch`` when one is given.

    Example:
        >>> out = torch.empty(3)
        >>> cast_into(out, torch.tensor([1.0001, 2.0, 3.0]), ["bfloat16", "float32"])
        >>> out
        tensor([1., 2., 3.])
    """
    if len(casts) <= 1 or src.dim() == 0 or src.numel() == 0:
        (copy_into if batch is None else batch.add)(dst, _chain(src, casts[:-1]) if len(casts) > 1 else src)
        return
    rows = max(1, CHAIN_CHUNK_ELEMENTS // max(1, src[0].numel()))
    for start in range(0, src.shape[0], rows):
        stop = min(start + rows, src.shape[0])
        copy_into(dst[start:stop], _chain(src[start:stop], casts[:-1]))


def arrange(view: torch.Tensor, piece: Piece) -> torch.Tensor:
    """``view`` (the piece's source box) in the target's dims: permuted, its dropped unit dims moved
    last and reshaped away, new unit dims added. A view, never a copy.

    Example:
        >>> piece = Piece("s", Box((0, 0, 0), (1, 2, 3)), Box((0, 0), (3, 2)), perm=(2, 1))
        >>> arrange(torch.arange(6).reshape(1, 2, 3), piece).tolist()
        [[0, 3], [1, 4], [2, 5]]
    """
    if piece.perm is None:
        return view
    kept = [p for p in piece.perm if p >= 0]
    if len(kept) == view.dim() and len(kept) == len(piece.perm):
        return view.permute(kept)
    dropped = [d for d in range(view.dim()) if d not in kept]
    return view.permute(kept + dropped).reshape(piece.target_box.sizes)


def piece_view(data: torch.Tensor, origin: Box, piece: Piece) -> torch.Tensor:
    """The piece's source box, read from ``data`` (which holds the region ``origin`` of its source),
    in the target's dims (:func:`arrange`): what :func:`copy_piece` casts into the target. A view.

    Example:
        >>> piece = Piece("s", Box((0, 1), (2, 2)), Box((0, 0), (2, 2)), perm=(1, 0))
        >>> piece_view(torch.arange(6).reshape(2, 3), Box((0, 0), (2, 3)), piece).tolist()
        [[1, 4], [2, 5]]
    """
    view = piece.source_box.cut(data, origin)
    return arrange(view, piece) if piece.perm is not None else view


def copy_bits(out: np.ndarray, src: np.ndarray, origin: Box, piece: Piece, batch: Copies) -> bool:
    """:func:`copy_piece` between a target and data of one dtype, both seen as integers (what
    :func:`~shardsync.exec.copies.ints` gives of them), added to ``batch``, where the piece moves bits
    in row runs: no cast, no permutation. Returns False, doing nothing, where it does not: then
    :func:`copy_piece` does it. The executor's copy of an ordinary piece costs a few numpy slices this
    way instead of tensor views and checks (it runs once per piece and stream, with caches the copies
    just flushed).

    Example:
        >>> from shardsync.exec.copies import ints
        >>> out, data = torch.zeros(3, 2), torch.arange(12.).reshape(3, 4)
        >>> piece = Piece("s", Box((0, 1), (3, 2)), Box((0, 0), (3, 2)))
        >>> batch = Copies()
        >>> copy_bits(ints(out), ints(data), Box((0, 0), (3, 4)), piece, batch)
        True
        >>> batch.run()
        >>> out.tolist()
        [[1.0, 2.0], [5.0, 6.0], [9.0, 10.0]]
    """
    if piece.casts or piece.perm is not None:
        return False
    # the trailing ``...`` keeps a 0-d array a view (``a[()]`` is a numpy scalar: a copy)
    return batch.add_ints(out[piece.target_box.slices() + (...,)], src[piece.source_box.slices_in(origin) + (...,)])


@no_grad
def copy_piece(
    out: torch.Tensor,
    data: torch.Tensor,
    origin: Box,
    piece: Piece,
    batch: Copies | None = None,
    out_ints: np.ndarray | None = None,
    data_ints: np.ndarray | None = None,
) -> None:
    """Write ``piece`` into target ``out``, reading its source box from ``data`` located at ``origin``
    (with ``batch``, when it runs: see :func:`cast_into`).

    Args:
        out: the target tensor.
        data: a tensor holding the region ``origin`` of the piece's source (a shard or a received read).
        origin: global box of ``data``; must contain ``piece.source_box``.
        piece: what to copy and how (permutation, casts).
        batch: the batch to add the copy to (else it runs now).
        out_ints, data_ints: ``out`` and ``data`` as integers (:func:`~shardsync.exec.copies.ints`),
            where the caller has them, ``data`` cannot overlap ``out`` and has its dtype: an ordinary
            piece then goes through :func:`copy_bits` (with ``batch``).

    Example:
        >>> out = torch.zeros(3, 2)
        >>> piece = Piece("s", Box((0, 0), (2, 3)), Box((0, 0), (3, 2)), perm=(1, 0))
        >>> copy_piece(out, torch.arange(6.).reshape(2, 3), Box((0, 0), (2, 3)), piece)
        >>> out
        tensor([[0., 3.],
                [1., 4.],
                [2., 5.]])
    """
    if (
        out_ints is not None
        and data_ints is not None
        and batch is not None
        and copy_bits(out_ints, data_ints, origin, piece, batch)
    ):
        return
    box = piece.target_box
    region = out if box.sizes == out.shape else out[box.slices()]  # the whole target: no view to make
    cast_into(region, piece_view(data, origin, piece), piece.casts, batch)
