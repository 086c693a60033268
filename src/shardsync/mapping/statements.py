"""Evaluation of one statement without a macro keyword on virtual tensors: rename, split, concat,
permute, cast, keep, reshape (the forms with a keyword are in :mod:`.fused` and :mod:`.grouped`).

Each function takes the statement and its input :class:`VTensor` s and returns the bound outputs, or
raises :class:`StatementError` naming the offending name. No key lookups happen here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ..layout.dtypes import dtype_name, to_torch_dtype
from .lexer import parse_int_list
from .syntax import Name, Statement
from .views import infer_shape, reshape
from .vtensor import VTensor, cast, concat, permute, split, take

__all__ = [
    "StatementError",
    "apply_statement",
    "ShardCount",
    "axis_of",
    "concat_checked",
    "cast_loss",
    "STATEMENT_ATTRIBUTES",
]

#: How many blocks a fused tensor has along a dim: ``(name, tensor, dim) -> T``; ``tensor`` is None for a
#: tensor being built (its destination layout decides).
ShardCount = Callable[[Name, "VTensor | None", int], int]
#: The attributes of statements without a macro keyword (the fused forms add their own).
STATEMENT_ATTRIBUTES = frozenset(
    {"axis", "permute", "dtype", "src_dtype", "dst_dtype", "sizes", "keep", "shape", "src_shape", "dst_shape", "lossy"}
)
_ONE_TO_ONE = frozenset(
    {"permute", "dtype", "axis", "src_dtype", "dst_dtype", "keep", "shape", "src_shape", "dst_shape", "lossy"}
)
_EXCLUSIVE = ("permute", "dtype", "axis", "shape", "dst_shape")


class StatementError(Exception):
    """A problem with one statement, at ``name`` (None: the statement as a whole)."""

    def __init__(self, message: str, name: Name | None = None, hints: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.message, self.name, self.hints = message, name, hints


def axis_of(st: Statement, v: VTensor, default: int | None = None) -> int:
    raw = st.attr("axis", default)
    if raw is None:
        raise StatementError("a split or concat needs axis=<dim>")
    if not isinstance(raw, int):
        raise StatementError(f"axis must be an integer, got {raw!r}", st.attr_name("axis"))
    if not -v.ndim <= raw < v.ndim:
        raise StatementError(
            f"axis={raw} is out of range for a {v.ndim}-dim tensor of shape {list(v.shape)}", st.attr_name("axis")
        )
    return raw % v.ndim


def _int_list(st: Statement, key: str) -> list[int]:
    try:
        return parse_int_list(str(st.attr(key)))
    except ValueError as exc:
        raise StatementError(f"{key}= must be a list of integers like '[2, 0, 1]': {exc}", st.attr_name(key)) from None


def _dtype(st: Statement, key: str) -> str:
    raw = st.attr(key)
    try:
        return dtype_name(str(raw))
    except ValueError as exc:
        raise StatementError(f"{key}={raw!r}: {exc}", st.attr_name(key)) from None


def cast_loss(src: str, dst: str) -> str | None:
    """What casting ``src`` to ``dst`` does beyond rounding, or None: dropping an imaginary part,
    turning a float into an integer (fractions cut, NaN and inf to arbitrary integers), or wrapping
    integers outside the target's range (any nonzero to True, for ``bool``).

    Example:
        >>> cast_loss("float32", "bfloat16") is None, cast_loss("int64", "int32")
        (True, 'wraps int64 values outside the range of int32')
    """
    a, b = to_torch_dtype(src), to_torch_dtype(dst)
    if a.is_complex and not b.is_complex:
        return "drops the imaginary part"
    if a == torch.bool or b.is_floating_point or b.is_complex or a == b:
        return None
    if b == torch.bool:
        return f"turns every nonzero {src} value into True"
    if a.is_floating_point:
        return "cuts fractions and turns NaN and inf into arbitrary integers"
    if torch.iinfo(b).min <= torch.iinfo(a).min and torch.iinfo(a).max <= torch.iinfo(b).max:
        return None
    return f"wraps {src} values outside the range of {dst}"


def _cast(st: Statement, v: VTensor, key: str) -> VTensor:
    """``v`` cast to the dtype of attribute ``key``; a lossy cast needs ``lossy=1``."""
    dtype = _dtype(st, key)
    flag = st.attr("lossy")
    if st.has("lossy") and flag != 1:
        raise StatementError(f"lossy={flag!r}: write lossy=1 to accept a cast that loses values", st.attr_name("lossy"))
    loss = cast_loss(v.dtype, dtype)
    if loss is not None and flag is None:
        raise StatementError(
            f"casting {st.left[0].text!r} from {v.dtype} to {dtype} {loss}",
            st.attr_name(key),
            ("add lossy=1 to the statement to cast anyway",),
        )
    return cast(v, dtype)


def _permute(st: Statement, v: VTensor) -> VTensor:
    perm = _int_list(st, "permute")
    if not perm:
        return permute(v, list(range(v.ndim))[::-1])
    if len(perm) != v.ndim:
        raise StatementError(
            f"permute={perm} has {len(perm)} entries but the tensor has {v.ndim} dims (shape {list(v.shape)})",
            st.attr_name("permute"),
        )
    norm = [p % v.ndim if -v.ndim <= p < v.ndim else None for p in perm]
    if None in norm or sorted(norm) != list(range(v.ndim)):  # type: ignore[type-var]
        raise StatementError(f"permute={perm} is not a permutation of dims 0..{v.ndim - 1}", st.attr_name("permute"))
    return permute(v, norm)  # type: ignore[arg-type]


def _keep(st: Statement, v: VTensor) -> VTensor:
    """``a -> b, axis=k, keep=N``: the first N entries of ``a`` along dim k (a padded vocabulary
    trimmed to its real size)."""
    if not st.has("axis"):
        raise StatementError("keep= needs axis=<dim>: the dim to keep the first entries of", st.attr_name("keep"))
    dim = axis_of(st, v)
    n = st.attr("keep")
    if not isinstance(n, int) or not 0 < n <= v.shape[dim]:
        raise StatementError(
            f"keep={n!r} must be a positive integer at most {v.shape[dim]}, the size of "
            f"dim {dim} of {st.left[0].text!r} (shape {list(v.shape)})",
            st.attr_name("keep"),
            ("check the value (for a vocabulary: the model config's vocab_size)",),
        )
    return take(v, dim, 0, n)


def _shape(st: Statement, key: str, v: VTensor) -> tuple[int, ...]:
    try:
        return infer_shape(_int_list(st, key), math.prod(v.shape))
    except ValueError as exc:
        raise StatementError(
            f"{key}={st.attr(key)!r} does not fit {st.left[0].text!r} of shape {list(v.shape)}: {exc}",
            st.attr_name(key),
        ) from None


def _reshape(st: Statement, v: VTensor) -> VTensor:
    """``a -> b, shape='[...]'`` (one way) or ``src_shape=`` / ``dst_shape=`` (reversible): ``a``
    reshaped row-major, as ``torch.reshape``; one size may be -1 (inferred)."""
    if st.has("src_shape") != st.has("dst_shape"):
        raise StatementError(
            "src_shape and dst_shape go together", st.attr_name("src_shape") or st.attr_name("dst_shape")
        )
    if st.has("src_shape") and _shape(st, "src_shape", v) != v.shape:
        raise StatementError(
            f"{st.left[0].text!r} has shape {list(v.shape)}, not src_shape={st.attr('src_shape')!r}",
            st.attr_name("src_shape"),
        )
    return reshape(v, _shape(st, "shape" if st.has("shape") else "dst_shape", v))


def _one_to_one(st: Statement, v: VTensor) -> VTensor:
    extra = sorted(a.key for a in st.attrs if a.key not in _ONE_TO_ONE)
    if extra:
        raise StatementError(
            f"a 1 -> 1 statement takes permute=, dtype=, axis= (with keep=), shape=, "
            f"src_dtype=/dst_dtype= or src_shape=/dst_shape=, not {', '.join(extra)}",
            st.attr_name(extra[0]),
        )
    kinds = [a.key for a in st.attrs if a.key in _EXCLUSIVE]
    if len(kinds) > 1:
        raise StatementError(
            f"a 1 -> 1 statement takes at most one of permute/dtype/axis/shape, got {' and '.join(kinds)}",
            st.attr_name(kinds[1]),
            ("write one statement per transform",),
        )
    if st.has("src_dtype") != st.has("dst_dtype"):
        raise StatementError("src_dtype and dst_dtype go together")
    if st.has("lossy") and not (st.has("dtype") or st.has("dst_dtype")):
        raise StatementError("lossy=1 goes with a cast (dtype= or src_dtype=/dst_dtype=)", st.attr_name("lossy"))
    if st.has("src_dtype"):
        src = _dtype(st, "src_dtype")
        _dtype(st, "dst_dtype")  # every spelling checked before what it says
        if src != v.dtype:
            raise StatementError(
                f"src_dtype={src!r} but {st.left[0].text!r} is {v.dtype}: src_dtype names the dtype the tensor has",
                st.attr_name("src_dtype"),
                (f"write src_dtype='{v.dtype}'",),
            )
        v = _cast(st, v, "dst_dtype")
    if st.has("src_shape") or "shape" in kinds or "dst_shape" in kinds:
        return _reshape(st, v)
    if st.has("keep"):
        return _keep(st, v)
    if "permute" in kinds:
        return _permute(st, v)
    if "dtype" in kinds:
        return _cast(st, v, "dtype")
    if "axis" in kinds:
        axis_of(st, v)  # checked, then a rename (Paddle drops the binding here: a defect)
    return v


def _split_statement(st: Statement, v: VTensor) -> list[VTensor]:
    dim = axis_of(st, v)
    n, parts = v.shape[dim], len(st.right)
    if st.has("sizes"):
        sizes = _int_list(st, "sizes")
        if len(sizes) != parts or sum(sizes) != n or min(sizes) < 0:
            raise StatementError(
                f"sizes={sizes} must give {parts} non-negative sizes summing to {n} (the size of dim {dim})",
                st.attr_name("sizes"),
            )
    else:
        if n % parts:
            raise StatementError(
                f"dim {dim} of {st.left[0].text!r} has size {n}, not divisible into {parts} equal parts",
                st.left[0],
                (f"give unequal sizes with sizes='[...]' summing to {n}",),
            )
        sizes = [n // parts] * parts
    return split(v, dim, sizes)


def concat_checked(st: Statement, vs: Sequence[VTensor], dim: int | None = None) -> VTensor:
    """Concatenate ``vs`` (named by ``st.left``) along ``dim`` (default: the ``axis=`` attribute)."""
    dim = axis_of(st, vs[0]) if dim is None else dim
    first = vs[0]
    for name, v in zip(st.left[1:], vs[1:]):
        if v.dtype != first.dtype:
            raise StatementError(
                f"{name.text!r} is {v.dtype} but {st.left[0].text!r} is {first.dtype}; "
                "concat inputs must share a dtype",
                name,
                (f"cast first: `{name.text} -> {name.text}, dtype='{first.dtype}'`",),
            )
        other = [i for i in range(max(v.ndim, first.ndim)) if i != dim]
        if v.ndim != first.ndim or any(v.shape[i] != first.shape[i] for i in other):
            raise StatementError(
                f"{name.text!r} has shape {list(v.shape)}, {st.left[0].text!r} has "
                f"{list(first.shape)}: all dims but {dim} must match to concat",
                name,
            )
    return concat(vs, dim)


def apply_statement(st: Statement, inputs: Sequence[VTensor]) -> list[VTensor]:
    """Evaluate a statement without a macro keyword on its inputs (in left-side order); returns its
    outputs (right-side order). Statements with a keyword go to :func:`~.fused.apply_fused`."""
    if len(inputs) == 1 and len(st.right) == 1:
        return [_one_to_one(st, inputs[0])]
    extra = sorted(a.key for a in st.attrs if a.key not in ("axis", "sizes"))
    if extra:
        raise StatementError(
            f"a split or concat takes only axis= (and sizes= for a split), not {', '.join(extra)}",
            st.attr_name(extra[0]),
            ("cast or permute in a statement of its own",),
        )
    if len(inputs) == 1:
        return _split_statement(st, inputs[0])
    if st.has("sizes"):
        raise StatementError("sizes= belongs to a split, not a concat", st.attr_name("sizes"))
    return [concat_checked(st, inputs)]
