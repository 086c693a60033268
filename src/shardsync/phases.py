"""The names of every cross-rank phase, in one table: what errors, logs and the roll call say.

A phase is one agreed step (:func:`shardsync.dist.agree`) or one data step
(:func:`shardsync.dist.data_phase`); a failure on any rank is raised on every rank as a
:class:`~shardsync.errors.DistributedError` naming it. Code names a phase by its constant here,
never by a literal, so that the names users see (and tests grep for) stay one vocabulary.

The orchestrator's phases (:mod:`shardsync.pipeline`), in the order a call runs them:
:data:`CHECK` (the fast path: one small collective when nothing changed since the group's last
call) or :data:`GATHER` then :data:`PLAN`, then the data phase of the verb (:data:`STREAM`,
:data:`LOAD`, :data:`RESHARD`) and its checks (:data:`DIGEST`, :data:`RECEIVED`, :data:`VERIFY`).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Final

__all__ = [
    "PHASES",
    "CHECK",
    "GATHER",
    "PLAN",
    "STREAM",
    "LOAD",
    "RESHARD",
    "DIGEST",
    "RECEIVED",
    "VERIFY",
    "DIGEST_GATHER",
    "SHM_PUBLISH",
    "SHM_OPEN",
    "SAVE_HF_CHECK",
    "SAVE_HF_MOVE",
    "SAVE_HF_WRITE",
    "SAVE_HF_COMMIT",
    "DCP_CHECK",
    "DCP_VALIDATE",
    "DCP_WRITE",
    "DCP_REMOVE_OLD",
    "SAVE_DCP_CHECK",
    "SAVE_DCP_TAKE",
    "SYNC_PREFLIGHT",
    "SYNC_OPTIMIZER_CHANGED",
    "SYNC_OPTIMIZER_STATES",
    "SYNC_SIGNATURE",
    "DRIFT_FINGERPRINTS",
    "DRIFT_EXACT",
    "PADDLE_ARGUMENTS",
]

#: Every phase: its constant's name -> the name errors show.
PHASES: Final = MappingProxyType(
    {
        # the orchestrator, every verb
        "CHECK": "check layout",
        "GATHER": "gather layout",
        "PLAN": "plan",
        # the data phases, one per destination kind
        "STREAM": "stream",
        "LOAD": "load",
        "RESHARD": "reshard",
        # checks of what moved
        "DIGEST": "digest",
        "RECEIVED": "verify received",
        "VERIFY": "verify",
        "DIGEST_GATHER": "digest: gather layout",
        # the same-host transport
        "SHM_PUBLISH": "shm publish",
        "SHM_OPEN": "shm open",
        # the writers
        "SAVE_HF_CHECK": "save_hf: check options",
        "SAVE_HF_MOVE": "save_hf: move targets to their file's writer",
        "SAVE_HF_WRITE": "save_hf: write files",
        "SAVE_HF_COMMIT": "save_hf: commit",
        "SAVE_DCP_CHECK": "save_dcp: check options",
        "SAVE_DCP_TAKE": "save_dcp: hold targets",
        "DCP_CHECK": "save: check",
        "DCP_VALIDATE": "save: validate layout",
        "DCP_WRITE": "save: write (torch's DCP writer)",
        "DCP_REMOVE_OLD": "save: remove the old generation",
        # replica sync and drift checks
        "SYNC_PREFLIGHT": "replica sync: preflight",
        "SYNC_OPTIMIZER_CHANGED": "replica sync: optimizer changed",
        "SYNC_OPTIMIZER_STATES": "replica sync: optimizer states",
        "SYNC_SIGNATURE": "replica sync: optimizer check",
        "DRIFT_FINGERPRINTS": "drift check: fingerprints",
        "DRIFT_EXACT": "drift check: exact differences",
        "PADDLE_ARGUMENTS": "add_extra_synchronization: arguments",
    }
)

CHECK: Final = PHASES["CHECK"]
GATHER: Final = PHASES["GATHER"]
PLAN: Final = PHASES["PLAN"]
STREAM: Final = PHASES["STREAM"]
LOAD: Final = PHASES["LOAD"]
RESHARD: Final = PHASES["RESHARD"]
DIGEST: Final = PHASES["DIGEST"]
RECEIVED: Final = PHASES["RECEIVED"]
VERIFY: Final = PHASES["VERIFY"]
DIGEST_GATHER: Final = PHASES["DIGEST_GATHER"]
SHM_PUBLISH: Final = PHASES["SHM_PUBLISH"]
SHM_OPEN: Final = PHASES["SHM_OPEN"]
SAVE_HF_CHECK: Final = PHASES["SAVE_HF_CHECK"]
SAVE_HF_MOVE: Final = PHASES["SAVE_HF_MOVE"]
SAVE_HF_WRITE: Final = PHASES["SAVE_HF_WRITE"]
SAVE_HF_COMMIT: Final = PHASES["SAVE_HF_COMMIT"]
SAVE_DCP_CHECK: Final = PHASES["SAVE_DCP_CHECK"]
SAVE_DCP_TAKE: Final = PHASES["SAVE_DCP_TAKE"]
DCP_CHECK: Final = PHASES["DCP_CHECK"]
DCP_VALIDATE: Final = PHASES["DCP_VALIDATE"]
DCP_WRITE: Final = PHASES["DCP_WRITE"]
DCP_REMOVE_OLD: Final = PHASES["DCP_REMOVE_OLD"]
SYNC_PREFLIGHT: Final = PHASES["SYNC_PREFLIGHT"]
SYNC_OPTIMIZER_CHANGED: Final = PHASES["SYNC_OPTIMIZER_CHANGED"]
SYNC_OPTIMIZER_STATES: Final = PHASES["SYNC_OPTIMIZER_STATES"]
SYNC_SIGNATURE: Final = PHASES["SYNC_SIGNATURE"]
DRIFT_FINGERPRINTS: Final = PHASES["DRIFT_FINGERPRINTS"]
DRIFT_EXACT: Final = PHASES["DRIFT_EXACT"]
PADDLE_ARGUMENTS: Final = PHASES["PADDLE_ARGUMENTS"]
