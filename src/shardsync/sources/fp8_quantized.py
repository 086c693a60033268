"""Values read as block FP8, for destinations that hold FP8 shards and their scale shards.

:class:`QuantizedSource` presents chosen weights of a source of values as ``float8_e4m3fn`` codes plus
a ``<name>_scale_inv`` key of fp32 scales (:func:`shardsync.quant.quantize`: ``amax / 448`` per
block). Every box of codes or scales is computed from the whole blocks it touches, so two ranks whose
shards cut the same block get the same scale for it: the scales split consistently with the codes.
:func:`for_destination` picks what load and reshard read for a destination.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..errors import LayoutError
from ..layout.box import Box
from ..layout.meta import LayoutEntry
from ..quant.fp8 import (
    CODE_DTYPES,
    DEFAULT_BLOCK,
    SCALE_SUFFIX,
    Block,
    check_block,
    quantize,
    scale_box,
    scale_key,
    scale_shape,
)
from .base import Source
from .fp8 import dequantized

__all__ = ["QuantizedSource", "for_destination"]


class QuantizedSource:
    """``source`` with the weights ``keys`` (held as values) read as block-FP8 codes and scales.

    Args:
        source: what holds the values.
        keys: the weights to quantise; others (and any already FP8) pass through unchanged.
        block: rows x columns of a block.

    Raises:
        LayoutError: (in :meth:`entries`) a shard of a chosen weight that does not hold whole blocks:
            its scales need values another rank holds.

    Example:
        >>> from shardsync.sources import LocalSource
        >>> src = QuantizedSource(LocalSource({"w": torch.arange(6.).reshape(2, 3)}), {"w"}, block=(2, 2))
        >>> [(e.key, e.dtype, e.shape) for e in src.entries()]
        [('w', 'float8_e4m3fn', (2, 3)), ('w_scale_inv', 'float32', (1, 2))]
        >>> bool(src.read("w_scale_inv", Box((0, 1), (1, 1))) == torch.tensor(5.0) / 448)   # block column 1
        True
    """

    def __init__(self, source: Source, keys: Iterable[str], *, block: tuple[int, int] = DEFAULT_BLOCK) -> None:
        self.inner = source
        self.keys = frozenset(keys)
        self.block: Block = check_block(block)
        self._shapes: dict[str, tuple[int, ...]] = {}

    @property
    def shared(self) -> bool:
        """Whether every rank sees the same data (files)."""
        return bool(getattr(self.inner, "shared", False))

    def entries(self) -> list[LayoutEntry]:
        """The inner entries; each chosen weight as codes, followed by the entry of its scales."""
        out, problems = [], []
        for e in self.inner.entries():
            if e.key not in self.keys or e.dtype in CODE_DTYPES or len(e.shape) < 2:
                out.append(e)
                continue
            self._shapes[e.key] = e.shape
            if _whole_blocks(e.box, e.shape, self.block) != e.box:
                problems.append(
                    f"{e.key!r}{e.box}: this rank's shard cuts blocks of {list(self.block)}, so "
                    "it cannot compute their scales alone; quantise from a checkpoint (every rank "
                    "reads whole blocks) or shard the source on block boundaries"
                )
            out.append(e._replace(dtype="float8_e4m3fn"))
            out.append(
                LayoutEntry(
                    scale_key(e.key),
                    scale_shape(e.shape, self.block),
                    "float32",
                    scale_box(e.box, self.block),
                    e.fingerprint,
                )
            )
        if problems:
            raise LayoutError("cannot quantise to block FP8:\n  " + "\n  ".join(problems))
        return sorted(out, key=lambda e: e.key)

    def read(self, key: str, box: Box) -> torch.Tensor:
        """Codes or scales of ``box``, quantised from the whole blocks it touches; other keys as the
        inner source reads them."""
        weight = key.removesuffix(SCALE_SUFFIX)
        if key != weight and weight in self._shapes:
            blocks = _blocks_of_scales(box, self._shapes[weight], self.block)
            return quantize(self.inner.read(weight, blocks), self.block)[1]
        if key not in self._shapes:
            return self.inner.read(key, box)
        whole = _whole_blocks(box, self._shapes[key], self.block)
        codes, _ = quantize(self.inner.read(key, whole), self.block)
        return box.cut(codes, whole)

    def device(self) -> torch.device:
        """The inner source's device."""
        return self.inner.device()


def _whole_blocks(box: Box, shape: tuple[int, ...], block: Block) -> Box:
    """``box`` grown to the blocks it touches (clipped to the tensor)."""
    return _blocks_of_scales(scale_box(box, block), shape, block)


def _blocks_of_scales(sbox: Box, shape: tuple[int, ...], block: Block) -> Box:
    """The box of weight values that the scales ``sbox`` cover (clipped to the tensor)."""
    *lead_off, r, c = sbox.offsets
    *lead_size, nr, nc = sbox.sizes
    r0, c0 = r * block[0], c * block[1]
    r1, c1 = min((r + nr) * block[0], shape[-2]), min((c + nc) * block[1], shape[-1])
    return Box((*lead_off, r0, c0), (*lead_size, r1 - r0, c1 - c0))


def for_destination(source: Source, dest: Iterable[LayoutEntry]) -> Source:
    """What load and reshard read for a destination: a destination that holds scales gets FP8 as it
    is and its other FP8 weights (``float8_e4m3fn`` keys with a ``*_scale_inv`` key) quantised from
    values by name (:class:`QuantizedSource`); any other destination gets block-FP8 weights
    dequantised, to be cast to its dtypes (FP8 without scales stays FP8: only an FP8 destination
    takes it).

    Example:
        >>> from shardsync.sources import LocalSource
        >>> type(for_destination(LocalSource({"w": torch.zeros(2)}), [])).__name__
        'Fp8Source'
    """
    held = {e.key: e.dtype for e in dest}
    if not any(k.endswith(SCALE_SUFFIX) for k in held):
        return dequantized(source, unscaled="keep")
    fp8 = {k for k, dtype in held.items() if dtype in CODE_DTYPES and scale_key(k) in held}
    return QuantizedSource(source, fp8)
