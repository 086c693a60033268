"""shardsync: move model weights between parallel layouts.

Stream full (mapped) tensors out of sharded state (:func:`full_params`), fill sharded state in place
(:func:`load`, :func:`reshard`), write checkpoints through a mapping (HuggingFace safetensors with
:func:`save_hf`, torch DCP with :func:`save_dcp`; this rank's shards as they are with :func:`save`)
and read them, and keep tensor-parallel replicas in sync (:mod:`shardsync.replicas`). Every verb
runs the one protocol of :mod:`shardsync.pipeline` (phases named in :mod:`shardsync.phases`,
options in :class:`shardsync.options.Options`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .startup import guard_startup

guard_startup()  # before the imports below, which take a second or more (torch)

from .caches import release
from .destinations import LoadResult, load, reshard
from .digests import VerifyReport, digest, verify
from .exec.box_hash import tensor_digest
from .errors import (DistributedError, DriftError, FormatError, LayoutError, LoadError, MappingError,
                     PlanError, ReplicaError, ShardsyncError, VerifyError)
from .io import read_layout, read_tensors, save_safetensors
from .io.save_dcp import save_dcp
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
           "PlanError", "FormatError", "DistributedError", "ReplicaError", "DriftError", "save_hf", "save", "save_dcp",
           "load", "reshard", "LoadResult", "LoadError", "digest", "verify", "VerifyReport",
           "VerifyError", "tensor_digest", "release"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from .io.dcp_writer import save


def __getattr__(name: str) -> Any:
    # torch.distributed.checkpoint (with DTensor) costs about a third of the import: load it on first use
    if name == "save":
        from .io.dcp_writer import save

        return save
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
