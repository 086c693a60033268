"""Resolver: a mapping program plus a layout -> every target as pieces of source boxes.

Variables are source keys and names bound by statements. A name is looked up among the names bound so
far, then among the sources. The outputs are every variable that no statement consumed and that was
not dropped, sorted by name; a source read by two statements (tied weights) feeds both. A source that
no statement reads passes through under its own name: :func:`unconsumed` lists those, :func:`resolve`
logs a warning naming them, and refuses them when strict.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from ..errors import MappingError
from ..layout.meta import GlobalLayout, TensorMeta
from ..quant.fp8 import DEFAULT_BLOCK, Block
from .fused import apply_fused
from .hints import moe_hint, with_moe_hint, with_prefix_hint
from .macros import expand_macros, reverse_program
from .parser import attribute_names
from .pieces import Piece, TargetSpec
from .program import Mapping, MappingLike
from .scales import fp8_pairs, scale_targets
from .statements import StatementError, apply_statement
from .syntax import Diagnostic, Name, Statement, suggest
from .vtensor import VTensor, source_tensor, to_pieces

__all__ = ["resolve", "unconsumed", "resolve_program", "Resolved", "OPTIMIZER_SUFFIXES", "SCALAR_SUFFIXES"]

logger = logging.getLogger(__name__)

#: Paddle's optimizer-state suffixes: fp32 master and Adam moments follow their parameter's mapping.
OPTIMIZER_SUFFIXES: tuple[str, ...] = (".w_0", ".moment1_0", ".moment2_0")
#: Scalar states copied whole from the first source of each target.
SCALAR_SUFFIXES: tuple[str, ...] = (".beta1_pow_acc_0", ".beta2_pow_acc_0")


class Resolved(NamedTuple):
    """What :func:`resolve_program` finds: the outputs by name, the problems, and the source keys
    that no statement read (they are outputs of their own name, less any ``prefix``)."""

    outputs: dict[str, VTensor]
    diags: list[Diagnostic]
    unconsumed: list[str]


@dataclass
class _Run:
    layout: GlobalLayout
    dest: GlobalLayout | None
    dest_prefix: str  # what a destination key has before the program's name for it
    sources: dict[str, VTensor]
    bound: dict[str, VTensor]
    live: dict[str, None]  # ordered set of output candidates
    producers: dict[str, Statement]  # the statement that bound each live name
    diags: list[Diagnostic]
    failed: set[str]  # names bound by a failed statement: their readers report nothing more
    tolerate: Callable[[str], bool]  # unknown names that skip their statement silently

    def fail(self, st: Statement, e: StatementError) -> None:
        self.diags.append(
            Diagnostic(
                e.message, st.index, st.text, e.name.col if e.name else 0, e.name.text if e.name else None, e.hints
            )
        )
        self.failed.update(n.text for n in st.right)

    def lookup(self, st: Statement, i: int) -> VTensor | None:
        name = st.left[i]
        found = self.bound[name.text] if name.text in self.bound else self.sources.get(name.text)
        if found is None and name.text not in self.failed and not self.tolerate(name.text):
            known = list(self.bound) + list(self.sources)
            self.diags.append(
                Diagnostic(
                    f"unknown name {name.text!r}{suggest(name.text, known)}", st.index, st.text, name.col, name.text
                )
            )
        return found

    def shard_count(self, name: Name, v: VTensor | None, dim: int) -> int:
        """Blocks of a fused tensor along ``dim``: its source's shards there, or for a tensor being
        built (``v`` None), the destination layout's (1 without a destination layout). The shards
        must all be the same size: each is read as one block."""
        if v is None:
            key = self.dest_prefix + name.text
            if self.dest is None or key not in self.dest:
                return 1
            meta = self.dest[key]
            return _equal_bands(name, meta, dim, 0, meta.shape[dim], f"destination {name.text!r}")
        whole = [f for f in v.frags if f.box.sizes == v.shape]
        if len(whole) != 1:
            raise StatementError(
                f"{name.text!r} must be one source tensor (renamed, cast or permuted at "
                "most) so that its shards can be counted",
                name,
                ("or give the block count: tp=<tensor-parallel size>",),
            )
        f = whole[0]
        sdim = f.perm[dim]
        if sdim < 0:
            return 1  # a unit dim the source lacks: one block
        what = repr(name.text) if f.source == name.text else f"{name.text!r} (source {f.source!r})"
        return _equal_bands(
            name, self.layout[f.source], sdim, f.source_box.offsets[sdim], f.source_box.stops[sdim], what
        )


def _equal_bands(name: Name, meta: TensorMeta, dim: int, lo: int, hi: int, what: str) -> int:
    """How many shards cut ``[lo, hi)`` of ``dim``; an error naming their sizes if they differ."""
    cuts = sorted({lo, hi} | {o for o in meta.offsets_along(dim) if lo < o < hi})
    sizes = [b - a for a, b in zip(cuts, cuts[1:])]
    if len(set(sizes)) > 1:
        raise StatementError(
            f"{what} is cut along dim {dim} into shards of sizes {sizes}; a fused form "
            "reads each shard as one block, so they must be the same size",
            name,
            ("give the block count explicitly: tp=<tensor-parallel size the weights were written with>",),
        )
    return max(1, len(sizes))


def _check_form(st: Statement) -> None:
    known = attribute_names()
    unknown = [a for a in st.attrs if a.key not in known]
    if unknown:
        a = unknown[0]
        raise StatementError(f"unknown attribute {a.key!r}{suggest(a.key, known)}", Name(a.key, a.col))
    if len(st.left) > 1 and len(st.right) > 1:
        raise StatementError("more than one name on both sides; split or concat in separate statements")
    outs = [n.text for n in st.right]
    dup = next((n for n in st.right if outs.count(n.text) > 1 and n.text != "_"), None)
    if dup is not None:
        raise StatementError(f"{dup.text!r} is assigned twice in one statement", dup)


def _run_statement(run: _Run, st: Statement) -> None:
    try:
        _check_form(st)
    except StatementError as e:
        run.fail(st, e)
        return
    if [n.text for n in st.left] == ["_"]:
        return  # `_ -> y`: y has no source; nothing is produced for it on export
    if st.optional and not any(n.text in run.bound or n.text in run.sources or n.text in run.failed for n in st.left):
        return  # `a? -> b` without `a`: skipped; a reader of `b` reports it unknown
    inputs = [run.lookup(st, i) for i in range(len(st.left))]
    if any(v is None for v in inputs):
        run.failed.update(n.text for n in st.right)
        return
    try:
        fused = any(a.value is None for a in st.attrs)
        if fused:
            outputs = apply_fused(st, inputs, run.shard_count)  # type: ignore[arg-type]
        else:
            outputs = apply_statement(st, inputs)  # type: ignore[arg-type]
    except StatementError as e:
        run.fail(st, e)
        return
    for n in st.left:
        run.live.pop(n.text, None)
    shadowed = [
        n for n in st.right if n.text in run.sources and n.text in run.live and n.text not in {m.text for m in st.left}
    ]
    if shadowed:
        n = shadowed[0]
        run.fail(
            st,
            StatementError(
                f"{n.text!r} is also a source that no statement consumes: both would be outputs of that name",
                n,
                (f"drop the source first (`{n.text} -> _`) or choose another name",),
            ),
        )
        return
    if _produced_twice(run, st):
        return
    for n, v in zip(st.right, outputs):
        if n.text != "_":
            run.bound[n.text] = v
            run.live[n.text] = None
            run.producers[n.text] = st


def _drop_optional_strays(run: _Run) -> None:
    """With a destination layout (``load``, ``reshard``), an output of an optional statement that the
    destination does not hold is dropped rather than reported unexpected when every tensor that
    statement reads is read by another statement as well: two optional lines for two layouts of a
    model (a Transformer Engine model's norms or grouped experts, another model's local names) read
    the same checkpoint tensor, and the destination picks one. An optional line that alone reads its
    tensor (an ``lm_head`` for a tied model) is still reported."""
    if run.dest is None:
        return
    strays = {
        n: run.producers[n]
        for n in run.live
        if n in run.producers and run.producers[n].optional and run.dest_prefix + n not in run.dest
    }
    stray_ids = {id(st) for st in strays.values()}
    read_elsewhere = {m.text for st in run.producers.values() if id(st) not in stray_ids for m in st.left}
    for name, st in strays.items():
        if all(m.text in read_elsewhere for m in st.left):
            del run.live[name]


def _produced_twice(run: _Run, st: Statement) -> bool:
    """Report a name of ``st``'s right side that an earlier statement bound and nothing has read
    since: both would produce that target, and the later one would silently win."""
    reads = {m.text for m in st.left}
    n = next((n for n in st.right if n.text in run.producers and n.text in run.live and n.text not in reads), None)
    if n is None:
        return False
    first = run.producers[n.text]
    where = (
        "an earlier expansion of this statement"
        if first.index == st.index
        else f"statement {first.index} `{first.text}`"
    )
    run.fail(
        st,
        StatementError(
            f"{n.text!r} is already produced by {where}: two statements would produce the same target",
            n,
            (f"give one of them another name, or read the first one before binding {n.text!r} again",),
        ),
    )
    return True


def _strip(keys: Sequence[str], prefix: str) -> dict[str, str]:
    """``{name the program reads: key}``: each key less ``prefix`` where it has it."""
    names: dict[str, str] = {}
    for k in keys:
        name = k[len(prefix) :] if prefix and k.startswith(prefix) else k
        if name in names:
            raise MappingError(
                f"source keys {names[name]!r} and {k!r} both read as {name!r} with "
                f"prefix={prefix!r}; drop one of them or give no prefix"
            )
        names[name] = k
    return names


def _one_way(statements: Sequence[Statement]) -> list[Diagnostic]:
    """``dtype=`` and ``shape=`` in a program run in reverse: each an error saying what to write."""
    fixes = {
        "dtype": "write src_dtype='<checkpoint dtype>', dst_dtype='<model dtype>'",
        "shape": "write src_shape='<checkpoint shape>', dst_shape='<model shape>'",
    }
    return [
        Diagnostic(f"{a.key}= is one-way and cannot run in reverse", st.index, st.text, a.col, a.key, (fixes[a.key],))
        for st in statements
        for a in st.attrs
        if a.key in fixes
    ]


def resolve_program(
    statements: Sequence[Statement],
    layout: GlobalLayout,
    *,
    dest: GlobalLayout | None = None,
    reverse: bool = False,
    keys: Sequence[str] | None = None,
    tolerate: Callable[[str], bool] = lambda name: False,
    prefix: str = "",
) -> Resolved:
    """Expand and evaluate ``statements`` over the sources ``keys`` (default: every layout key).

    ``tolerate(name)`` says which unknown names skip their statement (and its dependents) silently.
    ``prefix`` belongs to the left side's keys: source keys lose it, or in reverse mode outputs gain it.
    """
    names = _strip(layout.keys() if keys is None else list(keys), "" if reverse else prefix)
    dest_keys = None if dest is None else list(_strip(dest.keys(), prefix if reverse else ""))
    sources = {n: source_tensor(k, layout[k].shape, layout[k].dtype) for n, k in names.items()}
    run = _Run(layout, dest, prefix if reverse else "", sources, {}, dict.fromkeys(names), {}, [], set(), tolerate)
    # Each statement is expanded just before it runs, against the sources and the names bound so far
    # (with their shapes: an unstack's '*' outputs are numbered by them).
    for st in reversed(statements) if reverse else statements:
        shapes = {n: v.shape for n, v in run.sources.items()} | {n: v.shape for n, v in run.bound.items()}
        expanded, diags = expand_macros(
            [st], list(run.sources), dest_keys, reverse=reverse, shapes=shapes, bound=list(run.bound)
        )
        run.diags += diags
        if reverse:
            run.diags += _one_way(expanded)
            expanded = reverse_program(expanded)
        for each in expanded:
            _run_statement(run, each)
    _drop_optional_strays(run)
    values = {**run.sources, **run.bound}
    out_prefix = prefix if reverse else ""
    passed = [names[n] for n in run.live if n in run.sources and n not in run.bound]
    return Resolved({out_prefix + n: values[n] for n in sorted(run.live)}, run.diags, passed)


def _resolve(
    program: Mapping,
    layout: GlobalLayout,
    dest: GlobalLayout | None,
    state_suffixes: Sequence[str],
    scalar_suffixes: Sequence[str],
    block: Block = DEFAULT_BLOCK,
) -> tuple[list[TargetSpec], list[str]]:
    """Every target, sorted by name, and the source keys passed through unconsumed. The scales of
    block-FP8 weights are not sources of their own: they follow their weights (:mod:`.scales`)."""
    named = {n.text for st in program.statements for n in st.left + st.right}
    pairs = fp8_pairs(layout, {program.prefix + n for n in named} | named)
    scales = set(pairs.values())
    model_keys, states = _split_state_keys(
        [k for k in layout.keys() if k not in scales], named, tuple(state_suffixes), tuple(scalar_suffixes)
    )
    stems = {k[: -len(sfx)] for sfx, ks in states.items() for k in ks}
    stems |= {k[len(program.prefix) :] for k in stems if program.prefix and k.startswith(program.prefix)}
    outputs, diags, passed = resolve_program(
        program.statements,
        layout,
        dest=dest,
        reverse=program.reverse,
        keys=model_keys,
        tolerate=stems.__contains__,
        prefix=program.prefix,
    )
    if diags:
        diags = with_prefix_hint(sorted(diags, key=lambda d: d.index), model_keys, program)
        raise MappingError(with_moe_hint(diags, model_keys, program))
    targets = {name: _spec(name, v) for name, v in outputs.items()}
    targets.update(_state_targets(program, layout, states, tuple(scalar_suffixes), outputs))
    targets.update((t.name, t) for t in scale_targets(targets.values(), layout, pairs, block))
    return [targets[k] for k in sorted(targets)], passed


def resolve(
    mapping: MappingLike | None,
    layout: GlobalLayout,
    *,
    dest: GlobalLayout | None = None,
    reverse: bool | None = None,
    state_suffixes: Sequence[str] = OPTIMIZER_SUFFIXES,
    scalar_suffixes: Sequence[str] = SCALAR_SUFFIXES,
    strict: bool | None = None,
    fp8_block: Block = DEFAULT_BLOCK,
) -> list[TargetSpec]:
    """Resolve ``mapping`` against ``layout``: every target, sorted by name, as pieces.

    Optimizer-state keys ``<key><suffix>`` follow ``<key>``'s mapping (a state key is one whose stem
    is a source key or a name in the program); scalar states are copied whole from the first source
    of each target. With ``mapping=None`` every source key is a target of its own. A mapping that
    leaves sources unconsumed passes them through under their own names and logs a warning listing
    them (see :func:`unconsumed`); ``strict`` makes that an error. A block-FP8 weight (FP8 codes
    ``W`` with ``W_scale_inv``) is one tensor: the program names ``W`` and its scales follow it
    (:mod:`shardsync.mapping.scales`).

    Args:
        mapping: anything :meth:`Mapping.parse` takes (a shipped mapping's name included), or None.
        layout: the global layout of the sources.
        dest: a destination layout, for forms that need one (``*`` on the right, re-blocking).
        reverse: overrides the mapping's own reverse flag.
        state_suffixes: suffixes of states shaped like their parameter (Paddle's by default).
        scalar_suffixes: suffixes of scalar states; pass ``()`` for both to treat no key as a state.
        strict: refuse a mapping that leaves sources unconsumed; None: the mapping's own ``strict``.
        fp8_block: rows x columns of a block of the block-FP8 weights (config.json's
            ``weight_block_size``), for the pieces that cut them.

    Raises:
        MappingError: every problem of the program, each naming statement, column and name; or, when
            strict, the sources no statement reads; or block-FP8 weights cut through their blocks.

    Example:
        >>> from shardsync.layout import GlobalLayout, Box
        >>> lay = GlobalLayout.merge([[("w", (4, 2), "float32", Box((0, 0), (4, 2)))]])
        >>> [t.name for t in resolve(["w -> a, b, axis=0"], lay)]
        ['a', 'b']
    """
    program = Mapping.parse(mapping if mapping is not None else [], reverse=reverse)
    targets, passed = _resolve(program, layout, dest, state_suffixes, scalar_suffixes, fp8_block)
    if passed and program.statements:
        shown = ", ".join(map(repr, passed[:10])) + (f" and {len(passed) - 10} more" if len(passed) > 10 else "")
        moe = moe_hint(passed, program)  # a dense mapping on a model with some MoE layers
        if program.strict if strict is None else strict:
            raise MappingError(
                f"the mapping leaves {len(passed)} source{'s' * (len(passed) > 1)} unconsumed: "
                f"{shown}; "
                + (
                    moe
                    or "map each with a statement or drop it (`name -> _`), "
                    "or resolve without strict to pass them through under their "
                    "own names"
                )
            )
        logger.warning(
            "the mapping leaves %d source%s unconsumed; they pass through under their own names: %s%s",
            len(passed),
            "s" * (len(passed) > 1),
            shown,
            f"; {moe}" if moe else "",
        )
    return targets


def unconsumed(
    mapping: MappingLike, layout: GlobalLayout, *, dest: GlobalLayout | None = None, reverse: bool | None = None
) -> list[str]:
    """The sources a mapping leaves unconsumed.

    Args:
        mapping: anything :meth:`Mapping.parse` takes.
        layout: the global layout of the sources.
        dest: a destination layout, as for :func:`resolve`.
        reverse: overrides the mapping's own reverse flag.

    Returns:
        the source keys that no statement reads, in layout order: :func:`resolve` passes them through
        under their own names (less the mapping's ``prefix``). Optimizer states follow their
        parameter and are not listed.

    Raises:
        MappingError: the mapping does not resolve against ``layout``.

    Example:
        >>> from shardsync.layout import GlobalLayout, Box
        >>> lay = GlobalLayout.merge([[(k, (2,), "float32", Box((0,), (2,))) for k in ("w", "b")]])
        >>> unconsumed(["w -> weight"], lay)
        ['b']
    """
    program = Mapping.parse(mapping, reverse=reverse)
    return _resolve(program, layout, dest, OPTIMIZER_SUFFIXES, SCALAR_SUFFIXES)[1]


def _state_targets(
    program: Mapping,
    layout: GlobalLayout,
    states: dict[str, list[str]],
    scalars: tuple[str, ...],
    outputs: dict[str, VTensor],
) -> dict[str, TargetSpec]:
    """Targets for optimizer states: shaped ones run the program with each state key standing in for
    its parameter's; scalar ones are copied whole from the first source of each target."""
    targets: dict[str, TargetSpec] = {}
    firsts = {name: v.frags[0].source for name, v in outputs.items() if v.frags}
    for sfx in (s for s in states if s not in scalars):
        stand_in = GlobalLayout(
            {k[: -len(sfx)]: replace(layout[k], key=k[: -len(sfx)]) for k in states[sfx]}, layout.world_size
        )
        state_out = resolve_program(
            program.statements,
            stand_in,
            reverse=program.reverse,
            tolerate=lambda name: True,  # params without this state
            prefix=program.prefix,
        ).outputs
        for name, v in state_out.items():
            targets[name + sfx] = TargetSpec(
                name + sfx, v.shape, v.dtype, tuple(_suffixed(p, sfx) for p in to_pieces(v))
            )
            if v.frags:
                firsts.setdefault(name, v.frags[0].source)
    for sfx in (s for s in states if s in scalars):
        have = set(states[sfx])
        for name, first in firsts.items():
            if first + sfx in have:
                m = layout[first + sfx]
                targets[name + sfx] = _spec(name + sfx, source_tensor(first + sfx, m.shape, m.dtype))
    return targets


def _split_state_keys(
    keys: Sequence[str], named: set[str], shaped: tuple[str, ...], scalars: tuple[str, ...]
) -> tuple[list[str], dict[str, list[str]]]:
    model: list[str] = []
    states: dict[str, list[str]] = {}
    keyset = set(keys)
    for k in keys:
        sfx = next(
            (s for s in shaped + scalars if k.endswith(s) and (k[: -len(s)] in keyset or k[: -len(s)] in named)), None
        )
        if sfx is None:
            model.append(k)
        else:
            states.setdefault(sfx, []).append(k)
    return model, states


def _spec(name: str, v: VTensor) -> TargetSpec:
    return TargetSpec(name, v.shape, v.dtype, to_pieces(v))


def _suffixed(p: Piece, sfx: str) -> Piece:
    return Piece(p.source + sfx, p.source_box, p.target_box, p.perm, p.casts)
