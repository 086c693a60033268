"""Resolver: a mapping program plus a layout -> every target as pieces of source boxes.

Variables are source keys and names bound by statements. A name is looked up among the names bound so
far, then among the sources. The outputs are every variable that no statement consumed and that was
not dropped, sorted by name; a source read by two statements (tied weights) feeds both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..errors import MappingError
from ..layout.meta import GlobalLayout, TensorMeta
from .macros import expand_macros, reverse_program
from .parser import attribute_names
from .pieces import Piece, TargetSpec
from .program import Mapping, MappingLike
from .fused import apply_fused
from .statements import StatementError, apply_statement
from .syntax import Diagnostic, Name, Statement, suggest
from .vtensor import VTensor, source_tensor, to_pieces

__all__ = ["resolve", "resolve_program", "OPTIMIZER_SUFFIXES", "SCALAR_SUFFIXES"]

#: Paddle's optimizer-state suffixes: fp32 master and Adam moments follow their parameter's mapping.
OPTIMIZER_SUFFIXES: tuple[str, ...] = (".w_0", ".moment1_0", ".moment2_0")
#: Scalar states copied whole from the first source of each target.
SCALAR_SUFFIXES: tuple[str, ...] = (".beta1_pow_acc_0", ".beta2_pow_acc_0")


@dataclass
class _Run:
    layout: GlobalLayout
    dest: GlobalLayout | None
    sources: dict[str, VTensor]
    bound: dict[str, VTensor]
    live: dict[str, None]  # ordered set of output candidates
    diags: list[Diagnostic]
    failed: set[str]  # names bound by a failed statement: their readers report nothing more
    tolerate: Callable[[str], bool]  # unknown names that skip their statement silently

    def fail(self, st: Statement, e: StatementError) -> None:
        self.diags.append(Diagnostic(e.message, st.index, st.text, e.name.col if e.name else 0,
                                     e.name.text if e.name else None, e.hints))
        self.failed.update(n.text for n in st.right)

    def lookup(self, st: Statement, i: int) -> VTensor | None:
        name = st.left[i]
        found = self.bound[name.text] if name.text in self.bound else self.sources.get(name.text)
        if found is None and name.text not in self.failed and not self.tolerate(name.text):
            known = list(self.bound) + list(self.sources)
            self.diags.append(Diagnostic(f"unknown name {name.text!r}{suggest(name.text, known)}",
                                         st.index, st.text, name.col, name.text))
        return found

    def shard_count(self, name: Name, v: VTensor | None, dim: int) -> int:
        """Blocks of a fused tensor along ``dim``: its source's shards there, or for a tensor being
        built (``v`` None), the destination layout's (1 without a destination layout). The shards
        must all be the same size: each is read as one block."""
        if v is None:
            if self.dest is None or name.text not in self.dest:
                return 1
            meta = self.dest[name.text]
            return _equal_bands(name, meta, dim, 0, meta.shape[dim], f"destination {name.text!r}")
        whole = [f for f in v.frags if f.box.sizes == v.shape]
        if len(whole) != 1:
            raise StatementError(f"{name.text!r} must be one source tensor (renamed, cast or permuted at "
                                 "most) so that its shards can be counted", name,
                                 ("or give the block count: tp=<tensor-parallel size>",))
        f = whole[0]
        sdim = f.perm[dim]
        what = repr(name.text) if f.source == name.text else f"{name.text!r} (source {f.source!r})"
        return _equal_bands(name, self.layout[f.source], sdim, f.source_box.offsets[sdim],
                            f.source_box.stops[sdim], what)


def _equal_bands(name: Name, meta: TensorMeta, dim: int, lo: int, hi: int, what: str) -> int:
    """How many shards cut ``[lo, hi)`` of ``dim``; an error naming their sizes if they differ."""
    cuts = sorted({lo, hi} | {o for o in meta.offsets_along(dim) if lo < o < hi})
    sizes = [b - a for a, b in zip(cuts, cuts[1:])]
    if len(set(sizes)) > 1:
        raise StatementError(f"{what} is cut along dim {dim} into shards of sizes {sizes}; a fused form "
                             "reads each shard as one block, so they must be the same size", name,
                             ("give the block count explicitly: tp=<tensor-parallel size the weights "
                              "were written with>",))
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
    inputs = [run.lookup(st, i) for i in range(len(st.left))]
    if any(v is None for v in inputs):
        run.failed.update(n.text for n in st.right)
        return
    try:
        fused = any(a.value is None for a in st.attrs)
        outputs = (apply_fused(st, inputs, run.shard_count) if fused  # type: ignore[arg-type]
                   else apply_statement(st, inputs))  # type: ignore[arg-type]
    except StatementError as e:
        run.fail(st, e)
        return
    for n in st.left:
        run.live.pop(n.text, None)
    shadowed = [n for n in st.right if n.text in run.sources and n.text in run.live
                and n.text not in {m.text for m in st.left}]
    if shadowed:
        n = shadowed[0]
        run.fail(st, StatementError(f"{n.text!r} is also a source that no statement consumes: both "
                                    "would be outputs of that name", n,
                                    (f"drop the source first (`{n.text} -> _`) or choose another name",)))
        return
    for n, v in zip(st.right, outputs):
        if n.text != "_":
            run.bound[n.text] = v
            run.live[n.text] = None


def resolve_program(statements: Sequence[Statement], layout: GlobalLayout, *,
                    dest: GlobalLayout | None = None, reverse: bool = False, keys: Sequence[str] | None = None,
                    tolerate: Callable[[str], bool] = lambda name: False,
                    ) -> tuple[dict[str, VTensor], list[Diagnostic]]:
    """Expand and evaluate ``statements`` over the sources ``keys`` (default: every layout key).

    ``tolerate(name)`` says which unknown names skip their statement (and its dependents) silently.
    """
    keys = layout.keys() if keys is None else list(keys)
    expanded, diags = expand_macros(statements, keys, dest.keys() if dest else None, reverse=reverse)
    if reverse:
        diags += [Diagnostic("dtype= is one-way and cannot run in reverse", st.index, st.text,
                             next(a.col for a in st.attrs if a.key == "dtype"), "dtype",
                             ("write src_dtype='<checkpoint dtype>', dst_dtype='<model dtype>'",))
                  for st in expanded if st.has("dtype")]
        expanded = reverse_program(expanded)
    sources = {k: source_tensor(k, layout[k].shape, layout[k].dtype) for k in keys}
    run = _Run(layout, dest, sources, {}, dict.fromkeys(keys), diags, set(), tolerate)
    for st in expanded:
        _run_statement(run, st)
    values = {**run.sources, **run.bound}
    return {name: values[name] for name in sorted(run.live)}, run.diags


def resolve(mapping: MappingLike | None, layout: GlobalLayout, *, dest: GlobalLayout | None = None,
            reverse: bool | None = None, state_suffixes: Sequence[str] = OPTIMIZER_SUFFIXES,
            scalar_suffixes: Sequence[str] = SCALAR_SUFFIXES) -> list[TargetSpec]:
    """Resolve ``mapping`` against ``layout``: every target, sorted by name, as pieces.

    Optimizer-state keys ``<key><suffix>`` follow ``<key>``'s mapping (a state key is one whose stem
    is a source key or a name in the program); scalar states are copied whole from the first source
    of each target. With ``mapping=None`` every source key is a target of its own.

    Args:
        mapping: anything :meth:`Mapping.parse` takes, or None.
        layout: the global layout of the sources.
        dest: a destination layout, for forms that need one (``*`` on the right, re-blocking).
        reverse: overrides the mapping's own reverse flag.
        state_suffixes: suffixes of states shaped like their parameter (Paddle's by default).
        scalar_suffixes: suffixes of scalar states; pass ``()`` for both to treat no key as a state.

    Raises:
        MappingError: every problem of the program, each naming statement, column and name.

    Example:
        >>> from shardsync.layout import GlobalLayout, Box
        >>> lay = GlobalLayout.merge([[("w", (4, 2), "float32", Box((0, 0), (4, 2)))]])
        >>> [t.name for t in resolve(["w -> a, b, axis=0"], lay)]
        ['a', 'b']
    """
    program = Mapping.parse(mapping if mapping is not None else [], reverse=reverse)
    named = {n.text for st in program.statements for n in st.left + st.right}
    model_keys, states = _split_state_keys(layout.keys(), named, tuple(state_suffixes),
                                           tuple(scalar_suffixes))
    stems = {k[:-len(sfx)] for sfx, ks in states.items() for k in ks}
    outputs, diags = resolve_program(program.statements, layout, dest=dest, reverse=program.reverse,
                                     keys=model_keys, tolerate=stems.__contains__)
    if diags:
        raise MappingError(sorted(diags, key=lambda d: d.index))
    targets = {name: _spec(name, v) for name, v in outputs.items()}
    targets.update(_state_targets(program, layout, states, tuple(scalar_suffixes), outputs))
    return [targets[k] for k in sorted(targets)]


def _state_targets(program: Mapping, layout: GlobalLayout, states: dict[str, list[str]],
                   scalars: tuple[str, ...], outputs: dict[str, VTensor]) -> dict[str, TargetSpec]:
    """Targets for optimizer states: shaped ones run the program with each state key standing in for
    its parameter's; scalar ones are copied whole from the first source of each target."""
    targets: dict[str, TargetSpec] = {}
    firsts = {name: v.frags[0].source for name, v in outputs.items() if v.frags}
    for sfx in (s for s in states if s not in scalars):
        stand_in = GlobalLayout({k[:-len(sfx)]: replace(layout[k], key=k[:-len(sfx)]) for k in states[sfx]},
                                layout.world_size)
        state_out, _ = resolve_program(program.statements, stand_in, reverse=program.reverse,
                                       tolerate=lambda name: True)  # params without this state
        for name, v in state_out.items():
            targets[name + sfx] = TargetSpec(name + sfx, v.shape, v.dtype,
                                             tuple(_suffixed(p, sfx) for p in to_pieces(v)))
            if v.frags:
                firsts.setdefault(name, v.frags[0].source)
    for sfx in (s for s in states if s in scalars):
        have = set(states[sfx])
        for name, first in firsts.items():
            if first + sfx in have:
                m = layout[first + sfx]
                targets[name + sfx] = _spec(name + sfx, source_tensor(first + sfx, m.shape, m.dtype))
    return targets


def _split_state_keys(keys: Sequence[str], named: set[str], shaped: tuple[str, ...],
                      scalars: tuple[str, ...]) -> tuple[list[str], dict[str, list[str]]]:
    model: list[str] = []
    states: dict[str, list[str]] = {}
    keyset = set(keys)
    for k in keys:
        sfx = next((s for s in shaped + scalars
                    if k.endswith(s) and (k[:-len(s)] in keyset or k[:-len(s)] in named)), None)
        if sfx is None:
            model.append(k)
        else:
            states.setdefault(sfx, []).append(k)
    return model, states


def _spec(name: str, v: VTensor) -> TargetSpec:
    return TargetSpec(name, v.shape, v.dtype, to_pieces(v))


def _suffixed(p: Piece, sfx: str) -> Piece:
    return Piece(p.source + sfx, p.source_box, p.target_box, p.perm, p.casts)
