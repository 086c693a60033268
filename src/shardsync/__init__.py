"""shardsync: move model weights between parallel layouts.

Stream full (mapped) tensors out of sharded state (:func:`full_params`), fill sharded state in place
(:func:`load`, :func:`reshard`), write checkpoints through a mapping (HuggingFace safetensors with
:func:`save_hf`, torch DCP with :func:`save_dcp`; this rank's shards as they are with :func:`save`)
and read them, and keep tensor-parallel replicas in sync (:mod:`shardsync.replicas`). Every verb
runs the one protocol of :mod:`shardsync.pipeline` (phases named in :mod:`shardsync.phases`,
options in :class:`shardsync.options.Options`). Paddle-compatible entry points live in
:mod:`shardsync.paddle` only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .startup import guard_startup

guard_startup()  # before the imports below, which take a second or more (torch)

# torch.distributed.nn.functional (which torch DCP imports) takes the default process group as a
# default argument when it is imported: imported after init_process_group (as DCP is, on first use),
# it keeps the group alive after destroy_process_group, and gloo's threads, still running while the
# interpreter exits, then abort the process now and then (SIGABRT after the work is done). Imported
# here, before a program makes its group, it captures nothing (a few milliseconds).
import torch.distributed.nn.functional  # noqa: F401,E402  isort: skip

from .caches import release
from .destinations import LoadResult, load, reshard
from .digests import VerifyReport, digest, verify
from .errors import (
    DistributedError,
    DriftError,
    FormatError,
    LayoutError,
    LoadError,
    MappingError,
    PlanError,
    ReplicaError,
    ShardsyncError,
    VerifyError,
)
from .exec.box_hash import tensor_digest
from .io import save_safetensors
from .io.save_dcp import save_dcp
from .io.save_hf import save_hf
from .layout import Box, GlobalLayout, LocalShard, from_dtensor, shard_dim
from .mapping import Mapping, TargetSpec, resolve
from .mapping.explain import explain
from .planning import Plan
from .replicas import DriftReport, ReplicaSync, detect_drift, select_replicated, watch_drift
from .sources import from_megatron, read_layout, read_tensors
from .stream import ParamStream, full_params, plan

__all__ = [
    "Box",
    "GlobalLayout",
    "LocalShard",
    "from_dtensor",
    "shard_dim",
    "Mapping",
    "resolve",
    "explain",
    "full_params",
    "from_megatron",
    "plan",
    "Plan",
    "ParamStream",
    "TargetSpec",
    "save_safetensors",
    "read_layout",
    "read_tensors",
    "select_replicated",
    "ReplicaSync",
    "detect_drift",
    "watch_drift",
    "DriftReport",
    "ShardsyncError",
    "MappingError",
    "LayoutError",
    "PlanError",
    "FormatError",
    "DistributedError",
    "ReplicaError",
    "DriftError",
    "save_hf",
    "save",
    "save_dcp",
    "load",
    "reshard",
    "LoadResult",
    "LoadError",
    "digest",
    "verify",
    "VerifyReport",
    "VerifyError",
    "tensor_digest",
    "release",
]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from .io.dcp_writer import save


# Paddle-compatible names that were once exported here; they live in shardsync.paddle only (issue 18)
_MOVED_TO_PADDLE = frozenset({"full_param", "add_extra_synchronization"})


def __getattr__(name: str) -> Any:
    # torch.distributed.checkpoint (with DTensor) costs about a third of the import: load it on first use
    if name == "save":
        from .io.dcp_writer import save

        return save
    if name in _MOVED_TO_PADDLE:
        import warnings

        from . import paddle

        warnings.warn(
            f"shardsync.{name} is deprecated: import it from shardsync.paddle (from shardsync.paddle import {name})",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(paddle, name)
    if name == "ShardedTensor":  # renamed: torch has a class of that name (issue 18)
        from .layout import sharded

        return getattr(sharded, name)  # warns
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
