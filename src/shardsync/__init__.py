"""shardsync: move model weights between parallel layouts."""

from __future__ import annotations

from .errors import DistributedError, FormatError, LayoutError, MappingError, PlanError, ShardsyncError
from .layout import Box, GlobalLayout, ShardedTensor, from_dtensor, shard_dim

__all__ = ["Box", "GlobalLayout", "ShardedTensor", "from_dtensor", "shard_dim", "ShardsyncError",
           "MappingError", "LayoutError", "PlanError", "FormatError", "DistributedError"]
__version__ = "0.1.0"
