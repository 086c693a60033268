"""Quantised weight formats: block FP8 (DeepSeek-V3 / transformers FineGrainedFP8) both ways.

Small functions with no process group: the block grid of a weight, dequantising a box of it, and
quantising a tensor. Sources (:class:`shardsync.sources.Fp8Source`), the writers and the stream use them.
"""

from __future__ import annotations

from .fp8 import (
    DEFAULT_BLOCK,
    FP8_MAX,
    SCALE_SUFFIX,
    Block,
    Fp8Quantize,
    block_size_from_config,
    check_fp8_casts,
    dequantize,
    quantization_config,
    quantize,
    scale_box,
    scale_key,
    scale_shape,
)

__all__ = [
    "DEFAULT_BLOCK",
    "FP8_MAX",
    "SCALE_SUFFIX",
    "Block",
    "Fp8Quantize",
    "block_size_from_config",
    "check_fp8_casts",
    "dequantize",
    "quantization_config",
    "quantize",
    "scale_box",
    "scale_key",
    "scale_shape",
]
