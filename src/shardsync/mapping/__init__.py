"""Layer 2: the mapping language (lexer, macros, parser) and the resolver."""

from __future__ import annotations

from .pieces import Piece, TargetSpec
from .resolver import resolve

__all__ = ["Piece", "TargetSpec", "resolve"]
