"""LocalShard: this rank's piece of a global tensor, and helpers to make and read them.

``ShardedTensor``, its name before, still works (a DeprecationWarning): torch has a class of that
name (``torch.distributed._shard.ShardedTensor``, a tensor of all ranks' shards), which this is not.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Union

import torch

from ..errors import LayoutError
from .box import Box
from .dtypes import dtype_name
from .meta import LayoutEntry
from .placements import Split, shard_boxes

__all__ = ["LocalShard", "StateValue", "shard_dim", "from_dtensor", "dtensor_shards", "local_shards", "local_layout"]


class LocalShard:
    """This rank's shard of a global tensor (called ``ShardedTensor`` before: a deprecated alias).

    Args:
        local: the shard's data.
        global_shape: shape of the whole tensor.
        global_offset: where the shard starts in every dim.
        key: used in error messages only.

    Raises:
        LayoutError: rank counts differ, or the shard does not fit in the global shape.

    Example:
        >>> t = LocalShard(torch.zeros(2, 3), (4, 3), (2, 0))
        >>> t.box
        Box(offsets=(2, 0), sizes=(2, 3))
    """

    __slots__ = ("local", "global_shape", "global_offset", "_box")

    def __init__(
        self, local: torch.Tensor, global_shape: Sequence[int], global_offset: Sequence[int], *, key: str = "<tensor>"
    ) -> None:
        global_shape = tuple(int(s) for s in global_shape)
        global_offset = tuple(int(o) for o in global_offset)
        if not (local.dim() == len(global_shape) == len(global_offset)):
            raise LayoutError(
                f"{key!r}: local shape {list(local.shape)}, global shape "
                f"{list(global_shape)} and offset {list(global_offset)} need the same "
                "number of dims"
            )
        bad = [
            d for d in range(local.dim()) if global_offset[d] < 0 or global_offset[d] + local.shape[d] > global_shape[d]
        ]
        if bad:
            raise LayoutError(
                f"{key!r}: shard at offset {list(global_offset)} with local shape "
                f"{list(local.shape)} does not fit in global shape {list(global_shape)} "
                f"(dims {bad}); fix the offset or the global shape"
            )
        self.local = local
        self.global_shape = global_shape
        self.global_offset = global_offset
        self._box: Box | None = None

    @classmethod
    def whole(cls, tensor: torch.Tensor) -> LocalShard:
        """``tensor`` as the whole of a global tensor of its shape (nothing to check).

        Example:
            >>> LocalShard.whole(torch.zeros(2, 3)).box
            Box(offsets=(0, 0), sizes=(2, 3))
        """
        shard = cls.__new__(cls)
        shard.local, shard.global_shape = tensor, tuple(tensor.shape)
        shard.global_offset, shard._box = (0,) * tensor.dim(), None
        return shard

    @property
    def box(self) -> Box:
        """The shard's region in global coordinates (made once; again if ``local`` or the offset
        changed since)."""
        box = getattr(self, "_box", None)  # absent on a shard unpickled from an older shardsync
        if box is None or box.sizes != self.local.shape or box.offsets != self.global_offset:
            box = self._box = _box(tuple(map(int, self.global_offset)), tuple(self.local.shape))
        return box

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    def __repr__(self) -> str:
        return (
            f"LocalShard(local={list(self.local.shape)} {self.local.dtype}, "
            f"global_shape={list(self.global_shape)}, global_offset={list(self.global_offset)})"
        )


#: What a state dict may hold per key: a full tensor, one shard, or several shards of one tensor.
StateValue = Union[torch.Tensor, LocalShard, Sequence[LocalShard]]


def shard_dim(tensor: torch.Tensor, dim: int, rank: int, world: int) -> LocalShard:
    """Cut ``rank``'s shard of a full tensor along ``dim``, like ``torch.chunk``.

    Pieces are ``ceil(n / world)`` long; the last ranks get the smaller pieces (possibly empty).

    Example:
        >>> shard_dim(torch.arange(17.).reshape(17, 1), 0, 1, 2).local.shape
        torch.Size([8, 1])
    """
    if not 0 <= rank < world:
        raise LayoutError(f"shard_dim: rank {rank} is outside a world of size {world}; give 0 <= rank < world")
    dim = dim % tensor.dim()
    n = tensor.shape[dim]
    step = -(-n // world)
    start = min(rank * step, n)
    stop = min(start + step, n)
    offset = [0] * tensor.dim()
    offset[dim] = start
    return LocalShard(tensor.narrow(dim, start, stop - start), tensor.shape, offset)


def dtensor_shards(dt: Any, *, key: str = "<tensor>") -> list[LocalShard]:
    """This rank's region of a DTensor as ShardedTensors, each a view of ``dt.to_local()``.

    ``Shard`` and ``Replicate`` placements give one box; ``_StridedShard`` (FSDP2 ``fully_shard`` over
    tensor parallelism) may give several (see :mod:`shardsync.layout.placements`). Writes into the
    views land in the DTensor. ``key`` names it in error messages.

    Raises:
        TypeError: ``dt`` is not a DTensor.
        LayoutError: a ``Partial`` placement, or a local tensor whose shape is not what the
            placements say.
    """
    from torch.distributed.tensor import DTensor  # local: only DTensor users pay for the import
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    if not isinstance(dt, DTensor):
        raise TypeError(f"expected a DTensor, got {type(dt).__name__}")
    bad = [p for p in dt.placements if not isinstance(p, (Shard, _StridedShard, Replicate))]
    if bad:
        raise LayoutError(
            f"{key!r}: DTensor placement {bad[0]!r} is not supported; use Shard, "
            "_StridedShard or Replicate (redistribute partial tensors first)"
        )
    coordinate = dt.device_mesh.get_coordinate()
    local = dt.to_local()
    if coordinate is None:  # this rank is not in the mesh: it holds nothing
        return [LocalShard(local.new_empty((0,) * dt.dim()), tuple(dt.shape), tuple(dt.shape))]
    splits = [
        Split(p.dim, dt.device_mesh.size(m), coordinate[m], int(p.split_factor) if isinstance(p, _StridedShard) else 1)
        for m, p in enumerate(dt.placements)
        if isinstance(p, (Shard, _StridedShard))
    ]
    boxes = shard_boxes(tuple(dt.shape), splits)
    held = boxes[-1][1].stops  # the last box ends where the local tensor does
    if held != tuple(local.shape):
        raise LayoutError(
            f"{key!r}: DTensor {list(dt.shape)} with placements {list(dt.placements)}: the "
            f"local tensor is {list(local.shape)}, the placements give {list(held)}"
        )
    return [LocalShard(local[loc.slices()], tuple(dt.shape), glob.offsets, key=key) for glob, loc in boxes]


def from_dtensor(dt: Any) -> LocalShard:
    """This rank's shard of a DTensor as one LocalShard (see :func:`dtensor_shards`).

    Raises:
        LayoutError: the shard is several boxes (``_StridedShard``); use :func:`dtensor_shards`.
    """
    shards = dtensor_shards(dt)
    if len(shards) > 1:
        raise LayoutError(
            f"DTensor with placements {list(dt.placements)}: this rank holds "
            f"{len(shards)} boxes, not one; use dtensor_shards(dt) for the list"
        )
    return shards[0]


@functools.lru_cache(maxsize=4096)
def _box(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Box:
    """``Box(offsets, sizes)`` of Python ints, one object for equal arguments (a model's many shards
    of a few shapes)."""
    return Box(offsets, sizes)


def local_shards(key: str, value: StateValue) -> list[LocalShard]:
    """Normalise one state-dict value into the shards this rank holds.

    Raises:
        LayoutError: the key is not a string, the value is of an unsupported type, its shards
            disagree, or it is a meta tensor (no data to stream).

    Example:
        >>> local_shards(0, torch.zeros(2))
        Traceback (most recent call last):
        ...
        shardsync.errors.LayoutError: state key 0 (int) is not a string; state dict keys must be ...
    """
    if not isinstance(key, str):
        raise LayoutError(
            f"state key {key!r} ({type(key).__name__}) is not a string; state dict keys "
            "must be strings (as model.state_dict() makes them)"
        )
    shards = _normalise(key, value)
    if any(s.local.is_meta for s in shards):
        raise LayoutError(
            f"{key!r} is a meta tensor (a shape without data), so there is nothing to "
            "stream; materialise it first (e.g. model.to_empty(device='cpu'), then load "
            "the weights)"
        )
    return shards


def _normalise(key: str, value: StateValue) -> list[LocalShard]:
    if type(value).__name__ == "DTensor":
        return dtensor_shards(value, key=key)
    if isinstance(value, LocalShard):
        return [value]
    if isinstance(value, torch.Tensor):
        return [LocalShard.whole(value)]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, LocalShard) for v in value):
        shapes = {v.global_shape for v in value}
        dtypes = {v.dtype for v in value}
        if len(shapes) > 1 or len(dtypes) > 1:
            raise LayoutError(
                f"{key!r}: the shards held on this rank disagree on global shape or "
                f"dtype: {sorted(map(list, shapes))}, {sorted(map(str, dtypes))}"
            )
        return list(value)
    raise LayoutError(
        f"{key!r}: unsupported state value {type(value).__name__}; use a torch.Tensor, "
        "a LocalShard, a DTensor, or a list of LocalShard"
    )


def local_layout(state: Mapping[str, StateValue]) -> list[LayoutEntry]:
    """This rank's entries ``(key, global_shape, dtype, box)`` for :meth:`GlobalLayout.merge`.

    Example:
        >>> local_layout({"w": torch.zeros(2, 3)})[0].shape
        (2, 3)
    """
    shards = {key: local_shards(key, value) for key, value in state.items()}  # checks keys first
    return [LayoutEntry(key, s.global_shape, dtype_name(s.dtype), s.box) for key in sorted(shards) for s in shards[key]]


def __getattr__(name: str) -> Any:
    if name == "ShardedTensor":
        import warnings

        warnings.warn(
            "shardsync.ShardedTensor is deprecated: it is shardsync.LocalShard (this rank's shard "
            "of a global tensor; torch's ShardedTensor is another class)",
            DeprecationWarning,
            stacklevel=2,
        )
        return LocalShard
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
