"""Live in-memory state as a source: tensors, LocalShard, DTensor or lists of LocalShard."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..errors import LayoutError
from ..layout.box import Box
from ..layout.dtypes import dtype_name
from ..layout.meta import LayoutEntry
from ..layout.sharded import LocalShard, StateValue, local_shards
from .fingerprint import ReplicaCheck, check_replica_mode, fingerprints

__all__ = ["LocalSource"]


class LocalSource:
    """This rank's shards, by key, read in place.

    Args:
        state: the state dict (values: tensor, LocalShard, DTensor or list of LocalShard).
        replica_check: how :meth:`entries` fingerprints each shard for the replica check:
            ``"sampled"`` (16 elements), ``"exact"`` (every byte) or ``"off"``.
        deferred: :meth:`entries` leaves the fingerprints out; :meth:`fingerprinted` adds them to
            the entries that need them (the ones several ranks hold, once the layout is known).

    Example:
        >>> src = LocalSource({"w": torch.arange(6.).reshape(2, 3)})
        >>> src.read("w", Box((1, 0), (1, 2)))
        tensor([[3., 4.]])
    """

    def __init__(
        self, state: Mapping[str, StateValue], replica_check: ReplicaCheck = "sampled", *, deferred: bool = False
    ) -> None:
        check_replica_mode(replica_check)
        self.replica_check: ReplicaCheck = replica_check
        self.deferred = deferred
        #: key -> this rank's shards, normalised once (also what the layout is gathered from)
        self.shards: dict[str, list[LocalShard]] = {k: local_shards(k, v) for k, v in state.items()}

    def entries(self) -> list[LayoutEntry]:
        """This rank's layout entries, sorted by key, each with the fingerprint of its shard (checked
        across the ranks that hold the same box, see :mod:`shardsync.sources.fingerprint`)."""
        shards = [(key, s) for key in sorted(self.shards) for s in self.shards[key]]
        prints = fingerprints([s.local for _, s in shards], "off" if self.deferred else self.replica_check)
        return [
            LayoutEntry(key, s.global_shape, dtype_name(s.dtype), s.box, fp) for (key, s), fp in zip(shards, prints)
        ]

    def fingerprinted(self, entries: Sequence[LayoutEntry]) -> tuple[LayoutEntry, ...]:
        """``entries`` (of this source, or of a source wrapping it), each of a shard of this source
        (the same key and box) with that shard's fingerprint; any other as it is.

        Example:
            >>> src = LocalSource({"w": torch.zeros(2)}, deferred=True)
            >>> [e.fingerprint is None for e in src.entries() + list(src.fingerprinted(src.entries()))]
            [True, False]
        """
        if self.replica_check == "off" and all(e.fingerprint is None for e in entries):
            return tuple(entries)  # every fingerprint None, as it is
        taken: dict[tuple[str, Box], int] = {}  # shards of that exact box given out so far, in order
        mine: list[tuple[int, torch.Tensor]] = []
        for i, e in enumerate(entries):
            same = [s for s in self.shards.get(e.key, ()) if s.box == e.box]
            n = taken.get((e.key, e.box), 0)
            if n < len(same):  # a box this rank holds twice is two entries, each with its own shard
                taken[e.key, e.box] = n + 1
                mine.append((i, same[n].local))
        prints = fingerprints([t for _, t in mine], self.replica_check)
        out = list(entries)
        for (i, _), fp in zip(mine, prints):
            out[i] = out[i]._replace(fingerprint=fp)
        return tuple(out)

    def _find(self, key: str, box: Box) -> tuple[LocalShard, Box] | None:
        for s in self.shards.get(key, ()):
            shard_box = s.box
            if shard_box.contains(box):
                return s, shard_box
        return None

    def find(self, key: str, box: Box) -> LocalShard | None:
        """A local shard of ``key`` containing ``box``, or None."""
        found = self._find(key, box)
        return found[0] if found is not None else None

    def read(self, key: str, box: Box) -> torch.Tensor:
        """A view of ``box`` (global coordinates) of ``key``.

        Raises:
            LayoutError: no local shard contains the box (the plan says this rank holds it).
        """
        found = self._find(key, box)
        if found is None:
            raise LayoutError(
                f"{key!r}: this rank holds no shard containing {box}; the layout this "
                "rank reported does not match its state (was the state changed after "
                "the stream started?)"
            )
        shard, shard_box = found
        return box.cut(shard.local, shard_box)

    def device(self) -> torch.device:
        """Device of the first local tensor (cpu when there is none)."""
        for shards in self.shards.values():
            for s in shards:
                return s.local.device
        return torch.device("cpu")
