"""Lexer: statement text -> tokens with positions.

Tokens: ``->``, ``=``, ``:``, ``[``, ``]``, ``,``, integers (ASCII digits, at most 2**63 - 1 in
magnitude; negative ones too: an extension over Paddle), quoted strings, identifiers, parameters and
newlines. An identifier starts with a letter or ``_`` and goes on with letters, digits and
``. $ _ * ^``, so ``layers.$LAYER_ID.weight^T`` is one token; a ``?`` may end it (an optional statement,
an extension). A parameter is ``{name}`` (an extension: its value is filled in when the program is
parsed). ``#`` starts a comment that runs to the end of the line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["Token", "TokenKind", "tokenize", "parameter_names", "parse_int", "parse_int_list", "INT_LIMIT"]

#: ``ERROR`` tokens carry a message (a bad character, an unterminated string) for the parser to report
#: in the statement where it occurs.
TokenKind = Literal[
    "ARROW", "EQ", "COLON", "LBRACK", "RBRACK", "COMMA", "INT", "STRING", "NAME", "PARAM", "NEWLINE", "EOF", "ERROR"
]
_PUNCT: dict[str, TokenKind] = {"=": "EQ", ":": "COLON", "[": "LBRACK", "]": "RBRACK", ",": "COMMA"}
_NAME_CHARS = frozenset(".$_*^")
_DIGITS = frozenset("0123456789")
_INT = re.compile(r"[-+]?[0-9]+")
_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
#: The largest magnitude an integer may have (every size, dim or count fits a signed 64-bit int).
INT_LIMIT = 2**63 - 1


@dataclass(frozen=True, slots=True)
class Token:
    kind: TokenKind
    value: str
    pos: int


def parse_int(text: str) -> int:
    """``text`` as an integer: ASCII digits with an optional sign, at most :data:`INT_LIMIT`.

    Raises:
        ValueError: naming the problem (not an integer, or too large), with the value shortened.

    Example:
        >>> parse_int(" -12 ")
        -12
    """
    s = text.strip()
    shown = s if len(s) <= 24 else f"{s[:12]}...({len(s)} characters)"
    if not _INT.fullmatch(s):
        raise ValueError(f"{shown!r} is not an integer")
    # the length check first: int() of a huge digit string is slow, and refused past 4300 digits
    if len(s.lstrip("+-").lstrip("0")) > 19 or abs(int(s)) > INT_LIMIT:
        raise ValueError(f"integer {shown} is too large (at most 2**63 - 1)")
    return int(s)


def parse_int_list(text: str) -> list[int]:
    """``text`` as one flat list of integers: ``'[2, 0, 1]'``, brackets optional, ``'[]'`` empty.

    Raises:
        ValueError: a nested or unbalanced list (never flattened), or an item that is no integer.

    Example:
        >>> parse_int_list("[2, 0, 1]"), parse_int_list("1, 0"), parse_int_list("[]")
        ([2, 0, 1], [1, 0], [])
    """
    raw = text.strip()
    inner = raw[1:-1] if raw.startswith("[") and raw.endswith("]") else raw
    if "[" in inner or "]" in inner:
        raise ValueError(f"{raw!r} is nested or unbalanced, not one flat list")
    return [parse_int(x) for x in inner.split(",") if x.strip()]


def _name_end(text: str, i: int) -> int:
    while i < len(text) and (text[i].isalnum() or text[i] in _NAME_CHARS):
        i += 1
    return i


def _param_token(text: str, i: int) -> tuple[Token, int]:
    """The parameter ``{name}`` at ``i``, or an ERROR token; and where scanning goes on."""
    m = _PARAM.match(text, i)
    if m is not None:
        return Token("PARAM", m.group(1), i), m.end()
    j = text.find("}", i)
    line_end = text.find("\n", i)
    stop = len(text) if line_end < 0 else line_end
    end = j + 1 if 0 <= j < stop else stop
    return Token(
        "ERROR",
        f"a parameter is written {{name}} (a letter or '_', then letters, digits or '_'), not {text[i:end]!r}",
        i,
    ), end


def _int_token(digits: str, pos: int) -> Token:
    try:
        parse_int(digits)
    except ValueError as exc:
        return Token("ERROR", str(exc), pos)
    return Token("INT", digits, pos)


def tokenize(text: str) -> list[Token]:
    """Split ``text`` into tokens; a bad character or string becomes an ``ERROR`` token.

    Example:
        >>> [t.value for t in tokenize("a^T -> b, axis=-1")][:4]
        ['a^T', '->', 'b', ',']
    """
    tokens: list[Token] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            tokens.append(Token("NEWLINE", "\n", i))
            i += 1
        elif c.isspace():
            i += 1
        elif c == "#":
            while i < n and text[i] != "\n":
                i += 1
        elif text.startswith("->", i):
            tokens.append(Token("ARROW", "->", i))
            i += 2
        elif c in _PUNCT:
            tokens.append(Token(_PUNCT[c], c, i))
            i += 1
        elif c in _DIGITS or (c == "-" and i + 1 < n and text[i + 1] in _DIGITS):
            j = i + 1
            while j < n and text[j] in _DIGITS:
                j += 1
            tokens.append(_int_token(text[i:j], i))
            i = j
        elif c in "'\"":
            j = text.find(c, i + 1)
            if j < 0 or "\n" in text[i:j]:
                tokens.append(Token("ERROR", f"unterminated string starting with {c}", i))
                j = text.find("\n", i)
                i = n if j < 0 else j
                continue
            tokens.append(Token("STRING", text[i + 1 : j], i))
            i = j + 1
        elif c == "{":
            tok, i = _param_token(text, i)
            tokens.append(tok)
        elif c.isalpha() or c == "_":
            j = _name_end(text, i + 1)
            j += text.startswith("?", j)  # `name?`: the statement is optional
            tokens.append(Token("NAME", text[i:j], i))
            i = j
        else:
            tokens.append(Token("ERROR", f"unexpected character {c!r}", i))
            i += 1
    tokens.append(Token("EOF", "", n))
    return tokens


def parameter_names(text: str) -> list[str]:
    """The parameters ``{name}`` that ``text`` uses, in order of first use (comments ignored).

    Example:
        >>> parameter_names("qkv -> q, k, v, fused_qkv, num_heads={h}, num_key_value_groups={g}  # {x}")
        ['h', 'g']
    """
    return list(dict.fromkeys(t.value for t in tokenize(text) if t.kind == "PARAM"))
