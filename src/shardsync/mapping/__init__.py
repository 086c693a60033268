"""Layer 2: the mapping language (lexer, macros, parser) and the resolver."""

from __future__ import annotations

from .pieces import Piece, TargetSpec
from .program import Mapping, MappingLike
from .resolver import OPTIMIZER_SUFFIXES, SCALAR_SUFFIXES, resolve
from .syntax import Diagnostic

__all__ = ["Piece", "TargetSpec", "Mapping", "MappingLike", "resolve", "Diagnostic",
           "OPTIMIZER_SUFFIXES", "SCALAR_SUFFIXES"]
