"""Layer 1: inert metadata (boxes, shards, the global layout, dtype names)."""

from __future__ import annotations

from .box import Box
from .dtypes import DTYPES, dtype_name, itemsize, to_torch_dtype
from .meta import GlobalLayout, LayoutEntry, ShardSpec, TensorMeta
from .placements import Split, shard_boxes
from .sharded import (ShardedTensor, StateValue, dtensor_shards, from_dtensor, local_layout, local_shards,
                      shard_dim)

__all__ = ["Box", "DTYPES", "dtype_name", "itemsize", "to_torch_dtype", "GlobalLayout", "LayoutEntry", "ShardSpec",
           "TensorMeta", "ShardedTensor", "StateValue", "Split", "shard_boxes", "dtensor_shards", "from_dtensor",
           "local_layout", "local_shards", "shard_dim"]
