"""Layer 1: inert metadata (boxes, shards, the global layout, dtype names)."""

from __future__ import annotations

from .box import Box
from .dtypes import DTYPES, dtype_name, itemsize, to_torch_dtype
from .meta import GlobalLayout, LayoutEntry, ShardSpec, TensorMeta
from .sharded import ShardedTensor, StateValue, from_dtensor, local_layout, local_shards, shard_dim

__all__ = ["Box", "DTYPES", "dtype_name", "itemsize", "to_torch_dtype", "GlobalLayout", "LayoutEntry", "ShardSpec",
           "TensorMeta", "ShardedTensor", "StateValue", "from_dtensor", "local_layout", "local_shards",
           "shard_dim"]
