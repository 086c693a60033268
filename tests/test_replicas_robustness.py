"""Inputs that used to get through: a replica frozen on one rank only, masters added to the optimizer
after ``attach()``, a DeviceMesh as the group, a DTensor model's un-parallelised ``lm_head``, and grads
(transient) reported as drift after a clean broadcast sync. One spawn (world 2) runs every check; each
test asserts its own part."""

from __future__ import annotations

import traceback

import pytest
import torch
from torch import nn

from multiproc import run_ranks
from replicas_helpers import REPLICATED, H, TinyTP, fill, gather, replica_error
from shardsync.paddle import add_extra_synchronization
from shardsync.replicas import DEFAULT_WHAT, ReplicaSync, detect_drift, select_replicated, tp_sharding


def _base(p: torch.Tensor, scale: float = 0.25) -> torch.Tensor:
    return ((torch.arange(p.numel(), dtype=torch.float32) % 11 - 5) * scale).reshape(p.shape)


def _frozen(rank: int, world: int) -> dict:
    """norm.weight frozen on rank 1 only, blocks.1.ln.bias on rank 0 only; pos_embedding everywhere."""
    model = TinyTP()
    fill(model, rank)
    model.norm.weight.requires_grad_(rank == 0)
    model.blocks[1].ln.bias.requires_grad_(rank == 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    out = {
        "sync": replica_error(lambda: ReplicaSync(model, opt, grads="mean")),
        "paddle": replica_error(lambda: add_extra_synchronization(model, opt, sync_grad=True)),
    }
    model.norm.weight.requires_grad_(True)
    model.blocks[1].ln.bias.requires_grad_(True)
    model.pos_embedding.requires_grad_(False)  # frozen on every rank: fine, and never stepped
    before = model.pos_embedding.detach().clone()
    sync = ReplicaSync(model, opt, grads="mean")
    sync.attach()
    for p in model.parameters():
        p.grad = _base(p) * (rank + 1) if p.requires_grad else None
    opt.step()
    sync.detach()
    out["frozen_everywhere"] = (
        model.pos_embedding.grad is None,
        torch.equal(model.pos_embedding.detach(), before),
        torch.equal(model.norm.weight.grad, _base(model.norm.weight) * 1.5),
    )
    return out


def _masters_added_after_attach(rank: int, world: int) -> dict:
    """The optimizer first steps only the sharded masters; the replicated ones come in a second group
    after attach(): from the next step their grads (mean) and Adam moments (broadcast) are synced."""
    model = TinyTP()
    fill(model, rank)
    model.to(torch.bfloat16)
    masters = {p: p.detach().float().clone().requires_grad_(True) for p in model.parameters()}
    sharded = [m for p, m in masters.items() if tp_sharding(p) is not None]
    opt = torch.optim.AdamW(sharded, lr=0.01)
    sync = ReplicaSync(model, opt, master_params=masters, grads="mean")
    sync.attach()
    kinds_before = sorted({m.kind for b in sync.buckets for m in b.members})
    replicated = [m for p, m in masters.items() if tp_sharding(p) is None]
    opt.add_param_group({"params": replicated, "weight_decay": 0.0})
    ln = masters[model.blocks[0].ln.weight]
    seen = {}
    opt.register_step_pre_hook(lambda o, a, k: seen.update(g=ln.grad.clone()))  # after the sync's
    for m in masters.values():
        m.grad = _base(m) * (rank + 1)
    opt.step()
    exp_avg = opt.state[ln]["exp_avg"]
    out = {
        "kinds_before": kinds_before,
        "kinds_after": sorted({m.kind for b in sync.buckets for m in b.members}),
        "grad_is_mean": torch.equal(seen["g"], _base(ln) * 1.5),
        "exp_avg": torch.equal(exp_avg, 0.1 * _base(ln) * 1.5),
        "same": [torch.equal(*gather(t)) for t in (ln, exp_avg, opt.state[ln]["exp_avg_sq"])],
        "report": detect_drift(model, opt, master_params=masters).ok,
    }
    sync.detach()
    # Paddle's convention: optimizer._master_weights created after attach (at the first step)
    model = TinyTP()
    fill(model, rank)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sync = ReplicaSync(model, opt)
    sync.attach()
    master = model.norm.weight.detach().double() + rank
    opt._master_weights = {"norm.weight": master}
    opt.step()  # no grads: the step changes nothing; the post-step hook broadcasts the new master
    out["paddle_master"] = master.tolist() == model.norm.weight.double().tolist()
    return out


def _mesh_as_group(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    mesh3 = init_device_mesh("cpu", (1, world), mesh_dim_names=("x", "y"))
    out = {}
    for label, kwargs in (
        ("1-D", {"group": mesh}),
        ("2-D", {"group": mesh2}),
        ("2-D mesh_dim", {"group": mesh3, "mesh_dim": "y"}),
        ("slice", {"group": mesh2["tp"]}),
    ):
        model = TinyTP()
        fill(model, rank)
        ref = model.norm.weight.detach().clone()
        with torch.no_grad():
            if rank == 1:
                model.norm.weight[4] += 0.5
        report = detect_drift(model, **kwargs)
        sync = ReplicaSync(model, None, **kwargs)
        sync.broadcast_now()
        out[label] = (
            [(r.name, r.ranks, r.max_abs_diff) for r in report.rows],
            torch.equal(model.norm.weight.detach(), ref),
            sync.world,
        )
    model = TinyTP()
    opt = torch.optim.SGD(model.parameters())
    out["paddle"] = add_extra_synchronization(model, opt, mesh).world
    out["no_tp_dim"] = replica_error(lambda: ReplicaSync(model, None, group=mesh3))
    return out


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(H, 6)  # column-parallel
        self.down = nn.Linear(6, H)  # row-parallel: its bias is a Replicate DTensor
        self.norm = nn.LayerNorm(H)
        self.lm_head = nn.Linear(H, 11, bias=False)  # left out of the plan: a plain replica

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x + self.down(torch.relu(self.up(x)))))


def _dtensor_model(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = parallelize_module(_TinyLM(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    with torch.no_grad():
        model.lm_head.weight.copy_(_base(model.lm_head.weight, 0.125))
    ref = model.lm_head.weight.detach().clone()
    sel = select_replicated(model)
    out = {"selected": [(c.name, c.rule) for c in sel.selected], "skipped": [(c.name, c.rule) for c in sel.skipped]}
    with torch.no_grad():
        if rank == 1:
            model.lm_head.weight[3, 5] += 0.5
    report = detect_drift(model, group=mesh, on_drift="repair")
    out["rows"] = [(r.name, r.kind, r.shape, r.dtype, r.ranks, r.max_abs_diff) for r in report.rows]
    out["repaired"] = report.repaired and torch.equal(model.lm_head.weight.detach(), ref)
    # a step through the parallelised model, grads averaged: the replicas stay identical
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ReplicaSync(model, opt, mesh, grads="mean").attach()
    x = torch.arange(3 * H, dtype=torch.float32).reshape(3, H) / 50
    model(x).square().mean().backward()
    opt.step()
    out["after_step"] = str(detect_drift(model, opt, group=mesh))
    return out


def _clean_broadcast_sync(rank: int, world: int) -> dict:
    """Grads differ across ranks (not synced); params and moments are broadcast after the step."""
    model = TinyTP()
    fill(model, rank, sharded_differs=False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sync = ReplicaSync(model, opt, params="broadcast")
    sync.attach()
    for p in model.parameters():
        p.grad = _base(p) * (rank + 1)
    opt.step()
    report = detect_drift(model, opt)
    with_grads = detect_drift(model, opt, what=(*DEFAULT_WHAT, "grad"))
    return {
        "default": (report.ok, report.checked, str(report)),
        "grads": (with_grads.checked, [(r.name, r.kind, r.ranks, r.max_abs_diff) for r in with_grads.rows]),
    }


CHECKS = {
    "frozen": _frozen,
    "masters": _masters_added_after_attach,
    "mesh": _mesh_as_group,
    "dtensor": _dtensor_model,
    "drift_default": _clean_broadcast_sync,
}


def _worker(rank: int, world: int) -> dict:
    out = {}
    for name, check in CHECKS.items():  # one failing check does not hide the others
        try:
            out[name] = ("ok", check(rank, world))
        except Exception:
            out[name] = ("error", traceback.format_exc())
    return out


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    return run_ranks(_worker, 2, timeout=150)


def _result(outcomes: list[dict], name: str) -> dict:
    for o in outcomes:
        assert o[name][0] == "ok", o[name][1]
    assert outcomes[0][name] == outcomes[1][name]  # the same outcome on every rank
    return outcomes[0][name][1]


def test_requires_grad_mismatch_raises_on_every_rank(outcomes: list[dict]) -> None:
    o = _result(outcomes, "frozen")
    message = (
        "replica sync preflight: requires_grad differs across the ranks for 2 replicated "
        "parameter(s):\n"
        "  blocks.1.ln.bias: requires_grad=True on rank(s) [1], False on rank(s) [0]\n"
        "  norm.weight: requires_grad=True on rank(s) [0], False on rank(s) [1]\n"
        "A replica frozen on some ranks only would be updated there by the sync; freeze it "
        "on every rank, or leave it out of the selection (exclude=...)."
    )
    assert o["sync"] == ("ReplicaError", message)
    assert o["paddle"] == ("ReplicaError", message)
    assert o["frozen_everywhere"] == (True, True, True)


def test_masters_added_after_attach_are_synced(outcomes: list[dict]) -> None:
    o = _result(outcomes, "masters")
    assert o["kinds_before"] == ["grad", "master", "param"]  # grads of the bf16 params, no moments
    assert o["kinds_after"] == ["exp_avg", "exp_avg_sq", "grad", "master", "param"]
    assert o["grad_is_mean"] is True and o["exp_avg"] is True
    assert o["same"] == [True, True, True] and o["report"] is True
    assert o["paddle_master"] is True


def test_device_mesh_is_a_group(outcomes: list[dict]) -> None:
    o = _result(outcomes, "mesh")
    for label in ("1-D", "2-D", "2-D mesh_dim", "slice"):
        assert o[label] == ([("norm.weight", (1,), 0.5)], True, 2), label
    assert o["paddle"] == 2
    assert o["no_tp_dim"] == (
        "ReplicaError",
        (
            "group= is a 2-D device mesh with dims ('x', 'y') and mesh_dim=None names none of them; pass "
            "the TP mesh axis as mesh_dim= (a name or an index), or the 1-D mesh of the TP mesh axis (mesh['tp'])"
        ),
    )


def test_dtensor_model_selects_every_unsharded_parameter(outcomes: list[dict]) -> None:
    o = _result(outcomes, "dtensor")
    assert o["selected"] == [
        ("down.bias", "default pattern '*.bias'"),
        ("lm_head.weight", "not sharded (the model has DTensor parameters)"),
        ("norm.bias", "default pattern '*norm*.bias'"),
        ("norm.weight", "default pattern '*norm*.weight'"),
    ]
    assert o["skipped"] == [
        ("down.weight", "sharded on TP (DTensor Shard(dim=1) on mesh dim 'tp')"),
        ("up.bias", "sharded on TP (DTensor Shard(dim=0) on mesh dim 'tp')"),
        ("up.weight", "sharded on TP (DTensor Shard(dim=0) on mesh dim 'tp')"),
    ]
    assert o["rows"] == [("lm_head.weight", "param", (11, H), "float32", (1,), 0.5)]
    assert o["repaired"] is True
    assert o["after_step"] == "no drift: 12 tensors identical on 2 rank(s)"


def test_drift_compares_persistent_state_by_default(outcomes: list[dict]) -> None:
    o = _result(outcomes, "drift_default")
    assert o["default"] == (True, 27, "no drift: 27 tensors identical on 2 rank(s)")
    checked, rows = o["grads"]
    assert checked == 36
    # grads of rank 1 are twice rank 0's: the diff is max |base| = 1.25 for every replica
    assert rows == [(name, "grad", (1,), 1.25) for name in REPLICATED]
