"""A rank that fails or stops mid-stream makes every other rank raise, naming phase and rank."""

from __future__ import annotations

import os

import pytest
from multiproc import RankFailure, run_ranks
from test_stream_dist import case_tp

from shardsync.errors import DistributedError
from shardsync.stream import full_params

GROUP_TIMEOUT = 5  # seconds a peer may wait in a collective before it gives up


def _outcome(rank: int, world: int, fail: str) -> tuple:
    state, _, _ = case_tp(rank, world)
    names = []
    stream = iter(full_params(state, strategy="broadcast"))
    try:
        for name, _tensor in stream:
            names.append(name)
            if rank == 1 and fail == "caller raises":
                raise ValueError("the caller's own bug")
            if rank == 1 and fail == "stops iterating":
                stream.close()  # e.g. `break` out of the loop, then the iterator is dropped
                return ("stopped", names)
            if rank == 1 and fail == "rank dies":
                os._exit(3)  # no cleanup, no goodbye: the peer must not hang
            if rank == 1 and fail == "shard vanishes":
                state["b"].local = state["b"].local[:0]  # this rank can no longer send its shard
    except DistributedError as exc:
        return ("DistributedError", exc.phase, sorted(exc.failures), str(exc), names)
    except ValueError as exc:
        return ("ValueError", str(exc), names)
    return ("finished", names)


def test_caller_raising_on_one_rank_fails_the_other() -> None:
    out = run_ranks(_outcome, 2, "caller raises", timeout=90, group_timeout=GROUP_TIMEOUT)
    assert out[1] == ("ValueError", "the caller's own bug", ["a"])
    kind, phase, failed, _, names = out[0]
    assert (kind, phase, failed) == ("DistributedError", "stream", [1]) and names[0] == "a"


def test_rank_that_stops_iterating_is_named() -> None:
    out = run_ranks(_outcome, 2, "stops iterating", timeout=90, group_timeout=GROUP_TIMEOUT)
    assert out[1] == ("stopped", ["a"])
    kind, phase, failed, text, _ = out[0]
    assert (kind, phase, failed) == ("DistributedError", "stream", [1])
    assert "stopped iterating during phase 'stream'" in text


def test_exception_inside_the_stream_is_raised_on_every_rank() -> None:
    out = run_ranks(_outcome, 2, "shard vanishes", timeout=90, group_timeout=GROUP_TIMEOUT)
    for rank in (0, 1):
        kind, phase, failed, text, _ = out[rank]
        assert (kind, phase, failed) == ("DistributedError", "stream", [1]), rank
        assert "LayoutError: 'b': this rank holds no shard containing" in text, rank


def test_rank_that_dies_is_named() -> None:
    with pytest.raises(RankFailure) as err:
        run_ranks(_outcome, 2, "rank dies", timeout=90, group_timeout=GROUP_TIMEOUT)
    out = err.value.outcomes
    assert out[1][:2] == ("error", "Died")
    kind, phase, failed, _, names = out[0][1]
    assert (kind, phase, failed) == ("DistributedError", "stream", [1]) and names[0] == "a"
