"""Replicated parameters on the meta device (a model built with ``torch.device("meta")`` and not yet
materialised) hold no data: ``ReplicaSync`` (and so ``broadcast_now``) and ``detect_drift`` refuse
them alike, with one ReplicaError on every rank naming them, instead of skipping them silently or
raising a raw NotImplementedError. One spawn (world 2) runs every case."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from multiproc import run_ranks
from replicas_helpers import TinyTP, fill
from shardsync.errors import ReplicaError
from shardsync.replicas import ReplicaSync, detect_drift

META_MESSAGE = (
    "2 selected parameter(s) or their masters are on the meta device, with no data to sync or "
    "compare: norm.bias, norm.weight; materialise the model first "
    "(model.to_empty(device=...), then initialise or load it), or leave them out with the "
    "selector"
)


def _norm_on_meta(rank: int) -> TinyTP:
    model = TinyTP()
    fill(model, rank)
    model.norm.weight = nn.Parameter(torch.empty(model.norm.weight.shape, device="meta"))
    model.norm.bias = nn.Parameter(torch.empty(model.norm.bias.shape, device="meta"))
    return model


def _outcome(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # the test compares the class and message on every rank
        return (type(exc).__name__, str(exc))
    return ("no error", "")


def _worker(rank: int, world: int) -> dict[str, tuple[str, str]]:
    model = _norm_on_meta(rank)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    out = {
        "sync": _outcome(lambda: ReplicaSync(model, opt).broadcast_now()),
        "drift": _outcome(lambda: detect_drift(model, opt)),
    }
    # selected away, the rest syncs: pos_embedding comes from rank 0 on every rank
    with torch.no_grad():
        model.pos_embedding.add_(100.0 * rank)
    sync = ReplicaSync(model, opt, selector=lambda name, p: name in ("pos_embedding", "blocks.0.ln.bias"))
    sync.broadcast_now()
    out["rest"] = ("ok", str(model.pos_embedding.detach().flatten()[:5].tolist()))
    return out


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, tuple[str, str]]]:
    return run_ranks(_worker, 2, timeout=150)


@pytest.mark.parametrize("case", ["sync", "drift"])
def test_meta_parameters_are_refused_on_every_rank(outcomes: list[dict], case: str) -> None:
    assert [o[case] for o in outcomes] == [("ReplicaError", META_MESSAGE)] * 2


def test_selecting_them_away_syncs_the_rest(outcomes: list[dict]) -> None:
    reference = TinyTP()
    fill(reference, 0)
    expected = str(reference.pos_embedding.detach().flatten()[:5].tolist())
    assert [o["rest"] for o in outcomes] == [("ok", expected)] * 2


def test_one_process_refuses_them_too() -> None:
    model = _norm_on_meta(0)
    with pytest.raises(ReplicaError) as err:
        detect_drift(model)
    assert str(err.value) == META_MESSAGE
