"""ReplicaSync misuse that used to give wrong values or hang (issue 19): a second ReplicaSync attached
to the same model and optimizer (grads summed twice), and a parameter group added on one rank only
(one rank agreed again while the other ran its bucket collectives). One spawn (world 2) runs the
multi-process checks; each test asserts its own part."""

from __future__ import annotations

import pytest
import torch

from multiproc import run_ranks
from replicas_helpers import REPLICATED, TinyTP, fill, replica_error
from shardsync.errors import ReplicaError
from shardsync.replicas import ReplicaSync


def test_a_second_sync_on_the_same_model_or_optimizer_is_refused() -> None:
    model, other = TinyTP(), TinyTP()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    first = ReplicaSync(model, opt, grads="sum")
    first.attach()
    with pytest.raises(ReplicaError, match="another ReplicaSync .* is attached to this optimizer"):
        ReplicaSync(model, opt, grads="sum").attach()
    with pytest.raises(ReplicaError, match="attached to this model"):
        ReplicaSync(model, torch.optim.SGD(model.parameters(), lr=1.0)).attach()
    ReplicaSync(other, torch.optim.SGD(other.parameters(), lr=1.0)).attach()  # another model: fine
    first.detach()
    second = ReplicaSync(model, opt, grads="sum")
    with second.attach():  # the first one is gone: the second may take its place
        pass
    second.attach().remove()


def _sum_once(rank: int, world: int) -> dict:
    """grads='sum' with a second ReplicaSync refused: each replicated grad is summed once."""
    model = TinyTP()
    fill(model, rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sync = ReplicaSync(model, opt, grads="sum", params=None)
    handle = sync.attach()
    refused = replica_error(lambda: ReplicaSync(model, opt, grads="sum", params=None).attach())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    handle.remove()
    grads = {n: sorted(set(p.grad.flatten().tolist())) for n, p in model.named_parameters()}
    return {"refused": refused, "grads": grads}


def _group_on_one_rank(rank: int, world: int) -> dict:
    """Rank 1 adds a parameter group that rank 0 does not: the next sync fails on both, naming it."""
    model = TinyTP()
    fill(model, rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sync = ReplicaSync(model, opt, grads="mean")
    sync.attach()
    if rank == 1:
        opt.add_param_group({"params": [torch.zeros(3, requires_grad=True)]})
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    out = {"step": replica_error(opt.step)}
    opt.param_groups[1:] = []  # rank 1 takes it back: both agree again and the sync works
    out["after"] = replica_error(sync.sync_grads)
    return out


def _worker(rank: int, world: int) -> dict:
    return {"sum": _sum_once(rank, world), "group": _group_on_one_rank(rank, world)}


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    return run_ranks(_worker, 2, timeout=150)


def test_grads_are_summed_once(outcomes: list[dict]) -> None:
    for o in outcomes:
        kind, message = o["sum"]["refused"]
        assert kind == "ReplicaError" and "attached to this optimizer" in message, message
        for name, values in o["sum"]["grads"].items():
            assert values == ([2.0] if name in REPLICATED else [1.0]), (name, values)


def test_a_param_group_on_one_rank_fails_on_every_rank_naming_it(outcomes: list[dict]) -> None:
    for o in outcomes:
        kind, message = o["group"]["step"]
        assert kind == "ReplicaError", message
        assert (
            "the ranks' optimizers step different parameters (rank 0: 1 param group(s) of [15] params; "
            "rank 1: 2 param group(s) of [15, 1] params)"
        ) in message, message
        assert "add_param_group with the same parameters at the same step" in message
        assert o["group"]["after"] == ("no error", "")
