"""Lexer: statement text -> tokens with positions.

Tokens: ``->``, ``=``, ``:``, ``[``, ``]``, ``,``, integers (negative ones too: an extension over
Paddle), quoted strings, identifiers and newlines. An identifier starts with a letter or ``_`` and goes
on with letters, digits and ``. $ _ * ^``, so ``layers.$LAYER_ID.weight^T`` is one token. ``#`` starts a
comment that runs to the end of the line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Token", "TokenKind", "tokenize"]

#: ``ERROR`` tokens carry a message (a bad character, an unterminated string) for the parser to report
#: in the statement where it occurs.
TokenKind = Literal["ARROW", "EQ", "COLON", "LBRACK", "RBRACK", "COMMA", "INT", "STRING", "NAME",
                    "NEWLINE", "EOF", "ERROR"]
_PUNCT: dict[str, TokenKind] = {"=": "EQ", ":": "COLON", "[": "LBRACK", "]": "RBRACK", ",": "COMMA"}
_NAME_CHARS = frozenset(".$_*^")


@dataclass(frozen=True, slots=True)
class Token:
    kind: TokenKind
    value: str
    pos: int


def _name_end(text: str, i: int) -> int:
    while i < len(text) and (text[i].isalnum() or text[i] in _NAME_CHARS):
        i += 1
    return i


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
        elif c.isdigit() or (c == "-" and i + 1 < n and text[i + 1].isdigit()):
            j = i + 1
            while j < n and text[j].isdigit():
                j += 1
            tokens.append(Token("INT", text[i:j], i))
            i = j
        elif c in "'\"":
            j = text.find(c, i + 1)
            if j < 0 or "\n" in text[i:j]:
                tokens.append(Token("ERROR", f"unterminated string starting with {c}", i))
                j = text.find("\n", i)
                i = n if j < 0 else j
                continue
            tokens.append(Token("STRING", text[i + 1:j], i))
            i = j + 1
        elif c.isalpha() or c == "_":
            j = _name_end(text, i + 1)
            tokens.append(Token("NAME", text[i:j], i))
            i = j
        else:
            tokens.append(Token("ERROR", f"unexpected character {c!r}", i))
            i += 1
    tokens.append(Token("EOF", "", n))
    return tokens
