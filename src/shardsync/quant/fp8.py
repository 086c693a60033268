"""Block FP8 (DeepSeek-V3, transformers ``FineGrainedFP8``): the block grid, dequantise, quantise.

A block-FP8 weight is a ``float8_e4m3fn`` tensor ``q`` with a companion ``<name>_scale_inv`` (fp32,
one scale per block of ``block`` elements over the last two dims, partial blocks at the edges; any
leading dims, as for stacked experts, have one scale row each). Its value is ``q.float() * scale``,
block by block, in fp32 (what DeepSeek's ``weight_dequant`` and transformers' dequantisation do).
Quantising takes the block's largest magnitude to the largest e4m3 value: ``scale = amax / 448``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import LayoutError, PlanError
from ..layout.box import Box
from ..layout.dtypes import dtype_name, to_torch_dtype

if TYPE_CHECKING:  # the mapping imports this module (its block-FP8 pairs): no import at run time
    from ..mapping import TargetSpec

__all__ = [
    "FP8_MAX",
    "DEFAULT_BLOCK",
    "SCALE_SUFFIX",
    "CODE_DTYPES",
    "DEFAULT_SKIP",
    "Block",
    "scale_key",
    "scale_shape",
    "scale_box",
    "dequantize",
    "quantize",
    "block_size_from_config",
    "check_block",
    "quantization_config",
    "Fp8Quantize",
    "written",
    "check_fp8_casts",
    "check_fp8_fills",
]

#: Largest finite ``float8_e4m3fn`` value.
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
#: Rows x columns of one block: DeepSeek-V3's, and transformers' default.
DEFAULT_BLOCK = (128, 128)
#: The companion of weight ``w`` is ``w`` + this suffix (``...proj.weight_scale_inv``).
SCALE_SUFFIX = "_scale_inv"
#: dtype names whose elements are codes that mean nothing without their scales.
CODE_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"})
#: Targets never quantised by default (regular expressions, searched in the name): embeddings, norms,
#: the output head, and MoE routers (``mlp.gate.weight``; ``gate_proj`` is a Linear and is quantised).
DEFAULT_SKIP = (r"embed", r"norm", r"(^|\.)lm_head\.", r"(^|\.)gate\.weight$", r"router")

#: Rows x columns of a block.
Block = tuple[int, int]


def scale_key(name: str) -> str:
    """The key of the scales of weight ``name``.

    Example:
        >>> scale_key("model.layers.0.mlp.up_proj.weight")
        'model.layers.0.mlp.up_proj.weight_scale_inv'
    """
    return name + SCALE_SUFFIX


def scale_shape(shape: Sequence[int], block: Block) -> tuple[int, ...]:
    """The shape of the scales of a weight of ``shape``: one per block, partial blocks included.

    Example:
        >>> scale_shape((300, 17), (128, 128)), scale_shape((4, 256, 129), (128, 128))
        ((3, 1), (4, 2, 2))
    """
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def scale_box(box: Box, block: Block) -> Box:
    """The box of the scales that ``box`` of a weight needs (the blocks it touches, even in part).

    Example:
        >>> scale_box(Box((64, 0), (128, 17)), (128, 128))   # rows 64..191 touch block rows 0 and 1
        Box(offsets=(0, 0), sizes=(2, 1))
    """
    *lead_off, r, c = box.offsets
    *lead_size, nr, nc = box.sizes
    first = (r // block[0], c // block[1])
    last = ((r + nr - 1) // block[0] + 1 if nr else first[0], (c + nc - 1) // block[1] + 1 if nc else first[1])
    return Box((*lead_off, *first), (*lead_size, last[0] - first[0], last[1] - first[1]))


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, block: Block, offsets: Sequence[int] | None = None
) -> torch.Tensor:
    """fp32 values of ``q`` (codes), each block multiplied by its scale.

    Args:
        q: the codes of a box of the weight (``float8_e4m3fn``).
        scale: the scales that box needs (:func:`scale_box`), fp32.
        block: rows x columns of a block.
        offsets: where the box starts in the weight (None: the whole weight, from 0).

    Example:
        >>> q = torch.tensor([[1., 2., 3.]]).to(torch.float8_e4m3fn)
        >>> dequantize(q, torch.tensor([[0.5, 4.0]]), (1, 2)).tolist()
        [[0.5, 1.0, 12.0]]
    """
    r0, c0 = (0, 0) if offsets is None else (offsets[-2] % block[0], offsets[-1] % block[1])
    rows, cols = q.shape[-2:]
    grid = scale.to(torch.float32).repeat_interleave(block[0], dim=-2)[..., r0 : r0 + rows, :]
    grid = grid.repeat_interleave(block[1], dim=-1)[..., c0 : c0 + cols]
    return q.to(torch.float32) * grid


def quantize(w: torch.Tensor, block: Block = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``w``: e4m3 codes, and per block the fp32 scale ``amax / 448``.

    An all-zero block gets scale 1 and zero codes (it dequantises to 0, and nothing divides by 0).

    Example:
        >>> q, s = quantize(torch.tensor([[0., 0., 1., -896.]]), (1, 2))
        >>> q.float().tolist(), s.tolist()
        ([[0.0, 0.0, 0.5, -448.0]], [[1.0, 2.0]])
    """
    if w.dim() < 2:
        raise PlanError(f"block FP8 needs a tensor of 2 or more dims, got shape {list(w.shape)}")
    x = w.detach().to(torch.float32)
    *lead, rows, cols = x.shape
    pad_r, pad_c = -rows % block[0], -cols % block[1]
    padded = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))  # zeros never raise a block's amax
    tiles = padded.unflatten(-1, (-1, block[1])).unflatten(-3, (-1, block[0]))  # (..., R, b0, C, b1)
    amax = tiles.abs().amax(dim=(-3, -1))
    # a tensor divisor: CUDA divides by a Python number as a multiply by its (rounded) reciprocal, an
    # ulp off the host's correctly rounded quotient now and then; tensor by tensor, both round alike
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    codes = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    codes = codes.flatten(-2).flatten(-3, -2)[..., :rows, :cols]
    return codes.contiguous(), scale.contiguous()


def block_size_from_config(directory: str | Path | None) -> Block:
    """The block of a checkpoint: ``quantization_config.weight_block_size`` of its ``config.json``
    (:data:`DEFAULT_BLOCK` when there is no such file or key).

    Raises:
        LayoutError: the entry is not two positive integers.

    Example:
        >>> block_size_from_config(None)
        (128, 128)
    """
    path = None if directory is None else Path(directory) / "config.json"
    if path is None or not path.is_file():
        return DEFAULT_BLOCK
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):  # too deeply nested, too
        return DEFAULT_BLOCK  # not ours to judge: the weights are read without it (and the file checked)
    q = config.get("quantization_config") if isinstance(config, dict) else None
    size = q.get("weight_block_size") if isinstance(q, dict) else None
    return DEFAULT_BLOCK if size is None else check_block(size, f"{path}: weight_block_size")


def check_block(size: Any, what: str = "block") -> Block:
    """``size`` as a block, checked: two positive integers.

    Raises:
        LayoutError: it is not (the message names ``what``).
    """
    ok = (
        isinstance(size, (list, tuple))
        and len(size) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in size)
    )
    if not ok:
        raise LayoutError(f"{what} = {size!r}: give two positive integers, rows and columns (e.g. [128, 128])")
    return int(size[0]), int(size[1])


def quantization_config(block: Block, skipped: Sequence[str] = ()) -> dict[str, Any]:
    """The ``quantization_config`` of ``config.json`` for block-FP8 weights, as DeepSeek-V3 and
    transformers' FineGrainedFP8 read it; ``skipped`` are the modules left unquantised.

    Example:
        >>> quantization_config((128, 128))["weight_block_size"]
        [128, 128]
    """
    config: dict[str, Any] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    if skipped:
        config["modules_to_not_convert"] = sorted(skipped)
    return config


@dataclass(frozen=True)
class Fp8Quantize:
    """Which targets to quantise to block FP8 on the way out, and the block.

    Attributes:
        block: rows x columns of a block.
        patterns: regular expressions; a floating target of 2 or more dims whose name one of them
            matches (``re.search``) is quantised. None: every ``*.weight`` of 2 or more dims except
            :data:`DEFAULT_SKIP` (the Linear weights).

    Example:
        >>> q = Fp8Quantize()
        >>> [n for n in ("layers.0.q_proj.weight", "embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")
        ...  if q.selects(n, (256, 256), "bfloat16")]
        ['layers.0.q_proj.weight']
    """

    block: Block = DEFAULT_BLOCK
    patterns: tuple[str, ...] | None = None

    @classmethod
    def of(
        cls, quantize: str | None, block: Any = DEFAULT_BLOCK, patterns: Sequence[str] | None = None
    ) -> Fp8Quantize | None:
        """The checked options of a ``quantize=`` argument (None: no quantising).

        Raises:
            PlanError: an unknown format, a bad block, or a pattern that is not a regular expression.
        """
        if quantize is None:
            return None
        if quantize != "fp8":
            raise PlanError(f"quantize={quantize!r}: the one format is 'fp8' (block FP8, e4m3)")
        try:
            checked = check_block(block, "quantize_block")
        except LayoutError as exc:
            raise PlanError(str(exc)) from None
        if patterns is not None:
            patterns = tuple(patterns)
            for p in patterns:
                try:
                    re.compile(p)
                except (re.error, TypeError) as exc:
                    raise PlanError(f"quantize pattern {p!r} is not a regular expression: {exc}") from None
        return cls(checked, patterns)

    def selects(self, name: str, shape: Sequence[int], dtype: str) -> bool:
        """Whether target ``name`` (of ``shape`` and dtype name ``dtype``) is quantised."""
        if len(shape) < 2 or dtype in CODE_DTYPES or not to_torch_dtype(dtype).is_floating_point:
            return False
        if self.patterns is not None:
            return any(re.search(p, name) for p in self.patterns)
        return name.endswith("weight") and not any(re.search(p, name) for p in DEFAULT_SKIP)

    def split(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """``[(name, codes), (name_scale_inv, scales)]``, or ``[(name, tensor)]`` when not selected."""
        if not self.selects(name, tuple(tensor.shape), dtype_name(tensor.dtype)):
            return [(name, tensor)]
        codes, scales = quantize(tensor, self.block)
        return [(name, codes), (scale_key(name), scales)]


def written(
    name: str, tensor: torch.Tensor, fp8: Fp8Quantize | None, cast: torch.dtype | None
) -> list[tuple[str, torch.Tensor]]:
    """What a writer writes for target ``name``: its codes and scales when ``fp8`` selects it, else
    the tensor, cast to ``cast`` when it is floating.

    Example:
        >>> [(n, t.dtype) for n, t in written("x.weight", torch.ones(2, 2), Fp8Quantize(), torch.bfloat16)]
        [('x.weight', torch.float8_e4m3fn), ('x.weight_scale_inv', torch.float32)]
    """
    pieces = fp8.split(name, tensor) if fp8 is not None else [(name, tensor)]
    if len(pieces) == 1 and cast is not None and tensor.is_floating_point():
        return [(name, tensor.to(cast))]
    return pieces


def check_fp8_casts(targets: Sequence[TargetSpec], source_dtypes: Mapping[str, str]) -> None:
    """Raise when a target casts FP8 codes to another dtype: without their scales they are not values.

    Raises:
        LayoutError: naming every such target and source, with the fix.

    Example:
        >>> from shardsync.mapping import Piece, TargetSpec
        >>> t = TargetSpec("w", (2,), "bfloat16", (Piece("w", Box((0,), (2,)), Box((0,), (2,)), None, ("bfloat16",)),))
        >>> check_fp8_casts([t], {"w": "float8_e4m3fn"})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        shardsync.errors.LayoutError: FP8 codes cast to another dtype without their scales: 'w' ...
    """
    bad = sorted(
        {
            f"{p.source!r} ({source_dtypes[p.source]} -> {p.casts[-1] if p.casts else t.dtype})"
            for t in targets
            for p in t.pieces
            if source_dtypes.get(p.source) in CODE_DTYPES and (p.casts[-1] if p.casts else t.dtype) not in CODE_DTYPES
        }
    )
    if bad:
        raise LayoutError(
            "FP8 codes cast to another dtype without their scales: "
            + ", ".join(bad)
            + "; read the checkpoint through shardsync.sources.Fp8Source (save_hf/convert do "
            "when given a dtype), or pass Fp8Source(..., unscaled='cast') to cast the "
            "codes as values"
        )


def check_fp8_fills(
    fills: Iterable[tuple[str, TargetSpec]], source_dtypes: Mapping[str, str], dest_keys: Iterable[str]
) -> None:
    """Raise when an FP8 destination that holds scales would get values cast to FP8 (not quantised:
    its scales would not fit its codes).

    Args:
        fills: ``(destination key, target)`` of every box to be written.
        source_dtypes: dtype name of each source key, as the source presents it.
        dest_keys: the destination's keys.

    Raises:
        LayoutError: naming every such destination and source, with the fix.

    Example:
        >>> from shardsync.mapping import Piece, TargetSpec
        >>> t = TargetSpec("w", (2, 2), "float8_e4m3fn", (Piece("v", Box((0, 0), (2, 2)), Box((0, 0), (2, 2))),))
        >>> check_fp8_fills([("w", t)], {"v": "float32"}, ["w", "w_scale_inv"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        shardsync.errors.LayoutError: FP8 weights with scales would get values cast to FP8 without quantising: ...
    """
    keys = set(dest_keys)
    bad = sorted(
        {
            f"{name!r} from {p.source!r} ({source_dtypes.get(p.source)})"
            for name, t in fills
            if t.dtype in CODE_DTYPES and scale_key(name) in keys
            for p in t.pieces
            if source_dtypes.get(p.source) not in CODE_DTYPES
        }
    )
    if bad:
        raise LayoutError(
            "FP8 weights with scales would get values cast to FP8 without quantising: "
            + ", ".join(bad)
            + "; load quantises into FP8 + scales only a source weight of the "
            "destination's own name: convert the checkpoint with the mapping first, or load an "
            "FP8 checkpoint"
        )
