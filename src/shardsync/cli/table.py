"""Tables with numbered names folded: ``layers.{0..31}.mlp.w`` stands for 32 rows that differ only in
their layer number (and ``layers.{0..31}.experts.{0..7}.w`` for a full grid of them).

A number is a whole dot-separated component of a name (``layers.3.w``; not ``fc1`` nor ``w_0``).
Numbers that move together in one row's names (a target and the source it is built from, even when
they are offset, as pipeline stages renumber layers) fold together.

The two commands that compare checkpoints name by name (``diff``, ``verify``) share their config
(:class:`Comparison`) and their folded name lists (:func:`folded_list`, at most :data:`SHOWN` a line).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..mapping import Mapping, TargetSpec
from ..sources import Source, open_source
from .common import MappingFlags, layout_of, source_dir
from .messages import printable

__all__ = ["Row", "fold", "render", "render_ints", "json_text", "SHOWN", "folded_list", "Comparison"]

#: Names (or lines) listed in a text output before "... more" (``--json`` lists all).
SHOWN = 20

_NUMBER = re.compile(r"(?:(?<=\.)|^)\d+(?=\.|$)")


@dataclass(frozen=True)
class Row:
    """One table row before folding.

    Attributes:
        names: the columns folded by their numbers (the row's name first, e.g. a target and its source).
        same: columns that must be equal for two rows to fold (shape, dtype).
        count: how many tensors the row stands for (added when rows fold).
        nbytes: bytes (added when rows fold).
        sets: columns of values gathered when rows fold (files, ranks).
    """

    names: tuple[str, ...]
    same: tuple[Any, ...] = ()
    count: int = 1
    nbytes: int = 0
    sets: tuple[frozenset[Any], ...] = field(default=())


@dataclass
class _Group:
    template: tuple[tuple[str, ...], ...]  # each name cut at its numbers
    positions: list[list[int]]  # per number class: the flat number positions it covers
    offsets: list[list[int]]  # per class: each position's offset from the class's first


@dataclass
class _Folding:
    values: list[frozenset[int]]  # per number class
    row: Row


def fold(rows: Sequence[Row]) -> list[tuple[tuple[str, ...], Row]]:
    """Fold rows whose names differ only in numbers (with equal ``same`` columns), class by class.

    Returns:
        ``(folded names, folded row)`` pairs in natural order (``layers.2`` before ``layers.10``).

    Example:
        >>> rows = [Row((f"layers.{i}.w", f"l.{i}.x"), ("f32",), nbytes=4) for i in range(4)]
        >>> rows.append(Row(("norm",)))
        >>> [(names, row.count, row.nbytes) for names, row in fold(rows)]
        [(('layers.{0..3}.w', 'l.{0..3}.x'), 4, 16), (('norm',), 1, 0)]
    """
    by_template: dict[tuple[Any, ...], list[tuple[list[int], Row]]] = {}
    for row in rows:
        cut = tuple(tuple(_NUMBER.split(n)) for n in row.names)
        numbers = [int(x) for n in row.names for x in _NUMBER.findall(n)]
        by_template.setdefault((cut, row.same), []).append((numbers, row))
    out: list[tuple[Any, tuple[str, ...], Row]] = []
    for (cut, _), members in by_template.items():
        group = _classes(cut, [numbers for numbers, _ in members])
        items = [_Folding([frozenset({nums[c[0]]}) for c in group.positions], row) for nums, row in members]
        for k in range(len(group.positions)):
            items = _fold_class(items, k)
        for item in items:
            first = _names(group, [frozenset({min(v)}) for v in item.values])  # sorts the row
            out.append((_natural(first), _names(group, item.values), item.row))
    out.sort(key=lambda t: t[0])
    return [(names, row) for _, names, row in out]


def _classes(cut: tuple[tuple[str, ...], ...], numbers: list[list[int]]) -> _Group:
    """Numbers that keep a constant offset from each other in every row move together (a target's
    layer and its source's); two numbers of the row's own name never do (that would hide a diagonal)."""
    column = [c for c, pieces in enumerate(cut) for _ in pieces[1:]]
    n = len(column)
    positions: list[list[int]] = []
    offsets: list[list[int]] = []
    taken: set[int] = set()
    for p in range(n):
        if p in taken:
            continue
        linked = [p]
        for q in range(p + 1, n):
            if (
                q not in taken
                and not (column[q] == 0 and 0 in {column[x] for x in linked})
                and len({nums[q] - nums[p] for nums in numbers}) == 1
            ):
                linked.append(q)
        taken.update(linked)
        positions.append(linked)
        offsets.append([numbers[0][q] - numbers[0][p] for q in linked])
    return _Group(cut, positions, offsets)


def _fold_class(items: list[_Folding], k: int) -> list[_Folding]:
    merged: dict[tuple[frozenset[int], ...], _Folding] = {}
    for item in items:
        key = tuple(v for i, v in enumerate(item.values) if i != k)
        have = merged.get(key)
        if have is None:
            merged[key] = _Folding(list(item.values), item.row)
            continue
        have.values[k] = have.values[k] | item.values[k]
        a, b = have.row, item.row
        have.row = Row(
            a.names, a.same, a.count + b.count, a.nbytes + b.nbytes, tuple(x | y for x, y in zip(a.sets, b.sets))
        )
    return list(merged.values())


def _names(group: _Group, values: list[frozenset[int]]) -> tuple[str, ...]:
    flat: dict[int, str] = {}
    for vals, positions, offsets in zip(values, group.positions, group.offsets):
        for q, off in zip(positions, offsets):
            flat[q] = render_ints(v + off for v in vals)
    out, q = [], 0
    for pieces in group.template:
        text = pieces[0]
        for piece in pieces[1:]:
            text += flat[q] + piece
            q += 1
        out.append(text)
    return tuple(out)


def render_ints(values: Iterable[int]) -> str:
    """A set of integers as ``3``, ``{0..31}`` or ``{0..4,6,9..12}`` (runs of three or more as ranges).

    Example:
        >>> render_ints([5]), render_ints(range(32)), render_ints([0, 1, 2, 3, 4, 6, 9, 10, 11, 12])
        ('5', '{0..31}', '{0..4,6,9..12}')
    """
    vals = sorted(set(values))
    if len(vals) == 1:
        return str(vals[0])
    runs: list[list[int]] = []
    for v in vals:
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    parts = [f"{r[0]}..{r[-1]}" if len(r) >= 3 else ",".join(map(str, r)) for r in runs]
    return "{" + ",".join(parts) + "}"


def _natural(names: tuple[str, ...]) -> tuple[tuple[object, ...], ...]:
    return tuple(tuple((0, int(t)) if t.isdigit() else (1, t) for t in re.split(r"(\d+)", n)) for n in names)


def render(head: Sequence[str], body: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    """Columns padded to their widest cell (``right``: indices of right-aligned columns).

    Example:
        >>> print(render(("name", "n"), [("a", "1"), ("bb", "10")], right=(1,)))
        name   n
        a      1
        bb    10
    """
    rows = [list(head), *([printable(c, keep="") for c in r] for r in body)]  # names from a file
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in rows
    ]
    return "\n".join(lines)


_NUMBER_LIST = re.compile(r"\[\s*(-?[\d.e+-]+(?:,\s*-?[\d.e+-]+)*)?\s*\]")


def json_text(doc: object) -> str:
    """``doc`` as indented JSON, with lists of numbers (shapes, offsets) kept on one line.

    Example:
        >>> print(json_text({"shape": [2, 3], "names": ["a"]}))
        {
          "shape": [2, 3],
          "names": [
            "a"
          ]
        }
    """
    text = json.dumps(doc, indent=2)

    def one_line(m: re.Match[str]) -> str:
        return "[" + ", ".join(x.strip() for x in (m[1] or "").split(",") if x.strip()) + "]"

    return _NUMBER_LIST.sub(one_line, text)


def folded_list(names: Iterable[str], shown: int = SHOWN) -> str:
    """Names folded by their numbers, comma-separated, the first ``shown`` of them.

    Example:
        >>> folded_list(["norm", *(f"layers.{i}.w" for i in range(4))])
        'layers.{0..3}.w, norm'
        >>> folded_list(["a", "b", "c"], shown=2)
        'a, b, ... (1 more)'
    """
    folded = [names[0] for names, _ in fold([Row((n,)) for n in names])]
    more = f", ... ({len(folded) - shown} more)" if len(folded) > shown else ""
    return ", ".join(folded[:shown]) + more


@dataclass(frozen=True)
class Comparison:
    """Two checkpoints compared name by name, ``a`` through a mapping (the config of ``diff`` and
    ``verify``; each adds its own options).

    Example:
        >>> Comparison(Path("a"), Path("b")).header()
        {'a': 'a', 'b': 'b'}
    """

    a: Path
    b: Path
    flags: MappingFlags = MappingFlags()
    as_json: bool = False

    def open(self) -> tuple[Source, Source, Mapping | None, list[TargetSpec]]:
        """Both sources, and the mapping with the targets it gives over ``a``.

        Raises:
            FormatError: either path is not a checkpoint; MappingError: the mapping does not fit ``a``.
        """
        source_a, source_b = open_source(self.a), open_source(self.b)
        mapping, targets = self.flags.resolve(layout_of(source_a), source_dir(self.a))
        return source_a, source_b, mapping, targets

    def header(self) -> dict[str, Any]:
        """The paths, as the JSON documents start."""
        return {"a": str(self.a), "b": str(self.b)}

    def output(self, document: Callable[[], object], text: Callable[[], str]) -> str:
        """``document()`` as JSON with ``--json``, else ``text()``."""
        return json_text(document()) if self.as_json else text()
