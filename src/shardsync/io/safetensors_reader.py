"""Read safetensors checkpoints: one file, or a directory of shards with or without an index."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import FormatError
from ..layout.box import Box
from ..layout.meta import GlobalLayout

__all__ = ["checkpoint_files", "read_layout", "read_tensors"]

_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
           "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint: the file itself, the files an index names, or every
    ``*.safetensors`` in a directory (sorted).

    Raises:
        FormatError: nothing to read, or an index naming a missing file.
    """
    p = Path(path)
    if p.is_file():
        if p.name.endswith(".index.json"):
            return _from_index(p)
        return [p]
    if not p.is_dir():
        raise FormatError(f"{p} does not exist")
    indexes = sorted(p.glob("*.safetensors.index.json"))
    if len(indexes) == 1:
        return _from_index(indexes[0])
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FormatError(f"{p} holds no *.safetensors file")
    return files


def _from_index(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError) as exc:
        raise FormatError(f"{index}: not a safetensors index (needs a 'weight_map'): {exc}") from exc
    files = [index.parent / f for f in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise FormatError(f"{index} names missing files: {', '.join(missing)}")
    return files


def _header(path: Path) -> dict:
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise FormatError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        try:
            return json.loads(fh.read(n))
        except ValueError as exc:
            raise FormatError(f"{path}: bad safetensors header: {exc}") from exc


def read_layout(path: str | os.PathLike) -> GlobalLayout:
    """The layout of a checkpoint from its headers alone (no tensor data is read)."""
    entries = []
    seen: dict[str, Path] = {}
    for f in checkpoint_files(path):
        for key, info in _header(f).items():
            if key == "__metadata__":
                continue
            if key in seen:
                raise FormatError(f"tensor {key!r} is in both {seen[key].name} and {f.name}")
            seen[key] = f
            if info["dtype"] not in _DTYPES:
                raise FormatError(f"{f.name}: tensor {key!r} has unsupported dtype {info['dtype']}")
            shape = tuple(info["shape"])
            entries.append((key, shape, _DTYPES[info["dtype"]], Box.full(shape)))
    return GlobalLayout.merge([entries])


def read_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, loaded into CPU memory."""
    out: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(path):
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                if key in out:
                    raise FormatError(f"tensor {key!r} appears in two files (second: {f.name})")
                out[key] = fh.get_tensor(key)
    return out
