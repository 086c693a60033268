"""Grouped expert tensors on 2 gloo ranks: torchtitan's ``GroupedExperts`` (``w1/w2/w3 [E, ...]``)
under expert parallelism (sharded along the expert dim) and expert tensor parallelism (``w2`` cut
along its hidden dim, unevenly), to HuggingFace per-expert names with ``full_params`` and back into
the sharded layout with ``load``; each expert is read from the rank that holds it, never gathered."""

from __future__ import annotations

import torch

import shardsync
from multiproc import run_ranks
from reference import arange_tensor
from shardsync import LocalShard

E, HID, DIM = 4, 7, 5  # experts, expert hidden dim, model dim (odd, so misplacement shows)
# torchtitan names -> HuggingFace Qwen3-MoE / DeepSeek per-expert names; w1 gate, w3 up, w2 down
TITAN_TO_HF = [
    "layers.$LAYER_ID.moe.router.gate.weight -> model.layers.$LAYER_ID.mlp.gate.weight",
    "layers.$LAYER_ID.moe.experts.w1 -> model.layers.$LAYER_ID.mlp.experts.*.gate_proj.weight, unstack",
    "layers.$LAYER_ID.moe.experts.w3 -> model.layers.$LAYER_ID.mlp.experts.*.up_proj.weight, unstack",
    "layers.$LAYER_ID.moe.experts.w2 -> model.layers.$LAYER_ID.mlp.experts.*.down_proj.weight, unstack",
]
FULL = {
    "layers.0.moe.router.gate.weight": arange_tensor((E, DIM), start=-50),
    "layers.0.moe.experts.w1": arange_tensor((E, HID, DIM), start=1000),
    "layers.0.moe.experts.w3": arange_tensor((E, HID, DIM), start=2000),
    "layers.0.moe.experts.w2": arange_tensor((E, DIM, HID), start=3000),
}
W2_COLS = [(0, 4), (4, 7)]  # rank r holds w2[:, :, lo:hi]: expert tensor parallelism, uneven


def _shards(full: dict[str, torch.Tensor], rank: int) -> dict[str, object]:
    per = E // 2
    out: dict[str, object] = {"layers.0.moe.router.gate.weight": full["layers.0.moe.router.gate.weight"].clone()}
    for w in ("w1", "w3"):
        x = full[f"layers.0.moe.experts.{w}"]
        out[f"layers.0.moe.experts.{w}"] = LocalShard(
            x[rank * per : (rank + 1) * per].clone(), tuple(x.shape), (rank * per, 0, 0)
        )
    x = full["layers.0.moe.experts.w2"]
    lo, hi = W2_COLS[rank]
    out["layers.0.moe.experts.w2"] = LocalShard(x[:, :, lo:hi].clone(), tuple(x.shape), (0, 0, lo))
    return out


def _hf(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    hf = {"model.layers.0.mlp.gate.weight": full["layers.0.moe.router.gate.weight"]}
    for e in range(E):
        hf[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = full["layers.0.moe.experts.w1"][e]
        hf[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = full["layers.0.moe.experts.w3"][e]
        hf[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = full["layers.0.moe.experts.w2"][e]
    return hf


def _worker(rank: int, world: int) -> dict:
    state = _shards(FULL, rank)
    want = _hf(FULL)
    got = dict(shardsync.full_params(state, TITAN_TO_HF))
    out: dict = {"names": sorted(got) == sorted(want), "bad": [k for k in want if not torch.equal(got[k], want[k])]}
    plan = shardsync.plan(state, TITAN_TO_HF)
    holders = {}  # each gate/up expert target: the ranks holding what it reads
    for t in plan.targets:
        if "gate_proj" in t.name or "up_proj" in t.name:
            holders[t.name] = sorted({h for c in t.copies for h in plan.reads[c.read].holders})
    out["holders"] = holders
    dst = {
        k: LocalShard(torch.zeros_like(v.local), v.global_shape, v.global_offset)
        if isinstance(v, LocalShard)
        else torch.zeros_like(v)
        for k, v in state.items()
    }
    shardsync.load(dst, want, TITAN_TO_HF, reverse=True)  # HF per-expert -> the EP/ETP-sharded experts
    out["load bad"] = [
        k
        for k, v in dst.items()
        if not torch.equal(
            v.local if isinstance(v, LocalShard) else v,
            state[k].local if isinstance(state[k], LocalShard) else state[k],
        )
    ]  # type: ignore[union-attr]
    return out


def test_grouped_experts_under_expert_parallelism_both_ways() -> None:
    results = run_ranks(_worker, 2)
    for rank, r in enumerate(results):
        assert r["names"] and r["bad"] == [] and r["load bad"] == [], (rank, r)
        for e in range(E):  # experts 0-1 live on rank 0, 2-3 on rank 1: read there, not gathered
            for kind in ("gate_proj", "up_proj"):
                assert r["holders"][f"model.layers.0.mlp.experts.{e}.{kind}.weight"] == [e // 2], (rank, e)
