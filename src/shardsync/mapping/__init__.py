"""Layer 2: the mapping language (lexer, macros, parser), the resolver and the shipped mappings."""

from __future__ import annotations

from .pieces import Piece, TargetSpec
from .program import Mapping, MappingLike
from .resolver import OPTIMIZER_SUFFIXES, SCALAR_SUFFIXES, resolve, unconsumed
from .shipped import CONFIG_KEYS, ConfigLike, ParamValue, shipped_mappings, shipped_parameters
from .syntax import Diagnostic

__all__ = [
    "Piece",
    "TargetSpec",
    "Mapping",
    "MappingLike",
    "resolve",
    "unconsumed",
    "Diagnostic",
    "OPTIMIZER_SUFFIXES",
    "SCALAR_SUFFIXES",
    "shipped_mappings",
    "shipped_parameters",
    "ParamValue",
    "ConfigLike",
    "CONFIG_KEYS",
]
