"""A source narrowed to some of its keys, with a prefix removed: the model part of a torch DCP app
state (``{"model": ..., "optim": ...}`` saves keys ``model.<name>`` and ``optim.<...>``), or any part
of a checkpoint chosen by glob patterns.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

import torch

from ..errors import FormatError
from ..layout.box import Box
from ..layout.meta import LayoutEntry
from .base import Source

__all__ = ["SelectedSource", "select_keys"]


class SelectedSource:
    """The keys of ``inner`` that start with ``prefix`` and match one of ``patterns`` (all, when
    none is given; matched on the key as stored), named without ``prefix``.

    Example:
        >>> from shardsync.sources import LocalSource
        >>> src = SelectedSource(LocalSource({"model.w": torch.ones(2), "optim.state.w": torch.ones(2)}),
        ...                      "model.")
        >>> [e.key for e in src.entries()], src.read("w", Box((0,), (1,))).tolist()
        (['w'], [1.0])
    """

    def __init__(self, inner: Source, prefix: str = "", patterns: Sequence[str] = ()) -> None:
        self.inner, self.prefix = inner, prefix
        self.patterns = tuple(patterns)
        self.shared = bool(getattr(inner, "shared", False))  # spread() narrows it like its inner source

    def _keeps(self, key: str) -> bool:
        return key.startswith(self.prefix) and (
            not self.patterns or any(fnmatch.fnmatchcase(key, p) for p in self.patterns)
        )

    def entries(self) -> list[LayoutEntry]:
        """The inner source's entries that are kept, renamed."""
        return [e._replace(key=e.key[len(self.prefix) :]) for e in self.inner.entries() if self._keeps(e.key)]

    def read(self, key: str, box: Box) -> torch.Tensor:
        """The inner source's data of ``box`` of ``prefix + key``."""
        return self.inner.read(self.prefix + key, box)

    def device(self) -> torch.device:
        """The inner source's device."""
        return self.inner.device()


def select_keys(source: Source, prefix: str = "", patterns: Sequence[str] = ()) -> Source:
    """``source`` narrowed to the keys under ``prefix`` (which they lose) that match a glob of
    ``patterns``; ``source`` itself when neither is given.

    Raises:
        FormatError: no key is kept (naming a few keys the source has, and what to pass).

    Example:
        >>> from shardsync.sources import LocalSource
        >>> src = LocalSource({"model.a.w": torch.ones(1), "model.b.w": torch.ones(1), "optim.x": torch.ones(1)})
        >>> [e.key for e in select_keys(src, "model.", ["*.a.*"]).entries()]
        ['a.w']
    """
    if not prefix and not patterns:
        return source
    selected = SelectedSource(source, prefix, patterns)
    if not selected.entries():
        keys = sorted({e.key for e in source.entries()})
        what = " and ".join(
            filter(
                None,
                [
                    f"start with {prefix!r}" if prefix else "",
                    f"match {' or '.join(map(repr, patterns))}" if patterns else "",
                ],
            )
        )
        raise FormatError(
            f"no key of the checkpoint {what}; its keys look like {keys[:4]}: give a prefix "
            "(--prefix model. for a DCP app state {'model': ..., 'optim': ...}) or patterns "
            "that its keys have"
        )
    return selected
