"""Local assembly: read boxes of this rank's shards and copy pieces into targets.

Every piece is one ``copy_`` from a view of its data (permuted as a view) straight into the target's
memory: a cast and a permutation cost one pass and no temporary. A chain of several casts (f32 ->
bf16 -> f32) goes through intermediate dtypes chunk by chunk, so that it rounds exactly as applying the
casts in order does, with temporaries of at most :data:`CHAIN_CHUNK_ELEMENTS` elements.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..errors import LayoutError
from ..layout.box import Box
from ..layout.dtypes import to_torch_dtype
from ..layout.sharded import ShardedTensor, StateValue, local_shards
from ..mapping.pieces import Piece

__all__ = ["LocalSource", "copy_piece", "cast_into", "CHAIN_CHUNK_ELEMENTS"]

#: Largest temporary (in elements) of a multi-cast chain.
CHAIN_CHUNK_ELEMENTS = 1 << 20


class LocalSource:
    """This rank's shards, by key, read in place.

    Args:
        state: the state dict (values: tensor, ShardedTensor, DTensor or list of ShardedTensor).

    Example:
        >>> src = LocalSource({"w": torch.arange(6.).reshape(2, 3)})
        >>> src.read("w", Box((1, 0), (1, 2)))
        tensor([[3., 4.]])
    """

    def __init__(self, state: Mapping[str, StateValue]) -> None:
        #: key -> this rank's shards, normalised once (also what the layout is gathered from)
        self.shards: dict[str, list[ShardedTensor]] = {k: local_shards(k, v) for k, v in state.items()}

    def find(self, key: str, box: Box) -> ShardedTensor | None:
        """A local shard of ``key`` containing ``box``, or None."""
        for s in self.shards.get(key, ()):
            if s.box.contains(box):
                return s
        return None

    def read(self, key: str, box: Box) -> torch.Tensor:
        """A view of ``box`` (global coordinates) of ``key``.

        Raises:
            LayoutError: no local shard contains the box (the plan says this rank holds it).
        """
        shard = self.find(key, box)
        if shard is None:
            raise LayoutError(f"{key!r}: this rank holds no shard containing {box}; the layout this "
                              "rank reported does not match its state (was the state changed after "
                              "the stream started?)")
        if box == shard.box:
            return shard.local
        return shard.local[box.relative_to(shard.box).slices()]

    def device(self) -> torch.device:
        """Device of the first local tensor (cpu when there is none)."""
        for shards in self.shards.values():
            for s in shards:
                return s.local.device
        return torch.device("cpu")


def _chain(x: torch.Tensor, casts: Sequence[str]) -> torch.Tensor:
    for c in casts:
        x = x.to(to_torch_dtype(c))
    return x


def cast_into(dst: torch.Tensor, src: torch.Tensor, casts: Sequence[str]) -> None:
    """``dst.copy_(src cast through casts)``, rounding exactly as applying each cast in order.

    The last cast is ``dst``'s dtype and is done by ``copy_`` itself; earlier ones are applied to
    chunks along dim 0 of at most :data:`CHAIN_CHUNK_ELEMENTS` elements.

    Example:
        >>> out = torch.empty(3)
        >>> cast_into(out, torch.tensor([1.0001, 2.0, 3.0]), ["bfloat16", "float32"])
        >>> out
        tensor([1., 2., 3.])
    """
    if len(casts) <= 1 or src.dim() == 0 or src.numel() == 0:
        dst.copy_(_chain(src, casts[:-1]) if len(casts) > 1 else src)
        return
    rows = max(1, CHAIN_CHUNK_ELEMENTS // max(1, src[0].numel()))
    for start in range(0, src.shape[0], rows):
        stop = min(start + rows, src.shape[0])
        dst[start:stop].copy_(_chain(src[start:stop], casts[:-1]))


@torch.no_grad()
def copy_piece(out: torch.Tensor, data: torch.Tensor, origin: Box, piece: Piece) -> None:
    """Write ``piece`` into target ``out``, reading its source box from ``data`` located at ``origin``.

    Args:
        out: the target tensor.
        data: a tensor holding the region ``origin`` of the piece's source (a shard or a received read).
        origin: global box of ``data``; must contain ``piece.source_box``.
        piece: what to copy and how (permutation, casts).

    Example:
        >>> out = torch.zeros(3, 2)
        >>> piece = Piece("s", Box((0, 0), (2, 3)), Box((0, 0), (3, 2)), perm=(1, 0))
        >>> copy_piece(out, torch.arange(6.).reshape(2, 3), Box((0, 0), (2, 3)), piece)
        >>> out
        tensor([[0., 3.],
                [1., 4.],
                [2., 5.]])
    """
    view = data[piece.source_box.relative_to(origin).slices()]
    if piece.perm is not None:
        view = view.permute(piece.perm)
    cast_into(out[piece.target_box.slices()], view, piece.casts)
