"""A small tensor-parallel training loop: noise in one rank's replicated grads drifts without sync and
stays bit-identical with it."""

from __future__ import annotations

import torch

from multiproc import run_ranks
from replicas_helpers import REPLICATED, H, TinyTP, fill, gather
from shardsync.replicas import ReplicaSync, detect_drift

STEPS = 6


def _train(rank: int, synced: bool) -> dict:
    torch.manual_seed(0)
    model = TinyTP(tp=True)
    fill(model, rank)  # shards differ per rank, replicas identical
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    if synced:
        sync = ReplicaSync(model, opt, grads="mean")
        sync.broadcast_now()
        sync.attach()
    x = torch.arange(5 * H, dtype=torch.float32).reshape(5, H) / 40
    identical_each_step, losses = [], []
    for step in range(STEPS):
        loss = model(x).square().mean()
        loss.backward()
        if rank == 1:  # a non-deterministic kernel, a missed clip...: noise in a replicated grad
            with torch.no_grad():
                model.blocks[0].ln.weight.grad += 1e-3 * (step + 1) * torch.arange(H) / H
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        params = dict(model.named_parameters())
        identical_each_step.append(
            all(
                all(torch.equal(c, gather(t)[0]) for c in gather(t))
                for n in REPLICATED
                for t in (params[n], opt.state[params[n]]["exp_avg"], opt.state[params[n]]["exp_avg_sq"])
            )
        )
    report = detect_drift(model, opt, what=("param", "exp_avg", "exp_avg_sq"))
    ln = gather(model.blocks[0].ln.weight)
    up = gather(model.blocks[0].up.weight)
    return {
        "identical": identical_each_step,
        "rows": {(r.name, r.kind): (r.ranks, r.max_abs_diff) for r in report.rows},
        "ln_diff": float((ln[0] - ln[1]).abs().max()),
        "losses": losses,
        "shards_differ": not torch.equal(up[0], up[1]),
    }


def _training_worker(rank: int, world: int) -> dict:
    return {"plain": _train(rank, synced=False), "synced": _train(rank, synced=True)}


def test_tp_training_drifts_without_sync_and_not_with_it() -> None:
    out = run_ranks(_training_worker, 2, timeout=90)
    plain, synced = out[0]["plain"], out[0]["synced"]
    assert plain["identical"] == [False] * STEPS
    ranks, diff = plain["rows"][("blocks.0.ln.weight", "param")]
    assert ranks == (1,) and diff == plain["ln_diff"] > 0  # the detector's diff is the true one
    assert {("blocks.0.ln.weight", k) for k in ("param", "exp_avg", "exp_avg_sq")} <= set(plain["rows"])
    assert len(plain["rows"]) > 3  # the drift spreads through the activations to other replicas
    assert all(r == (1,) and d > 0 for r, d in plain["rows"].values())
    assert synced["identical"] == [True] * STEPS and synced["rows"] == {}
    assert synced["ln_diff"] == 0.0 and synced["shards_differ"] and plain["shards_differ"]
    assert synced["losses"][-1] < synced["losses"][0]  # it trained
    assert out[1]["synced"]["losses"] == synced["losses"]  # every rank saw the same loss
