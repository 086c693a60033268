"""Ranks that disagree raise the same error on every rank, quickly, instead of hanging."""

from __future__ import annotations

import torch
from torch import nn

from multiproc import run_ranks
from replicas_helpers import H, TinyTP, fill
from shardsync.errors import DistributedError, LayoutError, ReplicaError
from shardsync.paddle import add_extra_synchronization
from shardsync.replicas import ReplicaSync, detect_drift, select_replicated


def _attempt(fn) -> tuple:
    try:
        fn()
    except LayoutError as exc:
        return ("LayoutError", str(exc))
    except ReplicaError as exc:
        return ("ReplicaError", str(exc))
    except DistributedError as exc:
        return ("DistributedError", exc.phase, sorted(exc.failures), str(exc))
    return ("no error",)


def _preflight_worker(rank: int, world: int) -> dict:
    out = {}
    model = TinyTP()
    fill(model, rank)
    sel = select_replicated(model, exclude=["norm.bias"] if rank == 1 else ())
    out["selection"] = _attempt(lambda: ReplicaSync(model, None, selector=sel))
    out["drift"] = _attempt(lambda: detect_drift(model, selector=sel))
    m2 = TinyTP()
    if rank == 1:
        m2.pos_embedding = nn.Parameter(torch.zeros(6, H))
    out["numel"] = _attempt(lambda: ReplicaSync(m2, None))
    m3 = TinyTP()
    if rank == 1:
        m3.norm.to(torch.bfloat16)
    out["dtype"] = _attempt(lambda: ReplicaSync(m3, None))
    masters = {model.norm.weight: model.norm.weight.detach().clone()} if rank == 0 else None
    out["master"] = _attempt(lambda: ReplicaSync(model, None, master_params=masters))
    out["args"] = _attempt(lambda: ReplicaSync(model, None, src=5 if rank == 1 else 0))
    out["args_everywhere"] = _attempt(lambda: ReplicaSync(model, None, params="avg"))
    out["include_everywhere"] = _attempt(lambda: detect_drift(model, selector=lambda n, p: 1 / 0))
    out["paddle_args"] = _attempt(
        lambda: add_extra_synchronization(
            model, torch.optim.SGD(model.parameters()), sync_mode="avg" if rank == 0 else "broadcast"
        )
    )
    opt = torch.optim.AdamW(model.parameters())
    sync = ReplicaSync(model, opt)
    if rank == 0:  # only rank 0 steps: its Adam moments exist, rank 1's do not
        model(torch.ones(5, H)).sum().backward()
        opt.step()
    out["states"] = _attempt(sync.sync_params)
    ReplicaSync(model, None).broadcast_now()  # the group still works after all that
    out["alive"] = True
    # a tensor changed after the preflight: that rank fails before moving data, the peer learns why
    sync = ReplicaSync(model, None)
    if rank == 1:
        model.norm.weight.data = torch.zeros(H + 1)
    out["changed"] = _attempt(sync.broadcast_now)
    return out


def test_mismatches_raise_on_every_rank() -> None:
    out = run_ranks(_preflight_worker, 2, timeout=240, group_timeout=10)
    assert out[0] == out[1]
    o = out[0]
    assert o["selection"][0] == "LayoutError"
    assert (
        "replica sync preflight: the ranks disagree on 1 replicated tensor(s):\n"
        "  norm.bias: selected on rank(s) [0], not on rank(s) [1]\n"
    ) in o["selection"][1]
    assert o["drift"][0] == "LayoutError" and "norm.bias: selected on rank(s) [0]" in o["drift"][1]
    assert ("pos_embedding (param): rank 0: shape [5, 17] float32 on cpu, rank 1: shape [6, 17] float32 on cpu") in o[
        "numel"
    ][1]
    assert ("norm.weight (param): rank 0: shape [17] float32 on cpu, rank 1: shape [17] bfloat16 on cpu") in o["dtype"][
        1
    ] and "norm.bias (param)" in o["dtype"][1]
    assert "norm.weight (master): rank 0: shape [17] float32 on cpu, rank 1: absent" in o["master"][1]
    assert o["args"][:3] == ("DistributedError", "replica sync: preflight", [1])
    assert "src=5: must be a rank of the group, 0..1" in o["args"][3]
    assert o["args_everywhere"][0] == "ReplicaError" and "params='avg'" in o["args_everywhere"][1]
    assert o["include_everywhere"][:3] == ("DistributedError", "drift check: fingerprints", [0, 1])
    assert "ZeroDivisionError" in o["include_everywhere"][3]  # not a shardsync error: both named
    assert o["paddle_args"][:3] == ("DistributedError", "add_extra_synchronization: arguments", [0])
    assert "Paddle's modes are 'broadcast' and 'average'" in o["paddle_args"][3]
    assert o["states"][0] == "LayoutError"
    assert "norm.weight (exp_avg): rank 0: shape [17] float32 on cpu, rank 1: absent" in o["states"][1]
    assert o["alive"] is True
    assert o["changed"][:3] == ("DistributedError", "replica sync: broadcast", [1])
    assert "norm.weight (param) has shape [18], agreed [17]" in o["changed"][3]
