"""Destinations written in place: :func:`load` (from any source) and :func:`reshard` (live to live),
after checking that the source fits (missing, unexpected, shape, dtype); :class:`InPlace` is their
destination for the orchestrator (:mod:`shardsync.pipeline`)."""

from __future__ import annotations

from ..sources.modules import module_state
from .check import Mismatch, Report
from .state import Shards
from .transfer import InPlace, LoadResult, load, reshard

__all__ = ["load", "reshard", "LoadResult", "Mismatch", "Report", "Shards", "InPlace", "module_state"]
