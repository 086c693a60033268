"""Shipped mappings: the programs in ``shardsync/mappings/``, found by name.

Each ``<name>.txt`` there is a program; its first comment line describes it. ``Mapping.parse(name)``
(and so every verb that takes ``mapping=``) accepts the name; its ``{parameters}`` are filled from
``params=`` or ``config=`` (see :mod:`.params`).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import MappingError
from .lexer import parameter_names
from .syntax import suggest

__all__ = ["SHIPPED_DIR", "shipped_mappings", "shipped_path", "shipped_parameters", "unknown_mapping"]

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
    """The file of the shipped mapping ``name``, or None if there is none of that name.

    Example:
        >>> shipped_path("megatron-llama").name
        'megatron-llama.txt'
    """
    if not name or name.startswith(".") or "/" in name or "\\" in name:
        return None
    path = SHIPPED_DIR / f"{name}.txt"
    return path if path.is_file() else None


def shipped_parameters(name: str) -> list[str]:
    """The ``{parameters}`` the shipped mapping ``name`` takes, in order of first use.

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
    return MappingError(f"{text!r} is not a shipped mapping, a mapping file or a statement (a statement "
                        f"has '->'){suggest(text, names)}\nshipped mappings:{listing}")
