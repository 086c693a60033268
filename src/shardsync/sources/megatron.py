"""Megatron-style models as they are: parameters that carry tensor-parallel attributes become shards.

Megatron-core marks every tensor-parallel parameter with three attributes (set by
``megatron.core.tensor_parallel.set_tensor_model_parallel_attributes``):

* ``tensor_model_parallel``: True when each rank of the TP group holds a different part;
* ``partition_dim``: the dim the global tensor is cut along;
* ``partition_stride``: how many chunks of the global tensor each rank holds. Megatron cuts the global
  tensor along ``partition_dim`` into ``tp * stride`` equal chunks and gives rank ``r`` chunks
  ``r, r + tp, r + 2 tp, ...``, concatenated (``_initialize_affine_weight_cpu``; the resharding planner
  in ``megatron.core.resharding`` reads it the same way). A SwiGLU ``linear_fc1`` has stride 2: the
  global tensor is ``[gate; up]`` and rank ``r`` holds ``[gate_r; up_r]``.

PaddlePaddle marks its model-parallel parameters with ``is_distributed`` and ``split_axis`` (no stride).
Parameters with neither mark are replicas (layer norms); the layout gather checks that claim (see
:mod:`shardsync.sources.fingerprint`).

Mixture-of-experts layers (``MoELayer``) hold ``experts.local_experts.<i>``, numbered from 0 on every
expert-parallel rank; the layer's ``local_expert_indices`` are their global ids
(``ep_rank * experts_per_rank + i``), and its experts are split over their own tensor-parallel group
(``experts.tp_group``, Megatron's expert TP group, which ``expert_tensor_parallel_size`` may make
differ from the dense one). Ranks of the expert data-parallel group hold the same experts: replicas.
A ``GroupedMLP`` (``moe_grouped_gemm``) holds all local experts in ``weight1`` / ``weight2``; they are
presented as views of the per-expert weights stacked, ``[experts, 2 ffn, hidden]`` and
``[experts, hidden, ffn]``. Transformer Engine's ``TEGroupedMLP`` holds one ``linear_fc1.weight<i>`` /
``linear_fc2.weight<i>`` per local expert; ``<i>`` becomes the global id (see :mod:`.megatron_te`).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import Any

import torch

from ..dist import group_rank, group_size
from ..errors import LayoutError
from ..layout.sharded import LocalShard, StateValue
from .megatron_te import te_grouped_experts

__all__ = ["from_megatron", "tp_shards", "partition_of", "megatron_module_error"]


def tp_shards(
    local: torch.Tensor, dim: int, rank: int, world: int, stride: int = 1, *, key: str = "<tensor>"
) -> list[LocalShard]:
    """This rank's shard of a tensor Megatron splits along ``dim`` over ``world`` ranks.

    The global tensor is ``local`` * ``world`` long along ``dim`` (Megatron's shards are equal). With
    ``stride`` s the local tensor is s blocks; block k is chunk ``k * world + rank`` of the global
    tensor cut into ``world * s`` chunks, so it becomes its own LocalShard (views, no copy).

    Args:
        local: the rank's tensor.
        dim: Megatron's ``partition_dim``.
        rank: this rank in the tensor-parallel group.
        world: size of the tensor-parallel group.
        stride: Megatron's ``partition_stride``.
        key: used in error messages.

    Returns:
        the shards, in local order (one per stride block).

    Raises:
        LayoutError: ``dim`` outside the tensor, a stride below 1, or a local size along ``dim`` that
            the stride does not divide.

    Example:
        >>> fc1 = torch.arange(8.).reshape(4, 2)          # rank 1 of 2: [gate_1; up_1], stride 2
        >>> [s.box for s in tp_shards(fc1, 0, rank=1, world=2, stride=2)]
        [Box(offsets=(2, 0), sizes=(2, 2)), Box(offsets=(6, 0), sizes=(2, 2))]
    """
    if not -local.dim() <= dim < local.dim():
        raise LayoutError(
            f"{key!r}: partition dim {dim} is outside a tensor of shape "
            f"{list(local.shape)}; fix the partition_dim (or split_axis) attribute"
        )
    dim %= local.dim()
    if not isinstance(stride, int) or stride < 1 or local.shape[dim] % stride:
        raise LayoutError(
            f"{key!r}: partition_stride {stride!r} must be a positive integer that divides "
            f"the local size {local.shape[dim]} along dim {dim}"
        )
    block = local.shape[dim] // stride
    shape = list(local.shape)
    shape[dim] *= world
    shards = []
    for k in range(stride):
        offset = [0] * local.dim()
        offset[dim] = (k * world + rank) * block
        shards.append(LocalShard(local.narrow(dim, k * block, block), shape, offset, key=key))
    return shards


def partition_of(key: str, tensor: torch.Tensor) -> tuple[int, int] | None:
    """``(dim, stride)`` of a tensor-parallel tensor, from its Megatron or Paddle attributes; None for
    a tensor without them (a replica).

    Raises:
        LayoutError: a tensor marked parallel without a usable dim.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(4, 2))
        >>> w.tensor_model_parallel, w.partition_dim, w.partition_stride = True, 1, 1
        >>> partition_of("w", w), partition_of("b", torch.zeros(2))
        ((1, 1), None)
    """
    # `is True`: torch.Tensor has an is_distributed() method, which is truthy
    if getattr(tensor, "tensor_model_parallel", False) is True:
        dim, stride, names = (
            getattr(tensor, "partition_dim", None),
            getattr(tensor, "partition_stride", 1),
            "partition_dim",
        )
    elif getattr(tensor, "is_distributed", False) is True:
        dim, stride, names = getattr(tensor, "split_axis", None), 1, "split_axis"
    else:
        return None
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise LayoutError(
            f"{key!r} is marked tensor-parallel but its {names} is {dim!r}; set it to the dim the tensor is split along"
        )
    return dim, stride


def _tp_group(group: Any) -> tuple[int, int]:
    """This rank and the size of the tensor-parallel group (see :func:`from_megatron`)."""
    if group is None:
        # Only look at megatron when the caller already imported it: no import cost, no dependency.
        state = sys.modules.get("megatron.core.parallel_state")
        if state is not None and state.model_parallel_is_initialized():
            group = state.get_tensor_model_parallel_group()
    rank, size = group_rank(group), group_size(group)
    if rank < 0:
        raise LayoutError(
            "from_megatron: this rank is not in the tensor-parallel group it was given; "
            "pass the group this rank belongs to"
        )
    return rank, size


def _global_layer_names(model: torch.nn.Module) -> dict[str, str]:
    """``"decoder.layers.<i>."`` -> ``"decoder.layers.<layer_number - 1>."`` where Megatron numbers
    layers globally (pipeline stages hold layers 0.. locally, and ``layer_number`` says which)."""
    renames = {}
    for name, module in model.named_modules():
        found = re.fullmatch(r"(.*\blayers)\.(\d+)", name)
        number = getattr(module, "layer_number", None)
        if found and isinstance(number, int) and number - 1 != int(found[2]):
            renames[name + "."] = f"{found[1]}.{number - 1}."
    return renames


def _global_expert_names(model: torch.nn.Module) -> dict[str, str]:
    """``"<moe>.experts.local_experts.<i>."`` -> ``"<moe>.experts.local_experts.<global id>."`` for
    every Megatron ``MoELayer`` (its ``local_expert_indices`` hold the global ids of its experts)."""
    renames: dict[str, str] = {}
    for name, module in model.named_modules():
        ids = getattr(module, "local_expert_indices", None)
        local = getattr(getattr(module, "experts", None), "local_experts", None)
        if not isinstance(ids, list) or not isinstance(local, torch.nn.ModuleList):
            continue
        prefix = f"{name}.experts.local_experts." if name else "experts.local_experts."
        renames |= {f"{prefix}{i}.": f"{prefix}{g}." for i, g in enumerate(ids) if i != g}
    return renames


def _expert_groups(model: torch.nn.Module) -> dict[int, tuple[int, int]]:
    """Id of each expert parameter -> (rank, size) in its experts' tensor-parallel group
    (``SequentialMLP.tp_group``, Megatron's expert TP group)."""
    groups: dict[int, tuple[int, int]] = {}
    for module in model.modules():
        experts = getattr(module, "experts", None)
        group = getattr(experts, "tp_group", None)
        if (
            not isinstance(getattr(module, "local_expert_indices", None), list)
            or group is None
            or not isinstance(experts, torch.nn.Module)
        ):
            continue
        rank, size = group_rank(group), group_size(group)
        groups |= {id(t): (rank, size) for t in experts.parameters()}
    return groups


def _grouped_views(
    experts: torch.nn.Module,
    first: int,
    total: int,
    rank: int,
    world: int,
) -> dict[int, list[LocalShard]]:
    """A ``GroupedMLP``'s ``weight1`` / ``weight2`` as shards of ``[experts, 2 ffn, hidden]`` and
    ``[experts, hidden, ffn]`` (the per-expert HF weights stacked), by parameter id.

    Megatron views each TP rank's ``weight1 [hidden, local * 2 ffn / tp]`` as ``[local, hidden,
    2 ffn / tp]`` and ``weight2 [local * ffn / tp, hidden]`` as ``[local, ffn / tp, hidden]``
    (``GroupedMLP.forward``); an expert's fc1 output is ``[gate_r | up_r]`` on a gated MLP.
    """
    w1, w2 = experts.get_parameter("weight1"), experts.get_parameter("weight2")
    local, hidden = int(getattr(experts, "num_local_experts")), int(w1.shape[0])
    fc1 = w1.detach().view(local, hidden, -1).transpose(1, 2)  # [local, 2 ffn / tp, hidden]
    fc2 = w2.detach().view(local, -1, hidden).transpose(1, 2)  # [local, hidden, ffn / tp]
    gated = 2 if getattr(getattr(experts, "config", None), "gated_linear_unit", False) else 1
    views: dict[int, list[LocalShard]] = {id(w1): [], id(w2): []}
    for shard in tp_shards(fc1, 1, rank, world, gated, key="weight1"):
        views[id(w1)].append(
            LocalShard(shard.local, (total, *shard.global_shape[1:]), (first, *shard.global_offset[1:]))
        )
    (down,) = tp_shards(fc2, 2, rank, world, key="weight2")
    views[id(w2)].append(LocalShard(down.local, (total, *down.global_shape[1:]), (first, *down.global_offset[1:])))
    return views


def _grouped_experts(model: torch.nn.Module, rank: int, world: int) -> dict[int, list[LocalShard]]:
    """The placed views of every ``GroupedMLP`` of the model's MoE layers (:func:`_grouped_views`),
    each split over its experts' own TP group where they have one."""
    views: dict[int, list[LocalShard]] = {}
    for module in model.modules():
        ids, experts = getattr(module, "local_expert_indices", None), getattr(module, "experts", None)
        if (
            not isinstance(ids, list)
            or not ids
            or not isinstance(experts, torch.nn.Module)
            or not isinstance(getattr(experts, "weight1", None), torch.Tensor)
        ):
            continue
        group = getattr(experts, "tp_group", None)
        tp_rank, tp_world = (group_rank(group), group_size(group)) if group is not None else (rank, world)
        total = getattr(getattr(experts, "config", None), "num_moe_experts", None)
        total = total if isinstance(total, int) else len(ids)
        views |= _grouped_views(experts, ids[0], total, tp_rank, tp_world)
    return views


def _tied_copies(model: torch.nn.Module) -> set[str]:
    """Keys of output layers that only hold a copy of the embeddings: the last pipeline stage of a
    model with tied embeddings (``share_embeddings_and_output_weights``) keeps one to compute the
    logits, and the first stage holds the real one (HF's tied ``lm_head`` is not a tensor of its own)."""
    keys = set()
    for name, module in model.named_modules():
        if (
            getattr(module, "share_embeddings_and_output_weights", False) is True
            and getattr(module, "pre_process", True) is False
        ):
            keys.add(f"{name}.output_layer.weight" if name else "output_layer.weight")
    return keys


def _renamed(key: str, renames: dict[str, str]) -> str:
    for old, new in renames.items():
        if key.startswith(old):
            return new + key[len(old) :]
    return key


def _glu_fc1(model: torch.nn.Module) -> set[int]:
    """Ids of the ``linear_fc1`` tensors of gated (SwiGLU) Megatron MLPs. Their forward splits each
    rank's output in two (``[gate_r; up_r]``), so they have stride 2 whatever the attribute says
    (megatron-core before the resharding planner left it at 1)."""
    ids = set()
    for module in model.modules():
        fc1 = getattr(module, "linear_fc1", None)
        if isinstance(fc1, torch.nn.Module) and getattr(getattr(module, "config", None), "gated_linear_unit", False):
            ids |= {id(t) for t in fc1.parameters(recurse=False)}
    return ids


def _chunk_state(chunk: torch.nn.Module, rank: int, world: int) -> dict[str, StateValue]:
    layers, experts, glu = _global_layer_names(chunk), _global_expert_names(chunk), _glu_fc1(chunk)
    expert_groups, skip = _expert_groups(chunk), _tied_copies(chunk)
    grouped = _grouped_experts(chunk, rank, world)
    te_names, te_parts = te_grouped_experts(chunk)
    state: dict[str, StateValue] = {}
    for name, value in chunk.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor) or name.endswith("_extra_state") or name in skip:
            continue
        key = _renamed(_renamed(te_names.get(name, name), experts), layers)
        if id(value) in grouped:
            views = grouped[id(value)]
            state[key] = views[0] if len(views) == 1 else views
            continue
        part = te_parts[id(value)] if id(value) in te_parts else partition_of(key, value)
        if part is None:
            state[key] = value.detach()
            continue
        dim, stride = part
        if id(value) in glu and dim == 0 and stride == 1 and id(value) not in te_parts:
            stride = 2
        tp_rank, tp_world = expert_groups.get(id(value), (rank, world))
        shards = tp_shards(value.detach(), dim, tp_rank, tp_world, stride, key=key)
        state[key] = shards[0] if len(shards) == 1 else shards
    return state


def from_megatron(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    group: Any = None,
) -> dict[str, StateValue]:
    """A state for :func:`shardsync.full_params` from a Megatron-style model, as it is on this rank.

    Parameters and persistent buffers marked tensor-parallel (Megatron's ``tensor_model_parallel``,
    ``partition_dim``, ``partition_stride``; Paddle's ``is_distributed``, ``split_axis``) become
    :class:`LocalShard` views of this rank's shard; other tensors stay plain (replicas, checked
    when the layout is gathered); ``_extra_state`` and other non-tensor entries are skipped. Layers of
    a pipeline stage get their global numbers (from Megatron's ``layer_number``), the local experts of
    an expert-parallel rank theirs (from the ``MoELayer``'s ``local_expert_indices``; each expert is
    split over its own TP group, ``experts.tp_group``; a ``GroupedMLP``'s ``weight1`` / ``weight2``
    become its experts' weights stacked, a ``TEGroupedMLP``'s ``weight<i>`` take the global id as
    suffix, see the module docstring), and the copy of tied embeddings that the last pipeline stage
    holds as ``output_layer.weight`` is left out. Nothing is copied.

    Args:
        model: the unwrapped model (``megatron.training.utils.unwrap_model``), or a list of
            virtual-pipeline chunks.
        group: the tensor-parallel group. None: Megatron's TP group when ``megatron.core`` has
            initialised model parallelism, else the default group, else a single process. Experts
            use their own group (``experts.tp_group``) where they have one.

    Returns:
        key -> tensor, LocalShard or list of LocalShard (stride > 1), in state-dict order.

    Raises:
        LayoutError: a parallel tensor without a usable dim or stride, this rank outside ``group``, or
            two chunks holding the same key. Every rank raises it (it depends only on the model code).

    Example:
        >>> lin = torch.nn.Linear(3, 4, bias=False)
        >>> lin.weight.tensor_model_parallel, lin.weight.partition_dim = True, 0
        >>> from_megatron(lin)     # one process: the whole group
        {'weight': LocalShard(local=[4, 3] torch.float32, global_shape=[4, 3], global_offset=[0, 0])}
    """
    rank, world = _tp_group(group)
    state: dict[str, StateValue] = {}
    for chunk in [model] if isinstance(model, torch.nn.Module) else model:
        part = _chunk_state(chunk, rank, world)
        twice = sorted(set(part) & set(state))
        if twice:
            raise LayoutError(
                f"model chunks hold the same keys {twice[:5]}; pass chunks that hold "
                "different layers (with their Megatron layer_number)"
            )
        state |= part
    return state


def megatron_module_error(module: torch.nn.Module, what: str) -> LayoutError | None:
    """The error for a Megatron-style module passed where its placed state is needed; None for a
    module without Megatron's marks.

    A Megatron module's own state dict holds this rank's shards under local shapes (and, on pipeline
    stages and expert-parallel ranks, local layer and expert numbers), so taken as it is it cannot
    match full tensors: every sharded key would be a shape error.

    Args:
        module: the module given.
        what: how the message names it (``"the destination"``).

    Example:
        >>> lin = torch.nn.Linear(3, 4)
        >>> lin.weight.tensor_model_parallel = True
        >>> str(megatron_module_error(lin, "the destination"))[:60]
        'the destination is a Megatron module (tensor-parallel marks '
    """
    marked = next((n for n, p in module.named_parameters() if getattr(p, "tensor_model_parallel", False) is True), None)
    if marked is None:
        return None
    return LayoutError(
        f"{what} is a Megatron module (tensor-parallel marks on its parameters, e.g. "
        f"{marked!r}): its state dict holds this rank's shards with local shapes, layer "
        "and expert numbers; pass shardsync.from_megatron(model) instead, which places "
        "every shard in its global tensor"
    )
