"""The fused macros, built from split and concat: ``fused_qkv`` (GQA-interleaved), ``fused_qkv_old``
(blocked per tensor-parallel shard) and ``fused_ffn`` (gate/up blocked per shard)."""

from __future__ import annotations

from collections.abc import Sequence

from .statements import ShardCount, StatementError, axis_of, concat_checked, split_equal, split_sizes
from .syntax import Statement
from .vtensor import VTensor, concat

__all__ = ["apply_fused"]

_ALLOWED = {"fused_qkv": {"num_heads", "num_key_value_groups", "axis"},
            "fused_qkv_old": {"num_heads", "num_key_value_groups", "axis"},
            "fused_ffn": {"axis"}}


def _heads(st: Statement) -> tuple[int, int]:
    h, g = st.attr("num_heads"), st.attr("num_key_value_groups")
    if not isinstance(h, int) or not isinstance(g, int) or h <= 0 or g <= 0:
        raise StatementError("needs positive integers num_heads=<H> and num_key_value_groups=<G>")
    if h % g:
        raise StatementError(f"num_heads={h} is not divisible by num_key_value_groups={g}")
    return h, g


def _head_dim(st: Statement, w: VTensor, dim: int, h: int, g: int) -> int:
    n = w.shape[dim]
    if n % (h + 2 * g):
        raise StatementError(f"dim {dim} of {st.left[0].text!r} has size {n}, not divisible by "
                             f"num_heads + 2 * num_key_value_groups = {h + 2 * g}", st.left[0],
                             ("check num_heads/num_key_value_groups and axis",))
    return n // (h + 2 * g)


def _check_qkv(st: Statement, q: VTensor, k: VTensor, v: VTensor, dim: int, h: int, g: int) -> int:
    concat_checked(st, [q, k, v], dim)  # same dtype and other dims, or a clear error
    d = q.shape[dim] // h
    if q.shape[dim] != h * d or k.shape[dim] != g * d or v.shape[dim] != g * d:
        raise StatementError(f"q, k, v sizes {q.shape[dim]}, {k.shape[dim]}, {v.shape[dim]} along dim "
                             f"{dim} do not fit {h} query and {g} key/value heads of one head size")
    return d


def _interleaved(st: Statement, ins: Sequence[VTensor], dim: int) -> list[VTensor]:
    h, g = _heads(st)
    per = h // g
    if len(ins) == 1:
        d = _head_dim(st, ins[0], dim, h, g)
        blocks = split_sizes(ins[0], dim, [per * d, d, d] * g)
        return [concat(blocks[0::3], dim), concat(blocks[1::3], dim), concat(blocks[2::3], dim)]
    q, k, v = ins
    _check_qkv(st, q, k, v, dim, h, g)
    qs, ks, vs = (split_equal(x, dim, g, "fused_qkv") for x in (q, k, v))
    return [concat([x for i in range(g) for x in (qs[i], ks[i], vs[i])], dim)]


def _blocked_split(st: Statement, w: VTensor, dim: int, t: int) -> list[VTensor]:
    h, g = _heads(st)
    if h % t or g % t:
        raise StatementError(f"{st.left[0].text!r} has {t} shards along dim {dim}, which must divide "
                             f"num_heads={h} and num_key_value_groups={g}", st.left[0])
    d = _head_dim(st, w, dim, h, g)
    blocks = split_sizes(w, dim, [h // t * d, g // t * d, g // t * d] * t)
    return [concat(blocks[0::3], dim), concat(blocks[1::3], dim), concat(blocks[2::3], dim)]


def _blocked_join(st: Statement, parts: Sequence[VTensor], dim: int, t: int) -> VTensor:
    chunks = [split_equal(p, dim, t, f"{st.right[0].text!r} with {t} shards") for p in parts]
    return concat([c[r] for r in range(t) for c in chunks], dim)


def _qkv_old(st: Statement, ins: Sequence[VTensor], dim: int, count: ShardCount) -> list[VTensor]:
    h, g = _heads(st)
    if len(ins) == 3:
        _check_qkv(st, *ins, dim, h, g)
        return [_blocked_join(st, ins, dim, count(st.right[0].text, None, dim))]
    qkv = _blocked_split(st, ins[0], dim, count(st.left[0].text, ins[0], dim))
    if len(st.right) == 3:
        return qkv
    return [_blocked_join(st, qkv, dim, count(st.right[0].text, None, dim))]


def _ffn(st: Statement, ins: Sequence[VTensor], dim: int, count: ShardCount) -> list[VTensor]:
    if len(ins) == 2:
        concat_checked(st, ins, dim)
        return [_blocked_join(st, ins, dim, count(st.right[0].text, None, dim))]
    t = count(st.left[0].text, ins[0], dim)
    blocks = split_equal(ins[0], dim, 2 * t, f"fused_ffn on {st.left[0].text!r} with {t} shards")
    gate_up = [concat(blocks[0::2], dim), concat(blocks[1::2], dim)]
    if len(st.right) == 2:
        return gate_up
    return [_blocked_join(st, gate_up, dim, count(st.right[0].text, None, dim))]


_FORMS = {"fused_qkv": {(1, 3), (3, 1)}, "fused_qkv_old": {(1, 3), (3, 1), (1, 1)},
          "fused_ffn": {(1, 2), (2, 1), (1, 1)}}
_USAGE = {"fused_qkv": "`qkv -> q, k, v, fused_qkv, ...` or `q, k, v -> qkv, fused_qkv, ...`",
          "fused_qkv_old": "`W -> q, k, v, fused_qkv_old, ...`, `q, k, v -> W, fused_qkv_old, ...` or "
                           "`W -> W2, fused_qkv_old, ...`",
          "fused_ffn": "`W -> gate, up, fused_ffn`, `gate, up -> W, fused_ffn` or `W -> W2, fused_ffn`"}


def apply_fused(st: Statement, kind: str, ins: Sequence[VTensor], count: ShardCount) -> list[VTensor]:
    """Evaluate a statement carrying the bare keyword ``kind``."""
    if kind not in _FORMS:
        raise StatementError(f"{kind!r} is not a macro keyword; use fused_qkv, fused_qkv_old or fused_ffn")
    others = [a.key for a in st.attrs if a.key != kind and a.key not in _ALLOWED[kind]]
    if others:
        raise StatementError(f"{kind} takes {', '.join(sorted(_ALLOWED[kind]))}, not {', '.join(others)}")
    if (len(st.left), len(st.right)) not in _FORMS[kind]:
        raise StatementError(f"{kind} has the forms {_USAGE[kind]}")
    dim = axis_of(st, ins[0], default=1)
    if kind == "fused_qkv":
        return _interleaved(st, ins, dim)
    if kind == "fused_qkv_old":
        return _qkv_old(st, ins, dim, count)
    return _ffn(st, ins, dim, count)
