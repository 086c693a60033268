"""The drift report: one row per tensor whose replicas differ across the group."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import DriftError

__all__ = ["DriftRow", "DriftReport"]


@dataclass(frozen=True, slots=True)
class DriftRow:
    """One tensor whose replicas are not bitwise identical.

    Attributes:
        name: parameter name.
        kind: ``param``, ``master``, ``grad`` or an optimizer state key (``exp_avg``...).
        shape: the tensor's shape (local shard for DTensors).
        dtype: its dtype name.
        ranks: ranks whose value differs from the reference value (the value most ranks hold; on a
            tie, the value of ``src``, else of the lowest rank).
        max_abs_diff: max over elements of (max over ranks - min over ranks), over the ranks that
            hold the tensor; 0.0 when only bits differ (signed zeros) or only presence differs.
        missing: ranks where the tensor does not exist (a grad that is None, a state not created).
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    ranks: tuple[int, ...]
    max_abs_diff: float
    missing: tuple[int, ...] = ()

    def exceeds(self, atol: float) -> bool:
        """Whether the difference is beyond ``atol`` (always so for NaN or a missing replica)."""
        return bool(self.missing) or math.isnan(self.max_abs_diff) or self.max_abs_diff > atol


@dataclass(frozen=True, slots=True)
class DriftReport:
    """What :func:`~shardsync.replicas.detect_drift` found; identical on every rank.

    Attributes:
        rows: one per drifting tensor, in rank-stable order (name, then kind).
        checked: how many tensors were compared.
        world: group size.
        repaired: whether ``on_drift="repair"`` broadcast the drifting names from the source.
    """

    rows: tuple[DriftRow, ...]
    checked: int
    world: int
    repaired: bool = False

    @property
    def ok(self) -> bool:
        """True when no tensor drifted."""
        return not self.rows

    def __len__(self) -> int:
        return len(self.rows)

    def exceeding(self, atol: float = 0.0) -> tuple[DriftRow, ...]:
        """Rows whose difference is beyond ``atol``."""
        return tuple(r for r in self.rows if r.exceeds(atol))

    def raise_if(self, atol: float = 0.0) -> None:
        """Raise :class:`DriftError` when a row's max abs diff exceeds ``atol`` (same on every rank).

        Example:
            >>> DriftReport((), checked=3, world=2).raise_if()  # nothing drifted: no error
        """
        bad = self.exceeding(atol)
        if bad:
            raise DriftError(
                f"{len(bad)} replicated tensor(s) differ across the {self.world} ranks "
                f"beyond atol={atol}:\n{self.table(bad)}\nRepair with "
                "ReplicaSync.broadcast_now() or detect_drift(..., on_drift='repair')",
                self,
            )

    def table(self, rows: tuple[DriftRow, ...] | None = None) -> str:
        """The rows as an aligned text table."""
        rows = self.rows if rows is None else rows
        head = ("name", "kind", "shape", "dtype", "ranks", "max_abs_diff")
        body = [
            (
                r.name,
                r.kind,
                "x".join(map(str, r.shape)) or "scalar",
                r.dtype,
                ",".join(map(str, r.ranks)) + (f" (missing on {','.join(map(str, r.missing))})" if r.missing else ""),
                repr(r.max_abs_diff),
            )
            for r in rows
        ]
        widths = [max(len(row[i]) for row in (head, *body)) for i in range(len(head))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in (head, *body))

    def __str__(self) -> str:
        state = " (repaired from the source rank)" if self.repaired else ""
        if not self.rows:
            return f"no drift: {self.checked} tensors identical on {self.world} rank(s)"
        return f"drift in {len(self.rows)} of {self.checked} tensors across {self.world} ranks{state}:\n{self.table()}"
