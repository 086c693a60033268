"""Single-process tests: bucket planning, fingerprints, masters, argument checks, no-op with one rank."""

from __future__ import annotations

import pytest
import torch

from replicas_helpers import REPLICATED, TinyTP, fill, mixed_precision, mp_step
from shardsync.errors import ReplicaError
from shardsync.replicas import ReplicaSync, detect_drift, fingerprint, watch_drift
from shardsync.replicas import drift as drift_mod
from shardsync.replicas.buckets import Member, comm_dtype, make_buckets
from shardsync.replicas.replicated import resolve_replicated


def test_buckets_group_by_op_device_dtype_and_split_by_size() -> None:
    m = [Member(f"t{i}", "param", (17,)) for i in range(6)]
    items = [
        ("mean", "cpu", torch.bfloat16, m[0]),
        ("mean", "cpu", torch.float32, m[1]),
        ("broadcast", "cpu", torch.bfloat16, m[2]),
        ("sum", "cpu", torch.float32, m[3]),
        ("mean", "meta", torch.float32, m[4]),
        ("broadcast", "cpu", torch.bfloat16, m[5]),
    ]
    buckets = make_buckets(items, 1 << 20)
    got = [(b.op, b.device, b.dtype, [x.name for x in b.members]) for b in buckets]
    assert got == [
        ("mean", "cpu", torch.float32, ["t0", "t1"]),  # bf16 travels in fp32 for mean
        ("broadcast", "cpu", torch.bfloat16, ["t2", "t5"]),
        ("sum", "cpu", torch.float32, ["t3"]),
        ("mean", "meta", torch.float32, ["t4"]),
    ]
    assert buckets[0].nbytes == 34 * 4 and buckets[1].nbytes == 34 * 2
    big = Member("big", "param", (127,))
    split = make_buckets([("mean", "cpu", torch.float32, x) for x in (m[0], m[1], big, m[2], m[3], m[4])], 3 * 17 * 4)
    assert [[x.name for x in b.members] for b in split] == [["t0", "t1"], ["big"], ["t2", "t3", "t4"]]
    assert comm_dtype(torch.float16, "sum") == torch.float32
    assert comm_dtype(torch.float16, "broadcast") == torch.float16
    assert comm_dtype(torch.float64, "mean") == torch.float64
    with pytest.raises(ReplicaError, match=r"cannot sum or average non-floating tensors \['t0 \(param, int64\)'\]"):
        make_buckets([("mean", "cpu", torch.int64, m[0])], 100)
    flagged = make_buckets([("mean", "cpu", torch.float32, m[0])], 100, flags=True)
    assert flagged[0].flags and flagged[0].nbytes == 18 * 4


def test_fingerprint_sees_bits_and_order() -> None:
    a = torch.arange(127, dtype=torch.float32) / 7
    assert torch.equal(fingerprint(a), fingerprint(a.clone()))
    b = a.clone()
    b[100] = torch.nextafter(b[100], torch.tensor(1e9))  # one ulp
    assert not torch.equal(fingerprint(a), fingerprint(b))
    c = a.clone()
    c[[3, 4]] = c[[4, 3]]  # same sum, swapped positions
    assert not torch.equal(fingerprint(a), fingerprint(c))
    assert not torch.equal(fingerprint(torch.tensor([0.0])), fingerprint(torch.tensor([-0.0])))
    assert torch.equal(fingerprint(a.to(torch.bfloat16)), fingerprint(a.to(torch.bfloat16).clone()))
    assert fingerprint(torch.ones(3, 4).t()).tolist() == fingerprint(torch.ones(4, 3)).tolist()


def test_fingerprint_chunks_match_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.arange(1000, dtype=torch.float64) * 1.5
    whole = fingerprint(x)
    monkeypatch.setattr(drift_mod, "_CHUNK", 7)
    assert torch.equal(fingerprint(x), whole)


def test_one_rank_is_a_validated_no_op() -> None:
    model = TinyTP()
    fill(model)
    masters, opt = mixed_precision(model)
    sync = ReplicaSync(model, opt, master_params=masters, grads="mean", interval=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sync.broadcast_now()
    sync.sync_params()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with sync.attach():
        for _ in range(3):
            mp_step(model, masters, opt, torch.ones(5, 17))
        with pytest.raises(ReplicaError, match="already attached"):
            sync.attach()
    assert (sync.stats.steps, sync.stats.grad_syncs, sync.stats.collectives) == (3, 1, 0)
    plan = sync.plan()
    assert plan.collectives_per_step == 0 and plan.world == 1
    text = str(plan)
    assert text.startswith("replica sync over 1 rank(s), every 2 step(s):")
    assert "grads (before optimizer.step): 9 tensors" in text
    report = detect_drift(model, opt, master_params=masters)
    assert report.ok and report.checked == 9 * 4  # param, master, exp_avg, exp_avg_sq
    with pytest.raises(ReplicaError, match="sync_grads\\(\\) with grads=None"):
        ReplicaSync(model, opt).sync_grads()
    with pytest.raises(ReplicaError, match="attach\\(\\) needs the optimizer"):
        ReplicaSync(model).attach()


def test_arguments_are_checked_all_at_once() -> None:
    model = TinyTP()
    with pytest.raises(ReplicaError) as info:
        ReplicaSync(
            model,
            None,
            params="average",
            grads="avg",
            src=2,
            interval=0,
            bucket_bytes=0,
            optimizer_states="exp_avg",
            states_mode="sum",
        )
    msg = str(info.value)
    for part in (
        "params='average': use 'broadcast', 'mean' or None",
        "grads='avg'",
        "src=2: must be a rank of the group, 0..0",
        "interval=0",
        "bucket_bytes=0",
        "optimizer_states='exp_avg'",
        "states_mode='sum'",
    ):
        assert part in msg, part
    with pytest.raises(ReplicaError, match="partial grads must be summed on every step"):
        ReplicaSync(model, None, grads="sum", interval=4)
    with pytest.raises(ReplicaError, match="torch.distributed is not initialized"):
        ReplicaSync(model, None, object())
    with pytest.raises(ReplicaError) as info:
        detect_drift(model, what="param", on_drift="fix", atol=-1.0)
    assert "what='param'" in str(info.value) and "on_drift='fix'" in str(info.value)
    assert "atol=-1.0" in str(info.value)
    with pytest.raises(ReplicaError, match="every=0"):
        watch_drift(model, torch.optim.SGD(model.parameters()), every=0)


def test_master_params_forms_and_owner() -> None:
    model = TinyTP()
    params = dict(model.named_parameters())
    w = params["norm.weight"]
    m = w.detach().float().clone().requires_grad_(True)
    opt_masters = torch.optim.AdamW([m])
    by_param = resolve_replicated(model, ["norm.weight", "norm.bias"], opt_masters, {w: m})
    assert by_param[1].master is m and by_param[1].owner is m and by_param[0].owner is params["norm.bias"]
    by_name = resolve_replicated(model, ["norm.weight"], None, {"norm.weight": m})
    assert by_name[0].master is m and by_name[0].owner is w  # no optimizer holds the master
    by_fn = resolve_replicated(model, ["norm.weight"], None, lambda p: m if p is w else None)
    assert by_fn[0].master is m
    sgd = torch.optim.SGD(model.parameters())
    sgd._master_weights = {"norm.weight": m}
    assert resolve_replicated(model, ["norm.weight"], sgd, "auto")[0].master is m
    assert resolve_replicated(model, ["norm.weight"], sgd, None)[0].master is None
    with pytest.raises(ReplicaError) as info:
        resolve_replicated(
            model,
            ["norm.weight", "norm.bias", "pos_embedding"],
            None,
            {
                w: torch.zeros(3),
                params["norm.bias"]: params["norm.bias"],
                params["pos_embedding"]: torch.zeros(5, 17, dtype=torch.int32),
            },
        )
    msg = str(info.value)
    assert "'norm.weight': master shape [3] differs from the parameter's [17]" in msg
    assert "'norm.bias': the master is the parameter itself" in msg
    assert "'pos_embedding': master dtype torch.int32 is not a floating dtype" in msg
    with pytest.raises(ReplicaError, match="master_params= takes"):
        resolve_replicated(model, ["norm.weight"], None, 3)  # type: ignore[arg-type]
    in_order = resolve_replicated(model, list(reversed(REPLICATED)), None, None)
    assert [t.name for t in in_order] == list(REPLICATED)
