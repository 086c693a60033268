"""GroupedMLP experts (moe_grouped_gemm=True) without megatron-core, which cannot build them on CPU:
each rank's ``weight1`` / ``weight2`` laid out by hand from per-expert HF weights the way Megatron's
``GroupedMLP.forward`` views them, at TP=2 x EP=2, through from_megatron and the shipped
``-grouped`` mappings to HF names exactly, and back by load into the same memory."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import shardsync
import shardsync.sources.megatron as megatron
from reference import arange_tensor
from shardsync.layout import LocalShard
from shardsync.mapping import Mapping
from test_mappings_moe import EXPERTS, PARAMS, assert_same, hf_moe, megatron_moe

E, HID, FFN, TP, EP = 4, 6, 6, 2, 2  # 4 experts, 2 per EP rank; ffn 6 = 3 rows per TP rank


class Group:
    """A stand-in for the expert TP group: this process plays rank ``rank`` of ``TP``."""

    def __init__(self, rank: int) -> None:
        self.rank = rank


class GroupedMLP(torch.nn.Module):
    """Megatron's GroupedMLP parameters for EP rank ``ep``, TP rank ``tp``, from per-expert
    ``gate``/``up`` ``[FFN, HID]`` and ``down`` ``[HID, FFN]``: ``weight1.view(local, HID, -1)[j]`` is
    ``[gate_r | up_r]`` of local expert j transposed, ``weight2.view(local, -1, HID)[j]`` its
    ``down_r`` transposed."""

    def __init__(self, hf: dict[str, list[torch.Tensor]], ep: int, tp: int) -> None:
        super().__init__()
        local, rows = E // EP, slice(tp * FFN // TP, (tp + 1) * FFN // TP)
        ids = range(ep * local, (ep + 1) * local)
        w1 = torch.stack([torch.cat([hf["gate"][e][rows], hf["up"][e][rows]]).T for e in ids])
        w2 = torch.stack([hf["down"][e][:, rows].T for e in ids])
        self.weight1 = torch.nn.Parameter(w1.reshape(HID, -1).clone())  # [HID, local * 2 FFN / TP]
        self.weight2 = torch.nn.Parameter(w2.reshape(-1, HID).clone())  # [local * FFN / TP, HID]
        for w, dim in ((self.weight1, 1), (self.weight2, 0)):
            w.tensor_model_parallel, w.partition_dim = True, dim  # type: ignore[attr-defined]
        self.num_local_experts, self.tp_group = local, Group(tp)
        self.config = SimpleNamespace(gated_linear_unit=True, num_moe_experts=E)


def moe_layer(hf: dict[str, list[torch.Tensor]], ep: int, tp: int) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.local_expert_indices = [ep * (E // EP) + i for i in range(E // EP)]
    layer.experts = GroupedMLP(hf, ep, tp)
    return layer


def experts_hf() -> dict[str, list[torch.Tensor]]:
    return {
        "gate": [arange_tensor((FFN, HID), start=1000 * e) for e in range(E)],
        "up": [arange_tensor((FFN, HID), start=1000 * e + 500) for e in range(E)],
        "down": [arange_tensor((HID, FFN), start=-1000 * e - 1) for e in range(E)],
    }


def placed(layer: torch.nn.Module, tp: int, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """from_megatron of one rank's layer, its experts' TP group played by this process."""
    with monkeypatch.context() as m:
        m.setattr(megatron, "group_rank", lambda g=None: g.rank if isinstance(g, Group) else 0)
        m.setattr(megatron, "group_size", lambda g=None: TP if isinstance(g, Group) else 1)
        return shardsync.from_megatron(layer)


def all_ranks(
    hf: dict[str, list[torch.Tensor]],
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[list[torch.nn.Module], dict[str, list[LocalShard]]]:
    """Every (EP, TP) rank's layer, and their shards together (one process holds them all)."""
    layers = [moe_layer(hf, ep, tp) for ep in range(EP) for tp in range(TP)]
    state: dict[str, list[LocalShard]] = {}
    for i, layer in enumerate(layers):
        for key, value in placed(layer, i % TP, monkeypatch).items():
            state.setdefault(key, []).extend(value if isinstance(value, list) else [value])
    return layers, state


def test_grouped_weights_are_the_stacked_per_expert_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    hf = experts_hf()
    _, state = all_ranks(hf, monkeypatch)
    assert sorted(state) == ["experts.weight1", "experts.weight2"]
    w1 = state["experts.weight1"]
    assert {s.global_shape for s in w1} == {(E, 2 * FFN, HID)} and len(w1) == EP * TP * 2  # gate_r, up_r
    got = dict(shardsync.full_params(state))
    assert torch.equal(got["experts.weight1"], torch.stack([torch.cat([g, u]) for g, u in zip(hf["gate"], hf["up"])]))
    assert torch.equal(got["experts.weight2"], torch.stack(hf["down"]))


def test_views_share_the_parameters_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = moe_layer(experts_hf(), 1, 1)
    state = placed(layer, 1, monkeypatch)
    base = layer.experts.weight1.untyped_storage().data_ptr()
    assert all(s.local.untyped_storage().data_ptr() == base for s in state["experts.weight1"])
    down = state["experts.weight2"]
    assert isinstance(down, LocalShard) and down.global_offset == (2, 0, 3)  # experts 2, 3; ffn rows 3:6


@pytest.mark.parametrize("name, qwen", [("megatron-mixtral-grouped", False), ("megatron-qwen2-moe-grouped", True)])
def test_grouped_mappings_export_and_load_back(name: str, qwen: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    mg = megatron_moe(shared=qwen)  # the rest of the model, and per-expert fc1/fc2 for the reference
    want = hf_moe(mg, qwen=qwen)
    state: dict[str, Any] = {k: v for k, v in mg.items() if ".local_experts." not in k}
    for i in range(2):
        moe = "mlp." if qwen else "block_sparse_moe."
        names = ("gate_proj", "up_proj", "down_proj") if qwen else ("w1", "w3", "w2")
        per = {
            kind: [want[f"model.layers.{i}.{moe}experts.{e}.{n}.weight"] for e in range(EXPERTS)]
            for kind, n in zip(("gate", "up", "down"), names)
        }
        stacked_fc1 = torch.stack([torch.cat([g, u]) for g, u in zip(per["gate"], per["up"])])
        state[f"decoder.layers.{i}.mlp.experts.weight1"] = stacked_fc1  # as from_megatron presents it
        state[f"decoder.layers.{i}.mlp.experts.weight2"] = torch.stack(per["down"])
    mapping = Mapping.parse(name, params=PARAMS)
    assert_same(dict(shardsync.full_params(state, mapping)), want)
    dst = {k: torch.zeros_like(v) for k, v in state.items()}
    result = shardsync.load(dst, want, Mapping.parse(name, params=PARAMS, reverse=True))
    assert (result.missing, result.unexpected, result.mismatched) == ((), (), ())
    for k, v in state.items():
        rows = slice(0, 11) if k in ("embedding.word_embeddings.weight", "output_layer.weight") else slice(None)
        assert torch.equal(dst[k][rows], v[rows]), k


def test_load_writes_each_ranks_grouped_weights_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    hf = experts_hf()
    per_expert = {
        f"model.layers.0.block_sparse_moe.experts.{e}.{n}.weight": hf[kind][e]
        for e in range(E)
        for kind, n in (("gate", "w1"), ("up", "w3"), ("down", "w2"))
    }
    program = [
        "decoder.layers.0.mlp.experts.weight1 -> fc1.*, unstack",
        "fc1.$EXPERT_ID -> model.layers.0.block_sparse_moe.experts.$EXPERT_ID.w1.weight, "
        "model.layers.0.block_sparse_moe.experts.$EXPERT_ID.w3.weight, axis=0",
        "decoder.layers.0.mlp.experts.weight2 -> model.layers.0.block_sparse_moe.experts.*.w2.weight, unstack",
    ]
    want = [moe_layer(hf, ep, tp) for ep in range(EP) for tp in range(TP)]
    fresh = [moe_layer(hf, ep, tp) for ep in range(EP) for tp in range(TP)]
    for layer in fresh:
        with torch.no_grad():
            layer.experts.weight1.zero_()
            layer.experts.weight2.zero_()
    dst: dict[str, list[LocalShard]] = {}
    for i, layer in enumerate(fresh):
        for key, value in placed(layer, i % TP, monkeypatch).items():
            dst.setdefault("decoder.layers.0.mlp." + key, []).extend(value if isinstance(value, list) else [value])
    shardsync.load(dst, per_expert, Mapping.parse(program, reverse=True))
    for got, ref in zip(fresh, want):
        assert torch.equal(got.experts.weight1, ref.experts.weight1)
        assert torch.equal(got.experts.weight2, ref.experts.weight2)
