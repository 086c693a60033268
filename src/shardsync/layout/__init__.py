"""Layer 1: inert metadata (boxes, shards, the global layout, dtype names)."""

from __future__ import annotations

from typing import Any

from .box import Box
from .dtypes import DTYPES, dtype_name, itemsize, to_torch_dtype
from .meta import GlobalLayout, LayoutEntry, ShardSpec, TensorMeta
from .placements import Split, shard_boxes
from .sharded import LocalShard, StateValue, dtensor_shards, from_dtensor, local_layout, local_shards, shard_dim

__all__ = [
    "Box",
    "DTYPES",
    "dtype_name",
    "itemsize",
    "to_torch_dtype",
    "GlobalLayout",
    "LayoutEntry",
    "ShardSpec",
    "TensorMeta",
    "LocalShard",
    "StateValue",
    "Split",
    "shard_boxes",
    "dtensor_shards",
    "from_dtensor",
    "local_layout",
    "local_shards",
    "shard_dim",
]


def __getattr__(name: str) -> Any:
    if name == "ShardedTensor":  # renamed LocalShard; the old name warns
        from . import sharded

        return getattr(sharded, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
