"""A rank that fails or dies mid-stream makes every other rank raise, naming phase and rank."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from multiproc import RankFailure, new_group, run_ranks, run_ranks_one_dies, short_wait_group
from reference import arange_tensor
from shardsync.dist import WATCH_SECONDS
from shardsync.errors import DistributedError, PlanError
from shardsync.layout import shard_dim
from shardsync.stream import full_params
from test_stream_dist import case_tp

#: A group timeout no failure below waits out: each must be found well within it.
LONG_TIMEOUT = 120


def _outcome(rank: int, world: int, fail: str, signal_dir: str = "") -> tuple:
    state, _, _ = case_tp(rank, world)
    names = []
    # a shard that vanishes mid-stream fails a send; shared memory published every shard at setup
    transport = "backend" if fail == "shard vanishes" else "auto"
    stream = iter(full_params(state, strategy="broadcast", transport=transport))
    start = time.monotonic()
    try:
        for name, _tensor in stream:
            names.append(name)
            if rank == 1 and fail == "rank dies":
                os._exit(3)  # no cleanup, no goodbye: the peer must not hang
            if rank == 1 and fail == "shard vanishes":  # after "a": "h" is read two steps later
                state["h"].local = state["h"].local[:0]  # this rank can no longer read its shard
    except DistributedError as exc:
        seconds = time.monotonic() - start
        if signal_dir and rank == 0:
            open(os.path.join(signal_dir, "told"), "w").close()
        elif signal_dir:  # alive, its group open, in no collective, until rank 0 has its error
            for _ in range(LONG_TIMEOUT * 10):
                if os.path.exists(os.path.join(signal_dir, "told")):
                    break
                time.sleep(0.1)
        return ("DistributedError", exc.phase, sorted(exc.failures), str(exc), names, seconds)
    return ("finished", names)


def test_exception_inside_the_stream_is_raised_on_every_rank(tmp_path: Path) -> None:
    """Over gloo, a rank whose stream fails keeps running (its group open): its peer, waiting in a
    broadcast that rank will never join, finds its report in the roll call and raises, naming it and
    what went wrong, instead of waiting out the group's timeout."""
    out = run_ranks(_outcome, 2, "shard vanishes", str(tmp_path), timeout=90, group_timeout=LONG_TIMEOUT)
    for rank in (0, 1):
        kind, phase, failed, text, _, seconds = out[rank]
        assert (kind, phase, failed) == ("DistributedError", "stream", [1]), rank
        assert "LayoutError: 'h': this rank holds no shard containing" in text, rank
        assert seconds < LONG_TIMEOUT / 4, (rank, seconds)  # found, not waited out


def _slow_peer(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 takes longer than a look at the roll call between two of its targets: waited for, not
    blamed (a broadcast's wait looks again; a send's or receive's is never cut short)."""
    full = {f"w{i}": arange_tensor((2 * 257, 1031 + i), start=100 * i) for i in range(12)}  # 1 MiB each
    state = {k: shard_dim(v, 0, rank, world) for k, v in full.items()}
    out = {}
    for strategy in ("broadcast", "p2p"):
        got = {}
        for name, tensor in full_params(state, strategy=strategy, transport="backend", memory_budget=3 << 20):
            got[name] = torch.equal(tensor, full[name])
            if rank == 1 and len(got) == 1:  # rank 0 waits for this rank's next steps meanwhile
                time.sleep(WATCH_SECONDS * 2.5)
        out[strategy] = got
    return out


def test_a_slow_peer_is_waited_for_not_blamed() -> None:
    for rank, got in enumerate(run_ranks(_slow_peer, 2, timeout=90, group_timeout=LONG_TIMEOUT)):
        for strategy in ("broadcast", "p2p"):
            assert got[strategy] == {f"w{i}": True for i in range(12)}, (rank, strategy)


def test_rank_that_dies_is_named() -> None:
    with pytest.raises(RankFailure) as err:
        run_ranks(_outcome, 2, "rank dies", timeout=90)  # found gone: no timeout to wait out
    out = err.value.outcomes
    assert out[1][:2] == ("error", "Died")
    kind, phase, failed, _, names, _ = out[0][1]
    assert (kind, phase, failed) == ("DistributedError", "stream", [1]) and names[0] == "a"


# -- world 4: ranks that never come, and a rank that dies (one spawn; a fresh group per scenario) ----
# Only a rank that never comes is waited out (SHORT_WAIT seconds, on a group connected under a generous
# timeout, after a barrier of every rank); a rank that is told to fail has recorded its failure before
# the peers start waiting, and a rank that dies is found gone: no scenario races a busy machine's clock.

SHORT_WAIT = 2


def _drain(make: Any) -> tuple:
    try:
        return ("finished", [name for name, _ in make()])
    except DistributedError as exc:
        return ("DistributedError", exc.phase, exc.failures)
    except PlanError as exc:
        return ("PlanError", str(exc))


def _w4_scenarios(rank: int, world: int) -> dict[str, tuple]:
    state, _, _ = case_tp(rank, world)
    out = {}
    g = short_wait_group(SHORT_WAIT)
    if rank != 2:  # rank 2 never calls full_params
        out["never calls"] = _drain(lambda: full_params(state, group=g))
    dist.barrier()
    g = short_wait_group(SHORT_WAIT)
    stream = full_params(state, group=g)
    if rank != 1:  # rank 1 never iterates its stream
        out["never iterates"] = _drain(lambda: stream)
    dist.barrier()
    g = short_wait_group(SHORT_WAIT)
    if rank == 3:  # the bad call raises on rank 3 first; its peers call once it has
        out["bad argument"] = _drain(lambda: full_params(state, group=g, split_index=5))
    dist.barrier()
    if rank != 3:
        out["bad argument"] = _drain(lambda: full_params(state, group=g))
    dist.barrier()
    g = new_group()  # the death is found by its closed connections, no timeout involved
    names = []

    def dying() -> list[str]:
        for name, _ in full_params(state, group=g, strategy="broadcast"):
            names.append(name)
            if rank == 3:
                os._exit(3)
        return names

    out["dies"] = _drain(dying) + (names,)
    return out


@pytest.fixture(scope="module")
def w4() -> dict[int, dict[str, tuple]]:
    return run_ranks_one_dies(_w4_scenarios, 4, 3, timeout=120, group_timeout=30)  # dies in the last scenario


def test_a_rank_that_never_calls_full_params_is_named(w4: dict) -> None:
    never = (
        "never entered phase 'gather layout' (it entered no phase of this group yet; did it call this on every rank?)"
    )
    for rank in (0, 1):
        assert w4[rank]["never calls"] == ("DistributedError", "gather layout", {2: never})
    for rank in (0, 2):
        assert w4[rank]["never iterates"] == ("DistributedError", "gather layout", {1: never})


def test_an_argument_error_is_raised_by_the_call_and_named_to_the_peers(w4: dict) -> None:
    for rank in (0, 1, 2):
        kind, phase, failures = w4[rank]["bad argument"]
        assert (kind, phase, list(failures)) == ("DistributedError", "gather layout", [3])
        assert failures[3] == (
            "PlanError: invalid stream options:\n  num_splits=1, split_index=5: use "
            "integers with num_splits >= 1 and 0 <= split_index < num_splits"
        )


def test_every_survivor_blames_only_the_rank_that_died(w4: dict) -> None:
    for rank in (0, 1, 2):
        kind, phase, failures, names = w4[rank]["dies"]
        assert (kind, phase) == ("DistributedError", "stream") and names[:1] == ["a"]
        assert failures == {3: "entered phase 'stream' and then its process ended (it died or exited)"}
