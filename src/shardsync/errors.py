"""Error classes, by cause.

Every error shardsync raises subclasses :class:`ShardsyncError`. Errors that are the caller's mistake
(a bad mapping, a layout that cannot be served, a malformed file) also subclass :class:`ValueError`, so
generic handlers keep working.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "ShardsyncError",
    "MappingError",
    "LayoutError",
    "LoadError",
    "PlanError",
    "FormatError",
    "DistributedError",
    "ReplicaError",
    "DriftError",
    "VerifyError",
]


class ShardsyncError(Exception):
    """Base class of every error raised by shardsync."""


class MappingError(ShardsyncError, ValueError):
    """A mapping program is wrong: names the statement (index, text), the column and the name.

    Attributes:
        diagnostics: every problem found (a program with several errors reports all of them); each
            has ``index``, ``text``, ``col``, ``name`` and ``message``.
    """

    def __init__(self, diagnostics: Sequence[Any] | str) -> None:
        if isinstance(diagnostics, str):
            self.diagnostics: tuple[Any, ...] = ()
            super().__init__(diagnostics)
            return
        self.diagnostics = tuple(diagnostics)
        n = len(self.diagnostics)
        head = "mapping error:" if n == 1 else f"{n} mapping errors:"
        super().__init__(head + "".join(f"\n  {d}".replace("\n    ", "\n      ") for d in self.diagnostics))


class LayoutError(ShardsyncError, ValueError):
    """Sharded state cannot serve a request: a hole, an overlap, a shape or dtype disagreement."""


class LoadError(LayoutError):
    """A destination and its source do not match (``load``/``reshard`` with ``strict=True``): every
    missing target, unexpected source, shape and dtype mismatch at once, each naming the mapping
    statement it comes from. Raised on every rank before any destination tensor is written.

    Attributes:
        missing: destination keys nothing would be loaded into.
        unexpected: targets the source and mapping produce that have no destination.
        mismatched: shape and dtype mismatches (``.name``, ``.kind``, ``.expected``, ``.got``).
    """

    def __init__(
        self, message: str, missing: Sequence[str] = (), unexpected: Sequence[str] = (), mismatched: Sequence[Any] = ()
    ) -> None:
        super().__init__(message)
        self.missing, self.unexpected, self.mismatched = tuple(missing), tuple(unexpected), tuple(mismatched)


class PlanError(ShardsyncError, ValueError):
    """A plan failed validation (bounds, overlap, coverage) or cannot be built from its inputs."""


class FormatError(ShardsyncError, ValueError):
    """A file is malformed or does not match what was asked of it."""


class DistributedError(ShardsyncError, RuntimeError):
    """A cross-rank phase failed on one or more ranks; raised on every rank together.

    Ranks are group ranks; where a group rank differs from the global rank, the message gives the
    global one in brackets (``rank 1 [global 3]``).

    Attributes:
        phase: name of the phase that failed (``"gather layout"``, ``"stream"``...).
        failures: ``{group rank: message}`` for each rank that raised, stopped answering or never came.
        global_ranks: ``{group rank: global rank}`` for the ranks in ``failures``.

    Example:
        >>> print(DistributedError("stream", {1: "died"}, global_ranks=(2, 3)))
        phase 'stream' failed on rank(s) [1]:
          rank 1 [global 3]: died
    """

    def __init__(self, phase: str, failures: dict[int, str], global_ranks: Sequence[int] | None = None) -> None:
        self.phase = phase
        self.failures = dict(sorted(failures.items()))
        self.global_ranks = {r: global_ranks[r] if global_ranks is not None else r for r in self.failures}
        lines = [f"phase {phase!r} failed on rank(s) {sorted(self.failures)}:"]
        for r, msg in self.failures.items():
            glob = self.global_ranks[r]
            lines.append(f"  rank {r}{'' if glob == r else f' [global {glob}]'}: {msg}")
        super().__init__("\n".join(lines))


class ReplicaError(ShardsyncError, ValueError):
    """Replica selection or sync cannot be set up as asked: a pattern that matches nothing, a bad mode,
    a master copy that does not fit its parameter. The message names each offender and the fix."""


class DriftError(ShardsyncError, RuntimeError):
    """Tensors that should be identical across the tensor-parallel group differ.

    Attributes:
        report: the :class:`shardsync.replicas.DriftReport` that found the drift (same on every rank).
    """

    def __init__(self, message: str, report: object = None) -> None:
        self.report = report
        super().__init__(message)


class VerifyError(ShardsyncError, RuntimeError):
    """What was written or received does not have the digest of what was sent (``verify=True``);
    raised on every rank together.

    Attributes:
        tensors: the names whose digests differ, sorted.
    """

    def __init__(self, message: str, tensors: Sequence[str] = ()) -> None:
        self.tensors = tuple(sorted(tensors))
        super().__init__(message)
