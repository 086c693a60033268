"""FSDP2 ``fully_shard`` over TP ``parallelize_module`` (2 x 2 mesh, 4 gloo ranks, both mesh orders):
a transformers Llama whose parameters are DTensors with ``_StridedShard`` placements, as the source of
``full_params`` and ``reshard`` and the destination of ``load``. ``DTensor.full_tensor()`` is the
reference; the vocab (17) and ffn (20) sizes split unevenly."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardsync
from dest_helpers import hf_state
from llama_helpers import llama_config, llama_tp_plan
from multiproc import run_ranks

transformers = pytest.importorskip("transformers")


def fsdp_tp_llama(names: tuple[str, str]) -> Any:
    """A Llama tensor-parallel on mesh ``"tp"``, then ``fully_shard`` per layer and root on ``"dp"``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    torch.manual_seed(0)  # the same values on every rank before sharding
    model = transformers.LlamaForCausalLM(llama_config())
    parallelize_module(model, mesh["tp"], llama_tp_plan())
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _full(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}


def _bad(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k in want if not torch.equal(got[k], want[k]))


def _step(model: Any, step: int) -> None:
    """A stand-in for an optimizer step: every shard changes, replicas alike."""
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().mul_(0.5).add_(step + 0.125)


def source_worker(rank: int, world: int, names: tuple[str, str]) -> dict[str, Any]:
    from shardsync.layout import dtensor_shards

    model = fsdp_tp_llama(names)
    state = model.state_dict()
    out: dict[str, Any] = {
        "placements": sorted({str(list(v.placements)) for v in state.values()}),
        "boxes": max(len(dtensor_shards(v)) for v in state.values()),
    }
    want = _full(model)
    got = {k: t.clone() for k, t in shardsync.full_params(state)}
    out["keys"], out["bad stream"] = sorted(got), _bad(got, want)
    dst = transformers.LlamaForCausalLM(llama_config())
    out["bad reshard"], out["same plan"] = [], []
    first = None
    for step in range(3):
        _step(model, step)
        result = shardsync.reshard(model, dst)
        first = first or result.plan
        out["same plan"].append(result.plan is first)
        out["bad reshard"].append(_bad({k: v.detach() for k, v in dst.state_dict().items()}, _full(model)))
    return out


def load_worker(rank: int, world: int, names: tuple[str, str], path: str) -> dict[str, Any]:
    model = fsdp_tp_llama(names)
    before = {k: v.to_local().data_ptr() for k, v in model.state_dict().items()}
    shardsync.load(model, path)
    after = {k: v.to_local().data_ptr() for k, v in model.state_dict().items()}
    return {"bad": _bad(_full(model), shardsync.read_tensors(path)), "in place": before == after}


def fsdp_tp_worker(rank: int, world: int, names: tuple[str, str], path: str) -> dict[str, Any]:
    """Both 4-rank checks of one mesh order in one spawn: the model as a source, then as a destination."""
    return {"source": source_worker(rank, world, names), "load": load_worker(rank, world, names, path)}


@pytest.fixture(scope="module", params=[("dp", "tp"), ("tp", "dp")], ids=["dp-tp", "tp-dp"])
def fsdp_tp(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    path = tmp_path_factory.mktemp("hf")
    shardsync.save_safetensors(hf_state().items(), path)
    return run_ranks(fsdp_tp_worker, 4, request.param, str(path), timeout=900)


def test_fsdp_over_tp_llama_streams_and_reshards_exactly(fsdp_tp: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(r["source"] for r in fsdp_tp):
        assert any("_StridedShard(dim=0, sf=2)" in p for p in r["placements"]), r["placements"]
        assert r["keys"] == sorted(hf_state()), rank
        assert r["bad stream"] == [], (rank, r["bad stream"])
        assert r["bad reshard"] == [[], [], []], (rank, r["bad reshard"])
        assert r["same plan"] == [True, True, True], rank


def test_hf_checkpoint_loads_into_fsdp_over_tp_llama(fsdp_tp: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(r["load"] for r in fsdp_tp):
        assert r["bad"] == [] and r["in place"], (rank, r)


def strided_worker(rank: int, world: int) -> dict[str, Any]:
    """A 1-D mesh with ``_StridedShard(0, 2)`` alone: each rank holds two runs of rows (two boxes)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from reference import arange_tensor
    from shardsync.layout import dtensor_shards

    mesh, placements = init_device_mesh("cpu", (world,)), [_StridedShard(0, split_factor=2)]
    full = arange_tensor((17, 3), step=0.5)
    local = placements[0]._split_tensor(full, world, with_padding=False)[0][rank].clone()
    dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())
    streamed = dict(shardsync.full_params({"w": dt}))["w"]
    dst = DTensor.from_local(
        torch.zeros_like(local), mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
    )
    shardsync.load({"w": dst}, {"w": full} if rank == 0 else {})
    return {
        "boxes": [str(s.box) for s in dtensor_shards(dt)],
        "stream": torch.equal(streamed, full),
        "reference": torch.equal(dt.full_tensor(), full),
        "load": torch.equal(dst.full_tensor(), full),
    }


def dtensor_worker(rank: int, world: int) -> dict[str, Any]:
    """The 2-rank checks in one spawn: a strided 1-D mesh, then DTensors that are refused."""
    return {"strided": strided_worker(rank, world), "refused": refused_worker(rank, world)}


@pytest.fixture(scope="module")
def on_two() -> list[dict[str, Any]]:
    return run_ranks(dtensor_worker, 2, timeout=300)


def test_strided_shard_with_several_boxes_per_rank(on_two: list[dict[str, Any]]) -> None:
    r0, r1 = (r["strided"] for r in on_two)
    assert r0["boxes"] == ["[0:5, 0:3]", "[9:13, 0:3]"] and r1["boxes"] == ["[5:9, 0:3]", "[13:17, 0:3]"]
    for r in (r0, r1):
        assert r["reference"] and r["stream"] and r["load"], r


def refused_worker(rank: int, world: int) -> dict[str, str]:
    """A Partial DTensor, and a local tensor the placements do not explain, fail on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    mesh = init_device_mesh("cpu", (world,))
    partial = DTensor.from_local(torch.ones(3, 2), mesh, [Partial()])
    wrong = DTensor.from_local(
        torch.ones(4, 2), mesh, [Shard(0)], run_check=False, shape=(7, 2), stride=(2, 1)
    )  # rank 1 of 7 rows holds 3, not 4
    out = {}
    for name, state in (("partial", {"w": partial}), ("wrong", {"w": wrong})):
        try:
            dict(shardsync.full_params(state))
            out[name] = "no error"
        except shardsync.ShardsyncError as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def test_unsupported_dtensors_fail_on_every_rank(on_two: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(r["refused"] for r in on_two):
        assert (
            "'w': DTensor placement Partial(sum) is not supported; use Shard, _StridedShard or Replicate"
            in r["partial"]
        ), (rank, r)
        assert "the local tensor is [4, 2], the placements give [3, 2]" in r["wrong"], (rank, r)
        assert "'w': DTensor [7, 2]" in r["wrong"], (rank, r)
