"""Which parameters are replicated across the tensor-parallel group.

A parameter is *selected* when a rule matches it (a name pattern, a DTensor ``Replicate`` placement on
the TP mesh dim, a parameter attribute, a predicate; in a model with DTensor parameters, by default,
any parameter), no exclude pattern matches it, and it is not sharded on TP. Sharded means: a DTensor
whose placement on the TP mesh dim is not ``Replicate``, or a tensor marked ``is_distributed=True``
(PaddlePaddle) or ``tensor_model_parallel=True`` (Megatron). A sharded parameter is never selected,
whatever the rules say.

Selection is local (no collective); :class:`~shardsync.replicas.ReplicaSync` and
:func:`~shardsync.replicas.detect_drift` check across ranks that every rank selected the same tensors.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import nn

from ..errors import ReplicaError

__all__ = [
    "DEFAULT_INCLUDE",
    "Choice",
    "Selection",
    "select_replicated",
    "tp_sharding",
    "resolve_selector",
    "SelectorLike",
]

log = logging.getLogger(__name__)

#: Name patterns selected by default (glob, matched against ``model.named_parameters()`` names).
#: PaddlePaddle's ``tensor_parallel_sync_filter_fn`` rules, then common PyTorch names; ``*.bias``
#: selects the biases that are not sharded on TP (row-parallel and norm biases).
DEFAULT_INCLUDE: tuple[str, ...] = (
    "pos_embedding*",
    "*_layer_norm_scale",
    "*_layer_norm_bias",
    "*.b_*",
    "*norm*.weight",
    "*norm*.bias",
    "*Norm*.weight",
    "*Norm*.bias",
    "*ln_*.weight",
    "*ln_*.bias",
    "*pos_emb*",
    "*position_embedding*",
    "*wpe.weight",
    "*.bias",
    "bias",
)

#: What ``ReplicaSync``/``detect_drift`` accept as ``selector=``: a Selection, a predicate
#: ``(name, param) -> bool`` (applied with no other rule), or None for the defaults.
SelectorLike = Union["Selection", Callable[[str, torch.Tensor], bool], None]


@dataclass(frozen=True, slots=True)
class Choice:
    """One parameter and the rule that selected it (or the reason it was left out)."""

    name: str
    rule: str


@dataclass(frozen=True, slots=True)
class Selection:
    """The replicated parameters of a model, in rank-stable (sorted) order.

    Attributes:
        selected: each selected parameter with the rule that selected it, sorted by name.
        skipped: parameters a rule matched but that were left out (sharded on TP, or excluded).
        considered: how many parameters the model has.
    """

    selected: tuple[Choice, ...]
    skipped: tuple[Choice, ...] = ()
    considered: int = 0

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.selected)

    def rule(self, name: str) -> str:
        """The rule that selected ``name``; KeyError if it is not selected."""
        for c in self.selected:
            if c.name == name:
                return c.rule
        raise KeyError(f"{name!r} is not selected")

    def __len__(self) -> int:
        return len(self.selected)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def explain(self) -> str:
        """A table: each selected name and the rule that selected it, then what was left out and why.

        Example:
            >>> print(select_replicated(nn.Sequential(nn.LayerNorm(4))).explain())
            selected 2 of 2 parameters:
              0.bias    default pattern '*.bias'
              0.weight  parameter of a LayerNorm module
        """
        width = max((len(c.name) for c in self.selected + self.skipped), default=0)
        lines = [f"selected {len(self.selected)} of {self.considered} parameters:"]
        lines += [f"  {c.name:<{width}}  {c.rule}" for c in self.selected]
        if self.skipped:
            lines.append("left out although a rule matched:")
            lines += [f"  {c.name:<{width}}  {c.rule}" for c in self.skipped]
        return "\n".join(lines)


def _tp_mesh_dim(dt: Any, mesh_dim: int | str | None) -> tuple[int, str]:
    """Index and label of the TP mesh axis of a DTensor's mesh; ReplicaError when it is ambiguous."""
    mesh = dt.device_mesh
    names = tuple(mesh.mesh_dim_names or ())
    if mesh_dim is None:
        if mesh.ndim == 1:
            return 0, repr(names[0]) if names else "0"
        if "tp" in names:
            return names.index("tp"), "'tp'"
        raise ReplicaError(
            f"a {mesh.ndim}-D device mesh with dims {names or tuple(range(mesh.ndim))} "
            "has no mesh axis named 'tp'; pass mesh_dim= (the TP mesh axis's name or index)"
        )
    if isinstance(mesh_dim, str):
        if mesh_dim not in names:
            raise ReplicaError(
                f"mesh_dim={mesh_dim!r} is not a dim of the device mesh (dims: "
                f"{names or 'unnamed'}); pass one of them or an index"
            )
        return names.index(mesh_dim), repr(mesh_dim)
    if not 0 <= mesh_dim < mesh.ndim:
        raise ReplicaError(f"mesh_dim={mesh_dim} is outside the {mesh.ndim}-D device mesh")
    return mesh_dim, str(mesh_dim)


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "placements")


def tp_sharding(param: torch.Tensor, mesh_dim: int | str | None = None) -> str | None:
    """Why ``param`` counts as sharded on TP, or None when it is not.

    Example:
        >>> p = nn.Parameter(torch.zeros(3)); p.is_distributed = True
        >>> tp_sharding(p)
        'marked is_distributed=True'
    """
    if _is_dtensor(param):
        dim, label = _tp_mesh_dim(param, mesh_dim)
        placement = param.placements[dim]  # type: ignore[attr-defined]
        return None if placement.is_replicate() else f"DTensor {placement!r} on mesh dim {label}"
    for attr in ("is_distributed", "tensor_model_parallel"):
        if getattr(param, attr, False) is True:
            return f"marked {attr}=True"
    return None


def _compile(patterns: Sequence[str], what: str, errors: list[str]) -> list[tuple[str, Callable]]:
    out: list[tuple[str, Callable]] = []
    for pat in patterns:
        if not isinstance(pat, str) or not pat:
            errors.append(f"{what} pattern {pat!r} is not a non-empty string")
        elif pat.startswith("re:"):
            try:
                rx = re.compile(pat[3:])
            except re.error as exc:
                errors.append(f"{what} pattern {pat!r} is not a valid regex: {exc}")
                continue
            out.append((pat, lambda n, rx=rx: rx.fullmatch(n) is not None))
        else:
            out.append((pat, lambda n, p=pat: fnmatch.fnmatchcase(n, p)))
    return out


def _as_patterns(value: Sequence[str] | str | None, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, Sequence):
        raise ReplicaError(f"{what}= takes a sequence of patterns, got {type(value).__name__}")
    return tuple(value)


def _norm_modules(model: nn.Module) -> dict[str, str]:
    """Parameter name -> class name, for the parameters held directly by normalization modules."""
    found: dict[str, str] = {}
    for mod_name, module in model.named_modules():
        if type(module).__name__.endswith("Norm"):
            for pname, _ in module.named_parameters(recurse=False):
                found[f"{mod_name}.{pname}" if mod_name else pname] = type(module).__name__
    return found


def _first_rule(
    name: str,
    param: torch.Tensor,
    includes: list[tuple[str, Callable]],
    norms: dict[str, str],
    by_placement: bool,
    attribute: str | None,
    predicate: Callable | None,
    mesh_dim: int | str | None,
    hits: dict[str, int],
    fallback: str | None,
) -> str | None:
    rule = None
    for pat, match in includes:
        if match(name):
            hits[pat] += 1
            if rule is None:
                rule = f"default pattern {pat!r}" if pat in DEFAULT_INCLUDE else f"include {pat!r}"
    if rule is None and name in norms:
        rule = f"parameter of a {norms[name]} module"
    if rule is None and by_placement and _is_dtensor(param):
        dim, label = _tp_mesh_dim(param, mesh_dim)
        if param.placements[dim].is_replicate():  # type: ignore[attr-defined]
            rule = f"DTensor Replicate on mesh dim {label}"
    if rule is None and attribute is not None and getattr(param, attribute, False):
        rule = f"attribute {attribute}"
    if rule is None and predicate is not None and predicate(name, param):
        rule = "predicate"
    return rule if rule is not None else fallback


def _unsharded_rule(unsharded: bool | None, named: Sequence[tuple[str, torch.Tensor]]) -> str | None:
    """The rule that selects every parameter not sharded on TP, or None when it is off."""
    if unsharded is None:  # a DTensor model marks its shards: every other parameter is a replica
        return "not sharded (the model has DTensor parameters)" if any(_is_dtensor(p) for _, p in named) else None
    return "unsharded=True" if unsharded else None


def select_replicated(
    model: nn.Module,
    *,
    include: Sequence[str] | str | None = DEFAULT_INCLUDE,
    exclude: Sequence[str] | str | None = (),
    by_module: bool = True,
    by_placement: bool = True,
    attribute: str | None = None,
    predicate: Callable[[str, torch.Tensor], bool] | None = None,
    unsharded: bool | None = None,
    mesh_dim: int | str | None = None,
) -> Selection:
    """Select the parameters of ``model`` that are replicated across the tensor-parallel group.

    Args:
        model: the module; names are those of ``model.named_parameters()``.
        include: name patterns (glob, or a regex after ``re:``, matched against the whole name). The
            default, :data:`DEFAULT_INCLUDE`, covers Paddle's rules and common PyTorch names; extend
            it with ``include=(*DEFAULT_INCLUDE, "my.*")``. None or ``()`` selects by no name.
        exclude: name patterns that remove a parameter whatever else matched.
        by_module: select the parameters of normalization modules (any class whose name ends in
            ``Norm``: LayerNorm, RMSNorm, GroupNorm, LlamaRMSNorm...), whatever their names.
        by_placement: select DTensors whose placement on the TP mesh dim is ``Replicate``.
        attribute: select parameters with this attribute set truthy (e.g. Megatron's
            ``"sequence_parallel"``).
        predicate: select parameters for which ``predicate(name, param)`` is true.
        unsharded: select every parameter that is not sharded on TP. None (the default): when the
            model has DTensor parameters, whose placements say what is sharded, so that a plain
            parameter (a module left out of ``parallelize_module``, like an ``lm_head``) or a
            ``Replicate`` DTensor is a replica.
        mesh_dim: the TP mesh axis of multi-dim device meshes (name or index); by default the only axis of
            a 1-D mesh, else the dim named ``"tp"``.

    Returns:
        a :class:`Selection`, sorted by name.

    Raises:
        ReplicaError: an include pattern given by the caller matches no parameter (or only sharded
            ones), a pattern is malformed, or the TP mesh dim cannot be found. All offenders at once.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        >>> select_replicated(model).names
        ('0.bias', '1.bias', '1.weight')
    """
    if not isinstance(model, nn.Module):
        raise ReplicaError(
            f"model must be a torch.nn.Module, got {type(model).__name__}; pass the model "
            "whose replicated parameters to select"
        )
    if predicate is not None and not callable(predicate):
        raise ReplicaError(f"predicate must be callable(name, param) -> bool, got {predicate!r}")
    if unsharded not in (None, True, False):
        raise ReplicaError(f"unsharded must be True, False or None (automatic), got {unsharded!r}")
    errors: list[str] = []
    includes = _compile(_as_patterns(include, "include"), "include", errors)
    excludes = _compile(_as_patterns(exclude, "exclude"), "exclude", errors)
    if errors:
        raise ReplicaError("; ".join(errors))
    hits = {pat: 0 for pat, _ in includes}
    sharded_hits = {pat: 0 for pat, _ in includes}
    selected: list[Choice] = []
    skipped: list[Choice] = []
    named = list(model.named_parameters())
    norms = _norm_modules(model) if by_module else {}
    fallback = _unsharded_rule(unsharded, named)
    for name, param in named:
        try:
            rule = _first_rule(
                name, param, includes, norms, by_placement, attribute, predicate, mesh_dim, hits, fallback
            )
            sharded = tp_sharding(param, mesh_dim) if rule is not None else None
        except ReplicaError as exc:
            errors.append(f"{name!r}: {exc}")
            continue
        if rule is None:
            continue
        dropped = next((pat for pat, match in excludes if match(name)), None)
        if sharded is not None:
            skipped.append(Choice(name, f"sharded on TP ({sharded})"))
            for pat, match in includes:
                sharded_hits[pat] += bool(match(name))
        elif dropped is not None:
            skipped.append(Choice(name, f"excluded by {dropped!r}"))
        else:
            selected.append(Choice(name, rule))
    for pat, _ in includes:
        if pat in DEFAULT_INCLUDE or hits[pat] > sharded_hits[pat]:
            continue
        why = f"matches only parameters sharded on TP ({sharded_hits[pat]})" if hits[pat] else "matches no parameter"
        errors.append(
            f"include pattern {pat!r} {why}; fix the pattern (names look like {[n for n, _ in named[:3]]}) or drop it"
        )
    if errors:
        raise ReplicaError("cannot select replicated parameters:\n  " + "\n  ".join(errors))
    for pat, match in excludes:
        if not any(match(n) for n, _ in named):
            log.warning("exclude pattern %r matches no parameter", pat)
    log.debug("selected %d of %d parameters as TP replicas", len(selected), len(named))
    return Selection(
        tuple(sorted(selected, key=lambda c: c.name)), tuple(sorted(skipped, key=lambda c: c.name)), len(named)
    )


def resolve_selector(model: nn.Module, selector: SelectorLike, mesh_dim: int | str | None = None) -> Selection:
    """Turn a ``selector=`` argument into a :class:`Selection` of ``model``'s parameters.

    Raises:
        ReplicaError: a Selection names parameters the model does not have.
    """
    if selector is None:
        return select_replicated(model, mesh_dim=mesh_dim)
    if isinstance(selector, Selection):
        have = {n for n, _ in model.named_parameters()}
        missing = [n for n in selector.names if n not in have]
        if missing:
            raise ReplicaError(
                f"the selection names parameters the model does not have: {missing}; "
                "build it with select_replicated(model) on this model"
            )
        return selector
    if callable(selector):
        return select_replicated(
            model,
            include=(),
            by_module=False,
            by_placement=False,
            predicate=selector,
            unsharded=False,
            mesh_dim=mesh_dim,
        )
    raise ReplicaError(
        f"selector= takes a Selection (from select_replicated), a predicate "
        f"(name, param) -> bool, or None; got {type(selector).__name__}"
    )
