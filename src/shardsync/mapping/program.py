"""Mapping: a parsed program, from any of the input forms the spec allows (a shipped name included)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping as AbcMapping
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Union

from ..errors import FormatError, MappingError
from ..files import read_bounded
from .lexer import parameter_names
from .parser import parse_text
from .shipped import ConfigLike, ParamValue, fill_parameters, shipped_path, unknown_mapping
from .syntax import Diagnostic, Statement

__all__ = ["Mapping", "MappingLike"]

#: Everything :meth:`Mapping.parse` accepts.
MappingLike = Union["Mapping", str, os.PathLike, Sequence[str], dict]
# A one-line string without '->' that ends in one of these is a path, not a program.
_SUFFIXES = (".txt", ".json", ".yaml", ".yml")
#: Largest mapping file read (the shipped ones are a few KB); a bigger one is not a mapping.
MAX_MAPPING_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class Mapping:
    """A parsed mapping program (macros not yet expanded: that needs the source keys).

    Attributes:
        statements: the statements as written (parameters filled in), with their indices and text.
        reverse: run the program backwards (it was written for loading); see the spec.
        prefix: the left side's keys (the model's, in a Megatron -> HF program) carry this prefix, e.g.
            ``"module."`` for a DDP-wrapped state dict: source keys lose it; in reverse mode, the
            targets gain it.
        strict: resolving is an error if a source passes through unconsumed (not read by any statement).

    Example:
        >>> m = Mapping.parse(["qkv -> q, k, v, axis=0", "w^T -> w_t"])
        >>> len(m.statements), m.reverse
        (2, False)
    """

    statements: tuple[Statement, ...]
    reverse: bool = False
    prefix: str = ""
    strict: bool = False

    @classmethod
    def parse(
        cls,
        source: MappingLike,
        *,
        reverse: bool | None = None,
        params: AbcMapping[str, ParamValue] | None = None,
        config: ConfigLike | None = None,
        prefix: str | None = None,
        strict: bool | None = None,
    ) -> Mapping:
        """Parse a program.

        Args:
            source: the name of a shipped mapping (:func:`~.shipped.shipped_mappings`); a list of
                statement strings; one string with a statement per line; a dict
                ``{"aoa_statements": [...], "aoa_config_reverse": bool}``; a path to a ``.json`` or
                ``.yaml``/``.yml`` file holding that dict (or a bare list) or to a text file (a
                statement per line, ``#`` comments); or a Mapping (returned as is unless ``reverse``,
                ``prefix`` or ``strict`` change it). A string without ``->`` on one line is a shipped
                name, else a path.
            reverse: overrides ``aoa_config_reverse``.
            params: values of the program's ``{name}`` parameters (these win over ``config``).
            config: a model config supplying the other parameters: a ``config.json`` or its
                directory, a dict, or an object such as Megatron's ``TransformerConfig``.
            prefix: see the attribute (default ``""``).
            strict: see the attribute (default False).

        Raises:
            MappingError: listing every lexical and syntax error of the program (with the file, for a
                program read from one); or the file is missing, a directory, unreadable, or not
                valid JSON/YAML of the expected shape (with line and column where there is one); or a
                one-line string is no shipped name, file or statement; or a parameter has no value,
                a bad one, or is not one of the program's.

        Example:
            >>> m = Mapping.parse("megatron-llama", params={"num_heads": 8, "num_key_value_groups": 2,
            ...                                             "vocab_size": 1000})
            >>> m.statements[0].render()
            'embedding.word_embeddings.weight -> model.embed_tokens.weight, axis=0, keep=1000'
        """
        if isinstance(source, Mapping):
            if params is not None or config is not None:
                raise MappingError(
                    "params and config fill parameters while a program is parsed, and this "
                    "Mapping is parsed already: give the mapping's name, file or text"
                )
            return cls(
                source.statements,
                source.reverse if reverse is None else reverse,
                source.prefix if prefix is None else prefix,
                source.strict if strict is None else strict,
            )
        path, what = _locate(source)
        chunks, file_reverse = _from_source(source) if path is None else _read_file(path)
        needed = list(dict.fromkeys(n for chunk in chunks for n in parameter_names(chunk)))
        values = fill_parameters(needed, params, config, what=what)
        statements: list[Statement] = []
        diags: list[Diagnostic] = []
        index = 0
        for chunk in chunks:
            parsed, problems = parse_text(chunk, index, values)
            statements += parsed
            diags += problems
            index = max([s.index + 1 for s in parsed] + [d.index + 1 for d in problems] + [index])
        if diags:
            where = None if path is None else str(path)
            raise MappingError([replace(d, file=where) for d in sorted(diags, key=lambda d: d.index)])
        return cls(tuple(statements), file_reverse if reverse is None else reverse, prefix or "", bool(strict))

    def __len__(self) -> int:
        return len(self.statements)

    def text(self) -> str:
        """The program in canonical form, a statement per line."""
        return "\n".join(s.render() for s in self.statements)


def _locate(source: Any) -> tuple[Path | None, str]:
    """The file ``source`` names, if it names one, and how errors name the program.

    A PathLike is a path. A one-line string without ``->`` is a shipped mapping's name, else a path
    (so a missing file is reported as such, not parsed as a statement): it must end in a mapping-file
    suffix, hold a path separator, or be an existing file.
    """
    if isinstance(source, os.PathLike):
        return Path(source), f"mapping file {os.fspath(source)!r}"
    if not isinstance(source, str):
        return None, "the mapping"
    text = source.strip()
    if not text or "->" in text or "\n" in text or text.startswith("#"):
        return None, "the mapping"
    shipped = shipped_path(text)
    if shipped is not None:
        return shipped, f"mapping {text!r}"
    if Path(text).suffix in _SUFFIXES or "/" in text or os.sep in text or Path(text).is_file():
        return Path(text), f"mapping file {text!r}"
    raise unknown_mapping(text)


def _from_source(source: Any) -> tuple[list[str], bool]:
    if isinstance(source, dict):
        return _from_doc(source, "the mapping dict")
    if isinstance(source, str):
        return [source], False
    if isinstance(source, Sequence) and all(isinstance(s, str) for s in source):
        return list(source), False
    raise MappingError(
        f"cannot read a mapping from {type(source).__name__}; give a list of statements, "
        "a string, a dict with 'aoa_statements', or a .txt/.json/.yaml path"
    )


def _from_doc(doc: Any, where: str) -> tuple[list[str], bool]:
    """Statements and the reverse flag from a list of statements or a dict with ``aoa_statements``."""
    if isinstance(doc, list):
        doc = {"aoa_statements": doc}
    if not isinstance(doc, dict):
        raise MappingError(
            f"{where}: expected a list of statements or a dict with 'aoa_statements', found {type(doc).__name__}"
        )
    if "aoa_statements" not in doc:
        raise MappingError(f"{where}: a mapping dict needs the key 'aoa_statements' (found {sorted(map(str, doc))})")
    stmts = doc["aoa_statements"]
    if isinstance(stmts, str):
        stmts = [stmts]
    bad = [i for i, s in enumerate(stmts) if not isinstance(s, str)] if isinstance(stmts, list) else None
    if bad is None or bad:
        found = type(stmts).__name__ if bad is None else f"item {bad[0]} is {type(stmts[bad[0]]).__name__}"
        raise MappingError(f"{where}: 'aoa_statements' must be a list of statement strings ({found})")
    reverse = doc.get("aoa_config_reverse", False)
    if not isinstance(reverse, bool):
        raise MappingError(f"{where}: 'aoa_config_reverse' must be true or false, not {reverse!r}")
    return stmts, reverse


def _read_file(path: Path) -> tuple[list[str], bool]:
    if not path.exists():
        raise MappingError(f"mapping file {str(path)!r} does not exist (inline statements need '->')")
    if path.is_dir():
        raise MappingError(f"mapping path {str(path)!r} is a directory; give a .txt, .json or .yaml file")
    try:
        text = read_bounded(path, MAX_MAPPING_BYTES).decode("utf-8")
    except FormatError as exc:
        raise MappingError(
            f"cannot read mapping file {str(path)!r}: {exc} (a mapping file is a regular "
            f"file of at most {MAX_MAPPING_BYTES >> 20} MiB)"
        ) from None
    except UnicodeError as exc:
        raise MappingError(f"cannot read mapping file {str(path)!r}: {exc}") from None
    if path.suffix == ".json":
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MappingError(f"{path}, line {exc.lineno}, column {exc.colno}: invalid JSON: {exc.msg}") from None
        except RecursionError:
            raise MappingError(
                f"{path}: invalid JSON: nested too deeply to read (beyond Python's recursion limit); "
                "fix the mapping file"
            ) from None
    elif path.suffix in (".yaml", ".yml"):
        doc = _load_yaml(path, text)
    else:
        return [text], False  # a text program: a statement per line
    return _from_doc(doc, str(path))


def _load_yaml(path: Path, text: str) -> Any:
    try:
        import yaml  # optional: only YAML mapping files need it
    except ImportError as exc:
        raise MappingError(f"{path}: reading YAML needs PyYAML (pip install pyyaml), or use .json/.txt") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise MappingError(f"{path}{at}: invalid YAML: {problem}") from None
    except RecursionError:
        raise MappingError(
            f"{path}: invalid YAML: nested too deeply to read (beyond Python's recursion limit); fix the mapping file"
        ) from None
