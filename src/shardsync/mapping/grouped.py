"""Grouped and stacked tensors: the ``stack`` and ``unstack`` forms.

``a, b, c -> s, stack, axis=k`` builds ``s`` with a new dim ``k`` holding ``a``, ``b``, ``c`` in order
(``torch.stack``); ``s -> a, b, c, unstack, axis=k`` is the inverse (``torch.unbind``): one output per
entry of dim ``k``, that dim removed. With one name on each side they add or remove a dim of size 1.
Reverse mode exchanges the two keywords. Both are views (:mod:`.views`): a source sharded along the
stacked dim (experts under expert parallelism, layers) is read shard by shard, never gathered.
"""

from __future__ import annotations

from collections.abc import Sequence

from .statements import ShardCount, StatementError, concat_checked
from .syntax import Statement
from .views import squeeze, unsqueeze
from .vtensor import VTensor, take

__all__ = ["AnyToOne", "OneToAny", "stack_dim", "unstack_dim", "apply_stack", "apply_unstack"]


class AnyToOne:
    """The arities ``(n, 1)`` for every n >= 1 (a container of ``(inputs, outputs)`` pairs)."""

    def __contains__(self, arity: object) -> bool:
        return isinstance(arity, tuple) and len(arity) == 2 and arity[0] >= 1 and arity[1] == 1


class OneToAny:
    """The arities ``(1, n)`` for every n >= 1."""

    def __contains__(self, arity: object) -> bool:
        return isinstance(arity, tuple) and len(arity) == 2 and arity[0] == 1 and arity[1] >= 1


def _axis(st: Statement, ndim: int, what: str) -> int:
    raw = st.attr("axis", 0)
    if not isinstance(raw, int) or not -ndim <= raw < ndim:
        raise StatementError(
            f"axis={raw!r} is out of range: {what} has {ndim} dims (axis {-ndim} to {ndim - 1})", st.attr_name("axis")
        )
    return raw % ndim


def stack_dim(st: Statement, ins: Sequence[VTensor]) -> int:
    """The new dim of a stack: ``axis=`` (default 0) among the ``ndim + 1`` dims of the result."""
    return _axis(st, ins[0].ndim + 1, "the stacked tensor")


def unstack_dim(st: Statement, ins: Sequence[VTensor]) -> int:
    """The dim an unstack removes: ``axis=`` (default 0) of its input."""
    return _axis(st, ins[0].ndim, repr(st.left[0].text))


def apply_stack(st: Statement, ins: Sequence[VTensor], dim: int, count: ShardCount) -> list[VTensor]:
    """``a, b, ... -> s, stack, axis=dim``: the inputs (one shape and dtype) along a new dim."""
    for name, v in zip(st.left[1:], ins[1:]):
        if v.shape != ins[0].shape:
            raise StatementError(
                f"{name.text!r} has shape {list(v.shape)}, {st.left[0].text!r} has "
                f"{list(ins[0].shape)}: stacked tensors must have one shape",
                name,
            )
    return [concat_checked(st, [unsqueeze(v, dim) for v in ins], dim)]


def apply_unstack(st: Statement, ins: Sequence[VTensor], dim: int, count: ShardCount) -> list[VTensor]:
    """``s -> a, b, ..., unstack, axis=dim``: one output per entry of ``dim``, that dim removed."""
    v = ins[0]
    if v.shape[dim] != len(st.right):
        raise StatementError(
            f"unstack gives one tensor per entry of dim {dim} of {st.left[0].text!r} "
            f"(shape {list(v.shape)}): {v.shape[dim]} names are needed, "
            f"{len(st.right)} are given",
            st.left[0],
            ("name them all, or write one name with '*' (numbered 0, 1, ...)",),
        )
    return [squeeze(take(v, dim, i, i + 1), dim) for i in range(v.shape[dim])]
