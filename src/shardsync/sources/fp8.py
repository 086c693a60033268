"""Block-FP8 weights as values: a source that presents each FP8 weight and its scales as one tensor.

:class:`Fp8Source` wraps any source (a path, a state dict, a Source). Each ``float8_e4m3fn`` weight
with a ``<name>_scale_inv`` companion becomes one fp32 tensor in the layout, and its scale key leaves
the layout, so mappings and the planner see the weights only. Reading a box reads its codes and only
the scales of the blocks it touches, and dequantises them (:func:`shardsync.quant.dequantize`): a
tensor-parallel shard that cuts through a block reads that block's scale too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import torch

from ..errors import LayoutError
from ..layout.box import Box
from ..layout.meta import LayoutEntry
from ..quant.fp8 import (
    CODE_DTYPES,
    DEFAULT_BLOCK,
    SCALE_SUFFIX,
    Block,
    block_size_from_config,
    check_block,
    dequantize,
    scale_box,
    scale_key,
    scale_shape,
)
from .base import Source
from .dcp import DcpSource
from .open import SourceLike, SpreadSource, open_source
from .safetensors import SafetensorsSource
from .select import SelectedSource

__all__ = ["Fp8Source", "Unscaled", "dequantized", "fp8_block"]

#: What to do with an FP8 tensor that has no scales: refuse it, cast its codes as values, or keep it as
#: FP8 (a cast of it is then refused when planned, see :func:`shardsync.quant.check_fp8_casts`).
Unscaled = Literal["error", "cast", "keep"]


class Fp8Source:
    """``source`` with its block-FP8 weights dequantised to fp32, and their scale keys left out.

    Opened lazily, on first use (inside the streamers' agreed phase, so that a bad checkpoint fails on
    every rank together). Other tensors pass through unchanged.

    Args:
        source: a checkpoint path, a state dict or a Source.
        block: rows x columns of a block; None: ``quantization_config.weight_block_size`` of the
            checkpoint's ``config.json`` (for a path), else 128 x 128.
        unscaled: an FP8 tensor without scales is an error (``"error"``), is cast as if its codes were
            values (``"cast"``), or stays FP8 (``"keep"``: what load and reshard use, so that an FP8
            destination gets it as it is and any other is refused when planned).

    Raises:
        LayoutError: (on first use) an FP8 tensor without scales (``unscaled="error"``), scales of
            the wrong shape or dtype for their weight's blocks, scales without their weight, or a rank
            whose shard of a weight lacks the scales of the blocks it touches. Each message names the tensor.

    Example:
        >>> from shardsync.quant import dequantize, quantize
        >>> q, s = quantize(torch.randn(17, 2), (8, 8))
        >>> src = Fp8Source({"w": q, "w_scale_inv": s}, block=(8, 8))
        >>> [(e.key, e.dtype) for e in src.entries()]
        [('w', 'float32')]
        >>> torch.equal(src.read("w", Box((9, 0), (8, 2))), dequantize(q, s, (8, 8))[9:])
        True
    """

    def __init__(
        self, source: SourceLike, *, block: tuple[int, int] | None = None, unscaled: Unscaled = "error"
    ) -> None:
        self._given = source
        self._block = None if block is None else check_block(block)
        if unscaled not in ("error", "cast", "keep"):
            raise LayoutError(f"unscaled={unscaled!r}: use 'error', 'cast' or 'keep'")
        self.unscaled = unscaled
        self._inner: Source | None = None
        self._pairs: set[str] | None = None  # the paired weights, known once entries() ran

    @property
    def inner(self) -> Source:
        """The wrapped source (opened on first use)."""
        if self._inner is None:
            inner = open_source(self._given)
            if self._block is None:
                self._block = block_size_from_config(_directory(self._given, inner))
            self._inner = inner
        return self._inner

    @property
    def block(self) -> Block:
        """Rows x columns of a block."""
        _ = self.inner
        assert self._block is not None
        return self._block

    @property
    def shared(self) -> bool:
        """Whether every rank sees the same data (files): then the streamers spread its boxes."""
        return bool(getattr(self.inner, "shared", False))

    def entries(self) -> list[LayoutEntry]:
        """The inner entries, each paired FP8 weight as fp32 and its scale entries left out.

        Raises:
            LayoutError: see the class.
        """
        raw = self.inner.entries()
        by_key: dict[str, list[LayoutEntry]] = {}
        for e in raw:
            by_key.setdefault(e.key, []).append(e)
        problems: list[str] = []
        pairs = {k for k, es in by_key.items() if es[0].dtype in CODE_DTYPES and scale_key(k) in by_key}
        for key in sorted(pairs):
            problems += _pair_problems(key, by_key[key], by_key[scale_key(key)], self.block)
        problems += _stray_problems(by_key, pairs, self.unscaled)
        if problems:
            raise LayoutError("block-FP8 weights cannot be read as values:\n  " + "\n  ".join(problems))
        self._pairs = pairs
        scales = {scale_key(k) for k in pairs}
        cast = self.unscaled == "cast"
        return [
            e._replace(dtype="float32") if e.key in pairs or (cast and e.dtype in CODE_DTYPES) else e
            for e in raw
            if e.key not in scales
        ]

    def read(self, key: str, box: Box) -> torch.Tensor:
        """The fp32 values of ``box`` of a paired weight (its codes and the scales of the blocks it
        touches, dequantised); any other tensor's data as the inner source reads it."""
        inner = self.inner
        if self._pairs is None:
            self.entries()
        assert self._pairs is not None
        if key in self._pairs:
            codes = inner.read(key, box)
            scales = inner.read(scale_key(key), scale_box(box, self.block))
            return dequantize(codes, scales, self.block, box.offsets)
        data = inner.read(key, box)
        return data.to(torch.float32) if self.unscaled == "cast" and _is_code(data.dtype) else data

    def device(self) -> torch.device:
        """The inner source's device."""
        return self.inner.device()

    def __repr__(self) -> str:
        return f"Fp8Source({self._given!r}, block={self._block})"


def dequantized(source: SourceLike, *, unscaled: Unscaled = "error") -> Source:
    """``source`` read through :class:`Fp8Source` (kept as it is when it already is one).

    Example:
        >>> dequantized({"w": torch.zeros(2)}).entries()[0].dtype
        'float32'
    """
    if isinstance(source, Fp8Source):
        return source
    return Fp8Source(source, unscaled=unscaled)


def fp8_block(source: Source) -> Block:
    """The block of ``source``'s block-FP8 weights, for a mapping that cuts them without a dtype: an
    :class:`Fp8Source`'s own, else ``config.json``'s ``weight_block_size`` of the checkpoint it reads
    (through the sources that narrow or spread it), else 128 x 128.

    Example:
        >>> fp8_block(Fp8Source({"w": torch.zeros(2)}, block=(64, 32)))
        (64, 32)
    """
    while isinstance(source, (SpreadSource, SelectedSource)):
        source = source.inner
    if isinstance(source, Fp8Source):
        return source.block
    if isinstance(source, (SafetensorsSource, DcpSource)):
        return block_size_from_config(_directory(source.path, source))
    return DEFAULT_BLOCK


def _directory(given: SourceLike, inner: Source) -> Path | None:
    """Where the checkpoint's ``config.json`` would be."""
    if isinstance(given, (str, os.PathLike)):
        path = Path(given)
    elif isinstance(inner, (SafetensorsSource, DcpSource)):
        path = inner.path
    else:
        return None
    return path if path.is_dir() else path.parent


def _is_code(dtype: torch.dtype) -> bool:
    return str(dtype).removeprefix("torch.") in CODE_DTYPES


def _pair_problems(key: str, weight: list[LayoutEntry], scales: list[LayoutEntry], block: Block) -> list[str]:
    """What is wrong with one weight and its scales on this rank (nothing: an empty list)."""
    s0 = scales[0]
    want = scale_shape(weight[0].shape, block) if len(weight[0].shape) >= 2 else None
    if want is None:
        return [f"{key!r}: FP8 weight of shape {list(weight[0].shape)} has block scales, which need 2 or more dims"]
    if s0.shape != want or s0.dtype in CODE_DTYPES or s0.dtype not in ("float32", "bfloat16", "float16"):
        return [
            f"{scale_key(key)!r}: {s0.dtype} scales of shape {list(s0.shape)} do not fit weight {key!r} of "
            f"shape {list(weight[0].shape)} in blocks of {list(block)}: want float32 of shape {list(want)}; "
            "fix the scales, or give the block the checkpoint was quantised with (config.json's "
            "quantization_config.weight_block_size, or Fp8Source(block=...))"
        ]
    held = [s.box for s in scales]
    return [
        f"{key!r}{w.box}: this rank holds its codes but not the scales of the blocks it touches "
        f"({scale_key(key)!r}{scale_box(w.box, block)}); give each rank the scale rows and columns of "
        "its shard's blocks"
        for w in weight
        if not any(h.contains(scale_box(w.box, block)) for h in held)
    ]


def _stray_problems(by_key: dict[str, list[LayoutEntry]], pairs: set[str], unscaled: Unscaled) -> list[str]:
    """FP8 tensors without scales (when they are an error), and scales without an FP8 weight."""
    problems = []
    for key, es in sorted(by_key.items()):
        if es[0].dtype in CODE_DTYPES and key not in pairs and unscaled == "error":
            problems.append(
                f"{key!r}: {es[0].dtype} without scales ({scale_key(key)!r}), so its codes are "
                "not values; add the scales, or cast the codes as they are with "
                "cast_unscaled_fp8=True (CLI: --cast-unscaled-fp8; Fp8Source(unscaled='cast'))"
            )
        if key.endswith(SCALE_SUFFIX) and key.removesuffix(SCALE_SUFFIX) not in pairs:
            weight = key.removesuffix(SCALE_SUFFIX)
            what = (
                f"its weight {weight!r} is {by_key[weight][0].dtype}, not FP8"
                if weight in by_key
                else f"there is no weight {weight!r}"
            )
            problems.append(f"{key!r}: scales, but {what}; drop them or fix the weight's name")
    return problems
