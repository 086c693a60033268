"""shardsync: move model weights between parallel layouts.

Stream full (mapped) tensors out of sharded state (:func:`full_params`), write checkpoints (HuggingFace
safetensors with :func:`save_hf`, torch DCP with :func:`save`) and read them, and keep tensor-parallel
replicas in sync (:mod:`shardsync.replicas`).
"""

from __future__ import annotations

from .startup import guard_startup

guard_startup()  # before the imports below, which take a second or more (torch)

from .destinations import LoadResult, load, reshard
from .errors import (DistributedError, DriftError, FormatError, LayoutError, LoadError, MappingError,
                     PlanError, ReplicaError, ShardsyncError)
from .io import read_layout, read_tensors, save_safetensors
from .io.dcp_writer import save
from .io.save_hf import save_hf
from .layout import Box, GlobalLayout, ShardedTensor, from_dtensor, shard_dim
from .mapping import Mapping, TargetSpec, resolve
from .mapping.explain import explain
from .paddle import add_extra_synchronization, full_param
from .planning import Plan
from .replicas import DriftReport, ReplicaSync, detect_drift, select_replicated, watch_drift
from .sources import from_megatron
from .stream import ParamStream, full_params, plan

__all__ = ["Box", "GlobalLayout", "ShardedTensor", "from_dtensor", "shard_dim", "Mapping", "resolve",
           "explain", "full_params", "from_megatron", "plan", "Plan", "ParamStream", "TargetSpec",
           "full_param", "save_safetensors", "read_layout",
           "read_tensors", "select_replicated", "ReplicaSync", "detect_drift", "watch_drift",
           "add_extra_synchronization", "DriftReport", "ShardsyncError", "MappingError", "LayoutError",
           "PlanError", "FormatError", "DistributedError", "ReplicaError", "DriftError", "save_hf", "save",
           "load", "reshard", "LoadResult", "LoadError"]
__version__ = "0.1.0"
