"""Transformer Engine grouped experts (``TEGroupedMLP``) without Transformer Engine, which does not build
on CPU: each (EP, TP) rank's ``linear_fc1.weight<i>`` / ``linear_fc2.weight<i>`` built by hand with the
names, shapes and attributes TE gives them, through from_megatron and the shipped ``-te`` mappings to
HF names exactly (EP=2 and TP=2 x EP=2), and back by load into the same memory.

What the stand-ins copy, from megatron-core 0.16:

* ``megatron/core/transformer/moe/experts.py``, ``TEGroupedMLP.__init__``: ``linear_fc1`` is built with
  ``num_local_experts`` gemms, ``hidden -> 2 * moe_ffn_hidden_size`` (gated), ``linear_fc2`` with
  ``moe_ffn_hidden_size -> hidden``; its forward splits each rank's fc1 output with
  ``torch.chunk(x, 2, dim=-1)`` (``[gate_r | up_r]``); ``tp_group`` is the expert TP group.
* ``megatron/core/extensions/transformer_engine.py``, ``TEGroupedLinear.__init__``: with EP > 1 or an
  expert TP group > 1 (``explicit_expert_comm``) the output (column) or input (row) size is divided by
  the TP size and ``parallel_mode=None`` is passed to TE; ``_sharded_state_dict_grouped`` names the
  parameters ``weight<gemm_idx>`` / ``bias<gemm_idx>`` and the extra state ``_extra_state``;
  ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear.sharded_state_dict`` split fc1
  along dim 0 and fc2 along dim 1 (``tp_axis_map``), fc2's bias not at all.
* TE's ``GroupedLinear.reset_parameters`` (transformer_engine/pytorch/module/grouped_linear.py) marks
  each ``weight<i>`` ``tensor_model_parallel=True, partition_dim=1 if parallel_mode == "row" else 0,
  partition_stride=1``, and a bias only in column mode: with ``parallel_mode=None`` every weight says
  dim 0 and no bias is marked, which from_megatron must not believe.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import shardsync
import shardsync.sources.megatron as megatron
from reference import arange_tensor
from shardsync.layout import Box, LocalShard
from shardsync.mapping import Mapping
from shardsync.sources.megatron_te import te_grouped_experts
from test_mappings_moe import LAYERS, PARAMS, assert_same, hf_moe, megatron_moe

E, HID, FFN, EP = 4, 6, 6, 2  # 4 experts, 2 per EP rank; ffn 6: 3 rows per rank at TP=2


class Group:
    """A stand-in for the expert TP group: this process plays rank ``rank`` of ``size``."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


class TEGroupedLinear(torch.nn.Module):
    """TE's GroupedLinear as Megatron builds it under expert parallelism: ``weight<i>`` per local
    expert, marked as TE marks them with ``parallel_mode=None``, plus an ``_extra_state``."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None) -> None:
        super().__init__()
        self.num_gemms = len(weights)
        for i, w in enumerate(weights):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(w.clone()))
            p = getattr(self, f"weight{i}")
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
        for i, b in enumerate(biases or []):
            self.register_parameter(f"bias{i}", torch.nn.Parameter(b.clone()))

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)  # no FP8: TE saves an empty tensor

    def set_extra_state(self, state: Any) -> None:
        pass


def experts_hf(layer: int) -> dict[str, list[torch.Tensor]]:
    base = 100_000 * (layer + 1)
    return {
        "gate": [arange_tensor((FFN, HID), start=base + 1000 * e) for e in range(E)],
        "up": [arange_tensor((FFN, HID), start=base + 1000 * e + 500) for e in range(E)],
        "down": [arange_tensor((HID, FFN), start=-base - 1000 * e - 1) for e in range(E)],
        "router": [arange_tensor((E, HID), start=base + 7)],
    }


def moe_layer(hf: dict[str, list[torch.Tensor]], ep: int, tp: int, tp_size: int) -> torch.nn.Module:
    """The ``mlp`` of one decoder layer on EP rank ``ep``, expert TP rank ``tp``."""
    local, rows = E // EP, slice(tp * FFN // tp_size, (tp + 1) * FFN // tp_size)
    ids = list(range(ep * local, (ep + 1) * local))
    experts = torch.nn.Module()
    experts.linear_fc1 = TEGroupedLinear([torch.cat([hf["gate"][e][rows], hf["up"][e][rows]]) for e in ids])
    experts.linear_fc2 = TEGroupedLinear([hf["down"][e][:, rows] for e in ids])
    experts.num_local_experts, experts.tp_group = local, Group(tp, tp_size)
    experts.config = SimpleNamespace(gated_linear_unit=True, num_moe_experts=E)
    layer = torch.nn.Module()
    layer.local_expert_indices = ids
    layer.router = torch.nn.Linear(HID, E, bias=False)
    with torch.no_grad():
        layer.router.weight.copy_(hf["router"][0])
    layer.experts = experts
    return layer


def placed(module: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """from_megatron of one rank's module, its experts' TP group played by this process."""
    with monkeypatch.context() as m:
        m.setattr(megatron, "group_rank", lambda g=None: g.rank if isinstance(g, Group) else 0)
        m.setattr(megatron, "group_size", lambda g=None: g.size if isinstance(g, Group) else 1)
        return shardsync.from_megatron(module)


def ranks(tp_size: int) -> list[tuple[int, int]]:
    return [(ep, tp) for ep in range(EP) for tp in range(tp_size)]


def every_rank(
    layers: dict[tuple[int, int, int], torch.nn.Module],
    monkeypatch: pytest.MonkeyPatch,
) -> dict[str, list[LocalShard]]:
    """The shards of every rank's layers together, under ``decoder.layers.<i>.mlp.`` (one process
    holds them all)."""
    state: dict[str, list[LocalShard]] = {}
    for (i, _, _), layer in layers.items():
        for key, value in placed(layer, monkeypatch).items():
            if key.startswith("router."):
                continue  # a replica on every rank: the full state holds it once
            state.setdefault(f"decoder.layers.{i}.mlp.{key}", []).extend(value if isinstance(value, list) else [value])
    return state


def test_weights_get_global_ids_and_the_dims_of_their_role(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = moe_layer(experts_hf(0), ep=1, tp=1, tp_size=2)
    state = placed(layer, monkeypatch)
    assert list(state) == [
        "router.weight",
        "experts.linear_fc1.weight2",
        "experts.linear_fc1.weight3",
        "experts.linear_fc2.weight2",
        "experts.linear_fc2.weight3",
    ]
    gate_r, up_r = state["experts.linear_fc1.weight3"]  # [gate_1; up_1] of expert 3: stride 2
    assert (gate_r.box, up_r.box, gate_r.global_shape) == (Box((3, 0), (3, HID)), Box((9, 0), (3, HID)), (2 * FFN, HID))
    assert torch.equal(up_r.local, experts_hf(0)["up"][3][3:])
    down = state["experts.linear_fc2.weight2"]  # TE says dim 0; the row-parallel fc2 is split along 1
    assert isinstance(down, LocalShard) and down.box == Box((0, 3), (HID, 3))
    assert down.local.data_ptr() == layer.experts.linear_fc2.weight0.data_ptr()  # a view, nothing copied


def test_biases_follow_their_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = moe_layer(experts_hf(0), ep=0, tp=0, tp_size=2)
    layer.experts.linear_fc1 = TEGroupedLinear(
        [layer.experts.linear_fc1.weight0, layer.experts.linear_fc1.weight1],
        [arange_tensor((FFN,)), arange_tensor((FFN,), start=50)],
    )
    layer.experts.linear_fc2 = TEGroupedLinear(
        [layer.experts.linear_fc2.weight0, layer.experts.linear_fc2.weight1],
        [arange_tensor((HID,)), arange_tensor((HID,), start=50)],
    )
    renames, parts = te_grouped_experts(layer)
    assert renames["experts.linear_fc2.bias1"] == "experts.linear_fc2.bias1"  # EP rank 0: ids 0, 1
    state = placed(layer, monkeypatch)
    assert [s.box for s in state["experts.linear_fc1.bias1"]] == [Box((0,), (3,)), Box((6,), (3,))]
    assert isinstance(state["experts.linear_fc2.bias0"], torch.Tensor) and not isinstance(
        state["experts.linear_fc2.bias0"], LocalShard
    )  # not split: a replica
    assert parts[id(layer.experts.linear_fc2.bias0)] is None


def test_a_count_that_differs_from_the_local_experts_is_an_error() -> None:
    layer = moe_layer(experts_hf(0), ep=0, tp=0, tp_size=1)
    layer.local_expert_indices = [0, 1, 2]
    with pytest.raises(
        shardsync.LayoutError,
        match=r"experts.linear_fc1 holds 2 grouped weights but its MoE "
        r"layer 3 local experts",
    ):
        shardsync.from_megatron(layer)


def model_and_reference(
    qwen: bool,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[int, dict[str, list[torch.Tensor]]]]:
    """The non-expert part of a TE-spec MoE GPT (global tensors), the HF checkpoint it converts to
    written out plainly, and each layer's per-expert HF weights."""
    mg = megatron_moe(shared=qwen, qkv_bias=qwen, te=True)
    full = hf_moe(mg, qwen=qwen, te=True)
    rest = {k: v for k, v in mg.items() if ".mlp.experts." not in k and ".mlp.router." not in k}
    moe, (w1, w3, w2) = (
        ("mlp.", ("gate_proj", "up_proj", "down_proj")) if qwen else ("block_sparse_moe.", ("w1", "w3", "w2"))
    )
    want = {k: v for k, v in full.items() if f".{moe}experts." not in k and f".{moe}gate." not in k}
    per_layer = {i: experts_hf(i) for i in range(LAYERS)}
    for i, hf in per_layer.items():
        h = f"model.layers.{i}.{moe}"
        want[h + "gate.weight"] = hf["router"][0]
        for e in range(E):
            want |= {
                h + f"experts.{e}.{w1}.weight": hf["gate"][e],
                h + f"experts.{e}.{w3}.weight": hf["up"][e],
                h + f"experts.{e}.{w2}.weight": hf["down"][e],
            }
    return rest, want, per_layer


@pytest.mark.parametrize("tp_size", [1, 2], ids=["EP2", "TP2xEP2"])
@pytest.mark.parametrize("name, qwen", [("megatron-mixtral-te", False), ("megatron-qwen2-moe-te", True)])
def test_te_mappings_export_and_load_back_exactly(
    name: str, qwen: bool, tp_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rest, want, per_layer = model_and_reference(qwen)
    layers = {(i, ep, tp): moe_layer(hf, ep, tp, tp_size) for i, hf in per_layer.items() for ep, tp in ranks(tp_size)}
    state: dict[str, Any] = dict(rest) | every_rank(layers, monkeypatch)
    state |= {f"decoder.layers.{i}.mlp.router.weight": per_layer[i]["router"][0] for i in per_layer}
    assert f"decoder.layers.1.mlp.experts.linear_fc2.weight{E - 1}" in state
    assert_same(dict(shardsync.full_params(state, Mapping.parse(name, params=PARAMS))), want)

    fresh = {k: moe_layer(per_layer[k[0]], *k[1:], tp_size) for k in layers}
    for layer in fresh.values():
        with torch.no_grad():
            for p in layer.experts.parameters():
                p.fill_(-1.0)
    dst: dict[str, Any] = {k: torch.full_like(v, -1.0) for k, v in state.items() if ".experts." not in k}
    dst |= every_rank(fresh, monkeypatch)
    result = shardsync.load(dst, want, Mapping.parse(name, params=PARAMS, reverse=True))
    assert (result.missing, result.unexpected, result.mismatched) == ((), (), ())
    for k, layer in fresh.items():
        for (pname, got), ref in zip(layer.experts.named_parameters(), layers[k].experts.parameters()):
            assert torch.equal(got, ref), (k, pname)
    for k, v in rest.items():
        rows = slice(0, PARAMS["vocab_size"]) if k.startswith(("embedding.", "output_layer.")) else slice(None)
        assert torch.equal(dst[k][rows], v[rows]), k


def test_the_sequential_layout_still_loads_through_the_te_mapping() -> None:
    """The -te mappings read SequentialMLP and TEGroupedMLP experts; on load the destination decides
    which of the two optional lines writes (the other's outputs are not in it)."""
    mg = megatron_moe(te=True)
    hf = hf_moe(mg, qwen=False, te=True)
    dst = {k: torch.zeros_like(v) for k, v in mg.items()}
    result = shardsync.load(dst, hf, Mapping.parse("megatron-mixtral-te", params=PARAMS, reverse=True))
    assert (result.missing, result.unexpected, result.mismatched) == ((), (), ())
    assert all(torch.equal(dst[k], v) for k, v in mg.items() if not k.startswith(("embedding.", "output_layer.")))


def test_pipeline_and_expert_renumberings_combine(monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Module()  # a pipeline stage holding layer 5 (layer_number 6), on EP rank 1
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.decoder.layers[0].layer_number = 6
    model.decoder.layers[0].mlp = moe_layer(experts_hf(0), ep=1, tp=0, tp_size=1)
    keys = [k for k in placed(model, monkeypatch) if ".experts." in k]
    assert keys == [f"decoder.layers.5.mlp.experts.linear_fc{n}.weight{e}" for n in (1, 2) for e in (2, 3)]
