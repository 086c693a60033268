"""The cross-rank phase wrappers: a failure on one rank is raised on every rank."""

from __future__ import annotations

import pytest
from multiproc import run_ranks

from shardsync.errors import DistributedError
from shardsync.dist import agree, data_phase


def _agree_worker(rank: int, world: int, bad: int | None) -> list[int]:
    def work() -> int:
        if rank == bad:
            raise ValueError(f"bad input on {rank}")
        return rank * 10
    try:
        return agree("check", work)
    except DistributedError as exc:
        return [("DistributedError", exc.phase, exc.failures)]


def test_agree_gathers_results() -> None:
    assert run_ranks(_agree_worker, 2, None) == [[0, 10], [0, 10]]


def test_agree_raises_everywhere() -> None:
    out = run_ranks(_agree_worker, 4, 2)
    assert all(o[0][0] == "DistributedError" and o[0][1] == "check" for o in out)
    assert all(list(o[0][2]) == [2] and "bad input on 2" in o[0][2][2] for o in out)


def _data_worker(rank: int, world: int) -> str:
    import torch
    import torch.distributed as dist
    t = torch.zeros(4)
    try:
        with data_phase("stream"):
            if rank == 1:
                raise KeyError("lost a shard")
            dist.broadcast(t, src=1)
    except DistributedError as exc:
        return f"{exc.phase}:{sorted(exc.failures)}:{'lost a shard' in str(exc)}"
    return "no error"


def test_data_phase_peer_failure_is_named() -> None:
    out = run_ranks(_data_worker, 2, group_timeout=5, timeout=60)
    assert out == ["stream:[1]:True", "stream:[1]:True"]


def test_single_process_is_plain() -> None:
    assert agree("x", lambda: 3) == [3]
    with pytest.raises(KeyError), data_phase("y"):
        raise KeyError("z")
