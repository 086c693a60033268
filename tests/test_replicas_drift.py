"""Drift detection on gloo, world sizes 2 and 4: exactly the perturbed tensor, kind and max abs diff."""

from __future__ import annotations

import logging

import pytest
import torch

from multiproc import run_ranks
from replicas_helpers import REPLICATED, H, TinyTP, count_collectives, fill, mixed_precision, mp_step
from shardsync.errors import DistributedError, DriftError
from shardsync.replicas import DEFAULT_WHAT, DriftReport, DriftRow, ReplicaSync, detect_drift, watch_drift

X = torch.arange(5 * H, dtype=torch.float32).reshape(5, H) / 50
ALL = (*DEFAULT_WHAT, "grad")  # grads are opt-in


def _setup(rank: int) -> tuple:
    torch.manual_seed(0)
    model = TinyTP()
    fill(model, rank, sharded_differs=False)  # every rank computes the same: no drift yet
    masters, opt = mixed_precision(model)
    mp_step(model, masters, opt, X)
    for m in masters.values():
        m.grad = ((torch.arange(m.numel()) % 7 - 3) * 0.5).reshape(m.shape).float()
    return model, masters, opt


def _perturb(rank: int, victim: int, t: torch.Tensor, idx: int, delta: float) -> float:
    """Add ``delta`` at ``idx`` on ``victim``; return the exact resulting diff (same on every rank)."""
    with torch.no_grad():
        flat = t.view(-1)
        new = flat[idx] + delta  # in t's dtype, identically on every rank
        expected = abs(float(new) - float(flat[idx]))
        if rank == victim:
            flat[idx] = new
    return expected


def _rows(report: DriftReport) -> list[tuple]:
    return [(r.name, r.kind, r.shape, r.dtype, r.ranks, r.max_abs_diff, r.missing) for r in report.rows]


def _drift_worker(rank: int, world: int) -> dict:
    victim = world - 2 if world == 4 else 1
    model, masters, opt = _setup(rank)
    out: dict = {}

    def detect(what=ALL, **kw):
        return detect_drift(model, opt, master_params=masters, what=what, **kw)

    with count_collectives() as calls:
        clean = detect_drift(model, opt, master_params=masters)
    assert clean.ok and clean.checked == len(REPLICATED) * 4 and calls == [], (clean, calls)
    assert detect().checked == len(REPLICATED) * 5
    out["clean"] = str(clean)

    ln = model.blocks[1].ln.weight
    m_ln = masters[ln]
    cases = [
        ("param", ln, 3, 0.5, {"on_drift": "repair"}),
        ("master", masters[model.norm.bias], 16, 0.125, "broadcast_now"),
        ("grad", masters[model.blocks[0].down.bias].grad, 0, 2.0, {"on_drift": "repair"}),
        ("exp_avg", opt.state[m_ln]["exp_avg"], 5, 0.25, "mean"),
        ("exp_avg_sq", opt.state[masters[model.pos_embedding]]["exp_avg_sq"], 84, 0.0625, "raise"),
    ]
    names = {id(t): n for n, t in model.named_parameters()}
    names.update({id(m): n for p, m in masters.items() for n in [names[id(p)]]})
    owners = {
        "param": ln,
        "master": masters[model.norm.bias],
        "grad": masters[model.blocks[0].down.bias],
        "exp_avg": m_ln,
        "exp_avg_sq": masters[model.pos_embedding],
    }
    found = []
    for kind, t, idx, delta, repair in cases:
        expected = _perturb(rank, victim, t, idx, delta)
        with count_collectives() as calls:
            report = detect()
        row = (
            names[id(owners[kind])],
            kind,
            tuple(t.shape),
            str(t.dtype).removeprefix("torch."),
            (victim,),
            expected,
            (),
        )
        assert _rows(report) == [row], (_rows(report), row)
        assert calls == ["all_reduce", "all_reduce"]  # MAX and MIN of the one mismatching tensor
        found.append(row)
        if isinstance(repair, dict):
            assert detect(**repair).repaired
        elif repair == "broadcast_now":
            ReplicaSync(model, opt, master_params=masters).broadcast_now()
        elif repair == "mean":  # masters and moments averaged, params re-derived
            sync = ReplicaSync(model, opt, master_params=masters, params="mean")
            with count_collectives() as calls:
                sync.sync_params()
            assert calls == ["all_reduce"] * 2  # the optimizer check; one fp32 bucket: masters, moments
        else:
            try:
                detect(on_drift="raise")
            except DriftError as exc:
                assert exc.report.rows[0].kind == "exp_avg_sq" and "pos_embedding" in str(exc)
                out["raised"] = True
            ReplicaSync(model, opt, master_params=masters).broadcast_now()
        assert detect().ok, (kind, _rows(detect()))
    out["found"] = found
    assert torch.equal(ln.detach(), m_ln.detach().to(torch.bfloat16))  # still consistent

    # a grad missing on the victim: a row naming where, repaired by creating it from the source
    masters[model.norm.weight].grad = None if rank == victim else masters[model.norm.weight].grad
    report = detect()
    assert _rows(report) == [("norm.weight", "grad", (H,), "float32", (), 0.0, (victim,))]
    assert report.exceeding(0.0) == report.rows
    detect(on_drift="repair")
    assert masters[model.norm.weight].grad is not None and detect().ok

    # reference on a tie is src: perturb rank 0 (world 2) or ranks 1 and 3 (world 4)
    w = masters[model.norm.weight]
    if world == 2:
        diff = _perturb(rank, 0, w, 7, 0.75)
        out["tie"] = [(r.ranks, r.max_abs_diff == diff) for s in (0, 1) for r in detect(what=("master",), src=s).rows]
    else:
        a = _perturb(rank, 1, w, 7, 0.5)
        b = _perturb(rank, 3, w, 7, -0.25)
        out["tie"] = [(r.ranks, r.max_abs_diff == a + b) for r in detect(what=("master",)).rows]
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())  # type: ignore[method-assign]
    logging.getLogger("shardsync.replicas.drift").addHandler(handler)
    detect(what=("master",), on_drift="warn")
    out["warned"] = any("replica drift" in r and "norm.weight" in r for r in records)
    ReplicaSync(model, opt, master_params=masters).broadcast_now()

    # every N steps, repairing noise injected into one rank's grads
    watch = watch_drift(model, opt, every=2, on_drift="repair", master_params=masters)

    def noise() -> None:
        if rank == victim:
            masters[model.norm.weight].grad[1] += 0.5

    repaired = []
    for _ in range(4):
        mp_step(model, masters, opt, X, before_step=noise)
        repaired.append(watch.last.repaired if watch.last is not None else None)
    watch.remove()
    out["watch"] = (watch.checks, repaired, detect(what=DEFAULT_WHAT).ok)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_drift_detect_and_repair(world: int) -> None:
    out = run_ranks(_drift_worker, world, timeout=150)
    victim = world - 2 if world == 4 else 1
    assert all(o == out[0] for o in out)  # every rank has the same report
    o = out[0]
    assert o["clean"] == f"no drift: 36 tensors identical on {world} rank(s)"
    assert [(r[0], r[1], r[3], r[4]) for r in o["found"]] == [
        ("blocks.1.ln.weight", "param", "bfloat16", (victim,)),
        ("norm.bias", "master", "float32", (victim,)),
        ("blocks.0.down.bias", "grad", "float32", (victim,)),
        ("blocks.1.ln.weight", "exp_avg", "float32", (victim,)),
        ("pos_embedding", "exp_avg_sq", "float32", (victim,)),
    ]
    assert [r[5] for r in o["found"]][:3] == [0.5, 0.125, 2.0]  # fp32 moments: checked exactly on the ranks
    assert o["raised"] is True and o["warned"] is True
    assert o["tie"] == ([((1,), True), ((0,), True)] if world == 2 else [((1, 3), True)])
    assert o["watch"] == (2, [None, True, True, True], True)


def test_report_table_and_raise_if() -> None:
    rows = (
        DriftRow("norm.weight", "param", (17,), "bfloat16", (1,), 0.5),
        DriftRow("norm.bias", "grad", (17,), "float32", (), 0.0, (2, 3)),
        DriftRow("ln.bias", "master", (), "float32", (0,), 1e-7),
    )
    report = DriftReport(rows, checked=12, world=4)
    lines = str(report).splitlines()
    assert lines[0] == "drift in 3 of 12 tensors across 4 ranks:"
    assert lines[1].split() == ["name", "kind", "shape", "dtype", "ranks", "max_abs_diff"]
    assert lines[2].split() == ["norm.weight", "param", "17", "bfloat16", "1", "0.5"]
    assert lines[3].split() == ["norm.bias", "grad", "17", "float32", "(missing", "on", "2,3)", "0.0"]
    assert lines[4].split() == ["ln.bias", "master", "scalar", "float32", "0", "1e-07"]
    assert report.exceeding(1e-6) == rows[:2] and len(report) == 3 and not report.ok
    with pytest.raises(DriftError, match=r"3 replicated tensor\(s\) differ across the 4 ranks beyond atol=0.0"):
        report.raise_if()
    with pytest.raises(DriftError) as info:
        report.raise_if(atol=0.5)
    assert info.value.report is report and "ln.bias" not in str(info.value)
    DriftReport(rows[2:], 3, 4).raise_if(atol=1e-6)
    assert str(DriftReport((), 3, 1)) == "no drift: 3 tensors identical on 1 rank(s)"
    assert issubclass(DriftError, RuntimeError) and not issubclass(DriftError, DistributedError)
