"""Dtype names: the plain strings used in layouts, mappings and files, and their torch dtypes."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["DTYPES", "BITS", "NUMPY_DTYPES", "SAFETENSORS_DTYPES", "dtype_name", "to_torch_dtype", "itemsize"]

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
for _name in (
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "complex64",
    "complex128",
    "uint16",
    "uint32",
    "uint64",
):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)


def _numpy(name: str) -> np.dtype | None:
    try:
        return np.dtype(name)
    except TypeError:  # bfloat16, the FP8 dtypes
        return None


#: torch dtype -> numpy dtype, for the dtypes numpy has (named alike; ``torch.from_numpy`` takes them).
NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {t: d for name, t in DTYPES.items() if (d := _numpy(name)) is not None}

#: Element size in bytes -> the integer dtype a tensor of any dtype of that size is viewed as to move or
#: hash its bits (``t.view(BITS[t.element_size()])``; a view that changes no bytes).
BITS: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

#: Safetensors dtype code -> dtype name, for every code the format defines. None: a sub-byte dtype
#: (F4, F6_*) that has no torch dtype with one element per value, so boxes of it cannot be cut.
SAFETENSORS_DTYPES: dict[str, str | None] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
    "C64": "complex64",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "F4": None,
    "F6_E2M3": None,
    "F6_E3M2": None,
}

_ALIASES = {
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "bf16": "bfloat16",
    "fp32": "float32",
    "fp16": "float16",
    "int": "int32",
    "long": "int64",
}
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


# every known name, alias and torch dtype -> torch dtype: the executor asks per piece
_TORCH: dict[str | torch.dtype, torch.dtype] = {
    **{name: d for name, d in DTYPES.items()},
    **{alias: DTYPES[name] for alias, name in _ALIASES.items()},
    **{d: d for d in DTYPES.values()},
}


def to_torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a name (or the dtype itself)."""
    found = _TORCH.get(name)
    return found if found is not None else DTYPES[dtype_name(name)]  # an unknown name raises there


_ITEMSIZE = {key: d.itemsize for key, d in _TORCH.items()}


def itemsize(name: str | torch.dtype) -> int:
    """Bytes per element."""
    found = _ITEMSIZE.get(name)
    return found if found is not None else to_torch_dtype(name).itemsize
