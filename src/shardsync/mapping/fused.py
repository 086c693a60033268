"""The fused forms, built from split and concat, and :data:`FUSED_FORMS`, the one table of the forms
written with a keyword (the fused forms here, ``stack``/``unstack`` from :mod:`.grouped`).

The parser's keywords and attributes and the resolver's dispatch are derived from the table, so a new
form is one entry plus its function. ``fused_qkv`` is GQA-interleaved (independent of sharding);
``fused_qkv_old`` is ``[Q_r | K_r | V_r]`` and ``fused_ffn`` is ``[GATE_r | UP_r]`` per block r. A
blocked form's block count is ``tp=`` when given; otherwise the fused tensor's shard count along the
fused dim (its source layout's, or for a tensor being built, its destination layout's), and the resolver
refuses shards of unequal sizes there.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import NamedTuple

from .grouped import AnyToOne, OneToAny, apply_stack, apply_unstack, stack_dim, unstack_dim
from .statements import ShardCount, StatementError, axis_of, concat_checked
from .syntax import Name, Statement
from .vtensor import VTensor, chunk, concat, split

__all__ = ["FusedForm", "FusedApply", "FormDim", "FUSED_FORMS", "apply_fused"]

#: ``(statement, inputs, dim, count) -> outputs``: the evaluation of one fused form.
FusedApply = Callable[[Statement, Sequence[VTensor], int, ShardCount], list[VTensor]]
#: ``(statement, inputs) -> dim``: the dim a form works along, checked.
FormDim = Callable[[Statement, Sequence[VTensor]], int]


def _fused_dim(st: Statement, ins: Sequence[VTensor]) -> int:
    return axis_of(st, ins[0], default=1)


class FusedForm(NamedTuple):
    """One form with a keyword: the attributes it takes besides its keyword, its ``(inputs, outputs)``
    arities, how it is written (for errors), its function, and how it reads its dim (``axis=``,
    default 1 for the fused forms)."""

    attrs: frozenset[str]
    arities: Container[tuple[int, int]]
    usage: str
    apply: FusedApply
    dim: FormDim = _fused_dim


class _Blocks(NamedTuple):
    """How many blocks a fused tensor has, where that number came from, and where to point errors."""

    n: int
    why: str
    at: Name | None


def _blocks(st: Statement, name: Name, v: VTensor | None, dim: int, count: ShardCount) -> _Blocks:
    tp = st.attr("tp")
    if tp is None:
        n = count(name, v, dim)
        side = "destination" if v is None else "source"
        return _Blocks(n, f"{n} {side} shard{'s' * (n != 1)} along dim {dim}", name)
    if not isinstance(tp, int) or tp <= 0:
        raise StatementError(
            f"tp={tp!r} must be a positive integer: the tensor-parallel size the fused tensor was written with",
            st.attr_name("tp"),
        )
    return _Blocks(tp, f"tp={tp}", st.attr_name("tp"))


def _check_blocks(name: Name, size: int, dim: int, b: _Blocks, per_block: int = 1) -> None:
    if size % (b.n * per_block):
        raise StatementError(
            f"dim {dim} of {name.text!r} has size {size}, not divisible into {b.n} "
            f"blocks ({b.why})" + (f" of {per_block} equal parts" if per_block > 1 else ""),
            b.at,
            ("check tp= (or how the tensor is sharded) and axis=",),
        )


def _heads(st: Statement) -> tuple[int, int]:
    h, g = st.attr("num_heads"), st.attr("num_key_value_groups")
    if not isinstance(h, int) or not isinstance(g, int) or h <= 0 or g <= 0:
        raise StatementError("needs positive integers num_heads=<H> and num_key_value_groups=<G>")
    if h % g:
        raise StatementError(f"num_heads={h} is not divisible by num_key_value_groups={g}")
    return h, g


def _check_heads(name: Name, b: _Blocks, h: int, g: int) -> None:
    if h % b.n or g % b.n:
        raise StatementError(
            f"{name.text!r} is read in {b.n} blocks ({b.why}), which must divide "
            f"num_heads={h} and num_key_value_groups={g}",
            b.at,
        )


def _head_dim(st: Statement, w: VTensor, dim: int, h: int, g: int) -> int:
    n = w.shape[dim]
    if n % (h + 2 * g):
        raise StatementError(
            f"dim {dim} of {st.left[0].text!r} has size {n}, not divisible by "
            f"num_heads + 2 * num_key_value_groups = {h + 2 * g}",
            st.left[0],
            ("check num_heads/num_key_value_groups and axis",),
        )
    return n // (h + 2 * g)


def _check_qkv(st: Statement, q: VTensor, k: VTensor, v: VTensor, dim: int, h: int, g: int) -> None:
    concat_checked(st, [q, k, v], dim)  # same dtype and other dims, or a clear error
    d = q.shape[dim] // h
    if q.shape[dim] != h * d or k.shape[dim] != g * d or v.shape[dim] != g * d:
        raise StatementError(
            f"q, k, v sizes {q.shape[dim]}, {k.shape[dim]}, {v.shape[dim]} along dim "
            f"{dim} do not fit {h} query and {g} key/value heads of one head size"
        )


def _interleaved(st: Statement, ins: Sequence[VTensor], dim: int, count: ShardCount) -> list[VTensor]:
    h, g = _heads(st)
    per = h // g
    if len(ins) == 1:
        d = _head_dim(st, ins[0], dim, h, g)
        blocks = split(ins[0], dim, [per * d, d, d] * g)
        return [concat(blocks[0::3], dim), concat(blocks[1::3], dim), concat(blocks[2::3], dim)]
    q, k, v = ins
    _check_qkv(st, q, k, v, dim, h, g)  # sizes h*d, g*d, g*d: each divisible by g
    qs, ks, vs = (chunk(x, dim, g) for x in (q, k, v))
    return [concat([x for i in range(g) for x in (qs[i], ks[i], vs[i])], dim)]


def _blocked_join(parts: Sequence[VTensor], dim: int, n: int) -> VTensor:
    """``[P0_0 | P1_0 | ... | P0_1 | P1_1 | ...]``: block r of every part, for each of ``n`` blocks."""
    chunks = [chunk(p, dim, n) for p in parts]
    return concat([c[r] for r in range(n) for c in chunks], dim)


def _qkv_old(st: Statement, ins: Sequence[VTensor], dim: int, count: ShardCount) -> list[VTensor]:
    h, g = _heads(st)
    if len(ins) == 3:
        q, k, v = ins
        _check_qkv(st, q, k, v, dim, h, g)
        b = _blocks(st, st.right[0], None, dim, count)
        _check_heads(st.right[0], b, h, g)
        return [_blocked_join(ins, dim, b.n)]
    b = _blocks(st, st.left[0], ins[0], dim, count)
    _check_heads(st.left[0], b, h, g)
    d = _head_dim(st, ins[0], dim, h, g)
    blocks = split(ins[0], dim, [h // b.n * d, g // b.n * d, g // b.n * d] * b.n)
    qkv = [concat(blocks[0::3], dim), concat(blocks[1::3], dim), concat(blocks[2::3], dim)]
    if len(st.right) == 3:
        return qkv
    out = _blocks(st, st.right[0], None, dim, count)
    _check_heads(st.right[0], out, h, g)
    return [_blocked_join(qkv, dim, out.n)]


def _ffn(st: Statement, ins: Sequence[VTensor], dim: int, count: ShardCount) -> list[VTensor]:
    if len(ins) == 2:
        concat_checked(st, ins, dim)
        b = _blocks(st, st.right[0], None, dim, count)
        for name, part in zip(st.left, ins):
            _check_blocks(name, part.shape[dim], dim, b)
        return [_blocked_join(ins, dim, b.n)]
    b = _blocks(st, st.left[0], ins[0], dim, count)
    _check_blocks(st.left[0], ins[0].shape[dim], dim, b, per_block=2)
    blocks = chunk(ins[0], dim, 2 * b.n)
    gate_up = [concat(blocks[0::2], dim), concat(blocks[1::2], dim)]
    if len(st.right) == 2:
        return gate_up
    out = _blocks(st, st.right[0], None, dim, count)
    _check_blocks(st.right[0], gate_up[0].shape[dim], dim, out, per_block=1)
    return [_blocked_join(gate_up, dim, out.n)]


_QKV_ATTRS = frozenset({"num_heads", "num_key_value_groups", "axis"})
#: Every fused form, by keyword.
FUSED_FORMS: dict[str, FusedForm] = {
    "fused_qkv": FusedForm(
        _QKV_ATTRS,
        frozenset({(1, 3), (3, 1)}),
        "`qkv -> q, k, v, fused_qkv, ...` or `q, k, v -> qkv, fused_qkv, ...`",
        _interleaved,
    ),
    "fused_qkv_old": FusedForm(
        _QKV_ATTRS | {"tp"},
        frozenset({(1, 3), (3, 1), (1, 1)}),
        "`W -> q, k, v, fused_qkv_old, ...`, `q, k, v -> W, fused_qkv_old, ...` or `W -> W2, fused_qkv_old, ...`",
        _qkv_old,
    ),
    "fused_ffn": FusedForm(
        frozenset({"axis", "tp"}),
        frozenset({(1, 2), (2, 1), (1, 1)}),
        "`W -> gate, up, fused_ffn`, `gate, up -> W, fused_ffn` or `W -> W2, fused_ffn`",
        _ffn,
    ),
    "stack": FusedForm(frozenset({"axis"}), AnyToOne(), "`a, b, c -> s, stack [, axis=k]`", apply_stack, stack_dim),
    "unstack": FusedForm(
        frozenset({"axis"}), OneToAny(), "`s -> a, b, c, unstack [, axis=k]`", apply_unstack, unstack_dim
    ),
}


def apply_fused(st: Statement, ins: Sequence[VTensor], count: ShardCount) -> list[VTensor]:
    """Evaluate a statement carrying a fused form's keyword on its inputs (left-side order).

    Args:
        st: the statement; its bare keyword names the form.
        ins: its inputs.
        count: the shard count of a fused tensor along a dim, for blocked forms without ``tp=``.

    Returns:
        the outputs, in right-side order.

    Raises:
        StatementError: a second keyword, an attribute the form does not take, an arity it does not
            have, or sizes that do not fit.
    """
    kinds = [a.key for a in st.attrs if a.value is None]
    if len(kinds) > 1:
        raise StatementError(f"a statement takes one macro keyword, got {' and '.join(kinds)}", st.attr_name(kinds[1]))
    kind = kinds[0]
    form = FUSED_FORMS[kind]
    others = [a.key for a in st.attrs if a.key != kind and a.key not in form.attrs]
    if others:
        raise StatementError(
            f"{kind} does not take {', '.join(others)} (it takes {', '.join(a + '=' for a in sorted(form.attrs))})",
            st.attr_name(others[0]),
        )
    if (len(st.left), len(st.right)) not in form.arities:
        raise StatementError(f"{kind} has the forms {form.usage}")
    if len(st.left) == len(st.right) == 1 and st.has("tp"):
        raise StatementError(
            f"tp= fixes the block count of one fused tensor; re-blocking "
            f"`{st.left[0].text} -> {st.right[0].text}` has two",
            st.attr_name("tp"),
            (
                f"split into the parts with tp=<source blocks>, then join them with "
                f"tp=<destination blocks>, in two {kind} statements",
            ),
        )
    return form.apply(st, ins, form.dim(st, ins), count)
