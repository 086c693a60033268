"""Layer 6: tensor-parallel replica selection, coalesced sync hooks, drift detection.

* :func:`select_replicated` - which parameters are replicated across the TP group (``explain()``).
* :class:`ReplicaSync` - coalesced grad / param / fp32 master / optimizer-state sync as optimizer
  hooks, plus ``sync_grads()``, ``broadcast_now()`` and ``plan()``.
* :func:`detect_drift` - fingerprints first, exact max abs diff for mismatches; warn, raise or repair.
* :func:`add_extra_synchronization` - PaddlePaddle's entry, on the above.
"""

from __future__ import annotations

from ..errors import DriftError, ReplicaError
from .buckets import Bucket, PhasePlan, SyncPlan
from .drift import DEFAULT_WHAT, DriftWatch, detect_drift, fingerprint, watch_drift
from .engine import SyncStats
from .paddle_compat import add_extra_synchronization, paddle_filter
from .report import DriftReport, DriftRow
from .select import DEFAULT_INCLUDE, Choice, Selection, select_replicated, tp_sharding
from .sync import SYNC_BUCKET_BYTES, DEFAULT_STATES, HookHandle, ReplicaSync

__all__ = [
    "select_replicated", "Selection", "Choice", "DEFAULT_INCLUDE", "tp_sharding",
    "ReplicaSync", "HookHandle", "SyncPlan", "PhasePlan", "Bucket", "SyncStats",
    "SYNC_BUCKET_BYTES", "DEFAULT_STATES",
    "detect_drift", "DriftReport", "DriftRow", "DEFAULT_WHAT", "watch_drift", "DriftWatch",
    "fingerprint",
    "add_extra_synchronization", "paddle_filter",
    "ReplicaError", "DriftError",
]
