"""Transformer Engine's grouped experts (``TEGroupedMLP``) as :func:`~.megatron.from_megatron` presents them.

With ``moe_grouped_gemm=True`` and the Transformer Engine layer spec, a Megatron MoE layer's experts are
a ``TEGroupedMLP`` (``megatron/core/transformer/moe/experts.py``) whose ``linear_fc1`` and
``linear_fc2`` are TE ``GroupedLinear`` modules (``TEColumnParallelGroupedLinear`` /
``TERowParallelGroupedLinear``, ``megatron/core/extensions/transformer_engine.py``). Each holds one
parameter per local expert, ``weight<i>`` (and ``bias<i>`` with ``add_bias_linear``), numbered from 0
on every expert-parallel rank, shaped as an ``nn.Linear``'s:

* ``linear_fc1.weight<i>``: ``[2 ffn / tp, hidden]`` on a gated MLP (``[ffn / tp, hidden]`` otherwise),
  column-parallel over the expert TP group; the forward splits each rank's output in two
  (``torch.chunk(x, 2, dim=-1)``), so it holds ``[gate_r; up_r]`` (stride 2, as a SequentialMLP's
  ``linear_fc1``); ``bias<i>`` ``[2 ffn / tp]`` likewise;
* ``linear_fc2.weight<i>``: ``[hidden, ffn / tp]``, row-parallel (dim 1); ``bias<i>`` ``[hidden]`` is
  not split.

TE's own marks cannot be trusted for the dims: with expert parallelism or an expert TP group above 1
Megatron passes ``parallel_mode=None`` to TE (its token dispatcher does the communication), and TE
then marks every ``weight<i>`` with ``partition_dim=0`` and leaves the biases unmarked. The dims come
from the module's role instead, as Megatron's own ``sharded_state_dict`` does (its ``tp_axis_map``:
0 for fc1, 1 for fc2). The local index ``i`` becomes the global expert id
(``local_expert_indices[i]`` of the ``MoELayer``), so ``weight<i>`` on EP rank ``r`` is presented as
``weight<r * experts_per_rank + i>``.
"""

from __future__ import annotations

import torch

from ..errors import LayoutError

__all__ = ["te_grouped_experts", "Partition"]

#: ``(dim, stride)`` of a split tensor; None for a tensor every rank of the group holds whole.
Partition = tuple[int, int] | None


def _grouped_linears(experts: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """``(linear_fc1, linear_fc2)`` when ``experts`` is a TEGroupedMLP (TE GroupedLinear modules:
    an integer ``num_gemms`` and parameters ``weight0``, ...), else None."""
    pair = getattr(experts, "linear_fc1", None), getattr(experts, "linear_fc2", None)
    for fc in pair:
        if (
            not isinstance(fc, torch.nn.Module)
            or not isinstance(getattr(fc, "num_gemms", None), int)
            or not isinstance(getattr(fc, "weight0", None), torch.Tensor)
        ):
            return None
    return pair  # type: ignore[return-value]


def _one_layer(
    prefix: str,
    experts: torch.nn.Module,
    ids: list[int],
) -> tuple[dict[str, str], dict[int, Partition]]:
    linears = _grouped_linears(experts)
    if linears is None:
        return {}, {}
    gated = getattr(getattr(experts, "config", None), "gated_linear_unit", False) is True
    fc1_part: Partition = (0, 2 if gated else 1)
    renames: dict[str, str] = {}
    parts: dict[int, Partition] = {}
    for fc_name, fc, weight_part, bias_part in (
        ("linear_fc1", linears[0], fc1_part, fc1_part),
        ("linear_fc2", linears[1], (1, 1), None),
    ):
        count = int(getattr(fc, "num_gemms"))
        if count != len(ids):
            raise LayoutError(
                f"{prefix}{fc_name} holds {count} grouped weights but its MoE layer "
                f"{len(ids)} local experts (local_expert_indices {ids}); pass the model as "
                "Megatron built it"
            )
        for i, global_id in enumerate(ids):
            for kind, part in (("weight", weight_part), ("bias", bias_part)):
                tensor = getattr(fc, f"{kind}{i}", None)
                if isinstance(tensor, torch.Tensor):
                    renames[f"{prefix}{fc_name}.{kind}{i}"] = f"{prefix}{fc_name}.{kind}{global_id}"
                    parts[id(tensor)] = part
    return renames, parts


def te_grouped_experts(model: torch.nn.Module) -> tuple[dict[str, str], dict[int, Partition]]:
    """The global names and the partitions of every ``TEGroupedMLP`` weight and bias of ``model``.

    Returns:
        ``(renames, parts)``: state-dict key -> key with the global expert id (exact keys: ``weight1``
        is not a prefix of ``weight10``), and parameter id -> its ``(dim, stride)`` in the experts'
        tensor-parallel group (None: not split).

    Raises:
        LayoutError: a grouped linear whose number of weights differs from its layer's local experts.

    Example:
        >>> fc1, fc2 = torch.nn.Module(), torch.nn.Module()
        >>> for fc, shape in ((fc1, (4, 3)), (fc2, (3, 2))):
        ...     fc.num_gemms = 2
        ...     for i in range(2):
        ...         fc.register_parameter(f"weight{i}", torch.nn.Parameter(torch.zeros(shape)))
        >>> layer = torch.nn.Module()
        >>> layer.local_expert_indices = [2, 3]             # EP rank 1 of 2, 4 experts
        >>> layer.experts = torch.nn.Module()
        >>> layer.experts.linear_fc1, layer.experts.linear_fc2 = fc1, fc2
        >>> renames, parts = te_grouped_experts(layer)
        >>> renames["experts.linear_fc1.weight1"], parts[id(fc2.weight0)]
        ('experts.linear_fc1.weight3', (1, 1))
    """
    renames: dict[str, str] = {}
    parts: dict[int, Partition] = {}
    for name, module in model.named_modules():
        ids, experts = getattr(module, "local_expert_indices", None), getattr(module, "experts", None)
        if not isinstance(ids, list) or not isinstance(experts, torch.nn.Module):
            continue
        more_names, more_parts = _one_layer(f"{name}.experts." if name else "experts.", experts, ids)
        renames |= more_names
        parts |= more_parts
    return renames, parts
