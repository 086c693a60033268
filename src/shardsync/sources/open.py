"""Turn whatever the caller passed into a :class:`Source`, and spread a shared source across ranks.

``open_source`` takes a state dict, a Source, or a path (format detected). Under a process group a
*shared* source (files every rank sees: safetensors, DCP) is narrowed on each rank to the boxes that
rank is assigned (:func:`assign_boxes`: each box to exactly one rank, balanced by bytes), so the
planner sees it as a sharded state: every box is read by one rank and moved from there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Union

import torch

from ..errors import FormatError, LayoutError
from ..files import file_kind
from ..layout.box import Box
from ..layout.dtypes import itemsize
from ..layout.meta import LayoutEntry
from ..layout.sharded import StateValue
from .base import FileSource, Source
from .dcp import METADATA_FILE, DcpSource
from .fingerprint import ReplicaCheck
from .local import LocalSource
from .megatron_dist import MegatronDistSource, is_megatron_dist
from .modules import state_of
from .safetensors import SafetensorsSource

__all__ = ["SourceLike", "open_source", "open_path", "assign_boxes", "spread", "SpreadSource"]

#: What every verb reads from: a state dict, a module (its state dict), a Source, a checkpoint path, or
#: None (nothing on this rank).
SourceLike = Union[Mapping[str, StateValue], torch.nn.Module, Source, str, os.PathLike, None]

_WHAT = (
    "a .safetensors file, a *.safetensors.index.json, a directory of safetensors files, a "
    "torch DCP checkpoint directory (one holding .metadata), or a Megatron dist_checkpointing "
    "directory (metadata.json, common.pt)"
)


def open_source(x: SourceLike, replica_check: ReplicaCheck = "sampled", *, deferred: bool = False) -> Source:
    """The Source for ``x``: a state dict becomes a :class:`LocalSource` (fingerprinting its shards
    per ``replica_check``; ``deferred``: on demand, see :meth:`LocalSource.fingerprinted`), and so
    do a module (its tensors, read in place; see :func:`~shardsync.sources.modules.module_state`) and
    None (nothing on this rank); a Source is kept, a path is opened by its format (a Megatron
    ``dist_checkpointing`` directory has ``metadata.json`` and ``common.pt``, read per layer by
    :class:`~shardsync.sources.MegatronDistSource`; a DCP directory has ``.metadata``; else
    safetensors).

    Raises:
        FormatError: a path that does not exist or is not a checkpoint (the message says what is).
        LayoutError: ``x`` is none of these, or a Megatron-style module (pass ``from_megatron(model)``).

    Example:
        >>> type(open_source({"w": torch.zeros(2)})).__name__
        'LocalSource'
    """
    if isinstance(x, (str, os.PathLike)):
        return open_path(x)
    if x is None or isinstance(x, (Mapping, torch.nn.Module)):
        return LocalSource(state_of(x, "the source"), replica_check, deferred=deferred)
    if isinstance(x, Source):
        return x
    raise LayoutError(
        f"cannot read weights from a {type(x).__name__}; pass a state dict, a Source "
        f"(e.g. SafetensorsSource, DcpSource), an nn.Module, or a path to {_WHAT}"
    )


def open_path(path: str | os.PathLike) -> FileSource:
    """The source of the checkpoint at ``path``, by its format (see :func:`open_source`); the caller
    closes it when done.

    Raises:
        FormatError: ``path`` does not exist or is not a checkpoint (the message says what is).

    Example:
        >>> open_path("/nonexistent")
        Traceback (most recent call last):
        ...
        shardsync.errors.FormatError: /nonexistent does not exist
    """
    p = Path(path)
    if p.is_dir():
        if is_megatron_dist(p):
            return MegatronDistSource(p)
        if (p / METADATA_FILE).is_file():
            return DcpSource(p)
        if any(p.glob("*.safetensors")) or any(p.glob("*.safetensors.index.json")):
            return SafetensorsSource(p)
        raise FormatError(
            f"{p} is not a checkpoint: it holds no *.safetensors file and no {METADATA_FILE}; pass {_WHAT}"
        )
    if p.is_file():
        if p.name.endswith(".safetensors") or p.name.endswith(".safetensors.index.json"):
            return SafetensorsSource(p)
        if p.name == METADATA_FILE:
            raise FormatError(f"{p} is the metadata file of a DCP checkpoint; pass its directory {p.parent}")
        raise FormatError(f"{p} is not a checkpoint file; pass {_WHAT}")
    if os.path.lexists(p):
        try:
            kind = file_kind(p.stat())
        except OSError:
            kind = "a link to a missing file"
        raise FormatError(f"{p} is {kind}, not a checkpoint; pass {_WHAT}")
    raise FormatError(f"{p} does not exist")


def assign_boxes(entries: list[LayoutEntry], world: int) -> list[int]:
    """The rank that reads each entry: largest first, each to the rank with the fewest bytes so far
    (ties: lowest rank). Deterministic, so every rank computes the same assignment.

    Example:
        >>> e = [LayoutEntry(k, (n,), "float32", Box((0,), (n,))) for k, n in (("a", 4), ("b", 3), ("c", 2))]
        >>> assign_boxes(e, 2)
        [0, 1, 1]
    """
    load = [0] * world
    owner = [0] * len(entries)
    order = sorted(range(len(entries)), key=lambda i: (-_nbytes(entries[i]), entries[i].key, entries[i].box.offsets))
    for i in order:
        r = min(range(world), key=lambda k: (load[k], k))
        owner[i] = r
        load[r] += _nbytes(entries[i])
    return owner


def _nbytes(e: LayoutEntry) -> int:
    return e.box.numel * itemsize(e.dtype)


class SpreadSource:
    """The part of a shared source one rank reads: the boxes :func:`assign_boxes` gives it.

    Example:
        >>> src = SpreadSource(LocalSource({"a": torch.zeros(4), "b": torch.ones(3)}), rank=1, world=2)
        >>> [e.key for e in src.entries()]
        ['b']
    """

    def __init__(self, inner: Source, rank: int, world: int) -> None:
        self.inner = inner
        everything = inner.entries()
        owner = assign_boxes(everything, world)
        self._mine = [e for e, r in zip(everything, owner) if r == rank]

    def entries(self) -> list[LayoutEntry]:
        """This rank's share of the inner source's entries."""
        return list(self._mine)

    def read(self, key: str, box: Box) -> torch.Tensor:
        """The inner source's data of ``box``."""
        return self.inner.read(key, box)

    def device(self) -> torch.device:
        """The inner source's device."""
        return self.inner.device()


def spread(source: Source, rank: int, world: int) -> Source:
    """``source`` narrowed to ``rank``'s share when it is shared (every rank sees the same files)
    and there are several ranks; otherwise ``source`` itself.

    Example:
        >>> spread(LocalSource({"a": torch.zeros(4)}), 0, 2).entries()[0].key   # not shared: unchanged
        'a'
    """
    if world > 1 and getattr(source, "shared", False):
        return SpreadSource(source, rank, world)
    return source
