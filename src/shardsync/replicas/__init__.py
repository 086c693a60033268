"""Layer 6: tensor-parallel replica selection, coalesced sync hooks, drift detection.

* :func:`select_replicated` - which parameters are replicated across the TP group (``explain()``).
* :class:`ReplicaSync` - coalesced grad / param / fp32 master / optimizer-state sync as optimizer
  hooks, plus ``sync_grads()``, ``broadcast_now()`` and ``plan()``.
* :func:`detect_drift` - fingerprints first, exact max abs diff for mismatches; warn, raise or repair.

Every ``group=`` takes a process group or a device mesh (:data:`GroupLike`). PaddlePaddle's
``add_extra_synchronization`` is in :mod:`shardsync.paddle`, on :class:`ReplicaSync`.
"""

from __future__ import annotations

from ..errors import DriftError, ReplicaError
from .buckets import Bucket, PhasePlan, SyncPlan
from .drift import DEFAULT_WHAT, DriftWatch, detect_drift, fingerprint, watch_drift
from .engine import SyncStats
from .preflight import DEFAULT_STATES, GroupLike
from .report import DriftReport, DriftRow
from .select import DEFAULT_INCLUDE, Choice, Selection, select_replicated, tp_sharding
from .sync import SYNC_BUCKET_BYTES, HookHandle, ReplicaSync

__all__ = [
    "select_replicated",
    "Selection",
    "Choice",
    "DEFAULT_INCLUDE",
    "tp_sharding",
    "ReplicaSync",
    "HookHandle",
    "SyncPlan",
    "PhasePlan",
    "Bucket",
    "SyncStats",
    "SYNC_BUCKET_BYTES",
    "DEFAULT_STATES",
    "GroupLike",
    "detect_drift",
    "DriftReport",
    "DriftRow",
    "DEFAULT_WHAT",
    "watch_drift",
    "DriftWatch",
    "fingerprint",
    "ReplicaError",
    "DriftError",
]
