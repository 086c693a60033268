"""The global layout: every key's global shape, dtype and the shards each rank holds.

Inert data with a JSON round trip; no torch.distributed here. Build each rank's local layout with
:func:`local_layout`, gather them (the exec layer does that), and merge with :meth:`GlobalLayout.merge`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import LayoutError
from .box import Box

__all__ = ["LayoutEntry", "ShardSpec", "TensorMeta", "GlobalLayout"]


class LayoutEntry(NamedTuple):
    """One shard a rank holds, as it reports it when the layout is gathered."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    box: Box


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
    def merge(cls, per_rank: Iterable[Iterable[tuple[str, tuple[int, ...], str, Box]]],
              ) -> GlobalLayout:
        """Merge the local layouts of all ranks (rank i's entries at position i).

        Each entry is ``(key, global_shape, dtype, box)``. Raises one :class:`LayoutError` listing every
        key whose ranks disagree on global shape or dtype, or whose box falls outside the shape.
        """
        shapes: dict[str, dict[tuple[tuple[int, ...], str], list[int]]] = {}
        shards: dict[str, list[ShardSpec]] = {}
        problems: list[str] = []
        world = 0
        for rank, entries in enumerate(per_rank):
            world = rank + 1
            for key, shape, dtype, box in entries:
                shape = tuple(shape)
                shapes.setdefault(key, {}).setdefault((shape, dtype), []).append(rank)
                if not box.within(shape):
                    problems.append(f"{key!r}: rank {rank} holds box {box} outside global shape "
                                    f"{list(shape)}")
                shards.setdefault(key, []).append(ShardSpec(rank, box))
        metas = {}
        for key in sorted(shapes):
            variants = shapes[key]
            if len(variants) > 1:
                desc = "; ".join(f"ranks {r} say shape {list(s)} {d}" for (s, d), r in variants.items())
                problems.append(f"{key!r}: ranks disagree on global shape/dtype: {desc}")
                continue
            (shape, dtype), = variants
            specs = sorted(shards[key], key=lambda s: (s.rank, s.box.offsets))
            metas[key] = TensorMeta(key, shape, dtype, tuple(specs))
        if problems:
            raise LayoutError("inconsistent layout:\n  " + "\n  ".join(problems))
        return cls(metas, world)

    def to_json(self) -> str:
        """Serialise to JSON (see :meth:`from_json`)."""
        return json.dumps({
            "world_size": self.world_size,
            "tensors": {k: {"shape": list(m.shape), "dtype": m.dtype,
                            "shards": [[s.rank, list(s.box.offsets), list(s.box.sizes)]
                                       for s in m.shards]}
                        for k, m in sorted(self.tensors.items())},
        }, indent=1)

    @classmethod
    def from_json(cls, text: str) -> GlobalLayout:
        """Parse :meth:`to_json` output."""
        doc = json.loads(text)
        metas = {}
        for key, t in doc["tensors"].items():
            specs = tuple(ShardSpec(int(r), Box(tuple(o), tuple(s))) for r, o, s in t["shards"])
            metas[key] = TensorMeta(key, tuple(t["shape"]), t["dtype"], specs)
        return cls(metas, int(doc.get("world_size", 1)))
