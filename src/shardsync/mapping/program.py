"""Mapping: a parsed program, from any of the input forms the spec allows."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from ..errors import MappingError
from .parser import parse_text
from .syntax import Diagnostic, Statement

__all__ = ["Mapping", "MappingLike"]

#: Everything :meth:`Mapping.parse` accepts.
MappingLike = Union["Mapping", str, os.PathLike, Sequence[str], dict]


@dataclass(frozen=True, slots=True)
class Mapping:
    """A parsed mapping program (macros not yet expanded: that needs the source keys).

    Attributes:
        statements: the statements as written, with their indices and text.
        reverse: run the program backwards (it was written for loading); see the spec.

    Example:
        >>> m = Mapping.parse(["qkv -> q, k, v, axis=0", "w^T -> w_t"])
        >>> len(m.statements), m.reverse
        (2, False)
    """

    statements: tuple[Statement, ...]
    reverse: bool = False

    @classmethod
    def parse(cls, source: MappingLike, *, reverse: bool | None = None) -> Mapping:
        """Parse a program.

        Args:
            source: a list of statement strings; one string with a statement per line; a dict
                ``{"aoa_statements": [...], "aoa_config_reverse": bool}``; a path to a ``.txt``
                (a statement per line, ``#`` comments), ``.json`` or ``.yaml``/``.yml`` file holding that
                dict (or a bare list); or a Mapping (returned as is unless ``reverse`` changes it).
            reverse: overrides ``aoa_config_reverse``.

        Raises:
            MappingError: listing every lexical and syntax error of the program.
            FileNotFoundError: ``source`` names a file that does not exist.
        """
        if isinstance(source, Mapping):
            return source if reverse is None else cls(source.statements, reverse)
        chunks, file_reverse = _chunks(source)
        statements: list[Statement] = []
        diags: list[Diagnostic] = []
        index = 0
        for chunk in chunks:
            parsed, problems = parse_text(chunk, index)
            statements += parsed
            diags += problems
            index = max([s.index + 1 for s in parsed] + [d.index + 1 for d in problems] + [index])
        if diags:
            raise MappingError(sorted(diags, key=lambda d: d.index))
        return cls(tuple(statements), file_reverse if reverse is None else reverse)

    def __len__(self) -> int:
        return len(self.statements)

    def text(self) -> str:
        """The program in canonical form, a statement per line."""
        return "\n".join(s.render() for s in self.statements)


def _from_dict(doc: dict) -> tuple[list[str], bool]:
    if "aoa_statements" not in doc:
        raise MappingError(f"a mapping dict needs the key 'aoa_statements' (found {sorted(doc)})")
    stmts = doc["aoa_statements"]
    if isinstance(stmts, str):
        stmts = [stmts]
    if not isinstance(stmts, list) or not all(isinstance(s, str) for s in stmts):
        raise MappingError("'aoa_statements' must be a list of statement strings")
    return stmts, bool(doc.get("aoa_config_reverse", False))


def _chunks(source: Any) -> tuple[list[str], bool]:
    if isinstance(source, dict):
        return _from_dict(source)
    if isinstance(source, os.PathLike) or (isinstance(source, str) and "->" not in source
                                           and Path(source).suffix in (".txt", ".json", ".yaml", ".yml")):
        return _read_file(Path(source))
    if isinstance(source, str):
        return [source], False
    if isinstance(source, Sequence) and all(isinstance(s, str) for s in source):
        return list(source), False
    raise MappingError(f"cannot read a mapping from {type(source).__name__}; give a list of statements, "
                       "a string, a dict with 'aoa_statements', or a .txt/.json/.yaml path")


def _read_file(path: Path) -> tuple[list[str], bool]:
    text = path.read_text()
    if path.suffix == ".txt":
        return [text], False
    if path.suffix == ".json":
        doc = json.loads(text)
    else:
        try:
            import yaml  # optional: only YAML mapping files need it
        except ImportError as exc:
            raise MappingError(f"{path}: reading YAML needs PyYAML (pip install pyyaml), or use "
                               ".json/.txt") from exc
        doc = yaml.safe_load(text)
    if isinstance(doc, list):
        return [str(s) for s in doc], False
    if isinstance(doc, dict):
        return _from_dict(doc)
    raise MappingError(f"{path}: expected a list of statements or a dict with 'aoa_statements'")
