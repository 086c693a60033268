"""full_params on 2 and 4 gloo processes, every strategy, against the dense reference (tier 2).

Each spawn runs many scenarios; a worker compares what its rank yields with full tensors it builds
itself (arange-filled, odd sizes) and sends back only names, mismatches and counters.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from multiproc import BACKEND, on_device, run_ranks
from reference import arange_tensor
from shardsync.errors import DistributedError, LayoutError, PlanError
from shardsync.layout import LocalShard, shard_dim
from shardsync.stream import full_params

H, G, D, FFN = 8, 4, 2, 8  # query heads, kv heads, head dim, ffn width: qkv has (H + 2G) * D rows


# -- dense references --------------------------------------------------------------------------------


def split_qkv(w: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Megatron's blocked fused QKV: each of ``tp`` row blocks is [Q_r | K_r | V_r]."""
    q, k = H // tp * D, G // tp * D
    blocks = w.chunk(tp, 0)
    return [
        torch.cat([b[:q] for b in blocks]),
        torch.cat([b[q : q + k] for b in blocks]),
        torch.cat([b[q + k :] for b in blocks]),
    ]


def split_ffn(w: torch.Tensor, tp: int) -> list[torch.Tensor]:
    blocks = w.chunk(tp, 0)
    return [torch.cat([b[: FFN // tp] for b in blocks]), torch.cat([b[FFN // tp :] for b in blocks])]


def qkv_statement(prefix: str) -> str:
    return (
        f"{prefix}.qkv -> {prefix}.q, {prefix}.k, {prefix}.v, fused_qkv_old, num_heads={H}, "
        f"num_key_value_groups={G}, axis=0"
    )


# -- cases: (state of this rank, mapping, reference) ---------------------------------------------------


def case_tp(rank: int, world: int) -> tuple[dict, Any, dict]:
    n = 17 if world == 2 else 127
    full = {
        "a": arange_tensor((n, 3)),
        "b": arange_tensor((5, n), start=1000),
        "h": arange_tensor((n, 2), step=0.37).to(torch.bfloat16),
        "norm": arange_tensor((6,), start=7),
        "ids": torch.arange(7) * 3,
    }
    state: dict[str, Any] = {
        "a": shard_dim(full["a"], 0, rank, world),
        "norm": full["norm"],
        "b": shard_dim(full["b"], 1, rank, world),
        "h": shard_dim(full["h"], 0, rank, world),
    }
    if rank == 0:
        state["ids"] = full["ids"]
    return state, None, full


def case_fused(rank: int, world: int) -> tuple[dict, Any, dict]:
    state: dict[str, Any] = {"norm": arange_tensor((5,), step=0.3791)}
    ref = {"norm": state["norm"].to(torch.bfloat16).to(torch.float32)}
    for layer in range(2):
        p = f"layers.{layer}"
        qkv = arange_tensor(((H + 2 * G) * D, 5), start=1000 * layer)
        fc1 = arange_tensor((2 * FFN, 5), start=500 + 1000 * layer)
        proj = arange_tensor((5, H * D), start=-300 - 1000 * layer)
        state |= {
            f"{p}.qkv": shard_dim(qkv, 0, rank, world),
            f"{p}.fc1": shard_dim(fc1, 0, rank, world),
            f"{p}.proj": shard_dim(proj, 1, rank, world),
        }
        ref |= dict(zip([f"{p}.q", f"{p}.k", f"{p}.v"], split_qkv(qkv, world)))
        ref |= dict(zip([f"{p}.gate", f"{p}.up"], split_ffn(fc1, world)))
        ref[f"{p}.proj_t"] = proj.T
    mapping = [
        qkv_statement("layers.$LAYER_ID"),
        "layers.$LAYER_ID.fc1 -> layers.$LAYER_ID.gate, layers.$LAYER_ID.up, fused_ffn, axis=0",
        "layers.$LAYER_ID.proj^T -> layers.$LAYER_ID.proj_t",
        "norm -> norm, dtype='bfloat16'",
        "norm -> norm, dtype='float32'",
    ]
    return state, mapping, ref


def case_experts(rank: int, world: int) -> tuple[dict, Any, dict]:
    experts = {e: arange_tensor((3, 4), start=100 * e) for e in range(2 * world + 1)}
    state = {f"layers.0.experts.{e}.w": x for e, x in experts.items() if e % world == rank}
    ref = {f"model.layers.0.mlp.experts.{e}.weight": x for e, x in experts.items()}
    return state, ["layers.0.experts.$EXPERT_ID.w -> model.layers.0.mlp.experts.$EXPERT_ID.weight"], ref


def case_empty_rank(rank: int, world: int) -> tuple[dict, Any, dict]:
    full = {"a": arange_tensor((17, 3)), "solo": arange_tensor((4,), start=9)}
    if rank == world - 1:
        return {}, None, full  # this rank holds nothing and still receives everything
    state: dict[str, Any] = {"a": shard_dim(full["a"], 0, rank, world - 1)}
    if rank == 0:
        state["solo"] = full["solo"]
    return state, None, full


def case_count(rank: int, world: int) -> tuple[dict, Any, dict]:
    full = {f"k{i}": arange_tensor((2 * world, 4), start=100 * i) for i in range(6)}
    return {k: shard_dim(x, 0, rank, world) for k, x in full.items()}, None, full


# -- running and comparing -----------------------------------------------------------------------------


def run(state: dict, mapping: Any, ref: dict, **kw: Any) -> dict[str, Any]:
    kw.setdefault("transport", "backend")  # the strategies' collectives (test_shm.py: shared memory)
    stream = full_params(on_device(state), mapping, **kw)
    names, problems = [], []
    for name, t in stream:
        names.append(name)
        t = t.cpu()
        want = ref.get(name)
        if want is None or t.dtype != want.dtype or t.shape != want.shape or not torch.equal(t, want):
            problems.append(name)
        on_cpu = BACKEND == "gloo"  # under NCCL the state was copied to the GPU
        if name in state and isinstance(state[name], torch.Tensor) and kw.get("copy") is False and on_cpu:
            problems += [] if t is state[name] else [f"{name} copied"]
    s, c, rank = stream.stats, stream.plan.costs, dist.get_rank(kw.get("group"))
    return {
        "names": names,
        "problems": problems,
        "strategy": stream.plan.strategy,
        "stats": (s.bytes_sent, s.bytes_received, s.collectives),
        "peak": s.peak_bytes,
        "costs": (c.bytes_sent[rank], c.bytes_received[rank], c.collectives[rank]),
        "plan_peak": c.peak_bytes[rank],
    }


def strategies(world: int, mesh: Any) -> list[tuple[str, dict]]:
    return [
        ("broadcast", {}),
        ("bucketed", {"bucket_bytes": 256}),
        ("p2p", {}),
        ("mesh2d", {"mesh": mesh}),
        ("auto", {}),
    ]


def _catch(fn: Any) -> str:
    try:
        fn()
    except (DistributedError, LayoutError, PlanError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _errors(rank: int, world: int) -> dict[str, str]:
    full = arange_tensor((17, 3))
    holes = {"w": LocalShard(full[:5], (17, 3), (0, 0))} if rank == 0 else {}
    bad_map = ["nope -> x"] if rank == 1 else None
    return {
        "holes": _catch(lambda: list(full_params(holes))),
        "shape": _catch(lambda: list(full_params({"w": torch.zeros(3 + rank)}))),
        "one bad mapping": _catch(lambda: list(full_params({"w": full}, bad_map))),
        "options differ": _catch(lambda: list(full_params({"w": full, "v": full}, num_splits=2, split_index=rank))),
    }


def worker_w2(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out: dict = {}
    for case in (case_tp, case_fused, case_experts, case_empty_rank):
        state, mapping, ref = case(rank, world)
        for name, kw in strategies(world, (dist.group.WORLD, None)):
            out[(case.__name__, name)] = run(state, mapping, ref, strategy=name, **kw)
    state, _, ref = case_tp(rank, world)
    out["copy=False"] = run(state, None, ref, copy=False)
    replicated = {"norm": state["norm"], "bias": arange_tensor((3,), start=5)}
    out["replicated"] = run(replicated, None, replicated, strategy="broadcast")
    out["consumers=1"] = run(state, None, ref, consumers=1)
    out["consumers=[1,0]"] = run(state, None, ref, consumers=[1, 0], split_by="bytes")
    out["budget"] = run(state, None, ref, strategy="bucketed", memory_budget=1200)
    for i in range(3):
        out[("split", i)] = run(state, None, ref, strategy="bucketed", num_splits=3, split_index=i)
    state, _, ref = case_count(rank, world)
    out["count"] = run(state, None, ref, strategy="bucketed", bucket_bytes=2 * 2 * 4 * 4)
    mesh = init_device_mesh("cpu" if BACKEND == "gloo" else "cuda", (world,))
    full = arange_tensor((17, 5))
    dstate = {"d": distribute_tensor(full, mesh, [Shard(0)]), "r": distribute_tensor(full, mesh, [Replicate()])}
    out["dtensor"] = run(dstate, None, {"d": full, "r": full})
    out["errors"] = _errors(rank, world)
    return out


def check(records: list[dict], key: Any, names: list[str] | None = None) -> None:
    for rank, rec in enumerate(records):
        r = rec[key]
        assert r["problems"] == [], (key, rank, r["problems"])
        assert r["stats"] == r["costs"], (key, rank)
        assert r["peak"] <= r["plan_peak"], (key, rank)
        if names is not None:
            assert sorted(r["names"]) == sorted(names), (key, rank)
    by_set: dict[frozenset, set[tuple]] = {}
    for rec in records:  # ranks that yield the same targets yield them in the same order
        by_set.setdefault(frozenset(rec[key]["names"]), set()).add(tuple(rec[key]["names"]))
    assert all(len(orders) == 1 for orders in by_set.values()), (key, by_set)


def test_two_ranks_every_strategy_and_scenario() -> None:
    records = run_ranks(worker_w2, 2, timeout=240)
    for case in (case_tp, case_fused, case_experts, case_empty_rank):
        ref = case(0, 2)[2]
        for name, _ in strategies(2, None):
            check(records, (case.__name__, name), list(ref))
            if name != "auto":
                assert records[0][(case.__name__, name)]["strategy"] == name
    tp = list(case_tp(0, 2)[2])
    check(records, "copy=False", tp)
    check(records, "replicated", ["bias", "norm"])
    assert [rec["replicated"]["stats"] for rec in records] == [(0, 0, 0)] * 2  # held everywhere: no traffic
    check(records, "consumers=1")
    assert records[0]["consumers=1"]["names"] == []
    assert sorted(records[1]["consumers=1"]["names"]) == sorted(tp)
    check(records, "consumers=[1,0]")
    parts = [records[r]["consumers=[1,0]"]["names"] for r in (1, 0)]
    assert parts[0] + parts[1] == sorted(tp) and all(parts)
    check(records, "budget", tp)
    assert all(rec["budget"]["peak"] <= 1200 for rec in records)
    splits = [records[0][("split", i)]["names"] for i in range(3)]
    assert splits == [sorted(tp)[0:2], sorted(tp)[2:4], sorted(tp)[4:5]]
    check(records, "count")
    assert [rec["count"]["stats"][2] for rec in records] == [6, 6]  # 3 rounds x 2 senders
    check(records, "dtensor", ["d", "r"])
    errors = [rec["errors"] for rec in records]
    assert errors[0] == errors[1]  # every rank raises the same error
    e = errors[0]
    assert e["holes"].startswith("LayoutError") and "'w': box [5:17, 0:3]" in e["holes"]
    assert e["shape"].startswith("LayoutError") and "ranks disagree on global shape" in e["shape"]
    assert e["one bad mapping"].startswith("DistributedError: phase 'plan' failed on rank(s) [1]")
    assert "unknown name 'nope'" in e["one bad mapping"]
    assert e["options differ"].startswith("PlanError: ranks built different plans")
