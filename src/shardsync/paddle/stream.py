"""``full_param`` with FlexCheckpoint's keyword names, on :func:`shardsync.full_params`.

Code written for ``paddle.distributed.flex_checkpoint.dcp.full_param`` ports by changing the import and
the tensor type (``ShardedWeight`` -> :class:`~shardsync.layout.LocalShard`; objects with Paddle's
``local_tensor``/``global_shape``/``global_offset`` attributes are accepted as they are).

Differences from Paddle 3.3.1, on purpose: ``num_splits``/``shard_idx`` are honoured on the
single-group path too (Paddle ignores them there); unknown keywords raise ``TypeError`` instead of
being dropped silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import PlanError
from ..layout import LocalShard, StateValue
from ..planning import DEFAULT_MESH_THRESHOLD_BYTES
from ..stream import ParamStream, full_params

__all__ = ["full_param", "PADDLE_KEYWORDS"]

#: The keywords Paddle's ``full_param`` reads from ``**kwargs``.
PADDLE_KEYWORDS = ("process_group", "h_group", "v_group", "num_splits", "shard_idx", "memory_growth_threshold")


def _value(key: str, v: Any) -> StateValue:
    # Paddle's ShardedWeight carries local_tensor, global_shape, global_offset.
    if hasattr(v, "local_tensor") and hasattr(v, "global_shape") and hasattr(v, "global_offset"):
        return LocalShard(v.local_tensor, v.global_shape, v.global_offset, key=key)
    return v


def full_param(sharded_state_dict: Mapping[str, Any], aoa_config: Any = None, **kwargs: Any) -> ParamStream:
    """Stream full parameters like Paddle's ``full_param``; returns an iterable of ``(name, tensor)``.

    Args:
        sharded_state_dict: key -> LocalShard (or tensor, DTensor, ShardedWeight-like object).
        aoa_config: Paddle's mapping dict ``{"aoa_statements": [...], "aoa_config_reverse": bool}``,
            or anything :func:`shardsync.full_params` takes as ``mapping``.
        **kwargs: ``process_group``; ``h_group`` and ``v_group`` together (2-D mesh path);
            ``num_splits`` and ``shard_idx``; ``memory_growth_threshold`` (bytes, default 8 GiB).

    Raises:
        TypeError: a keyword Paddle's ``full_param`` does not take.
        PlanError: only one of ``h_group``/``v_group`` (a ValueError).

    Example:
        >>> import torch
        >>> state = {"w": torch.arange(6.0).reshape(2, 3)}
        >>> for name, tensor in full_param(state, {"aoa_statements": ["w^T -> w_t"]}):
        ...     print(name, tuple(tensor.shape))
        w_t (3, 2)
    """
    unknown = sorted(set(kwargs) - set(PADDLE_KEYWORDS))
    if unknown:
        raise TypeError(f"full_param() got unexpected keyword(s) {unknown}; it takes {list(PADDLE_KEYWORDS)}")
    h, v = kwargs.get("h_group"), kwargs.get("v_group")
    if (h is None) != (v is None):
        raise PlanError("both h_group and v_group must be given for the 2-D mesh path (or neither)")
    state = {k: _value(k, x) for k, x in sharded_state_dict.items()}
    return full_params(
        state,
        aoa_config,
        group=kwargs.get("process_group"),
        strategy="mesh2d" if h is not None else "auto",
        mesh=(h, v) if h is not None else None,
        num_splits=kwargs.get("num_splits", 1),
        split_index=kwargs.get("shard_idx", 0),
        mesh_threshold_bytes=kwargs.get("memory_growth_threshold", DEFAULT_MESH_THRESHOLD_BYTES),
    )
