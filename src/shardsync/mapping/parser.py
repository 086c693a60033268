"""Parser: tokens -> statements, with every syntax error of the program reported at once.

Statement boundaries are grammatical: after ``names -> names [, attrs]`` a new statement may start on
the same line (Paddle parses ``"a -> b" "c -> d"`` as two); newlines also end statements. ``name[a:b]``
is expanded here into ``name_a, ..., name_{b-1}`` (it depends on no keys), up to
:data:`MAX_RANGE_NAMES` names. A parameter ``{name}`` in an attribute's place takes its value from the
``params`` given; a ``?`` ending a name on the left makes the statement optional.
"""

from __future__ import annotations

from collections.abc import Mapping

from .fused import FUSED_FORMS
from .lexer import Token, tokenize
from .statements import STATEMENT_ATTRIBUTES
from .syntax import Attr, Diagnostic, Name, Statement

__all__ = ["parse_text", "attribute_names", "MAX_RANGE_NAMES"]

#: The most names one ``name[a:b]`` may expand to (a typo such as ``w[0:1000000000]`` would otherwise
#: build a billion names before anything else is checked).
MAX_RANGE_NAMES = 10_000


def attribute_names() -> frozenset[str]:
    """Every attribute a statement may carry: the plain statements' and, from :data:`FUSED_FORMS`,
    each fused form's keyword and attributes (read when called, so a registered form is known)."""
    return STATEMENT_ATTRIBUTES.union(FUSED_FORMS, *(form.attrs for form in FUSED_FORMS.values()))


class _Fail(Exception):
    def __init__(self, message: str, tok: Token, name: str | None = None) -> None:
        super().__init__(message)
        self.message, self.tok, self.name = message, tok, name


class _Parser:
    def __init__(self, text: str, tokens: list[Token], params: Mapping[str, int | str]) -> None:
        self.text, self.toks, self.i, self.params = text, tokens, 0, params
        self.optional = False  # the statement being parsed has a `name?`

    def peek(self, k: int = 0) -> Token:
        tok = self.toks[min(self.i + k, len(self.toks) - 1)]
        if tok.kind == "ERROR":
            raise _Fail(tok.value, tok)
        return tok

    def take(self, kind: str, what: str) -> Token:
        tok = self.peek()
        if tok.kind != kind:
            got = "end of statement" if tok.kind in ("NEWLINE", "EOF") else repr(tok.value)
            raise _Fail(f"expected {what}, found {got}", tok)
        self.i += 1
        return tok

    def names(self, start: int, right: bool) -> list[Name]:
        out = self.name(start, right)
        while self.peek().kind == "COMMA" and self.peek(1).kind == "NAME":
            nxt = self.peek(1)
            if right and (nxt.value in FUSED_FORMS or self.peek(2).kind == "EQ"):
                break
            self.i += 1
            out += self.name(start, right)
        return out

    def name(self, start: int, right: bool) -> list[Name]:
        tok = self.take("NAME", "a name")
        col = tok.pos - start
        if tok.value.endswith("?"):
            if right:
                raise _Fail(
                    f"{tok.value!r}: '?' marks an optional statement and goes after a name on the left of '->'",
                    tok,
                    tok.value,
                )
            self.optional = True
            tok = Token(tok.kind, tok.value[:-1], tok.pos)
        if self.peek().kind != "LBRACK":
            return [Name(tok.value, col)]
        self.i += 1
        lo = int(self.take("INT", "a start index in name[a:b]").value)
        self.take("COLON", "':' in name[a:b]")
        hi_tok = self.take("INT", "an end index in name[a:b]")
        self.take("RBRACK", "']' closing name[a:b]")
        hi = int(hi_tok.value)
        if hi <= lo:
            raise _Fail(f"empty range {tok.value}[{lo}:{hi}]: the end must exceed the start", hi_tok, tok.value)
        if hi - lo > MAX_RANGE_NAMES:
            raise _Fail(
                f"{tok.value}[{lo}:{hi}] would expand to {hi - lo} names; a range expands to at "
                f"most {MAX_RANGE_NAMES}: check the bounds, or match the keys with a '*' or "
                "$NAME placeholder instead",
                tok,
                tok.value,
            )
        return [Name(f"{tok.value}_{k}", col) for k in range(lo, hi)]

    def attr(self, start: int, seen: list[Attr]) -> Attr:
        key = self.take("NAME", "an attribute")
        col = key.pos - start
        if any(a.key == key.value for a in seen):
            raise _Fail(f"attribute {key.value!r} is given twice; give it once", key, key.value)
        if self.peek().kind != "EQ":
            if key.value not in FUSED_FORMS:
                raise _Fail(f"attribute {key.value!r} needs a value ({key.value}=...)", key, key.value)
            return Attr(key.value, None, col)
        if key.value in FUSED_FORMS:
            raise _Fail(f"{key.value} is a bare keyword and takes no value (`..., {key.value}, ...`)", key, key.value)
        self.i += 1
        tok = self.peek()
        if tok.kind == "INT":
            self.i += 1
            return Attr(key.value, int(tok.value), col)
        if tok.kind == "STRING":
            self.i += 1
            return Attr(key.value, tok.value, col)
        if tok.kind == "PARAM":
            if tok.value not in self.params:
                raise _Fail(f"parameter {{{tok.value}}} has no value", tok, tok.value)
            self.i += 1
            return Attr(key.value, self.params[tok.value], col)
        if tok.kind == "LBRACK":  # extension: permute=[2, 0, 1] without quotes, {parameters} inside
            self.i += 1
            items = []
            while self.peek().kind in ("INT", "PARAM"):
                items.append(self.list_item())
                if self.peek().kind != "COMMA":
                    break
                self.i += 1
            self.take("RBRACK", "']' closing the list")
            return Attr(key.value, "[" + ", ".join(items) + "]", col)
        raise _Fail(f"attribute {key.value!r} needs an integer or a quoted string (or a {{parameter}})", tok, key.value)

    def list_item(self) -> str:
        """An integer of a ``[...]`` list, or a ``{parameter}`` whose value is an integer."""
        tok = self.peek()
        self.i += 1
        if tok.kind == "INT":
            return tok.value
        value = self.params.get(tok.value)
        if value is None:
            raise _Fail(f"parameter {{{tok.value}}} has no value", tok, tok.value)
        if not isinstance(value, int):
            raise _Fail(
                f"parameter {{{tok.value}}} is {value!r}; in a [...] list it must be an integer", tok, tok.value
            )
        return str(value)

    def statement(self, index: int) -> Statement:
        first = self.peek()
        start = first.pos
        self.optional = False
        left = self.names(start, right=False)
        self.take("ARROW", "'->'")
        right = self.names(start, right=True)
        attrs: list[Attr] = []
        while self.peek().kind == "COMMA":
            self.i += 1
            attrs.append(self.attr(start, attrs))
        end_tok = self.peek()
        if end_tok.kind not in ("NEWLINE", "EOF", "NAME"):
            raise _Fail(f"unexpected {end_tok.value!r} after the statement", end_tok)
        end = self.toks[self.i - 1]
        stop = end.pos + len(end.value) + (2 if end.kind in ("STRING", "PARAM") else 0)
        return Statement(tuple(left), tuple(right), tuple(attrs), index, self.text[start:stop].strip(), self.optional)

    def skip_line(self) -> None:
        while self.toks[self.i].kind not in ("NEWLINE", "EOF"):
            self.i += 1


def _line_of(text: str, pos: int) -> tuple[str, int]:
    lo = text.rfind("\n", 0, pos) + 1
    hi = text.find("\n", pos)
    line = text[lo:] if hi < 0 else text[lo:hi]
    stripped = line.lstrip()
    return stripped.rstrip(), pos - lo - (len(line) - len(stripped))


def parse_text(
    text: str,
    first_index: int = 0,
    params: Mapping[str, int | str] | None = None,
) -> tuple[list[Statement], list[Diagnostic]]:
    """Parse one chunk of program text; statement indices start at ``first_index``; ``params`` gives
    the values of ``{name}`` parameters.

    Returns:
        the statements and the diagnostics (lexical and syntax errors, parameters without a value;
        parsing resumes on the next line).
    """
    p = _Parser(text, tokenize(text), params or {})
    diags: list[Diagnostic] = []
    statements: list[Statement] = []
    index = first_index
    while p.toks[p.i].kind != "EOF":
        if p.toks[p.i].kind == "NEWLINE":
            p.i += 1
            continue
        try:
            statements.append(p.statement(index))
        except _Fail as f:
            line, col = _line_of(text, f.tok.pos)
            diags.append(Diagnostic(f.message, index, line, col, f.name))
            p.skip_line()
        index += 1
    return statements, diags
