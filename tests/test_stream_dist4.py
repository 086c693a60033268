"""full_params on 4 gloo processes: TP x PP, replicas, splits across replica groups, 2-D mesh."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from multiproc import BACKEND, run_ranks
from reference import arange_tensor
from shardsync.layout import shard_dim
from shardsync.stream import plan
from test_stream_dist import (
    case_count,
    case_empty_rank,
    case_experts,
    case_fused,
    case_tp,
    check,
    qkv_statement,
    run,
    split_qkv,
    strategies,
)

CASES = (case_tp, case_fused, case_experts, case_empty_rank)


def case_tp_pp(rank: int, world: int) -> tuple[dict, Any, dict]:
    """TP=2 inside each of 2 pipeline stages; layers numbered from 1 (stage 0: 1, 2; stage 1: 3, 4)."""
    stage, tp = divmod(rank, 2)
    state: dict[str, Any] = {}
    ref: dict[str, torch.Tensor] = {}
    for layer in range(1, 5):
        qkv = arange_tensor((32, 5), start=100 * layer)
        proj = arange_tensor((5, 16), start=-100 * layer, step=0.5)
        if (layer - 1) // 2 == stage:
            state[f"layers.{layer}.qkv"] = shard_dim(qkv, 0, tp, 2)
            state[f"layers.{layer}.proj"] = shard_dim(proj, 1, tp, 2)
        ref |= dict(zip([f"layers.{layer - 1}.{x}" for x in "qkv"], split_qkv(qkv, 2)))
        ref[f"layers.{layer - 1}.proj"] = proj
    mapping = [qkv_statement("layers.$LAYER_ID_OFFSET"), "layers.$LAYER_ID_OFFSET.proj -> layers.$LAYER_ID_OFFSET.proj"]
    return state, mapping, ref


def case_replicas(rank: int, world: int) -> tuple[dict, Any, dict]:
    """DP=2 x TP=2 in one group: every shard has 2 holders; 'pair' lives on ranks 0 and 1 only."""
    full = {f"w{i}": arange_tensor((9, 4), start=50 * i) for i in range(4)}
    state: dict[str, Any] = {k: shard_dim(x, 0, rank % 2, 2) for k, x in full.items()}
    full["pair"] = arange_tensor((6,), start=-5)
    if rank < 2:
        state["pair"] = full["pair"]
    return state, None, full


def worker_w4(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu" if BACKEND == "gloo" else "cuda", (2, 2))
    out: dict = {}
    for case in (*CASES, case_tp_pp, case_replicas):
        state, mapping, ref = case(rank, world)
        for name, kw in strategies(world, mesh):
            out[(case.__name__, name)] = run(state, mapping, ref, strategy=name, **kw)
    state, _, ref = case_replicas(rank, world)
    p = plan(state, strategy="broadcast")
    out["senders"] = sorted(r.sender for r in p.reads if r.receivers)
    state, _, ref = case_tp(rank, world)
    hv = (mesh.get_group(1), mesh.get_group(0))
    out["mesh tuple, global"] = run(state, None, ref, strategy="mesh2d", mesh=hv, mesh_threshold_bytes=600)
    out["consumers=[1,3]"] = run(state, None, ref, consumers=[1, 3])
    out["consumers=2"] = run(state, None, ref, consumers=2, strategy="p2p", bucket_bytes=1000)
    out["budget"] = run(state, None, ref, strategy="bucketed", memory_budget=5000)
    state, _, ref = case_count(rank, world)
    out["count"] = run(state, None, ref, strategy="bucketed", bucket_bytes=2 * 2 * 4 * 4)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    state, _, ref = case_replicas(rank % 2, 2)  # each pair of ranks holds a whole TP=2 replica
    state.pop("pair", None)
    ref.pop("pair")
    for by in ("count", "bytes"):
        out[("dp split", by)] = run(
            state, None, ref, group=groups[rank // 2], num_splits=2, split_index=rank // 2, split_by=by
        )
    return out


def test_four_ranks_every_strategy_and_scenario() -> None:
    records = run_ranks(worker_w4, 4, timeout=300)
    for case in (*CASES, case_tp_pp, case_replicas):
        ref = case(0, 4)[2]
        for name, _ in strategies(4, None):
            check(records, (case.__name__, name), list(ref))
    # Replicas share the sending: the 80 B shards go to ranks 0 and 2 in turn, the 64 B ones to 1 and
    # 3, and 'pair' (held by 0 and 1) to rank 1, which has sent less.
    assert records[0]["senders"] == [0, 0, 1, 1, 1, 2, 2, 3, 3]
    tp = sorted(case_tp(0, 4)[2])
    check(records, "mesh tuple, global", tp)
    check(records, "consumers=[1,3]")
    assert [records[r]["consumers=[1,3]"]["names"] for r in (1, 3)] == [tp[:3], tp[3:]]
    assert records[0]["consumers=[1,3]"]["names"] == records[2]["consumers=[1,3]"]["names"] == []
    check(records, "consumers=2")
    assert records[2]["consumers=2"]["names"] == tp
    check(records, "budget", tp)
    assert all(rec["budget"]["peak"] <= 5000 for rec in records)
    check(records, "count")
    assert [rec["count"]["stats"][2] for rec in records] == [12] * 4  # 3 rounds x 4 senders
    names = sorted(case_replicas(0, 2)[2])
    names.remove("pair")
    for by in ("count", "bytes"):
        check(records, ("dp split", by))
        parts = [records[r][("dp split", by)]["names"] for r in range(4)]
        assert parts[0] == parts[1] and parts[2] == parts[3] and parts[0] + parts[2] == names
        assert parts[0] and parts[2]


def test_pipeline_stages_hold_disjoint_keys() -> None:
    # The plan in a single process with the TP x PP layout merged by hand: every target reads from
    # exactly one pipeline stage (ranks {0, 1} or {2, 3}), never both.
    from shardsync.layout import GlobalLayout, local_layout
    from shardsync.mapping import resolve
    from shardsync.planning import PlanOptions, build_plan

    lay = GlobalLayout.merge([local_layout(case_tp_pp(r, 4)[0]) for r in range(4)])
    p = build_plan(resolve(case_tp_pp(0, 4)[1], lay), lay, PlanOptions(strategy="broadcast"))
    for t in p.targets:
        holders = {h for c in t.copies for h in p.reads[c.read].holders}
        assert holders in ({0, 1}, {2, 3}), (t.name, holders)
    # q and v complete with k (one fused read feeds all three), before proj
    assert p.order[:4] == ("layers.0.k", "layers.0.q", "layers.0.v", "layers.0.proj")
