"""Destinations: fill sharded state in place - :func:`load` from any source, :func:`reshard` live to
live - after checking that the source fits (missing, unexpected, shape, dtype)."""

from __future__ import annotations

from .check import Mismatch, Report
from .transfer import LoadResult, load, reshard
from .state import Destination, as_source, module_state

__all__ = ["load", "reshard", "LoadResult", "Mismatch", "Report", "Destination", "as_source",
           "module_state"]
