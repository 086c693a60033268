"""Macro expansion over parsed statements (everything that depends on the key sets).

Order, as in the spec: ``$LAYER_ID_OFFSET``; other ``$NAME`` placeholders; ``*``; ``X^T`` on the
reading side. (``name[a:b]`` is expanded by the parser; the fused macros are evaluated by the
resolver, which knows shapes and shard counts.) Reverse mode is applied last, on the expanded list.

The *source side* of a statement is the side read in the export direction: the left side normally, the
right side for a reversed (load-direction) program. Its names match against source keys; the other
side's names match against destination keys, which only a destination layout provides.

A name with placeholders or ``*`` matches keys in linear time: each slot is taken whole (no
backtracking). A ``*`` that is a whole segment of a dotted name (``experts.*.w``) matches any segment;
otherwise a slot is a run of ASCII digits, so it must end the name or be followed by a non-digit.

Names bound by earlier statements (intermediates) are matched like source keys, so a statement can read
``gate.$LAYER_ID`` that an earlier one assigned. A ``*`` among the outputs of an ``unstack`` numbers
them ``0, 1, ...`` along the unstacked dim, whose size ``shapes`` gives (the resolver expands each
statement just before it runs, knowing the shapes of the sources and of the names bound so far).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
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
# A whole-segment '*': any run of characters but '.', taken possessively.
_SEGMENT = "[^.]++"
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
        nxt = text[m.end() : m.end() + 1]
        ph = m.group(1)
        segment = ph is None and text[m.start() - 1 : m.start()] in ("", ".") and nxt in ("", ".")
        if not segment and (nxt.isascii() and nxt.isdigit() or _SLOT.match(text, m.end())):
            raise _MacroFail(
                f"{name.text!r}: {m.group()!r} is directly followed by {nxt!r}; a placeholder "
                "or '*' must end the name or be followed by a non-digit, so that a run of "
                "digits in a key can be cut only one way",
                name,
            )
        out.append(re.escape(text[at : m.start()]))
        star = f"({_SEGMENT})" if segment else f"({_RUN})"
        out.append(star if ph is None else f"(?P={ph})" if ph in seen else f"(?P<{ph}>{_RUN})")
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
        raise _MacroFail(f"{missing[0].text!r} lacks {_OFFSET}: with {_OFFSET} every name must carry it", missing[0])
    if carrier is None:
        raise _MacroFail(f"{_OFFSET} must appear on the source side", names[0])
    pat = _template(carrier)
    ids = sorted({int(m.group(_OFFSET[1:])) for k in keys if (m := pat.fullmatch(k))})
    if not ids and st.optional:
        return []
    if not ids:
        raise _MacroFail(
            f"{carrier.text!r} matches no source key", carrier, (f"source keys look like {sorted(keys)[:3]}",)
        )
    out = []
    for lid in ids:
        # stage-local numbering on the load side, global on the model side: L on the left, L-1 right
        s_id, d_id = (lid, lid + 1) if reverse else (lid, lid - 1)
        out.append(
            _rebuild(
                st,
                reverse,
                [Name(n.text.replace(_OFFSET, str(s_id)), n.col) for n in src],
                [Name(n.text.replace(_OFFSET, str(d_id)), n.col) for n in dst],
            )
        )
    return out


def _expand_placeholders(
    st: Statement, src_keys: Sequence[str], dst_keys: Sequence[str] | None, reverse: bool, shown: Sequence[str]
) -> list[Statement]:
    """One statement per combination of placeholder values; ``src_keys`` are matched (the sources and
    the names bound so far), ``shown`` are the keys an error shows (the sources)."""
    src, dst = _sides(st, reverse)
    carriers = [n for n in src if _PLACEHOLDER.search(n.text)]
    keys: Sequence[str] = src_keys
    if not carriers:
        carriers = [n for n in dst if _PLACEHOLDER.search(n.text)]
        if dst_keys is None:
            raise _MacroFail("placeholders only on the destination side need a destination layout", carriers[0])
        keys = dst_keys
    first = carriers[0]
    phs = sorted(set(_PLACEHOLDER.findall(first.text)))
    for n in src + dst:
        if n.text != "_" and sorted(set(_PLACEHOLDER.findall(n.text))) != phs:
            raise _MacroFail(f"{n.text!r} must carry the same placeholders as {first.text!r} (${', $'.join(phs)})", n)

    def combos(name: Name) -> set[tuple[int, ...]]:
        pat = _template(name)
        return {tuple(int(m.group(ph)) for ph in phs) for k in keys if (m := pat.fullmatch(k))}

    found = combos(first)
    if not found and st.optional:
        return []
    if not found:
        raise _MacroFail(
            f"{first.text!r} matches no {'source' if keys is src_keys else 'destination'} key",
            first,
            (f"keys look like {sorted(shown if keys is src_keys else keys)[:3]}",),
        )
    for other in carriers[1:]:
        if combos(other) != found:
            raise _MacroFail(f"{other.text!r} matches other ${'/$'.join(phs)} values than {first.text!r}", other)
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


def _order(segment: str) -> tuple[int, int, str]:
    """Numbers first, in numeric order, then other segments in text order."""
    number = segment.isascii() and segment.isdigit() and len(segment) <= 18
    return (0, int(segment), "") if number else (1, 0, segment)


def _star_hits(name: Name, keys: Sequence[str]) -> list[tuple[tuple[int, int, str], str]]:
    """The keys a name with one ``*`` matches, numbers first in numeric order, then by text."""
    pat = _template(name)
    return sorted((_order(m.group(1)), k) for k in dict.fromkeys(keys) if (m := pat.fullmatch(k)))


def _star(
    name: Name,
    keys: Sequence[str] | None,
    which: str,
    shown: Sequence[str] | None = None,
) -> list[Name]:
    if name.text.count("*") != 1:
        raise _MacroFail(f"{name.text!r}: a name may hold one '*'", name)
    if keys is None:
        raise _MacroFail(f"{name.text!r}: '*' on the destination side needs a destination layout", name)
    hits = _star_hits(name, keys)
    if not hits:
        raise _MacroFail(
            f"{name.text!r} matches no {which} key",
            name,
            (f"{which} keys look like {sorted(keys if shown is None else shown)[:3]}",),
        )
    suffix = _T if name.text.endswith(_T) else ""
    return [Name(k + suffix, name.col) for _, k in hits]


def _unstacks(st: Statement, reverse: bool) -> bool:
    """Whether ``st`` runs as an unstack (a ``stack`` read in reverse mode does)."""
    keyword = "stack" if reverse else "unstack"
    return any(a.key == keyword and a.value is None for a in st.attrs)


def _numbered(
    src: Sequence[Name], dst: Sequence[Name], st: Statement, shapes: Mapping[str, Sequence[int]]
) -> list[Name]:
    """The outputs ``x.*.y`` of an unstack, numbered ``0 .. n-1`` by the size of the unstacked dim."""
    out = dst[0]
    if len(src) != 1 or len(dst) != 1 or out.text.count("*") != 1:
        raise _MacroFail(
            "an unstack numbers its outputs with '*' when it has one input and one output name holding one '*'", out
        )
    shape = shapes.get(src[0].text)
    axis = st.attr("axis", 0)
    if shape is None:  # an unknown input: the statement reports it when it runs
        return list(dst)
    if not isinstance(axis, int) or not -len(shape) <= axis < len(shape):
        raise _MacroFail(
            f"axis={axis!r} is out of range for {src[0].text!r} of shape {list(shape)}", st.attr_name("axis")
        )
    return [Name(out.text.replace("*", str(i)), out.col) for i in range(shape[axis])]


def _expand_star(
    st: Statement,
    src_keys: Sequence[str],
    dst_keys: Sequence[str] | None,
    reverse: bool,
    shapes: Mapping[str, Sequence[int]],
    shown: Sequence[str],
) -> list[Statement]:
    """``*`` expanded on both sides (an unstack's outputs numbered); an optional statement whose
    source-side ``*`` matches nothing is dropped."""
    src, dst = _sides(st, reverse)
    if st.optional and any("*" in n.text and not _star_hits(n, src_keys) for n in src):
        return []
    new_src = [m for n in src for m in (_star(n, src_keys, "source", shown) if "*" in n.text else [n])]
    if _unstacks(st, reverse) and any("*" in n.text for n in dst):
        return [_rebuild(st, reverse, new_src, _numbered(new_src, dst, st, shapes))]
    new_dst = [m for n in dst for m in (_star(n, dst_keys, "destination") if "*" in n.text else [n])]
    return [_rebuild(st, reverse, new_src, new_dst)]


def _expand_transpose(st: Statement) -> list[Statement]:
    """``a^T -> b`` becomes ``a -> a^T, permute='[]'`` then ``a^T -> b``, as written (reverse mode
    reverses the pair later); ``x -> y^T`` is an error in either mode."""
    for n in st.right:
        if n.text.endswith(_T):
            base = n.text.removesuffix(_T)
            raise _MacroFail(
                f"cannot assign to a transpose ({n.text!r} is a view, not a variable)",
                n,
                (f"assign first, then transpose: `... -> {base}` and `{base}^T -> {base}`",),
            )
    pre = [
        replace(st, left=(Name(n.text.removesuffix(_T), n.col),), right=(n,), attrs=(Attr("permute", "[]"),))
        for n in dict.fromkeys(n for n in st.left if n.text.endswith(_T))
    ]
    return pre + [st]


def _expand_one(
    st: Statement,
    src_keys: Sequence[str],
    known: Sequence[str],
    dst_keys: Sequence[str] | None,
    reverse: bool,
    shapes: Mapping[str, Sequence[int]],
) -> list[Statement]:
    todo = [st]
    if any(_OFFSET in n.text for n in st.left + st.right):
        todo = [s for t in todo for s in _expand_offset(t, src_keys, reverse)]
    if any(_PLACEHOLDER.search(n.text) for t in todo for n in t.left + t.right):
        todo = [s for t in todo for s in _expand_placeholders(t, known, dst_keys, reverse, src_keys)]
    todo = [s for t in todo for s in _expand_star(t, known, dst_keys, reverse, shapes, src_keys)]
    return [s for t in todo for s in _expand_transpose(t)]


def expand_macros(
    statements: Sequence[Statement],
    src_keys: Sequence[str],
    dst_keys: Sequence[str] | None = None,
    *,
    reverse: bool = False,
    shapes: Mapping[str, Sequence[int]] | None = None,
    bound: Sequence[str] = (),
) -> tuple[list[Statement], list[Diagnostic]]:
    """Expand every key-dependent macro; return the expanded statements and any diagnostics.

    Statements are expanded in the order they run (the reverse of the written order in reverse mode),
    each against the source keys, the names ``bound`` before the program and those earlier statements
    bind; ``shapes`` (of those names) numbers the outputs of an unstack written with ``*``.
    """
    chunks: list[list[Statement]] = []
    diags: list[Diagnostic] = []
    known = list(dict.fromkeys([*src_keys, *bound]))
    for st in reversed(statements) if reverse else statements:
        try:
            chunk = _expand_one(st, src_keys, known, dst_keys, reverse, shapes or {})
            chunks.append(chunk)
            known += [n.text for t in chunk for n in _sides(t, reverse)[1] if n.text != "_" and not n.text.endswith(_T)]
        except _MacroFail as f:
            col = f.name.col if f.name else 0
            name = f.name.text if f.name else None
            if name and "matches no" in f.message:
                f.hints = f.hints + (
                    (suggest(name, src_keys).removeprefix("; ").rstrip("?") + "?",) if suggest(name, src_keys) else ()
                )
            diags.append(Diagnostic(f.message, st.index, st.text, col, name, f.hints))
    out = [s for chunk in (reversed(chunks) if reverse else chunks) for s in chunk]
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


#: Attributes (and keywords) that reverse mode exchanges.
_REVERSED_KEYS = {
    "src_dtype": "dst_dtype",
    "dst_dtype": "src_dtype",
    "src_shape": "dst_shape",
    "dst_shape": "src_shape",
    "stack": "unstack",
    "unstack": "stack",
}


def _reverse_attr(a: Attr) -> Attr:
    if a.key == "permute" and isinstance(a.value, str):
        try:
            return Attr("permute", invert_permutation(a.value), a.col)
        except ValueError:
            return a  # kept as written: evaluating it reports the error as forward mode does
    swapped = _REVERSED_KEYS.get(a.key)
    return a if swapped is None else Attr(swapped, a.value, a.col)


def reverse_program(statements: Sequence[Statement]) -> list[Statement]:
    """Run a load-direction program backwards: order reversed, sides swapped, permutations inverted,
    split <-> concat (by the swap), ``src_dtype`` <-> ``dst_dtype``, ``src_shape`` <-> ``dst_shape``,
    ``stack`` <-> ``unstack``; a split's ``sizes=`` is dropped
    (the concat it becomes needs none), and so is ``keep=`` (no rows are invented: the tensor passes
    with the rows it has)."""
    out = []
    for st in reversed(statements):
        attrs = tuple(
            _reverse_attr(a) for a in st.attrs if not (a.key == "sizes" and len(st.right) > 1) and a.key != "keep"
        )
        out.append(replace(st, left=st.right, right=st.left, attrs=attrs))
    return out
