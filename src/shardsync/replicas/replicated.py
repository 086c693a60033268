"""The tensors behind each selected parameter, and the cross-rank checks that they agree.

A :class:`ReplicatedParam` is one selected parameter with its fp32 master copy (if any) and its *owner*: the
tensor the optimizer steps (the master when the optimizer holds the master, else the parameter).
Grads and optimizer states (``optimizer.state[owner][key]``) belong to the owner.

Tensors are looked up each time they are needed (grads and states are replaced during training), as
local tensors (a DTensor's local shard). Each (name, kind) pair is an *entry*; every rank describes
its entries (shape, dtype, device type, present, requires_grad) and :func:`check_same` and
:func:`check_requires_grad` compare them across ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Union

import torch
from torch import nn

from ..errors import LayoutError, ReplicaError
from ..layout import dtype_name

__all__ = [
    "ReplicatedParam",
    "Entry",
    "MasterParams",
    "TENSOR_KINDS",
    "resolve_replicated",
    "local",
    "get_tensor",
    "set_grad",
    "describe",
    "owner_entries",
    "layout_entries",
    "check_same",
    "check_requires_grad",
    "kind_order",
]

log = logging.getLogger(__name__)

#: Kinds that are not optimizer states; any other kind names a key of ``optimizer.state[owner]``.
TENSOR_KINDS = ("param", "master", "grad")

#: ``master_params=``: ``{param or name: master}``, ``callable(param) -> master | None``, None for
#: no masters, or ``"auto"``: ``optimizer._master_weights`` when the optimizer has one (Paddle's
#: convention, keyed by parameter or name), else no masters.
MasterParams = Union[
    Mapping[Any, torch.Tensor], Callable[[torch.Tensor], Union[torch.Tensor, None]], Literal["auto"], None
]


class Entry(NamedTuple):
    """What a rank says about one tensor (compared across ranks, so plain picklable data).

    ``kind`` is ``param``, ``master``, ``grad``, an optimizer state key, or ``stepped``: then
    ``dtype`` says which tensor the optimizer steps (``"param"`` or ``"master"``).
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    present: bool
    requires_grad: bool = False


@dataclass(frozen=True, slots=True, eq=False)
class ReplicatedParam:
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
        return lambda name, p: master_params(p)
    raise ReplicaError(
        f"master_params= takes a mapping {{param or name: master}}, a callable "
        f"param -> master | None, 'auto' or None; got {type(master_params).__name__}"
    )


def _check_master(name: str, param: torch.Tensor, master: Any) -> str | None:
    if not isinstance(master, torch.Tensor):
        return f"{name!r}: master is a {type(master).__name__}, not a tensor"
    if master is param:
        return f"{name!r}: the master is the parameter itself; give a separate fp32 copy or None"
    if tuple(local(master).shape) != tuple(local(param).shape):
        return (
            f"{name!r}: master shape {list(local(master).shape)} differs from the parameter's "
            f"{list(local(param).shape)}"
        )
    if not master.is_floating_point():
        return f"{name!r}: master dtype {master.dtype} is not a floating dtype"
    return None


def resolve_replicated(
    model: nn.Module, names: Sequence[str], optimizer: Any, master_params: MasterParams
) -> list[ReplicatedParam]:
    """The selected ``names`` with their masters and owners, sorted by name.

    Raises:
        ReplicaError: a parameter or master is on the meta device (it has no data to sync or
            compare), or a master does not fit its parameter (every offender listed).
    """
    params = dict(model.named_parameters())
    lookup = _master_lookup(master_params, optimizer)
    held = {id(p) for g in optimizer.param_groups for p in g["params"]} if optimizer is not None else set()
    replicated, errors, meta = [], [], []
    for name in sorted(names):
        param = params[name]
        master = lookup(name, param)
        if any(t is not None and local(t).is_meta for t in (param, master)):
            meta.append(name)
            continue
        if master is not None:
            problem = _check_master(name, param, master)
            if problem:
                errors.append(problem)
                continue
        owner = master if master is not None and id(master) in held else param
        replicated.append(ReplicatedParam(name, param, master, owner))
    if meta:
        raise ReplicaError(
            f"{len(meta)} selected parameter(s) or their masters are on the meta device, "
            f"with no data to sync or compare: {', '.join(meta[:8])}"
            f"{' ...' if len(meta) > 8 else ''}; materialise the model first "
            "(model.to_empty(device=...), then initialise or load it), or leave them "
            "out with the selector"
        )
    if errors:
        raise ReplicaError("master_params do not fit their parameters:\n  " + "\n  ".join(errors))
    return replicated


def kind_order(kinds: Sequence[str]) -> dict[str, int]:
    """Rank-stable order of kinds: param, master, grad, then states in the order given."""
    order = {k: i for i, k in enumerate(TENSOR_KINDS)}
    for k in kinds:
        order.setdefault(k, len(order))
    return order


def get_tensor(rp: ReplicatedParam, kind: str, optimizer: Any) -> torch.Tensor | None:
    """The local tensor of one kind (``param``, ``master``, ``grad`` or a state key), or None."""
    if kind == "param":
        return local(rp.param)
    if kind == "master":
        return None if rp.master is None else local(rp.master)
    if kind == "grad":
        grad = rp.owner.grad
        return None if grad is None else local(grad)
    if optimizer is None:
        return None
    value = optimizer.state.get(rp.owner, {}).get(kind)
    return local(value) if isinstance(value, torch.Tensor) else None


def set_grad(rp: ReplicatedParam, value: torch.Tensor | None) -> None:
    """Give the owner a grad equal to ``value`` (a new tensor), or drop its grad (None)."""
    owner = rp.owner
    if value is None:
        owner.grad = None
        return
    new = value.detach().to(owner.dtype).reshape(local(owner).shape).clone()
    if type(owner).__name__ == "DTensor":
        from torch.distributed.tensor import DTensor  # local: only DTensor users pay the import

        new = DTensor.from_local(
            new,
            owner.device_mesh,  # type: ignore[attr-defined]
            owner.placements,  # type: ignore[attr-defined]
            run_check=False,
        )
    owner.grad = new


def describe(replicated: Sequence[ReplicatedParam], kinds: Sequence[str], optimizer: Any) -> list[Entry]:
    """This rank's entries for ``kinds`` of every replicated parameter, in rank-stable order."""
    order = kind_order(kinds)
    entries: list[Entry] = []
    for rp in replicated:
        for kind in sorted(kinds, key=order.__getitem__):
            t = get_tensor(rp, kind, optimizer)
            trainable = kind == "param" and rp.param.requires_grad
            if t is None:
                ref = local(rp.owner if kind not in ("param", "master") else rp.param)
                entries.append(Entry(rp.name, kind, tuple(ref.shape), "-", ref.device.type, False))
            else:
                entries.append(
                    Entry(rp.name, kind, tuple(t.shape), dtype_name(t.dtype), t.device.type, True, trainable)
                )
    return entries


def owner_entries(replicated: Sequence[ReplicatedParam]) -> list[Entry]:
    """Which tensor the optimizer steps (and whose grad and states sync), per replicated parameter."""
    return [
        Entry(rp.name, "stepped", (), "master" if rp.owner is rp.master else "param", "-", True) for rp in replicated
    ]


def layout_entries(replicated: Sequence[ReplicatedParam], optimizer: Any) -> list[Entry]:
    """What the ranks must agree on before syncing: each param and master, and what is stepped."""
    return describe(replicated, ("param", "master"), optimizer) + owner_entries(replicated)


def _fmt(e: Entry | None) -> str:
    if e is None:
        return "absent"
    if e.kind == "stepped":
        return f"the optimizer steps the {e.dtype}"
    if not e.present:
        return "absent"
    return f"shape {list(e.shape)} {e.dtype} on {e.device}"


def _shown(problems: list[str]) -> str:
    more = [f"... and {len(problems) - 20} more"] if len(problems) > 20 else []
    return "\n  ".join(problems[:20] + more)


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
    tables = [{(e.name, e.kind): e for e in entries} for entries in per_rank]
    names = [{e.name for e in entries} for entries in per_rank]
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
        facts = {_fmt(e) for e in seen if presence or e is None or e.present}
        if len(facts) > 1:
            by_rank = ", ".join(f"rank {r}: {_fmt(e)}" for r, e in enumerate(seen))
            problems.append(f"{key[0]} ({key[1]}): {by_rank}")
    if problems:
        raise LayoutError(
            f"{phase}: the ranks disagree on {len(problems)} replicated tensor(s):\n  "
            + _shown(problems)
            + "\nEvery rank of the group must select the same "
            "parameters with the same shapes and dtypes; check the selector, the "
            "model and master_params on each rank."
        )


def check_requires_grad(phase: str, per_rank: Sequence[Sequence[Entry]]) -> None:
    """Raise the same ReplicaError on every rank when a parameter is frozen on some ranks only.

    A replica frozen on some ranks would be changed there anyway: a synced grad is created for it
    (so the optimizer steps it), and mean or broadcast overwrite it with the other ranks' values.
    Call it after :func:`check_same` (every rank then has the same names).

    Raises:
        ReplicaError: names each such parameter and the ranks on each side.

    Example:
        >>> e = Entry("ln.weight", "param", (17,), "float32", "cpu", True, True)
        >>> check_requires_grad("preflight", [[e], [e._replace(requires_grad=False)]])
        Traceback (most recent call last):
        ...
        shardsync.errors.ReplicaError: preflight: requires_grad differs across the ranks ...
    """
    flags: dict[str, list[bool]] = {}
    for entries in per_rank:
        for e in entries:
            if e.kind == "param":
                flags.setdefault(e.name, []).append(e.requires_grad)
    problems = [
        f"{name}: requires_grad=True on rank(s) {[r for r, f in enumerate(seen) if f]}, "
        f"False on rank(s) {[r for r, f in enumerate(seen) if not f]}"
        for name, seen in sorted(flags.items())
        if len(set(seen)) > 1
    ]
    if problems:
        raise ReplicaError(
            f"{phase}: requires_grad differs across the ranks for {len(problems)} "
            f"replicated parameter(s):\n  {_shown(problems)}\nA replica frozen on "
            "some ranks only would be updated there by the sync; freeze it on every "
            "rank, or leave it out of the selection (exclude=...)."
        )
