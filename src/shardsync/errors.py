"""Error classes, by cause.

Every error shardsync raises subclasses :class:`ShardsyncError`. Errors that are the caller's mistake
(a bad mapping, a layout that cannot be served, a malformed file) also subclass :class:`ValueError`, so
generic handlers keep working.
"""

from __future__ import annotations

__all__ = [
    "ShardsyncError",
    "MappingError",
    "LayoutError",
    "PlanError",
    "FormatError",
    "DistributedError",
]


class ShardsyncError(Exception):
    """Base class of every error raised by shardsync."""


class MappingError(ShardsyncError, ValueError):
    """A mapping program is wrong: names the statement (index, text), the column and the name."""


class LayoutError(ShardsyncError, ValueError):
    """Sharded state cannot serve a request: a hole, an overlap, a shape or dtype disagreement."""


class PlanError(ShardsyncError, ValueError):
    """A plan failed validation (bounds, overlap, coverage) or cannot be built from its inputs."""


class FormatError(ShardsyncError, ValueError):
    """A file is malformed or does not match what was asked of it."""


class DistributedError(ShardsyncError, RuntimeError):
    """A cross-rank phase failed on one or more ranks; raised on every rank together.

    Attributes:
        phase: name of the phase that failed (``"gather layout"``, ``"execute"``...).
        failures: ``{rank: message}`` for each rank that raised or stopped answering.
    """

    def __init__(self, phase: str, failures: dict[int, str]) -> None:
        self.phase = phase
        self.failures = dict(sorted(failures.items()))
        lines = [f"phase {phase!r} failed on rank(s) {sorted(self.failures)}:"]
        lines += [f"  rank {r}: {msg}" for r, msg in self.failures.items()]
        super().__init__("\n".join(lines))
