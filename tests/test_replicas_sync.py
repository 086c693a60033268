"""ReplicaSync on gloo, world sizes 2 and 4: exact values of sum/mean/broadcast, masters, hooks, buckets."""

from __future__ import annotations

import pytest
import torch

from multiproc import run_ranks
from replicas_helpers import REPLICATED, TinyTP, count_collectives, fill, gather, mixed_precision, mp_step
from shardsync.replicas import ReplicaSync, detect_drift


def _base(p: torch.Tensor) -> torch.Tensor:
    return ((torch.arange(p.numel(), dtype=torch.float32) % 11 - 5) * 0.25).reshape(p.shape)


def _same_everywhere(t: torch.Tensor) -> bool:
    copies = gather(t)
    return all(torch.equal(copies[0], c) for c in copies)


def _check_grads(rank: int, world: int) -> None:
    """sum vs mean: exact values; a grad absent on rank 0 is created; absent everywhere stays None."""
    model = TinyTP()
    params = dict(model.named_parameters())
    total = world * (world + 1) // 2  # sum of (rank + 1)
    for mode, factor, absent_factor in (("sum", total, total - 1), ("mean", total / world, (total - 1) / world)):
        sync = ReplicaSync(model, None, grads=mode, params=None)
        for p in params.values():
            p.grad = _base(p) * (rank + 1)
        params["norm.bias"].grad = None if rank == 0 else params["norm.bias"].grad
        params["pos_embedding"].grad = None
        with count_collectives() as calls:
            sync.sync_grads()
        # the optimizer check (two integers), then the one bucket
        assert calls == ["all_reduce"] * 2 and len(sync.buckets) == 1, (calls, sync.buckets)
        for name, p in params.items():
            if name == "pos_embedding":
                assert p.grad is None
            elif name == "norm.bias":
                assert torch.equal(p.grad, _base(p) * absent_factor), name
            elif name in REPLICATED:
                assert torch.equal(p.grad, _base(p) * factor), (mode, name)
            else:  # sharded: untouched
                assert torch.equal(p.grad, _base(p) * (rank + 1)), name


def _check_bf16_sum_in_fp32(rank: int, world: int) -> None:
    """bf16 grads are summed in fp32 and rounded once."""
    model = TinyTP().to(torch.bfloat16)
    w = model.norm.weight
    vals = [1.0, 2.0**-8, 2.0**-8, 0.0][:world]
    w.grad = torch.full_like(w, vals[rank])
    sync = ReplicaSync(model, None, grads="sum", params=None, selector=lambda n, p: n == "norm.weight")
    assert sync.buckets[0].dtype == torch.float32
    sync.sync_grads()
    expected = torch.tensor(sum(vals), dtype=torch.float64).to(torch.bfloat16)
    assert w.grad.dtype == torch.bfloat16 and bool((w.grad == expected).all()), (w.grad, expected)


def _check_broadcast_and_mean_repair(rank: int, world: int) -> None:
    src = 1 if world == 4 else 0
    for mode in ("broadcast", "mean"):
        model = TinyTP()
        fill(model, rank)
        ref = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            if rank == 1:
                model.blocks[1].ln.weight[3] += 0.25 * world
        sync = ReplicaSync(model, None, params=mode, src=src)
        with count_collectives() as calls:
            sync.broadcast_now() if mode == "broadcast" else sync.sync_params()
        assert len(calls) == len(sync.buckets) + 1 == 2  # the optimizer check, then the bucket
        expected = ref["blocks.1.ln.weight"].clone()
        expected[3] += 0.25 * world if (mode == "broadcast" and src == 1) else 0.0
        expected[3] += 0.25 if mode == "mean" else 0.0
        for name, p in model.named_parameters():
            if name == "blocks.1.ln.weight":
                assert torch.equal(p.detach(), expected), (mode, p, expected)
            else:  # other replicas unchanged, shards untouched
                assert torch.equal(p.detach(), ref[name]), (mode, name)
            assert _same_everywhere(p) == (name in REPLICATED or name == "blocks.1.ln.weight")


def _check_masters(rank: int, world: int) -> None:
    """bf16 param + fp32 master stay consistent under mean (re-derived) and broadcast (both move)."""
    model = TinyTP()
    fill(model, rank)
    masters, opt = mixed_precision(model)
    p = model.blocks[0].ln.bias
    m = masters[p]
    before = m.detach().clone()
    with torch.no_grad():
        if rank == 1:
            m[2] += world * 2.0**-10  # the mean lands between two bf16 values
    sync = ReplicaSync(model, opt, master_params=masters, params="mean")
    with count_collectives() as calls:
        sync.sync_params()
    assert calls == ["all_reduce"] * 2  # the optimizer check; masters only, params are re-derived
    assert m[2].item() == before[2].item() + 2.0**-10 and _same_everywhere(m)
    for q, mq in masters.items():  # every param == cast(master), the re-derived one included
        assert torch.equal(q.detach(), mq.detach().to(torch.bfloat16))
    assert p[2].item() != m[2].item() and _same_everywhere(p)  # rounded to bf16, identically
    # broadcast: perturb both on rank 1; src 0's param and master both win
    with torch.no_grad():
        if rank == 1:
            p[5] += 1.0
            m[5] += 1.0
    src_p, src_m = gather(p)[0], gather(m)[0]
    sync = ReplicaSync(model, opt, master_params=masters, params="broadcast")
    with count_collectives() as calls:
        sync.broadcast_now()
    # the optimizer check, then a bf16 bucket and an fp32 bucket
    assert calls == ["all_reduce", "broadcast", "broadcast"] and len(sync.buckets) == 2
    assert torch.equal(p.detach().double(), src_p) and torch.equal(m.detach().double(), src_m)
    assert torch.equal(p.detach(), m.detach().to(torch.bfloat16))


def _check_small_buckets(rank: int, world: int) -> None:
    model = TinyTP()
    fill(model, rank)
    sync = ReplicaSync(model, None, grads="mean", bucket_bytes=150)
    assert [len(b.members) for b in sync.buckets] == [2, 2, 2, 2, 1] * 2
    assert [m.name for b in sync.buckets[:5] for m in b.members] == list(REPLICATED)
    for p in model.parameters():
        p.grad = _base(p) * rank
    with count_collectives() as calls:
        sync.sync_grads()
        sync.sync_params()
    assert calls == ["all_reduce"] * 6 + ["all_reduce"] + ["broadcast"] * 5  # each after its check
    assert sync.stats.collectives == 10 == sync.plan().collectives_per_step
    assert torch.equal(model.norm.weight.grad, _base(model.norm.weight) * (world - 1) / 2)


def _check_hooks(rank: int, world: int) -> dict:
    """interval=2: grads, params, masters, moments sync on steps 2 and 4 only; noise on rank 1."""
    torch.manual_seed(0)
    model = TinyTP()
    fill(model, rank, sharded_differs=False)
    masters, opt = mixed_precision(model)
    sync = ReplicaSync(model, opt, master_params=masters, grads="mean", interval=2)
    handle = sync.attach()
    ln = masters[model.blocks[0].ln.weight]
    x = torch.arange(5 * 17, dtype=torch.float32).reshape(5, 17) / 50

    def noise() -> None:
        if rank == 1:
            ln.grad[4] += 0.5

    per_step, clean = [], []
    for _ in range(5):
        with count_collectives() as calls:
            mp_step(model, masters, opt, x, before_step=noise)
        per_step.append(len(calls))
        clean.append(detect_drift(model, opt, master_params=masters).ok)
    handle.remove()
    mp_step(model, masters, opt, x)  # detached: no more syncs
    plan = sync.plan()
    return {
        "per_step": per_step,
        "clean": clean,
        "buckets": len(sync.buckets),
        "plan": plan.collectives_per_step,
        "stats": (sync.stats.steps, sync.stats.grad_syncs, sync.stats.param_syncs),
        "kinds": sorted({m.kind for b in sync.buckets for m in b.members}),
    }


def _check_sync_before_clipping(rank: int, world: int) -> None:
    """sync_grads() then clipping (in-place rescale): the pre-step hook does not sum twice."""
    model = TinyTP()
    fill(model, rank)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sync = ReplicaSync(model, opt, grads="sum", params=None)
    sync.attach()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = _base(p) * (rank + 1)
    sync.sync_grads()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)  # rescales in place by 1.0
    opt.step()
    total = world * (world + 1) // 2
    for n, p in model.named_parameters():
        factor = total if n in REPLICATED else rank + 1
        assert torch.equal(p.detach(), before[n] - _base(p) * factor), n
    assert sync.stats.grad_syncs == 1
    for p in model.parameters():
        p.grad = _base(p)
    opt.step()  # no explicit call: the hook syncs
    assert sync.stats.grad_syncs == 2
    assert torch.equal(model.norm.weight.grad, _base(model.norm.weight) * world)


def _sync_worker(rank: int, world: int) -> dict:
    _check_grads(rank, world)
    _check_bf16_sum_in_fp32(rank, world)
    _check_broadcast_and_mean_repair(rank, world)
    _check_masters(rank, world)
    if world == 2:  # bucketing and the clipping handshake do not depend on the world size
        _check_small_buckets(rank, world)
        _check_sync_before_clipping(rank, world)
    return _check_hooks(rank, world)


@pytest.mark.parametrize("world", [2, 4])
def test_replica_sync(world: int) -> None:
    out = run_ranks(_sync_worker, world, timeout=150)
    for o in out:
        assert o["per_step"] == [0, 5, 0, 5, 0]  # 3 buckets and the optimizer check of each sync
        assert o["clean"] == [False, True, False, True, False]
        assert o["buckets"] == 3 == o["plan"]  # grads (fp32) + params (bf16) + masters & moments (fp32)
        assert o["stats"] == (5, 2, 2)  # the sixth step ran after remove(): not even seen
        assert o["kinds"] == ["exp_avg", "exp_avg_sq", "grad", "master", "param"]
