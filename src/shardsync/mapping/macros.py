"""Macro expansion over parsed statements (everything that depends on the key sets).

Order, as in the spec: ``$LAYER_ID_OFFSET``; other ``$NAME`` placeholders; ``*``; ``X^T`` on the
reading side. (``name[a:b]`` is expanded by the parser; the fused macros are evaluated by the
resolver, which knows shapes and shard counts.) Reverse mode is applied last, on the expanded list.

The *source side* of a statement is the side read in the export direction: the left side normally, the
right side for a reversed (load-direction) program. Its names match against source keys; the other
side's names match against destination keys, which only a destination layout provides.

A name with placeholders or ``*`` matches keys in linear time: each slot is a run of ASCII digits taken
whole (no backtracking), so a slot must end the name or be followed by a non-digit.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

from .lexer import parse_int_list
from .syntax import Attr, Diagnostic, Name, Statement, suggest

__all__ = ["expand_macros", "reverse_program", "invert_permutation"]

_OFFSET = "$LAYER_ID_OFFSET"
_PLACEHOLDER = re.compile(r"\$([A-Z_][A-Z0-9_]*)")
_SLOT = re.compile(r"\$([A-Z_][A-Z0-9_]*)|\*")
# A slot's digits, taken possessively (never given back, so matching cannot backtrack); 18 digits at
# most, so every value fits int() and an absurd key simply does not match.
_RUN = "[0-9]{1,18}+"
_T = "^T"


class _MacroFail(Exception):
    def __init__(self, message: str, name: Name | None = None, hints: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.message, self.name, self.hints = message, name, hints


def _sides(st: Statement, reverse: bool) -> tuple[tuple[Name, ...], tuple[Name, ...]]:
    return (st.right, st.left) if reverse else (st.left, st.right)


def _rebuild(st: Statement, reverse: bool, src: list[Name], dst: list[Name]) -> Statement:
    left, right = (dst, src) if reverse else (src, dst)
    return replace(st, left=tuple(left), right=tuple(right))


def _template(name: Name) -> re.Pattern[str]:
    """The pattern of keys that ``name`` (less a ``^T``) matches: each ``$NAME`` is a named group (the
    same digits wherever it repeats), each ``*`` an unnamed one. Because a slot is followed by a
    non-digit or the end, a key matches in at most one way."""
    text = name.text.removesuffix(_T)
    out, at, seen = [], 0, set()
    for m in _SLOT.finditer(text):
        nxt = text[m.end():m.end() + 1]
        if nxt.isascii() and nxt.isdigit() or _SLOT.match(text, m.end()):
            raise _MacroFail(f"{name.text!r}: {m.group()!r} is directly followed by {nxt!r}; a placeholder "
                             "or '*' must end the name or be followed by a non-digit, so that a run of "
                             "digits in a key can be cut only one way", name)
        out.append(re.escape(text[at:m.start()]))
        ph = m.group(1)
        out.append(f"({_RUN})" if ph is None else f"(?P={ph})" if ph in seen else f"(?P<{ph}>{_RUN})")
        seen.add(ph)
        at = m.end()
    out.append(re.escape(text[at:]))
    return re.compile("".join(out))


def _expand_offset(st: Statement, keys: Sequence[str], reverse: bool) -> list[Statement]:
    src, dst = _sides(st, reverse)
    names = src + dst
    carrier = next((n for n in src if _OFFSET in n.text), None)
    missing = [n for n in names if _OFFSET not in n.text and n.text != "_"]
    if missing:
        raise _MacroFail(f"{missing[0].text!r} lacks {_OFFSET}: with {_OFFSET} every name must carry it",
                         missing[0])
    if carrier is None:
        raise _MacroFail(f"{_OFFSET} must appear on the source side", names[0])
    pat = _template(carrier)
    ids = sorted({int(m.group(_OFFSET[1:])) for k in keys if (m := pat.fullmatch(k))})
    if not ids and st.optional:
        return []
    if not ids:
        raise _MacroFail(f"{carrier.text!r} matches no source key", carrier,
                         (f"source keys look like {sorted(keys)[:3]}",))
    out = []
    for lid in ids:
        # stage-local numbering on the load side, global on the model side: L on the left, L-1 right
        s_id, d_id = (lid, lid + 1) if reverse else (lid, lid - 1)
        out.append(_rebuild(st, reverse, [Name(n.text.replace(_OFFSET, str(s_id)), n.col) for n in src],
                            [Name(n.text.replace(_OFFSET, str(d_id)), n.col) for n in dst]))
    return out


def _expand_placeholders(st: Statement, src_keys: Sequence[str], dst_keys: Sequence[str] | None,
                         reverse: bool) -> list[Statement]:
    src, dst = _sides(st, reverse)
    carriers = [n for n in src if _PLACEHOLDER.search(n.text)]
    keys: Sequence[str] = src_keys
    if not carriers:
        carriers = [n for n in dst if _PLACEHOLDER.search(n.text)]
        if dst_keys is None:
            raise _MacroFail("placeholders only on the destination side need a destination layout",
                             carriers[0])
        keys = dst_keys
    first = carriers[0]
    phs = sorted(set(_PLACEHOLDER.findall(first.text)))
    for n in src + dst:
        if n.text != "_" and sorted(set(_PLACEHOLDER.findall(n.text))) != phs:
            raise _MacroFail(f"{n.text!r} must carry the same placeholders as {first.text!r} "
                             f"(${', $'.join(phs)})", n)

    def combos(name: Name) -> set[tuple[int, ...]]:
        pat = _template(name)
        return {tuple(int(m.group(ph)) for ph in phs) for k in keys if (m := pat.fullmatch(k))}

    found = combos(first)
    if not found and st.optional:
        return []
    if not found:
        raise _MacroFail(f"{first.text!r} matches no {'source' if keys is src_keys else 'destination'} "
                         "key", first, (f"keys look like {sorted(keys)[:3]}",))
    for other in carriers[1:]:
        if combos(other) != found:
            raise _MacroFail(f"{other.text!r} matches other ${'/$'.join(phs)} values than "
                             f"{first.text!r}", other)
    out = []
    # Only the combinations present (ragged experts per layer work); placeholder names sorted, so
    # EXPERT_ID varies slowest, as in Paddle.
    for combo in sorted(found):
        def sub(n: Name, combo: tuple[int, ...] = combo) -> Name:
            text = n.text
            for ph, v in zip(phs, combo):
                text = text.replace("$" + ph, str(v))
            return Name(text, n.col)
        out.append(_rebuild(st, reverse, [sub(n) for n in src], [sub(n) for n in dst]))
    return out


def _star_hits(name: Name, keys: Sequence[str]) -> list[tuple[int, str]]:
    """The keys a name with one ``*`` matches, as ``(number, key)`` in numeric order."""
    pat = _template(name)
    return sorted((int(m.group(1)), k) for k in keys if (m := pat.fullmatch(k)))


def _star(name: Name, keys: Sequence[str] | None, which: str) -> list[Name]:
    if name.text.count("*") != 1:
        raise _MacroFail(f"{name.text!r}: a name may hold one '*'", name)
    if keys is None:
        raise _MacroFail(f"{name.text!r}: '*' on the destination side needs a destination layout", name)
    hits = _star_hits(name, keys)
    if not hits:
        raise _MacroFail(f"{name.text!r} matches no {which} key", name,
                         (f"{which} keys look like {sorted(keys)[:3]}",))
    suffix = _T if name.text.endswith(_T) else ""
    return [Name(k + suffix, name.col) for _, k in hits]


def _expand_star(st: Statement, src_keys: Sequence[str], dst_keys: Sequence[str] | None,
                 reverse: bool) -> list[Statement]:
    """``*`` expanded on both sides; an optional statement whose source-side ``*`` matches nothing is
    dropped."""
    src, dst = _sides(st, reverse)
    if st.optional and any("*" in n.text and not _star_hits(n, src_keys) for n in src):
        return []
    new_src = [m for n in src for m in (_star(n, src_keys, "source") if "*" in n.text else [n])]
    new_dst = [m for n in dst for m in (_star(n, dst_keys, "destination") if "*" in n.text else [n])]
    return [_rebuild(st, reverse, new_src, new_dst)]


def _expand_transpose(st: Statement) -> list[Statement]:
    """``a^T -> b`` becomes ``a -> a^T, permute='[]'`` then ``a^T -> b``, as written (reverse mode
    reverses the pair later); ``x -> y^T`` is an error in either mode."""
    for n in st.right:
        if n.text.endswith(_T):
            base = n.text.removesuffix(_T)
            raise _MacroFail(f"cannot assign to a transpose ({n.text!r} is a view, not a variable)", n,
                             (f"assign first, then transpose: `... -> {base}` and `{base}^T -> {base}`",))
    pre = [replace(st, left=(Name(n.text.removesuffix(_T), n.col),), right=(n,),
                   attrs=(Attr("permute", "[]"),))
           for n in dict.fromkeys(n for n in st.left if n.text.endswith(_T))]
    return pre + [st]


def expand_macros(statements: Sequence[Statement], src_keys: Sequence[str],
                  dst_keys: Sequence[str] | None = None, *, reverse: bool = False,
                  ) -> tuple[list[Statement], list[Diagnostic]]:
    """Expand every key-dependent macro; return the expanded statements and any diagnostics."""
    out: list[Statement] = []
    diags: list[Diagnostic] = []
    for st in statements:
        try:
            todo = [st]
            if any(_OFFSET in n.text for n in st.left + st.right):
                todo = [s for t in todo for s in _expand_offset(t, src_keys, reverse)]
            if any(_PLACEHOLDER.search(n.text) for t in todo for n in t.left + t.right):
                todo = [s for t in todo for s in _expand_placeholders(t, src_keys, dst_keys, reverse)]
            todo = [s for t in todo for s in _expand_star(t, src_keys, dst_keys, reverse)]
            out += [s for t in todo for s in _expand_transpose(t)]
        except _MacroFail as f:
            col = f.name.col if f.name else 0
            name = f.name.text if f.name else None
            if name and "matches no" in f.message:
                f.hints = f.hints + ((suggest(name, src_keys).removeprefix("; ").rstrip("?") + "?",)
                                     if suggest(name, src_keys) else ())
            diags.append(Diagnostic(f.message, st.index, st.text, col, name, f.hints))
    return out, diags


def invert_permutation(spec: str) -> str:
    """The inverse of a ``permute='[...]'`` value (``'[]'``, a full reversal, is its own inverse).

    Raises:
        ValueError: ``spec`` is not a permutation of ``0..n-1`` (negative entries count from the end).

    Example:
        >>> invert_permutation("[1, 2, 0]")
        '[2, 0, 1]'
    """
    perm = parse_int_list(spec)
    n = len(perm)
    norm = [p % n for p in perm if -n <= p < n]
    if sorted(norm) != list(range(n)):
        raise ValueError(f"permute={spec!r} is not a permutation of 0..{n - 1}")
    inv = [0] * n
    for i, p in enumerate(norm):
        inv[p] = i
    return "[" + ", ".join(map(str, inv)) + "]"


def _reverse_attr(a: Attr) -> Attr:
    if a.key == "permute" and isinstance(a.value, str):
        try:
            return Attr("permute", invert_permutation(a.value), a.col)
        except ValueError:
            return a  # kept as written: evaluating it reports the error as forward mode does
    if a.key == "src_dtype":
        return Attr("dst_dtype", a.value, a.col)
    if a.key == "dst_dtype":
        return Attr("src_dtype", a.value, a.col)
    return a


def reverse_program(statements: Sequence[Statement]) -> list[Statement]:
    """Run a load-direction program backwards: order reversed, sides swapped, permutations inverted,
    split <-> concat (by the swap), ``src_dtype`` <-> ``dst_dtype``; a split's ``sizes=`` is dropped
    (the concat it becomes needs none), and so is ``keep=`` (no rows are invented: the tensor passes
    with the rows it has)."""
    out = []
    for st in reversed(statements):
        attrs = tuple(_reverse_attr(a) for a in st.attrs
                      if not (a.key == "sizes" and len(st.right) > 1) and a.key != "keep")
        out.append(replace(st, left=st.right, right=st.left, attrs=attrs))
    return out
