"""Where weights come from: the :class:`Source` protocol and its implementations."""

from __future__ import annotations

from .base import Source
from .local import LocalSource
from .megatron import from_megatron

__all__ = ["Source", "LocalSource", "from_megatron"]
