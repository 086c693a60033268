"""The Paddle-compatible entry: defaults, average + grads + moments, states only, _master_weights."""

from __future__ import annotations

import torch

from multiproc import run_ranks
from replicas_helpers import REPLICATED, TinyTP, fill, gather
from shardsync.paddle import add_extra_synchronization
from shardsync.replicas import ReplicaSync


def _base(p: torch.Tensor) -> torch.Tensor:
    return ((torch.arange(p.numel(), dtype=torch.float32) % 9 - 4) * 0.125).reshape(p.shape)


def _paddle_worker(rank: int, world: int) -> dict:
    out = {}
    # defaults: broadcast params (and masters) from rank 0 after each step; no grads, no moments
    model = TinyTP()
    fill(model, rank)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sync = add_extra_synchronization(model, opt)
    out["defaults"] = (sync.params, sync.grads, sync.states, sync.src, sync.selection.names)
    with torch.no_grad():
        if rank == 1:
            model.norm.weight[0] += 1.0
    for p in model.parameters():
        p.grad = _base(p)
    before0 = gather(model.norm.weight)[0]
    opt.step()
    after = gather(model.norm.weight)
    out["broadcast"] = all(torch.equal(a, before0 - _base(model.norm.weight).double()) for a in after)
    sync.detach()

    # average, with grads and moments, and a custom filter (name, param) -> bool
    model = TinyTP()
    fill(model, rank)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sync = add_extra_synchronization(
        model,
        opt,
        params_filter_fn=lambda n, p: n.startswith("norm."),
        sync_mode="average",
        sync_grad=True,
        sync_moment=True,
    )
    seen = {}
    opt.register_step_pre_hook(lambda o, a, k: seen.update(g=model.norm.weight.grad.clone()))
    for p in model.parameters():
        p.grad = _base(p) * (rank + 1)
    opt.step()
    out["average"] = (
        sync.selection.names,
        sync.params,
        sync.grads,
        sync.states,
        torch.equal(seen["g"], _base(model.norm.weight) * (world + 1) / 2),
        torch.equal(
            model.blocks[0].ln.weight.grad,  # not selected: untouched
            _base(model.blocks[0].ln.weight) * (rank + 1),
        ),
    )
    sync.detach()

    # moments only: params may differ, moments are averaged
    model = TinyTP()
    fill(model, rank)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sync = add_extra_synchronization(model, opt, sync_mode="average", sync_param=False, sync_moment=True)
    with torch.no_grad():
        if rank == 1:
            model.norm.weight[0] += 1.0  # stays: params are not synced
    for p in model.parameters():
        p.grad = _base(p) * (rank + 1)
    opt.step()
    m = opt.state[model.norm.weight]["exp_avg"]
    g = gather(m)
    out["moments"] = (
        torch.equal(g[0], g[1]),
        torch.equal(m, 0.1 * _base(model.norm.weight) * (world + 1) / 2),
        not torch.equal(*gather(model.norm.weight)),
    )
    sync.detach()

    # Paddle's convention: masters in optimizer._master_weights, keyed by name
    model = TinyTP()
    fill(model, rank)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    master = model.norm.weight.detach().double() + rank
    opt._master_weights = {"norm.weight": master}
    sync = ReplicaSync(model, opt)
    sync.broadcast_now()
    out["master_weights"] = (
        master.tolist() == model.norm.weight.double().tolist(),
        [m.kind for b in sync.buckets for m in b.members].count("master"),
    )
    return out


def test_add_extra_synchronization() -> None:
    out = run_ranks(_paddle_worker, 2, timeout=90)
    for o in out:
        assert o["defaults"] == ("broadcast", None, (), 0, REPLICATED)
        assert o["broadcast"] is True
        assert o["average"] == (("norm.bias", "norm.weight"), "mean", "mean", ("exp_avg", "exp_avg_sq"), True, True)
        assert o["moments"] == (True, True, True)
        assert o["master_weights"] == (True, 1)
