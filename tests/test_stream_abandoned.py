"""A rank that leaves a stream early (``break``, an exception in the loop, ``close()``, a ``with``
block) finishes its part of the collectives: the other ranks get every target, exact, and the group
stays usable for the next call.

The groups use torch's default timeout (30 minutes) and each run has a deadline of a few minutes, so
a rank left waiting in a collective fails the test as a "Hang" instead of passing late.
"""

from __future__ import annotations

import pytest
import torch

from multiproc import run_ranks
from shardsync.stream import full_params
from test_stream_dist import case_tp

DEFAULT_TIMEOUT = 1800.0
DEADLINE = 240.0


def _leave(stream, how: str) -> list[str]:
    """Take one target from ``stream``, then leave it the way a caller would."""
    names = []
    if how == "break":
        for name, _ in stream:
            names.append(name)
            break
    elif how == "raise":
        try:
            for name, _ in stream:
                names.append(name)
                raise ValueError("the caller's own bug")
        except ValueError:
            pass
    elif how == "close":
        it = iter(stream)
        names.append(next(it)[0])
        stream.close()
    else:  # "with"
        with stream:
            it = iter(stream)
            names.append(next(it)[0])
    return names


def _run(rank: int, world: int, how: str, transport: str) -> dict:
    state, _, full = case_tp(rank, world)
    stream = full_params(state, strategy="broadcast", transport=transport)
    if rank == 1:
        first = _leave(stream, how)
    else:
        got = {name: t.clone() for name, t in stream}
        first = sorted(got)
        assert all(torch.equal(got[k], full[k]) for k in full), rank
    again = {name: torch.equal(t, full[name]) for name, t in full_params(state, transport=transport)}
    return {"first": first, "again": again, "abandoned": stream.stats.abandoned}


@pytest.mark.parametrize("how", ["break", "raise", "close", "with"])
def test_leaving_early_lets_the_others_finish(how: str) -> None:
    out = run_ranks(_run, 2, how, "backend", timeout=DEADLINE, group_timeout=DEFAULT_TIMEOUT)
    assert out[0]["first"] == ["a", "b", "h", "ids", "norm"] and not out[0]["abandoned"]
    assert out[1]["first"] == ["a"] and out[1]["abandoned"]
    for rank in (0, 1):  # the group is usable: the next call is exact on every rank
        assert out[rank]["again"] == dict.fromkeys(["a", "b", "h", "ids", "norm"], True), rank


def test_leaving_early_over_shared_memory() -> None:
    out = run_ranks(_run, 2, "break", "shm", timeout=DEADLINE, group_timeout=DEFAULT_TIMEOUT)
    assert out[0]["first"] == ["a", "b", "h", "ids", "norm"] and out[1]["abandoned"]
    assert out[1]["again"] == dict.fromkeys(["a", "b", "h", "ids", "norm"], True)


def test_a_single_process_stream_closes_without_work() -> None:
    stream = full_params({"w": torch.arange(6.0), "b": torch.ones(2)})
    for _ in stream:
        break
    assert stream.stats.targets == 1 and not stream.stats.abandoned
