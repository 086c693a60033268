"""The tensors behind each selected parameter, and the cross-rank check that they agree.

A :class:`Target` is one selected parameter with its fp32 master copy (if any) and its *owner*: the
tensor the optimizer steps (the master when the optimizer holds the master, else the parameter).
Grads and optimizer states (``optimizer.state[owner][key]``) belong to the owner.

Tensors are looked up each time they are needed (grads and states are replaced during training), as
local tensors (a DTensor's local shard). Each (name, kind) pair is an *entry*; every rank describes
its entries (shape, dtype, device type, present) and :func:`check_same` compares them across ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

import torch
from torch import nn

from ..errors import LayoutError, ReplicaError
from ..layout import dtype_name

__all__ = ["Target", "Entry", "MasterParams", "TENSOR_KINDS", "resolve_targets", "local", "get_tensor",
           "set_grad", "describe", "check_same", "kind_order"]

log = logging.getLogger(__name__)

#: Kinds that are not optimizer states; any other kind names a key of ``optimizer.state[owner]``.
TENSOR_KINDS = ("param", "master", "grad")

#: ``master_params=``: ``{param or name: master}``, ``callable(param) -> master | None``, None for
#: no masters, or ``"auto"``: ``optimizer._master_weights`` when the optimizer has one (Paddle's
#: convention, keyed by parameter or name), else no masters.
MasterParams = Union[Mapping[Any, torch.Tensor], Callable[[torch.Tensor], Union[torch.Tensor, None]],
                     Literal["auto"], None]

#: (name, kind, shape, dtype name, device type, present) - what a rank says about one tensor.
Entry = tuple[str, str, tuple[int, ...], str, str, bool]


@dataclass(frozen=True, slots=True, eq=False)
class Target:
    """One selected parameter, its fp32 master (or None) and the tensor the optimizer steps."""

    name: str
    param: torch.Tensor
    master: torch.Tensor | None
    owner: torch.Tensor


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor behind ``t`` (a DTensor's local shard, which aliases its storage)."""
    if type(t).__name__ == "DTensor":
        with torch.no_grad():
            return t.to_local()  # type: ignore[attr-defined]
    return t


def _master_lookup(master_params: MasterParams, optimizer: Any) -> Callable[[str, torch.Tensor], Any]:
    if master_params == "auto":
        master_params = getattr(optimizer, "_master_weights", None)
        if not isinstance(master_params, Mapping):
            return lambda name, p: None
    if master_params is None:
        return lambda name, p: None
    if isinstance(master_params, Mapping):
        table = master_params

        def lookup(name: str, p: torch.Tensor) -> Any:
            # tensors hash by identity; Paddle keys _master_weights by the parameter's own name
            for key in (p, name, getattr(p, "name", None)):
                if key is not None and key in table:
                    return table[key]
            return None
        return lookup
    if callable(master_params):
        return lambda name, p: master_params(p)  # type: ignore[operator]
    raise ReplicaError(f"master_params= takes a mapping {{param or name: master}}, a callable "
                       f"param -> master | None, 'auto' or None; got {type(master_params).__name__}")


def _check_master(name: str, param: torch.Tensor, master: Any) -> str | None:
    if not isinstance(master, torch.Tensor):
        return f"{name!r}: master is a {type(master).__name__}, not a tensor"
    if master is param:
        return f"{name!r}: the master is the parameter itself; give a separate fp32 copy or None"
    if tuple(local(master).shape) != tuple(local(param).shape):
        return (f"{name!r}: master shape {list(local(master).shape)} differs from the parameter's "
                f"{list(local(param).shape)}")
    if not master.is_floating_point():
        return f"{name!r}: master dtype {master.dtype} is not a floating dtype"
    return None


def resolve_targets(model: nn.Module, names: Sequence[str], optimizer: Any,
                    master_params: MasterParams) -> list[Target]:
    """The targets of the selected ``names``, sorted by name.

    Raises:
        ReplicaError: a master does not fit its parameter (every offender listed).
    """
    params = dict(model.named_parameters())
    lookup = _master_lookup(master_params, optimizer)
    held = {id(p) for g in optimizer.param_groups for p in g["params"]} if optimizer is not None else set()
    targets, errors = [], []
    for name in sorted(names):
        param = params[name]
        master = lookup(name, param)
        if master is not None:
            problem = _check_master(name, param, master)
            if problem:
                errors.append(problem)
                continue
        owner = master if master is not None and id(master) in held else param
        targets.append(Target(name, param, master, owner))
    if errors:
        raise ReplicaError("master_params do not fit their parameters:\n  " + "\n  ".join(errors))
    return targets


def kind_order(kinds: Sequence[str]) -> dict[str, int]:
    """Rank-stable order of kinds: param, master, grad, then states in the order given."""
    order = {k: i for i, k in enumerate(TENSOR_KINDS)}
    for k in kinds:
        order.setdefault(k, len(order))
    return order


def get_tensor(target: Target, kind: str, optimizer: Any) -> torch.Tensor | None:
    """The local tensor of one kind (``param``, ``master``, ``grad`` or a state key), or None."""
    if kind == "param":
        return local(target.param)
    if kind == "master":
        return None if target.master is None else local(target.master)
    if kind == "grad":
        grad = target.owner.grad
        return None if grad is None else local(grad)
    if optimizer is None:
        return None
    value = optimizer.state.get(target.owner, {}).get(kind)
    return local(value) if isinstance(value, torch.Tensor) else None


def set_grad(target: Target, value: torch.Tensor | None) -> None:
    """Give the owner a grad equal to ``value`` (a new tensor), or drop its grad (None)."""
    owner = target.owner
    if value is None:
        owner.grad = None
        return
    new = value.detach().to(owner.dtype).reshape(local(owner).shape).clone()
    if type(owner).__name__ == "DTensor":
        from torch.distributed.tensor import DTensor  # local: only DTensor users pay the import

        new = DTensor.from_local(new, owner.device_mesh, owner.placements,  # type: ignore[attr-defined]
                                 run_check=False)
    owner.grad = new


def describe(targets: Sequence[Target], kinds: Sequence[str], optimizer: Any) -> list[Entry]:
    """This rank's entries for ``kinds`` of every target, in rank-stable order."""
    order = kind_order(kinds)
    entries: list[Entry] = []
    for target in targets:
        for kind in sorted(kinds, key=order.__getitem__):
            t = get_tensor(target, kind, optimizer)
            if t is None:
                ref = local(target.owner if kind not in ("param", "master") else target.param)
                entries.append((target.name, kind, tuple(ref.shape), "-", ref.device.type, False))
            else:
                entries.append((target.name, kind, tuple(t.shape), dtype_name(t.dtype), t.device.type,
                                True))
    return entries


def _fmt(e: Entry | None) -> str:
    if e is None:
        return "absent"
    if e[1] == "stepped":
        return f"the optimizer steps the {e[3]}"
    if not e[5]:
        return "absent"
    return f"shape {list(e[2])} {e[3]} on {e[4]}"


def check_same(phase: str, per_rank: Sequence[Sequence[Entry]], *, presence: bool = True) -> None:
    """Raise the same LayoutError on every rank when the ranks' entries differ.

    Args:
        phase: what is being checked, for the message.
        per_rank: every rank's entries (from ``agree``), identical on all ranks.
        presence: also require each tensor to be present on all ranks or on none (else only the
            ranks where it is present are compared).

    Raises:
        LayoutError: names each parameter selected on some ranks only, and each differing
            (name, kind) with what every rank has.
    """
    tables = [{(e[0], e[1]): e for e in entries} for entries in per_rank]
    names = [{e[0] for e in entries} for entries in per_rank]
    problems = []
    for name in sorted(set().union(*names)):
        missing = [r for r, have in enumerate(names) if name not in have]
        if missing:
            have = [r for r in range(len(names)) if r not in missing]
            problems.append(f"{name}: selected on rank(s) {have}, not on rank(s) {missing}")
    keys = sorted(set().union(*tables), key=lambda k: (k[0], k[1]))
    for key in keys:
        seen = [t.get(key) for t in tables]
        if any(key[0] not in have for have in names):
            continue  # reported above, once per name
        facts = {_fmt(e) for e in seen if presence or e is None or e[5]}
        if len(facts) > 1:
            by_rank = ", ".join(f"rank {r}: {_fmt(e)}" for r, e in enumerate(seen))
            problems.append(f"{key[0]} ({key[1]}): {by_rank}")
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise LayoutError(f"{phase}: the ranks disagree on {len(problems)} replicated tensor(s):\n  "
                          + "\n  ".join(shown) + "\nEvery rank of the group must select the same "
                          "parameters with the same shapes and dtypes; check the selector, the "
                          "model and master_params on each rank.")
