"""Does a source, through a mapping, fit a destination? Missing, unexpected, shape and dtype checks.

Like ``load_state_dict(strict=True)``, but every problem names the mapping statement it comes from,
and all are found at once from the gathered layouts (so every rank finds the same ones, before any
data moves). Casting follows the destination: a target whose dtype differs from its destination's is
cast to it, unless the mapping cast it explicitly (then the two disagree), or the cast would change
the kind of number (float <-> integer, which a mapping must ask for).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from ..errors import LoadError
from ..layout.dtypes import to_torch_dtype
from ..layout.meta import GlobalLayout, TensorMeta
from ..mapping.macros import expand_macros, reverse_program
from ..mapping.pieces import TargetSpec
from ..mapping.program import Mapping
from ..mapping.syntax import Statement, suggest

__all__ = ["Mismatch", "Report", "Provenance", "provenance", "fills_padded", "check_targets", "describe", "load_error"]


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A target whose shape or dtype differs from its destination's.

    Attributes:
        name: the destination key.
        kind: ``"shape"`` or ``"dtype"``.
        expected: the destination's shape or dtype, as text.
        got: what the source and mapping produce.
        origin: where it comes from (``statement 2 `a -> b```, or ``source 'a'``).

    Example:
        >>> str(Mismatch("w", "shape", "[4, 6]", "[4, 5]", "source 'w'"))
        "shape of 'w': source 'w' gives [4, 5], the destination is [4, 6]"
    """

    name: str
    kind: Literal["shape", "dtype"]
    expected: str
    got: str
    origin: str

    def __str__(self) -> str:
        return f"{self.kind} of {self.name!r}: {self.origin} gives {self.got}, the destination is {self.expected}"


@dataclass(frozen=True, slots=True)
class Report:
    """What does not fit: destination keys nothing loads into, targets with no destination, mismatches.

    Example:
        >>> Report(("b",), (), ()).ok
        False
    """

    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    mismatched: tuple[Mismatch, ...]

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)


@dataclass(frozen=True, slots=True)
class Provenance:
    """For each name, the statement that last binds it; the names declared ``_ -> y`` (left as they
    are: never missing); and the padded names, each with its dim: in a reversed program, the names a
    ``keep=`` statement trims (a padded vocabulary), which may be shorter than their destination
    along that dim (the rows past the target keep what the destination holds).

    Example:
        >>> Provenance({}, frozenset({"y"})).origin("y", ("y",))
        "source 'y'"
    """

    binders: dict[str, Statement]
    untouched: frozenset[str]
    padded: dict[str, int] = field(default_factory=dict)

    def origin(self, name: str, sources: Sequence[str]) -> str:
        st = self.binders.get(name)
        if st is not None:
            return f"statement {st.index} `{st.text}`"
        return "source " + ", ".join(repr(s) for s in sources[:3]) + (" ..." if len(sources) > 3 else "")


def provenance(mapping: Mapping | None, src_keys: Sequence[str], dst_keys: Sequence[str]) -> Provenance:
    """Expand ``mapping`` (in its direction) over the key sets and note who binds what.

    Example:
        >>> p = provenance(Mapping.parse(["a -> b", "_ -> c"]), ["a"], ["b", "c"])
        >>> p.binders["b"].index, sorted(p.untouched)
        (0, ['c'])
    """
    if mapping is None:
        return Provenance({}, frozenset())
    expanded, _ = expand_macros(mapping.statements, src_keys, dst_keys, reverse=mapping.reverse)
    padded: dict[str, int] = {}
    if mapping.reverse:  # the trimmed side of `a -> b, axis=k, keep=N` is the destination's `a`
        padded = {
            n.text: dim
            for st in expanded
            if st.has("keep") and isinstance(dim := st.attr("axis"), int)
            for n in st.left
        }
        expanded = reverse_program(expanded)
    binders: dict[str, Statement] = {}
    untouched: set[str] = set()
    for st in expanded:
        names = [n.text for n in st.right if n.text != "_"]
        if [n.text for n in st.left] == ["_"]:
            untouched.update(names)
        else:
            binders.update(dict.fromkeys(names, st))
    return Provenance(binders, frozenset(untouched), padded)


def _kind(dtype: str) -> str:
    d = to_torch_dtype(dtype)
    return "complex" if d.is_complex else "float" if d.is_floating_point else "integer"


def fills_padded(shape: Sequence[int], dest: Sequence[int], dim: int | None) -> bool:
    """Does a target of ``shape`` fill the start of a destination of shape ``dest`` that is padded
    along ``dim`` (equal elsewhere, at most as long along ``dim``)?

    Example:
        >>> fills_padded((100, 8), (128, 8), 0), fills_padded((100, 8), (128, 8), 1)
        (True, False)
    """
    if dim is None or len(shape) != len(dest) or not -len(dest) <= dim < len(dest):
        return False
    dim %= len(dest)
    return all(a == b for i, (a, b) in enumerate(zip(shape, dest)) if i != dim) and shape[dim] <= dest[dim]


def _mismatch(t: TargetSpec, want: TensorMeta, origin: str, pad_dim: int | None) -> Mismatch | None:
    if t.shape != want.shape and not fills_padded(t.shape, want.shape, pad_dim):
        return Mismatch(t.name, "shape", str(list(want.shape)), str(list(t.shape)), origin)
    if t.dtype == want.dtype:
        return None
    if any(p.casts for p in t.pieces):  # the mapping chose this dtype
        return Mismatch(t.name, "dtype", want.dtype, t.dtype, origin)
    if _kind(t.dtype) != _kind(want.dtype):
        return Mismatch(t.name, "dtype", want.dtype, t.dtype, origin)
    return None


def check_targets(
    targets: Sequence[TargetSpec],
    dest: GlobalLayout,
    why: Provenance,
) -> tuple[list[TargetSpec], Report]:
    """Split resolved ``targets`` into those that fit their destination and a :class:`Report`.

    A padded target (:attr:`Provenance.padded`) fits a destination that is longer along its dim.

    Args:
        targets: the resolved targets (whole tensors, with the dtypes the mapping gives them).
        dest: the gathered destination layout.
        why: the mapping's :class:`Provenance` (for names in messages and ``_ -> y``).

    Returns:
        the targets to load (each fits its destination; a dtype may still differ, to be cast), and
        the report of everything else.

    Example:
        >>> from shardsync.layout import Box
        >>> from shardsync.mapping import Piece
        >>> dest = GlobalLayout.merge([[("w", (4,), "float32", Box((0,), (4,)))]])
        >>> t = TargetSpec("v", (4,), "float32", (Piece("v", Box((0,), (4,)), Box((0,), (4,))),))
        >>> check_targets([t], dest, provenance(None, ["v"], ["w"]))[1]
        Report(missing=('w',), unexpected=('v',), mismatched=())
    """
    produced = {t.name for t in targets}
    missing = tuple(k for k in dest.keys() if k not in produced and k not in why.untouched)
    unexpected = tuple(sorted(n for n in produced if n not in dest))
    fit: list[TargetSpec] = []
    bad: list[Mismatch] = []
    for t in targets:
        if t.name not in dest:
            continue
        m = _mismatch(t, dest[t.name], why.origin(t.name, t.sources), why.padded.get(t.name))
        if m is None:
            fit.append(t)
        else:
            bad.append(m)
    return fit, Report(missing, unexpected, tuple(bad))


def describe(report: Report, targets: Sequence[TargetSpec], why: Provenance) -> tuple[str, ...]:
    """One line per problem of ``report``, each naming its origin and the fix.

    Example:
        >>> describe(Report(("b",), (), ()), [], provenance(None, [], ["b"]))[0][:40]
        "missing 'b': nothing in the source maps "
    """
    by_name = {t.name: t for t in targets}
    lines = [
        f"missing {k!r}: nothing in the source maps to it{suggest(k, report.unexpected)}; map a "
        f"source to it, or declare it untouched with `_ -> {k}`"
        for k in report.missing
    ]
    for n in report.unexpected:
        lines.append(
            f"unexpected {n!r} ({why.origin(n, by_name[n].sources)}): the destination has no "
            f"such key{suggest(n, report.missing)}; map it to one, or drop it with `{n} -> _`"
        )
    for m in report.mismatched:
        fix = (
            "fix the mapping (split, concat, transpose) or the destination"
            if m.kind == "shape"
            else f"cast with `{m.name} -> {m.name}, dtype='{m.expected}'` or fix the mapping's cast"
        )
        lines.append(f"{m}; {fix}")
    return tuple(lines)


def load_error(report: Report, lines: Sequence[str]) -> LoadError:
    """The :class:`LoadError` listing every problem of ``report`` (``lines`` from :func:`describe`).

    Example:
        >>> load_error(Report(("b",), (), ()), ["missing 'b'"]).missing
        ('b',)
    """
    head = (
        f"the source does not fit the destination ({len(lines)} problem{'s' if len(lines) != 1 else ''}"
        "; nothing was written; strict=False loads what fits and returns these lists)"
    )
    return LoadError(head + ":\n  " + "\n  ".join(lines), report.missing, report.unexpected, report.mismatched)
