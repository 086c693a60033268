"""shardsync.reshard on 4 gloo ranks: trainers (Megatron TP=2, fused QKV with GQA, fused gate/up) to
inference workers (HF names, TP=2, separate q/k/v), colocated with replicas, strict errors, failures
raised on every rank, the plan cache and a memory budget."""

from __future__ import annotations

from typing import Any

import torch

from dest_helpers import HIDDEN, LAYERS, MAPPING, hf_shards, hf_state, megatron_shards
from multiproc import run_ranks
from shardsync import DistributedError, LoadError, LocalShard, reshard


def _local(v: Any) -> torch.Tensor:
    return v.local if isinstance(v, LocalShard) else v


def _bad(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    return [k for k in want if not torch.equal(_local(got[k]), _local(want[k]))]


def _zero(state: dict[str, Any]) -> None:
    for v in state.values():
        _local(v).zero_()


def _catch(fn: Any) -> str:
    try:
        fn()
    except (LoadError, DistributedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _trainers_to_inference(rank: int, hf: dict) -> dict:
    """Ranks 0-1 train (Megatron TP=2), ranks 2-3 serve (HF TP=2), each destination shard exact."""
    src = megatron_shards(hf, rank, 2) if rank < 2 else None
    dst = hf_shards({k: torch.zeros_like(v) for k, v in hf.items()}, rank - 2, 2) if rank >= 2 else None
    first = reshard(src, dst, MAPPING)
    c = first.plan.costs
    out = {
        "bad": _bad(dst, hf_shards(hf, rank - 2, 2)) if dst else [],
        "mine": sum(_local(v).numel() * 4 for v in dst.values()) if dst else 0,
        "stats": (first.stats.bytes_sent, first.stats.bytes_received, first.stats.collectives),
        "costs": (c.bytes_sent[rank], c.bytes_received[rank], c.collectives[rank]),
        "kinds": sorted({s.kind for s in first.plan.steps}),
        "transport": first.stats.transport,
    }
    if dst:
        _zero(dst)
    gloo = reshard(src, dst, MAPPING, transport="backend")  # the same boxes through the collectives
    out["bad gloo"] = _bad(dst, hf_shards(hf, rank - 2, 2)) if dst else []
    out["stats gloo"] = (gloo.stats.bytes_sent, gloo.stats.bytes_received, gloo.stats.transport)
    if dst:
        _zero(dst)
    second = reshard(src, dst, MAPPING)  # the RL loop: same layouts, the cached plan
    out["same plan"] = second.plan is first.plan
    out["bad again"] = _bad(dst, hf_shards(hf, rank - 2, 2)) if dst else []
    out["stats again"] = (second.stats.bytes_sent, second.stats.bytes_received, second.stats.collectives)
    # only rank 3 changes (it leaves): every rank must notice and plan again
    if dst:
        _zero(dst)
    third = reshard(src, None if rank == 3 else dst, MAPPING)
    out["third replanned"] = third.plan is not first.plan
    out["third received"] = third.stats.bytes_received
    out["bad third"] = _bad(dst, hf_shards(hf, 0, 2)) if rank == 2 else []
    budget = reshard(src, dst, MAPPING, memory_budget=600, bucket_bytes=600)
    out["budget peak"] = budget.stats.peak_bytes
    out["bad budget"] = _bad(dst, hf_shards(hf, rank - 2, 2)) if dst else []
    return out


def _replicated_inference(rank: int, hf: dict) -> dict:
    """Ranks 2-3 each serve the whole model (TP=1, two replicas): every box goes by one broadcast
    from its trainer to both; with strategy='p2p', by one message to each."""
    src = megatron_shards(hf, rank, 2) if rank < 2 else None
    out = {}
    for strategy, transport in (("auto", "backend"), ("p2p", "backend"), ("p2p", "shm")):
        dst = {k: torch.zeros_like(v) for k, v in hf.items()} if rank >= 2 else None
        r = reshard(src, dst, MAPPING, strategy=strategy, transport=transport)  # type: ignore[arg-type]
        out[strategy, transport] = {
            "bad": _bad(dst, hf) if dst else [],
            "strategy": r.plan.strategy,
            "stats": (r.stats.bytes_sent, r.stats.bytes_received),
        }
    return out


def _colocated(rank: int, hf: dict) -> dict:
    """Every rank holds a trainer shard (DP=2 x TP=2: two replicas of each) and an HF TP=4 shard."""
    dst = hf_shards({k: torch.zeros_like(v) for k, v in hf.items()}, rank, 4)
    r = reshard(megatron_shards(hf, rank % 2, 2), dst, MAPPING)
    return {
        "bad": _bad(dst, hf_shards(hf, rank, 4)),
        "senders": sorted({x.sender for x in r.plan.reads if x.sender is not None}),
    }


def _errors(rank: int, hf: dict) -> dict:
    """A destination that does not fit; a bad argument on one rank; nothing written anywhere."""
    src = megatron_shards(hf, rank, 2) if rank < 2 else None
    dst: dict[str, Any] | None = None
    if rank >= 2:
        dst = hf_shards({k: torch.zeros_like(v) for k, v in hf.items()}, rank - 2, 2)
        dst.pop("model.norm.weight")  # the source's norm is now unexpected
        dst["model.extra.weight"] = torch.zeros(3)  # missing
        dst["lm_head.weight"] = torch.zeros(5, 16)  # shape mismatch (not sharded any more)
        dst["model.layers.0.input_layernorm.weight"] = torch.zeros(16, dtype=torch.int32)  # dtype
    out = {
        "strict": _catch(lambda: reshard(src, dst, MAPPING)),
        "written": any(_local(v).any() for v in dst.values()) if dst else False,
        "bad argument": _catch(lambda: reshard(src, 42 if rank == 3 else dst, MAPPING)),
    }
    return out


def _worker(rank: int, world: int) -> dict:
    hf = hf_state()
    return {
        "acceptance": _trainers_to_inference(rank, hf),
        "colocated": _colocated(rank, hf),
        "replicated": _replicated_inference(rank, hf),
        "errors": _errors(rank, hf),
    }


def test_reshard_trainers_to_inference_colocated_and_errors() -> None:
    records = run_ranks(_worker, 4, timeout=300)
    acc = [rec["acceptance"] for rec in records]
    for rank, a in enumerate(acc):
        assert a["bad"] == a["bad again"] == a["bad budget"] == [], rank
        assert a["same plan"] and a["third replanned"] and a["bad third"] == [], rank
        assert a["stats again"] == a["stats"] == a["costs"]
        assert a["budget peak"] <= 600
        assert a["kinds"] == ["multicast", "p2p"]  # the norms, wanted by both workers, are broadcast
        assert a["transport"] == "shm" and a["bad gloo"] == [], rank  # one host: shared memory
        assert a["stats gloo"] == (*a["stats"][:2], "gloo"), rank
    # each inference rank received exactly its own shards' bytes, and sent nothing; trainers only send
    assert [a["stats"][1] for a in acc] == [0, 0, acc[2]["mine"], acc[3]["mine"]]
    assert [a["third received"] for a in acc] == [0, 0, acc[2]["mine"], 0]
    assert acc[2]["mine"] > 0 and [a["stats"][0] for a in acc[2:]] == [0, 0]
    norms = (2 * LAYERS + 1) * HIDDEN * 4  # replicated on both workers, sent once
    assert sum(a["stats"][0] for a in acc[:2]) == acc[2]["mine"] + acc[3]["mine"] - norms

    model = sum(v.numel() * 4 for v in hf_state().values())
    # a box both workers want: one broadcast, two messages, or published once in shared memory
    for strategy, copies in ((("auto", "backend"), 1), (("p2p", "backend"), 2), (("p2p", "shm"), 1)):
        reps = [rec["replicated"][strategy] for rec in records]
        assert all(r["bad"] == [] for r in reps), strategy
        assert [r["stats"][1] for r in reps] == [0, 0, model, model]
        assert sum(r["stats"][0] for r in reps) == copies * model, strategy
    assert records[0]["replicated"]["p2p", "backend"]["strategy"] == "p2p"

    for rank, rec in enumerate(records):
        assert rec["colocated"]["bad"] == [], rank
    assert records[0]["colocated"]["senders"] == [0, 1, 2, 3]  # replicas share the sending

    errors = [rec["errors"] for rec in records]
    assert all(e["strict"] == errors[0]["strict"] for e in errors)  # the same report on every rank
    report = errors[0]["strict"]
    assert report.startswith("LoadError: the source does not fit the destination (4 problems")
    assert "missing 'model.extra.weight'" in report
    assert (
        "unexpected 'model.norm.weight' (statement 1 `decoder.final_layernorm.weight -> model.norm.weight`)"
    ) in report
    assert "shape of 'lm_head.weight': statement 2 `output_layer.weight" in report
    assert "gives [17, 16], the destination is [5, 16]" in report
    assert "dtype of 'model.layers.0.input_layernorm.weight'" in report and "gives float32" in report
    assert not any(e["written"] for e in errors)
    assert all(
        e["bad argument"].startswith("DistributedError: phase 'gather layout' failed on rank(s) [3]") for e in errors
    )
    assert "the destination is a int" in errors[0]["bad argument"]


# -- the plan alone (no processes) ------------------------------------------------------------------


def test_plan_cuts_targets_to_destination_boxes_and_pairs_share_steps() -> None:
    from shardsync.layout import Box, GlobalLayout
    from shardsync.mapping import resolve
    from shardsync.planning import PlanOptions, build_plan
    from shardsync.planning.destinations import box_targets

    # "w" (8, 4): rows cut on trainers 0, 1; the destination cuts columns, on workers 2, 3; "n" (3,)
    # is on trainer 0 and wanted whole by both workers (one broadcast among 0, 2, 3)
    n = ("n", (3,), "float32", Box((0,), (3,)))
    src = GlobalLayout.merge(
        [[n, ("w", (8, 4), "float32", Box((0, 0), (4, 4)))], [("w", (8, 4), "float32", Box((4, 0), (4, 4)))], [], []]
    )
    dest = GlobalLayout.merge(
        [
            [],
            [],
            [n, ("w", (8, 4), "bfloat16", Box((0, 0), (8, 2)))],
            [n, ("w", (8, 4), "bfloat16", Box((0, 2), (8, 2)))],
        ]
    )
    boxes = box_targets(resolve(None, src), dest, src)
    assert [(b.spec.name, b.ranks) for b in boxes] == [("n", (2, 3)), ("w[0:8, 0:2]", (2,)), ("w[0:8, 2:4]", (3,))]
    assert all(p.casts == ("bfloat16",) for b in boxes[1:] for p in b.spec.pieces)
    plan = build_plan(
        [b.spec for b in boxes], src, PlanOptions(destinations=tuple(b.ranks for b in boxes), in_place=True)
    )
    assert plan.strategy == "multicast"
    assert [(s.kind, [(pk.src, pk.dst) for pk in s.packets]) for s in plan.steps] == [
        ("p2p", [(0, 2), (0, 3), (1, 2), (1, 3)]),
        ("multicast", [(0, -1)]),
    ]
    assert plan.costs.bytes_received == (0, 0, 12 + 64, 12 + 64)  # each worker: its columns and "n"
    assert plan.costs.bytes_sent == (12 + 64, 64, 0, 0)  # "n" leaves trainer 0 once
    assert plan.costs.peak_bytes[2] == 12 + 64  # buffers only: the destination is not counted
