"""Checks that run before anything moves: the group (a process group or a device mesh), the
arguments of :class:`~shardsync.replicas.ReplicaSync`, and what the optimizer holds.

Everything here is local but :func:`check_signatures` (one small collective at every sync: do the
ranks' optimizers step the same parameter groups); the cross-rank comparison of what each rank
selected is in :mod:`~shardsync.replicas.replicated` (``check_same``, ``check_requires_grad``).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh  # imported by torch.distributed anyway

from .. import phases
from ..dist import agree, data_phase, is_distributed, wait_for
from ..errors import FormatError, ReplicaError
from ..exec import run_device
from ..roll_call import transport_errors
from ..sizes import parse_size

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "GroupLike",
    "SyncMode",
    "GradMode",
    "DEFAULT_STATES",
    "resolve_group",
    "validate_sync_args",
    "optimizer_signature",
    "check_signatures",
    "SIGNATURE_PHASE",
]

#: The phase of :func:`check_signatures`, as errors name it.
SIGNATURE_PHASE = phases.SYNC_SIGNATURE

#: What replica APIs take as ``group=``: a process group, a device mesh (1-D, or multi-dim with the
#: TP mesh axis given by ``mesh_dim``), or None for the default group.
GroupLike = Union["ProcessGroup", DeviceMesh, None]
SyncMode = Literal["broadcast", "mean"]
GradMode = Literal["mean", "sum", "broadcast"]
DEFAULT_STATES: tuple[str, ...] = ("exp_avg", "exp_avg_sq")


def _mesh_group(mesh: DeviceMesh, mesh_dim: int | str | None) -> ProcessGroup:
    """The process group of ``mesh``'s TP mesh axis: its only axis, ``mesh_dim``, or the axis named "tp"."""
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh_dim is None and "tp" in names:
        mesh_dim = "tp"
    if isinstance(mesh_dim, str) and mesh_dim in names:
        return mesh.get_group(mesh_dim)
    if isinstance(mesh_dim, int) and not isinstance(mesh_dim, bool) and 0 <= mesh_dim < mesh.ndim:
        return mesh.get_group(mesh_dim)
    raise ReplicaError(
        f"group= is a {mesh.ndim}-D device mesh with dims {names or tuple(range(mesh.ndim))}"
        f" and mesh_dim={mesh_dim!r} names none of them; pass the TP mesh axis as mesh_dim= "
        "(a name or an index), or the 1-D mesh of the TP mesh axis (mesh['tp'])"
    )


def resolve_group(group: GroupLike, mesh_dim: int | str | None = None) -> ProcessGroup | None:
    """The process group behind ``group``; ReplicaError when it cannot be used from this process.

    Args:
        group: a process group, a 1-D device mesh, a multi-dim device mesh (its TP mesh axis is
            ``mesh_dim``, by default the dim named ``"tp"``), or None for the default group.
        mesh_dim: the TP mesh axis of a multi-dim mesh (name or index).

    Returns:
        the process group (None stays None: the default group).

    Raises:
        ReplicaError: no TP mesh axis in a multi-dim mesh, torch.distributed not initialized while a group
            was given, or this process not a member of the group.

    Example:
        >>> resolve_group(None) is None
        True
    """
    pg = _mesh_group(group, mesh_dim) if isinstance(group, DeviceMesh) else group
    if pg is not None and not (dist.is_available() and dist.is_initialized()):
        raise ReplicaError(
            "a group was given but torch.distributed is not initialized; call "
            "init_process_group first, or pass group=None for a single process"
        )
    if pg is not None and dist.get_rank(pg) < 0:
        raise ReplicaError(
            "this process is not a member of the given group; build ReplicaSync only on the group's ranks"
        )
    return pg


def validate_sync_args(
    params: Any, grads: Any, states_mode: Any, states: Any, src: Any, world: int, interval: Any, bucket_bytes: Any
) -> None:
    """Check :class:`~shardsync.replicas.ReplicaSync`'s arguments; every problem in one error.

    Raises:
        ReplicaError: each bad argument with the values it takes.

    Example:
        >>> validate_sync_args("broadcast", None, None, DEFAULT_STATES, 0, 2, 1, 1 << 20)
    """
    problems = []
    if params not in ("broadcast", "mean", None):
        problems.append(f"params={params!r}: use 'broadcast', 'mean' or None")
    if grads not in (None, "mean", "sum", "broadcast"):
        problems.append(f"grads={grads!r}: use None, 'mean', 'sum' or 'broadcast'")
    if states_mode not in ("broadcast", "mean", None):
        problems.append(f"states_mode={states_mode!r}: use 'broadcast', 'mean' or None (as params)")
    if isinstance(states, str) or not all(isinstance(k, str) for k in states):
        problems.append(f"optimizer_states={states!r}: use a tuple of state keys like {DEFAULT_STATES}")
    elif {"param", "master", "grad"} & set(states):
        problems.append(f"optimizer_states={states!r} names a non-state kind")
    if not isinstance(src, int) or not 0 <= src < world:
        problems.append(f"src={src!r}: must be a rank of the group, 0..{world - 1}")
    if not isinstance(interval, int) or interval < 1:
        problems.append(f"interval={interval!r}: must be an int >= 1")
    elif grads == "sum" and interval != 1:
        problems.append(
            f"grads='sum' with interval={interval}: partial grads must be summed on "
            "every step; use interval=1 (or grads='mean' for a periodic safety net)"
        )
    if isinstance(bucket_bytes, str):  # a size such as "4MiB", read as every size argument is
        try:
            parse_size(bucket_bytes, "bucket_bytes")
        except FormatError as exc:
            problems.append(str(exc))
    elif not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        problems.append(f"bucket_bytes={bucket_bytes!r}: must be an int >= 1 or a size such as '4MiB'")
    if problems:
        raise ReplicaError("invalid ReplicaSync arguments:\n  " + "\n  ".join(problems))


def optimizer_signature(optimizer: torch.optim.Optimizer | None) -> tuple[Any, ...]:
    """What decides which tensors the optimizer steps: parameters per group, and the size of
    ``optimizer._master_weights`` (Paddle's masters, often created at the first step).

    Cheap enough for every step (no tensor is touched); a change means masters or parameters were
    added, so the ranks must agree again on what is synced.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.zeros(3, requires_grad=True)])
        >>> optimizer_signature(opt)
        ((1,), None)
    """
    if optimizer is None:
        return ()
    masters = getattr(optimizer, "_master_weights", None)
    return (
        tuple(len(g["params"]) for g in optimizer.param_groups),
        len(masters) if isinstance(masters, Mapping) else None,
    )


def check_signatures(signature: tuple[Any, ...], group: ProcessGroup | None) -> None:
    """Check that every rank's optimizer has ``signature`` (see :func:`optimizer_signature`): one
    ``all_reduce`` of two integers (max of a digest and of its negation); on a mismatch the ranks
    gather their signatures and every rank raises the same error. A no-op in one process.

    Without it, a rank that added a parameter group alone would agree again on what is synced
    while the others ran their bucket collectives: both would wait out the timeout.

    Raises:
        ReplicaError: the ranks' optimizers step different parameter groups (on every rank).
        DistributedError: a peer failed or died during the check.

    Example:
        >>> check_signatures(((2, 1), None), None)   # a plain process: nothing to compare
    """
    if not is_distributed(group):
        return
    code = zlib.crc32(repr(signature).encode())
    both = torch.tensor([code, -code], dtype=torch.int64, device=run_device(dist.get_backend(group), None))
    with data_phase(SIGNATURE_PHASE, group) as roll, transport_errors():
        wait_for(dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group, async_op=True), roll)
    if (int(both[0]), -int(both[1])) == (code, code):
        return
    per_rank = agree(SIGNATURE_PHASE, lambda: signature, group).all
    shown = "; ".join(f"rank {r}: {_signature_text(s)}" for r, s in enumerate(per_rank))
    raise ReplicaError(
        f"the ranks' optimizers step different parameters ({shown}): a parameter group "
        "(or a master) was added on some ranks only; every rank must call "
        "add_param_group with the same parameters at the same step"
    )


def _signature_text(signature: tuple[Any, ...]) -> str:
    if not signature:
        return "no optimizer"
    sizes, masters = signature
    text = f"{len(sizes)} param group(s) of {list(sizes)} params"
    return text if masters is None else f"{text}, {masters} master(s)"
