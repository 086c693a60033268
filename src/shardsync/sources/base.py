"""The Source protocol: where weights come from.

A source tells what this rank holds (its layout entries) and reads boxes of it on demand. The planner
sees only the entries (gathered from every rank); the executor calls :meth:`Source.read` only for the
boxes its plan gives this rank, so a lazy source (files) reads nothing else.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..layout.box import Box
from ..layout.meta import LayoutEntry

__all__ = ["Source", "FileSource"]


@runtime_checkable
class Source(Protocol):
    """What one rank holds, and how to read a box of it.

    Call sequence (every rank): ``entries()`` once while the layout is gathered; then ``read(key, box)``
    for each box the plan has this rank send or copy, any number of times, in plan order;
    ``device()`` once before execution.

    Example:
        >>> import torch
        >>> from shardsync.sources import LocalSource
        >>> src = LocalSource({"w": torch.arange(6.).reshape(2, 3)})
        >>> src.entries()[0].shape, src.read("w", Box((0, 1), (2, 1))).flatten().tolist()
        ((2, 3), [1.0, 4.0])
    """

    def entries(self) -> list[LayoutEntry]:
        """This rank's layout entries ``(key, global shape, dtype name, box[, fingerprint])``, sorted by
        key; a fingerprint (optional) lets the layout gather check that replicas agree."""
        ...

    def read(self, key: str, box: Box) -> torch.Tensor:
        """The data of ``box`` (global coordinates) of ``key``; the box lies inside one of this rank's
        entries for ``key``. May be a view; callers never write to it."""
        ...

    def device(self) -> torch.device:
        """Where :meth:`read` returns tensors."""
        ...


@runtime_checkable
class FileSource(Source, Protocol):
    """A source read from checkpoint files that every rank of a group sees (what
    :func:`~shardsync.sources.open_path` opens).

    Call sequence: :class:`Source`'s, then ``close()`` once by whoever opened it (the verbs close a
    source they opened from a path when the call ends); a read after ``close()`` reopens what it needs.

    Attributes:
        shared: True: every rank sees the same data at the same path, so ranks can split the reading
            (:func:`~shardsync.sources.spread`).
    """

    shared: bool

    def close(self) -> None:
        """Release open files and mappings."""
        ...
