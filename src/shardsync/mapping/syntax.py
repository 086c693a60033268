"""The statement AST, source positions and diagnostics shared by the lexer, parser and resolver."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["Name", "Attr", "Statement", "Diagnostic", "suggest"]


@dataclass(frozen=True, slots=True)
class Name:
    """A name as written: ``text`` at column ``col`` (0-based) of its statement."""

    text: str
    col: int = 0


@dataclass(frozen=True, slots=True)
class Attr:
    """``key=value``; ``value`` is None for a bare macro keyword such as ``fused_qkv``."""

    key: str
    value: int | str | None
    col: int = 0


@dataclass(frozen=True, slots=True)
class Statement:
    """One statement: ``left -> right, attrs``.

    ``index`` and ``text`` name the statement as the user wrote it; statements produced by macro
    expansion keep those of their origin, so errors point at what the user can fix. ``optional``
    (written ``name?`` on the left): the statement is skipped when none of the names it reads exists.
    """

    left: tuple[Name, ...]
    right: tuple[Name, ...]
    attrs: tuple[Attr, ...] = ()
    index: int = 0
    text: str = ""
    optional: bool = False

    def attr(self, key: str, default: int | str | None = None) -> int | str | None:
        for a in self.attrs:
            if a.key == key:
                return a.value
        return default

    def has(self, key: str) -> bool:
        return any(a.key == key for a in self.attrs)

    def attr_name(self, key: str) -> Name | None:
        """The attribute ``key`` as a :class:`Name` at its column, to point errors at (None: absent)."""
        return next((Name(a.key, a.col) for a in self.attrs if a.key == key), None)

    def render(self) -> str:
        """The statement in canonical text form (used for expanded statements)."""

        def val(a: Attr) -> str:
            if a.value is None:
                return a.key
            return f"{a.key}={a.value!r}" if isinstance(a.value, str) else f"{a.key}={a.value}"

        left = [n.text for n in self.left]
        if self.optional and left:
            left[0] += "?"
        out = ", ".join(left) + " -> " + ", ".join(n.text for n in self.right)
        return out + "".join(", " + val(a) for a in self.attrs)


@dataclass(frozen=True, slots=True)
class Diagnostic:
    """One problem in a program: where (file, statement index, text, column), which name, what is
    wrong."""

    message: str
    index: int
    text: str
    col: int = 0
    name: str | None = None
    hints: tuple[str, ...] = field(default=())
    file: str | None = None

    def __str__(self) -> str:
        head = f"statement {self.index} `{self.text}`, column {self.col + 1}: {self.message}"
        if self.file is not None:
            head = f"{self.file}: {head}"
        caret = f"\n    {self.text}\n    {' ' * self.col}^" if self.text else ""
        return head + caret + "".join(f"\n    hint: {h}" for h in self.hints)


def suggest(name: str, known: Iterable[str]) -> str:
    """A "did you mean" clause for an unknown name, or an empty string."""
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.5)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
