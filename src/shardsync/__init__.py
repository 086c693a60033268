"""shardsync: move model weights between parallel layouts.

Stream full (mapped) tensors out of sharded state (:func:`full_params`), write and read HuggingFace
safetensors checkpoints, and keep tensor-parallel replicas in sync (:mod:`shardsync.replicas`).
"""

from __future__ import annotations

from .destinations import LoadResult, load, reshard
from .errors import (DistributedError, DriftError, FormatError, LayoutError, LoadError, MappingError,
                     PlanError, ReplicaError, ShardsyncError)
from .io import read_layout, read_tensors, save_safetensors
from .layout import Box, GlobalLayout, ShardedTensor, from_dtensor, shard_dim
from .mapping import Mapping, resolve
from .mapping.explain import explain
from .paddle_compat import full_param
from .replicas import (DriftReport, ReplicaSync, add_extra_synchronization, detect_drift,
                       select_replicated, watch_drift)
from .stream import full_params, plan

__all__ = ["Box", "GlobalLayout", "ShardedTensor", "from_dtensor", "shard_dim", "Mapping", "resolve",
           "explain", "full_params", "plan", "full_param", "save_safetensors", "read_layout",
           "read_tensors", "select_replicated", "ReplicaSync", "detect_drift", "watch_drift",
           "add_extra_synchronization", "DriftReport", "ShardsyncError", "MappingError", "LayoutError",
           "PlanError", "FormatError", "DistributedError", "ReplicaError", "DriftError", "load", "reshard",
           "LoadResult", "LoadError"]
__version__ = "0.1.0"
