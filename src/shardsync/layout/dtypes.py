"""Dtype names: the plain strings used in layouts, mappings and files, and their torch dtypes."""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "dtype_name", "to_torch_dtype", "itemsize"]

#: Name -> torch dtype, for every dtype a mapping may name or a layout may carry.
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
for _name in ("float8_e4m3fn", "float8_e5m2", "complex64", "complex128", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)

_ALIASES = {"float": "float32", "double": "float64", "half": "float16", "bf16": "bfloat16",
            "fp32": "float32", "fp16": "float16", "int": "int32", "long": "int64"}
_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical name of a torch dtype or a dtype name (``torch.float32`` -> ``"float32"``).

    Raises:
        ValueError: the dtype is unknown; the message lists the known names.
    """
    if isinstance(dtype, torch.dtype):
        if dtype in _NAMES:
            return _NAMES[dtype]
        raise ValueError(f"unsupported dtype {dtype}")
    name = _ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPES))}")
    return name


def to_torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a name (or the dtype itself)."""
    return DTYPES[dtype_name(name)]


def itemsize(name: str | torch.dtype) -> int:
    """Bytes per element."""
    return to_torch_dtype(name).itemsize
