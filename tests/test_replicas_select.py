"""Selection of TP-replicated parameters: rules, explain(), errors, DTensor placements."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from multiproc import run_ranks
from replicas_helpers import REPLICATED, TinyTP
from shardsync.errors import ReplicaError
from shardsync.paddle import paddle_filter
from shardsync.replicas import DEFAULT_INCLUDE, Selection, select_replicated, tp_sharding
from shardsync.replicas.select import resolve_selector


def test_default_selection_finds_replicas_and_skips_shards() -> None:
    sel = select_replicated(TinyTP())
    assert sel.names == REPLICATED
    assert sel.rule("pos_embedding") == "default pattern 'pos_embedding*'"
    assert sel.rule("blocks.0.ln.weight") == "parameter of a LayerNorm module"
    assert sel.rule("blocks.1.down.bias") == "default pattern '*.bias'"
    assert sel.rule("norm.weight") == "default pattern '*norm*.weight'"
    skipped = {c.name: c.rule for c in sel.skipped}
    assert skipped == {
        "blocks.0.up.bias": "sharded on TP (marked is_distributed=True)",
        "blocks.1.up.bias": "sharded on TP (marked is_distributed=True)",
    }
    assert sel.considered == 15 and len(sel) == 9 and "norm.bias" in sel


def test_explain_lists_every_name_with_its_rule() -> None:
    text = select_replicated(TinyTP(), exclude=["norm.*"]).explain()
    lines = text.splitlines()
    assert lines[0] == "selected 7 of 15 parameters:"
    assert lines[1].split() == ["blocks.0.down.bias", "default", "pattern", "'*.bias'"]
    assert "left out although a rule matched:" in lines
    assert any(ln.split()[:1] == ["norm.weight"] and "excluded by 'norm.*'" in ln for ln in lines)
    assert any(ln.split()[:1] == ["blocks.0.up.bias"] and "sharded on TP" in ln for ln in lines)


def test_include_exclude_attribute_predicate() -> None:
    model = TinyTP()
    model.blocks[0].up.weight.sequence_parallel = True  # sharded: an attribute cannot select it
    model.blocks[1].down.weight.is_distributed = False
    model.blocks[1].down.weight.sequence_parallel = True
    sel = select_replicated(
        model, include=["re:blocks\\.\\d\\.ln\\.weight"], by_module=False, attribute="sequence_parallel"
    )
    assert sel.names == ("blocks.0.ln.weight", "blocks.1.down.weight", "blocks.1.ln.weight")
    assert sel.rule("blocks.1.down.weight") == "attribute sequence_parallel"
    assert sel.rule("blocks.0.ln.weight") == "include 're:blocks\\\\.\\\\d\\\\.ln\\\\.weight'"
    sel = select_replicated(
        model, include=None, by_module=False, predicate=lambda n, p: p.dim() == 2 and p.shape[0] == 5
    )
    assert sel.names == ("pos_embedding",) and sel.rule("pos_embedding") == "predicate"
    everything = select_replicated(model, include=(), predicate=lambda n, p: True)
    assert "blocks.0.up.weight" not in everything and "blocks.0.up.bias" not in everything
    assert len(everything) == 15 - 5  # all but the five sharded tensors
    sel = select_replicated(model, include="norm.*", exclude="*.bias", by_module=False)
    assert sel.names == ("norm.weight",)
    extended = select_replicated(model, include=(*DEFAULT_INCLUDE, "blocks.1.down.weight"))
    assert extended.names == tuple(sorted((*REPLICATED, "blocks.1.down.weight")))
    assert extended.rule("blocks.1.down.weight") == "include 'blocks.1.down.weight'"


def test_unmatched_and_sharded_only_patterns_are_errors() -> None:
    with pytest.raises(ReplicaError) as info:
        select_replicated(TinyTP(), include=["*.lm_head.*", "blocks.0.up.*", "norm.weight"])
    msg = str(info.value)
    assert "include pattern '*.lm_head.*' matches no parameter" in msg
    assert "include pattern 'blocks.0.up.*' matches only parameters sharded on TP (2)" in msg
    assert "pattern 'norm.weight'" not in msg
    with pytest.raises(ReplicaError, match="not a valid regex"):
        select_replicated(TinyTP(), include=["re:(unclosed"])
    with pytest.raises(ReplicaError, match="is not a non-empty string"):
        select_replicated(TinyTP(), include=[""])
    with pytest.raises(ReplicaError, match="torch.nn.Module"):
        select_replicated({"a": torch.zeros(1)})  # type: ignore[arg-type]


def test_selector_forms() -> None:
    model = TinyTP()
    sel = select_replicated(model)
    assert resolve_selector(model, sel) is sel
    assert resolve_selector(model, None).names == REPLICATED
    by_fn = resolve_selector(model, lambda n, p: n.startswith("norm"))
    assert by_fn.names == ("norm.bias", "norm.weight")
    stale = Selection(sel.selected + (sel.selected[0].__class__("gone.weight", "x"),))
    with pytest.raises(ReplicaError, match=r"does not have: \['gone.weight'\]"):
        resolve_selector(model, stale)
    with pytest.raises(ReplicaError, match="selector= takes"):
        resolve_selector(model, 3)  # type: ignore[arg-type]


def test_tp_sharding_marks_and_paddle_filter() -> None:
    p = nn.Parameter(torch.zeros(3))
    assert tp_sharding(p) is None
    p.tensor_model_parallel = True
    assert tp_sharding(p) == "marked tensor_model_parallel=True"
    q = nn.Parameter(torch.zeros(3))
    q.is_distributed = True
    assert not paddle_filter("fc.b_0", q) and paddle_filter("fc.b_0", nn.Parameter(torch.zeros(3)))
    assert paddle_filter("pos_embedding_0.w_0", q)  # Paddle checks distribution only for biases
    assert paddle_filter("enc.pre_att_layer_norm_scale", q)
    assert paddle_filter("layers.0.fc.bias", torch.zeros(2))
    assert not paddle_filter("layers.0.ln.weight", torch.zeros(2))
    assert not paddle_filter("fc.bias", torch.zeros(2), bias=False)


def _dtensor_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from shardsync.replicas import ReplicaSync, detect_drift

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    base = torch.arange(34.0).reshape(2, 17) * 0.5

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.extra = nn.Parameter(distribute_tensor(base.clone(), mesh, [Replicate()]))
            self.q_norm = nn.Module()
            self.q_norm.weight = nn.Parameter(distribute_tensor(base.clone(), mesh, [Shard(1)]))
            self.fc = nn.Linear(17, 3)

    torch.manual_seed(0)  # fc is replicated: the same init on every rank
    model = M()
    sel = select_replicated(model)
    out = {"names": sel.names, "skipped": [(c.name, c.rule) for c in sel.skipped], "extra_rule": sel.rule("extra")}
    assert select_replicated(model, include=(), by_module=False, by_placement=False, unsharded=False).names == ()
    out["unsharded"] = select_replicated(model, include=(), by_module=False, by_placement=False).names
    try:
        select_replicated(model, include=["q_norm.*"])
    except ReplicaError as exc:
        out["sharded_only"] = "matches only parameters sharded on TP" in str(exc)
    # 2-D mesh (dp=1, tp=world): only the TP mesh axis's placement decides
    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    a = nn.Parameter(distribute_tensor(base.clone(), mesh2, [Shard(0), Replicate()]))
    b = nn.Parameter(distribute_tensor(base.clone(), mesh2, [Replicate(), Shard(1)]))
    out["2d"] = (tp_sharding(a), tp_sharding(b), tp_sharding(b, mesh_dim=0))
    mesh3 = init_device_mesh("cpu", (1, world), mesh_dim_names=("x", "y"))
    try:
        tp_sharding(nn.Parameter(distribute_tensor(base.clone(), mesh3, [Replicate(), Replicate()])))
    except ReplicaError as exc:
        out["no_tp_dim"] = str(exc)
    # drift on a DTensor's local tensor is found, and repaired by broadcast
    with torch.no_grad():
        if rank == 1:
            model.extra.to_local()[1, 4] += 0.75
    report = detect_drift(model, what=("param",))
    out["rows"] = [(r.name, r.kind, r.shape, r.ranks, r.max_abs_diff) for r in report.rows]
    sync = ReplicaSync(model, None, grads="mean")
    sync.broadcast_now()
    out["repaired"] = model.extra.to_local().tolist() == base.tolist()
    # DTensor grads: a missing grad on rank 0 is created from the others (mean over the group)
    model.extra.grad = None if rank == 0 else model.extra.detach() * 0 + (rank + 1)
    sync.sync_grads()
    g = model.extra.grad
    out["grad"] = (type(g).__name__, g.placements, g.to_local()[0, :3].tolist())
    return out


def test_dtensor_replicate_vs_shard() -> None:
    out = run_ranks(_dtensor_worker, 2, timeout=90)
    for o in out:
        assert o["names"] == ("extra", "fc.bias", "fc.weight")  # a DTensor model: all unsharded
        assert o["unsharded"] == ("extra", "fc.bias", "fc.weight")
        assert o["extra_rule"] == "DTensor Replicate on mesh dim 'tp'"
        assert o["skipped"] == [("q_norm.weight", "sharded on TP (DTensor Shard(dim=1) on mesh dim 'tp')")]
        assert o["sharded_only"] is True
        assert o["2d"] == (None, "DTensor Shard(dim=1) on mesh dim 'tp'", None)
        assert "has no mesh axis named 'tp'; pass mesh_dim=" in o["no_tp_dim"]
        assert o["rows"] == [("extra", "param", (2, 17), (1,), 0.75)]
        assert o["repaired"] is True
        assert o["grad"][0] == "DTensor" and str(o["grad"][1]) == "(Replicate(),)"
        assert o["grad"][2] == [1.0, 1.0, 1.0]  # (0 + 2) / 2
