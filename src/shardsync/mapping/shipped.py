"""Shipped mappings, found by name, and the parameters that programs take.

Each ``<name>.txt`` in ``shardsync/mappings/`` is a program; its first comment line describes it.
``Mapping.parse(name)`` (and so every verb that takes ``mapping=``) accepts the name.

A program writes a parameter ``{name}`` where a value goes (``num_heads={num_heads}``);
:meth:`~.program.Mapping.parse` fills each from ``params`` (explicit values win) or from ``config``: a
HuggingFace ``config.json`` (or the directory holding it), a dict, or a config object such as
Megatron's ``TransformerConfig`` or its ``args``. A config key of the parameter's own name is used,
else the keys of :data:`CONFIG_KEYS` in order.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

from ..errors import MappingError
from .lexer import parameter_names, parse_int
from .syntax import suggest

__all__ = [
    "SHIPPED_DIR",
    "shipped_mappings",
    "shipped_path",
    "shipped_parameters",
    "unknown_mapping",
    "ParamValue",
    "ConfigLike",
    "CONFIG_KEYS",
    "fill_parameters",
    "read_config",
]

#: A parameter's value: an integer, or a string (a string of digits is taken as an integer, so values
#: from a command line such as ``--set num_heads=32`` work as they are).
ParamValue = Union[int, str]
#: Where parameters come from: a ``config.json`` path or its directory, a dict, or an object whose
#: attributes are the config keys (Megatron's ``TransformerConfig``, an ``argparse.Namespace``).
ConfigLike = Union[str, "os.PathLike[str]", Mapping[str, Any], object]

#: The directory of the shipped mapping files.
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "mappings"


def _description(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
    return ""


def shipped_mappings() -> dict[str, str]:
    """Every shipped mapping: ``{name: one-line description}``, sorted by name.

    Example:
        >>> "megatron-llama" in shipped_mappings()
        True
    """
    return {p.stem: _description(p) for p in sorted(SHIPPED_DIR.glob("*.txt"), key=lambda p: p.stem)}


def shipped_path(name: str) -> Path | None:
    """The file of a shipped mapping (to read, or to copy and adapt).

    Args:
        name: a shipped mapping's name, e.g. ``"megatron-llama"``.

    Returns:
        its ``.txt`` file, or None if there is no shipped mapping of that name.

    Example:
        >>> shipped_path("megatron-llama").name
        'megatron-llama.txt'
    """
    if not name or name.startswith(".") or "/" in name or "\\" in name:
        return None
    path = SHIPPED_DIR / f"{name}.txt"
    return path if path.is_file() else None


def shipped_parameters(name: str) -> list[str]:
    """The ``{parameters}`` a shipped mapping takes.

    Args:
        name: a shipped mapping's name.

    Returns:
        the parameter names, in order of first use.

    Raises:
        MappingError: there is no shipped mapping ``name`` (listing those there are).

    Example:
        >>> shipped_parameters("megatron-llama")
        ['vocab_size', 'num_heads', 'num_key_value_groups']
    """
    path = shipped_path(name)
    if path is None:
        raise unknown_mapping(name)
    return parameter_names(path.read_text(encoding="utf-8"))


def unknown_mapping(text: str) -> MappingError:
    """The error for a one-line mapping string that is neither a shipped name, a file nor a statement:
    it suggests close shipped names and lists them all."""
    names = shipped_mappings()
    listing = "".join(f"\n  {n}: {d}" for n, d in names.items())
    return MappingError(
        f"{text!r} is not a shipped mapping, a mapping file or a statement (a statement "
        f"has '->'){suggest(text, names)}\nshipped mappings:{listing}"
    )


_INT = re.compile(r"[-+]?[0-9]+")

#: Config keys that supply a parameter of another name, tried in order after the parameter's own name.
#: ``num_key_value_groups`` falls back to the head count (a config without GQA keys has one group per
#: head, as HuggingFace and Megatron both assume).
CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "num_heads": ("num_attention_heads",),
    "num_key_value_groups": ("num_key_value_heads", "num_query_groups", "num_attention_heads"),
    "tp": ("tensor_model_parallel_size",),
}


def read_config(config: ConfigLike) -> Mapping[str, Any] | object:
    """A model config ready for look-ups.

    Args:
        config: a path (a ``config.json`` or a directory holding one), a dict, or any object.

    Returns:
        the JSON object of a path; a dict or any other object as it is.

    Raises:
        MappingError: the file is missing, unreadable, not JSON, or not a JSON object.

    Example:
        >>> read_config({"num_attention_heads": 32})["num_attention_heads"]
        32
    """
    if not isinstance(config, (str, os.PathLike)):
        return config
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise MappingError(
            f"model config {str(path)!r} does not exist; give a config.json, the "
            "directory holding it, or the parameters themselves (params=...)"
        )
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeError) as exc:
        raise MappingError(f"cannot read model config {str(path)!r}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise MappingError(f"{path}, line {exc.lineno}, column {exc.colno}: invalid JSON: {exc.msg}") from None
    except RecursionError:
        raise MappingError(
            f"model config {str(path)!r}: invalid JSON: nested too deeply to read (beyond Python's recursion limit)"
        ) from None
    if not isinstance(doc, dict):
        raise MappingError(f"model config {str(path)!r} holds a JSON {type(doc).__name__}, not an object")
    return doc


def _lookup(config: Mapping[str, Any] | object, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def _coerce(name: str, value: Any, where: str) -> int | str:
    """An integer, or a string of digits, as an int; any other string as it is."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise MappingError(f"parameter {name} = {value!r} ({where}) must be an integer or a string")
    text = str(value).strip()
    if not isinstance(value, int) and not _INT.fullmatch(text):
        return value
    try:
        return parse_int(text)
    except ValueError as exc:
        raise MappingError(f"parameter {name} = {value!r} ({where}): {exc}") from None


def _from_config(name: str, config: Mapping[str, Any] | object) -> tuple[Any, str] | None:
    for key in (name, *CONFIG_KEYS.get(name, ())):
        value = _lookup(config, key)
        if value is not None:
            return value, f"config key {key!r}"
    return None


def _missing_error(missing: Sequence[str], what: str, had_config: bool) -> MappingError:
    keys = "; ".join(" or ".join((n, *CONFIG_KEYS.get(n, ()))) for n in missing)
    example = ", ".join(f"{n!r}: ..." for n in missing)
    where = "the config given has none of the keys" if had_config else "with the keys"
    return MappingError(
        f"{what} needs the parameter{'s' * (len(missing) > 1)} {', '.join(missing)}: pass "
        f"params={{{example}}} to shardsync.Mapping.parse (command line: --set "
        f"{missing[0]}=...), or config= a model config.json or its directory ({where}: "
        f"{keys})"
    )


def fill_parameters(
    needed: Sequence[str],
    params: Mapping[str, ParamValue] | None,
    config: ConfigLike | None,
    *,
    what: str = "the mapping",
) -> dict[str, int | str]:
    """The value of every parameter in ``needed``: from ``params`` first, then from ``config``.

    Args:
        needed: the parameters the program uses (:func:`~.lexer.parameter_names`).
        params: explicit values; each must be a parameter the program uses.
        config: a model config (see :data:`ConfigLike`); keys it has that the program does not use are
            ignored.
        what: how errors name the program (``"mapping 'megatron-llama'"``).

    Returns:
        ``{name: value}`` for every name in ``needed``.

    Raises:
        MappingError: an explicit parameter the program does not use (with close matches), a value
            that is not an integer or a string, or parameters that neither source supplies (naming
            each, with the config keys that would supply it and how to pass it).

    Example:
        >>> fill_parameters(["num_heads", "num_key_value_groups"], {"num_heads": "32"},
        ...                 {"num_key_value_heads": 8})
        {'num_heads': 32, 'num_key_value_groups': 8}
    """
    given = dict(params or {})
    unknown = sorted(set(given) - set(needed))
    if unknown:
        takes = f"it takes {', '.join(needed)}" if needed else "it takes no parameters"
        raise MappingError(f"{what} has no parameter {unknown[0]!r}{suggest(unknown[0], needed)} ({takes})")
    values = {n: _coerce(n, given[n], "given") for n in needed if n in given}
    cfg = None if config is None else read_config(config)
    for name in (n for n in needed if n not in values and cfg is not None):
        found = _from_config(name, cfg)
        if found is not None:
            values[name] = _coerce(name, *found)
    missing = [n for n in needed if n not in values]
    if missing:
        raise _missing_error(missing, what, cfg is not None)
    return values
