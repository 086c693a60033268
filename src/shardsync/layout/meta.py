"""The global layout: every key's global shape, dtype and the shards each rank holds.

Inert data with a JSON round trip; no torch.distributed here. Build each rank's local layout with
:func:`local_layout`, gather them (the exec layer does that), and merge with :meth:`GlobalLayout.merge`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

from ..errors import LayoutError
from .box import Box

__all__ = ["LayoutEntry", "ShardSpec", "TensorMeta", "GlobalLayout", "check_replicas", "without_values", "EXACT_PREFIX"]


class LayoutEntry(NamedTuple):
    """One shard a rank holds, as it reports it when the layout is gathered.

    ``fingerprint`` (optional) hashes the shard's shape, dtype and a fixed sample of its elements
    (:mod:`shardsync.sources.fingerprint`); ranks that report the same box of a key claim to hold
    replicas, and :meth:`GlobalLayout.merge` checks that their fingerprints agree.
    """

    key: str
    shape: tuple[int, ...]
    dtype: str
    box: Box
    fingerprint: str | None = None


#: What an exact fingerprint (every byte hashed, ``replica_check="exact"``) starts with.
EXACT_PREFIX = "exact:"
#: What :meth:`GlobalLayout.merge` takes per entry: a LayoutEntry or a plain 4- or 5-tuple.
EntryLike = tuple[Any, ...]


def _replica_problems(per_rank: Sequence[Iterable[EntryLike]]) -> list[str]:
    """One line per (key, box) whose holders report different fingerprints."""
    seen: dict[tuple[str, Box], dict[str, list[int]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for rank, entries in enumerate(per_rank):
        for entry in entries:
            if len(entry) > 4 and entry[4] is not None:
                key, shape, _, box = entry[:4]
                shapes[key] = tuple(shape)
                seen.setdefault((key, box), {}).setdefault(entry[4], []).append(rank)
    problems = []
    for (key, box), prints in sorted(seen.items(), key=lambda kv: (kv[0][0], kv[0][1].offsets)):
        if len(prints) < 2:
            continue
        groups = " vs ".join(f"ranks {ranks}" for ranks in sorted(prints.values()))
        whole = box.offsets == (0,) * len(box.offsets) and box.sizes == shapes[key]
        fix = (
            "a plain tensor is taken as a replica, and this looks like a per-rank shard: wrap it in "
            "LocalShard, or use shardsync.from_megatron(model)"
            if whole
            else "ranks holding the same box of a key are taken as replicas: check the global offsets "
            "(do pipeline stages or expert-parallel ranks reuse the same names?)"
        )
        kind = "exact digests" if any(p.startswith(EXACT_PREFIX) for p in prints) else "sampled fingerprints"
        problems.append(
            f"{key!r}: {groups} hold box {box} with different values ({kind} differ); {fix}; "
            "if these are replicas that drifted apart, sync them first (shardsync.detect_drift)"
        )
    return problems


def without_values(entries: Iterable[EntryLike]) -> tuple[LayoutEntry, ...]:
    """The entries without their fingerprints: the layout alone, which is what a plan depends on.
    Values change every training step, the layout does not, so plans are cached by this.

    Example:
        >>> without_values([LayoutEntry("w", (2,), "float32", Box((0,), (2,)), "01")])[0].fingerprint is None
        True
    """
    entries = tuple(entries)
    if all(type(e) is LayoutEntry and e.fingerprint is None for e in entries):  # nothing to drop
        return cast(tuple[LayoutEntry, ...], entries)  # (a live state's entries, not fingerprinted)
    return tuple(LayoutEntry(*e[:4]) for e in entries)


def check_replicas(per_rank: Sequence[Iterable[EntryLike]]) -> None:
    """Check that ranks reporting the same box of a key hold the same values (by fingerprint).

    Args:
        per_rank: every rank's entries, rank i's at position i; entries without a fingerprint are
            not compared.

    Raises:
        LayoutError: naming every key, box and the ranks that disagree, with the fix.

    Example:
        >>> a = LayoutEntry("w", (2,), "float32", Box((0,), (2,)), "01")
        >>> check_replicas([[a], [a._replace(fingerprint="02")]])
        Traceback (most recent call last):
        ...
        shardsync.errors.LayoutError: replicas differ: ...
    """
    problems = _replica_problems(per_rank)
    if problems:
        raise LayoutError("replicas differ:\n  " + "\n  ".join(problems))


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """One shard of a global tensor: the rank holding it and its box in global coordinates."""

    rank: int
    box: Box


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """A global tensor: key, global shape, dtype name and its shards (sorted by rank, then box)."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    shards: tuple[ShardSpec, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def offsets_along(self, dim: int) -> list[int]:
        """Distinct shard offsets along ``dim`` (how many ways the tensor is cut there)."""
        return sorted({s.box.offsets[dim] for s in self.shards if not s.box.empty})


@dataclass(frozen=True, slots=True)
class GlobalLayout:
    """Every key's :class:`TensorMeta`, from all ranks."""

    tensors: Mapping[str, TensorMeta]
    world_size: int = 1

    def __getitem__(self, key: str) -> TensorMeta:
        return self.tensors[key]

    def __contains__(self, key: object) -> bool:
        return key in self.tensors

    def keys(self) -> list[str]:
        return sorted(self.tensors)

    @classmethod
    def merge(cls, per_rank: Iterable[Iterable[EntryLike]]) -> GlobalLayout:
        """Merge the local layouts of all ranks (rank i's entries at position i).

        Each entry is a :class:`LayoutEntry` ``(key, global_shape, dtype, box[, fingerprint])``. Raises
        one :class:`LayoutError` listing every key whose ranks disagree on global shape or dtype, whose
        box falls outside the shape, or whose replicas (same box on several ranks) have different
        fingerprints.
        """
        per_rank = [list(entries) for entries in per_rank]
        shapes: dict[str, dict[tuple[tuple[int, ...], str], list[int]]] = {}
        shards: dict[str, list[ShardSpec]] = {}
        problems: list[str] = []
        world = len(per_rank)
        for rank, entries in enumerate(per_rank):
            for entry in entries:
                key, shape, dtype, box = entry[:4]
                shape = tuple(shape)
                shapes.setdefault(key, {}).setdefault((shape, dtype), []).append(rank)
                if not box.within(shape):
                    problems.append(f"{key!r}: rank {rank} holds box {box} outside global shape {list(shape)}")
                shards.setdefault(key, []).append(ShardSpec(rank, box))
        metas = {}
        for key in sorted(shapes):
            variants = shapes[key]
            if len(variants) > 1:
                desc = "; ".join(f"ranks {r} say shape {list(s)} {d}" for (s, d), r in variants.items())
                problems.append(f"{key!r}: ranks disagree on global shape/dtype: {desc}")
                continue
            ((shape, dtype),) = variants
            specs = sorted(shards[key], key=lambda s: (s.rank, s.box.offsets))
            metas[key] = TensorMeta(key, shape, dtype, tuple(specs))
        problems += _replica_problems(per_rank)
        if problems:
            raise LayoutError("inconsistent layout:\n  " + "\n  ".join(problems))
        return cls(metas, world)

    def to_json(self) -> str:
        """Serialise to JSON (see :meth:`from_json`)."""
        return json.dumps(
            {
                "world_size": self.world_size,
                "tensors": {
                    k: {
                        "shape": list(m.shape),
                        "dtype": m.dtype,
                        "shards": [[s.rank, list(s.box.offsets), list(s.box.sizes)] for s in m.shards],
                    }
                    for k, m in sorted(self.tensors.items())
                },
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> GlobalLayout:
        """Parse :meth:`to_json` output."""
        doc = json.loads(text)
        metas = {}
        for key, t in doc["tensors"].items():
            specs = tuple(ShardSpec(int(r), Box(tuple(o), tuple(s))) for r, o, s in t["shards"])
            metas[key] = TensorMeta(key, tuple(t["shape"]), t["dtype"], specs)
        return cls(metas, int(doc.get("world_size", 1)))
