"""The cross-rank phase wrappers: a failure on one rank is raised on every rank, naming the culprit.

One spawn of 4 ranks runs every scenario in turn, each on a fresh group (a group whose collective
failed is left behind); the scenario where a rank dies comes last. No scenario races a clock: a group
is connected under a generous timeout; only where the peers must wait out a rank that does not come is
it shortened (:func:`multiproc.short_wait_group`), and a rank told to fail records its failure before
its peers start waiting.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from multiproc import new_group, run_ranks_one_dies, short_wait_group
from shardsync.dist import GATHER_BYTES, Agreed, abandon, agree, data_phase, transport_errors
from shardsync.errors import DistributedError, PlanError
from shardsync.roll_call import TransportFailure, is_transport_failure

SHORT_WAIT = 2  # seconds a collective waits for a peer that does not come


def _caught(fn: Any) -> tuple:
    try:
        return ("ok", fn())
    except DistributedError as exc:
        return ("DistributedError", exc.phase, exc.failures, str(exc))


def _moving(group: Any, rank: int, fail: str | None = None) -> None:
    """A data phase of broadcasts from every rank of ``group``; group rank 1 fails as told."""
    t = torch.zeros(4)
    with data_phase("stream", group):
        if rank == 1 and fail == "copy":
            t.copy_(torch.zeros(3))  # a local RuntimeError, not a transport failure
        if rank == 3 and fail == "die":
            os._exit(3)
        for src in dist.get_process_group_ranks(group):
            with transport_errors():
                dist.broadcast(t, src=src, group=group)


def _part(rank: int, n: int) -> bytes:
    return bytes((rank * 7 + i) % 251 for i in range(n))


def _all_gathers(fn: Any) -> tuple[Any, int]:
    """``fn()`` and the number of ``dist.all_gather`` calls it made."""
    real, calls = dist.all_gather, [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    dist.all_gather = counted  # type: ignore[assignment]  # this spawned rank only
    try:
        return fn(), calls[0]
    finally:
        dist.all_gather = real


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    mine = [rank] * (rank + 1)
    agreed = agree("sizes", lambda: mine, share=len)
    out["agreed"] = (agreed.mine is mine, agreed.all)
    out["plain"] = agree("ranks", lambda: rank * 10).all
    out["gathers"] = {
        "small": _all_gathers(lambda: agree("small", lambda: bytes(range(rank + 1))).all),
        # rank 1's part pickles to more than GATHER_BYTES: every rank takes the second gather
        "large": _all_gathers(lambda: agree("large", lambda: _part(rank, GATHER_BYTES if rank == 1 else 3)).all),
        "every rank large": _all_gathers(lambda: agree("larger", lambda: _part(rank, 3 * GATHER_BYTES + rank)).all),
    }
    # a part that cannot be pickled is that rank's failure, raised on every rank (it used to hang)
    out["unpicklable"] = _caught(lambda: agree("share", lambda: (lambda: rank) if rank == 3 else rank))

    def bad() -> int:
        if rank == 2:
            raise ValueError("bad input on 2")
        return rank

    out["raises"] = _caught(lambda: agree("check", bad))

    tail = new_group([1, 2, 3])  # group ranks 0..2 are global ranks 1..3; every member calls agree
    if rank > 0:
        out["tail"] = _caught(lambda: agree("check tail", lambda: bad() * 0, tail))

    g = short_wait_group(SHORT_WAIT)
    if rank != 2:  # rank 2 never enters the phase
        out["missing"] = _caught(lambda: agree("gather layout", lambda: rank, g))
    dist.barrier()

    g = short_wait_group(SHORT_WAIT)
    if rank == 2:  # it says why it will not come before the others start waiting for it
        abandon("gather layout", g, PlanError("strategy 'bogus' is unknown"))
    dist.barrier()
    if rank != 2:
        out["abandoned"] = _caught(lambda: agree("gather layout", lambda: rank, g))
    dist.barrier()

    g = short_wait_group(SHORT_WAIT)
    if rank == 1:  # fails (and records it) first; the others then wait out the one that left
        out["local RuntimeError"] = _caught(lambda: _moving(g, rank, "copy"))
    dist.barrier()
    if rank != 1:
        out["local RuntimeError"] = _caught(lambda: _moving(g, rank, "copy"))
    dist.barrier()
    out["dies"] = _caught(lambda: _moving(new_group(), rank, "die"))  # found gone: nothing to wait out
    return out


@pytest.fixture(scope="module")
def outcomes() -> dict[int, dict[str, Any]]:
    return run_ranks_one_dies(_scenarios, 4, 3, timeout=120, group_timeout=30)  # dies in the last scenario


def test_agree_returns_this_ranks_object_and_what_everyone_shared(outcomes: dict) -> None:
    for o in outcomes.values():
        assert o["agreed"] == (True, [1, 2, 3, 4])
        assert o["plain"] == [0, 10, 20, 30]


def test_agree_gathers_in_one_all_gather_unless_a_part_is_large(outcomes: dict) -> None:
    for o in outcomes.values():
        got = o["gathers"]
        assert got["small"] == ([bytes(range(r + 1)) for r in range(4)], 1)
        assert got["large"] == ([_part(r, GATHER_BYTES if r == 1 else 3) for r in range(4)], 2)
        assert got["every rank large"] == ([_part(r, 3 * GATHER_BYTES + r) for r in range(4)], 2)


def test_a_part_that_cannot_be_pickled_fails_every_rank(outcomes: dict) -> None:
    for o in outcomes.values():
        kind, phase, failures, _ = o["unpicklable"]
        assert (kind, phase, list(failures)) == ("DistributedError", "share", [3])
        assert "pickle" in failures[3], failures


def test_agree_raises_everywhere(outcomes: dict) -> None:
    for o in outcomes.values():
        kind, phase, failures, text = o["raises"]
        assert (kind, phase, list(failures)) == ("DistributedError", "check", [2])
        assert failures[2].startswith("ValueError: bad input on 2 (at ") and "rank 2: ValueError" in text


def test_errors_name_group_ranks_with_the_global_rank_in_brackets(outcomes: dict) -> None:
    for rank in (1, 2):
        kind, phase, failures, text = outcomes[rank]["tail"]
        assert (kind, phase, list(failures)) == ("DistributedError", "check tail", [1])
        assert "phase 'check tail' failed on rank(s) [1]:\n  rank 1 [global 2]: ValueError: bad input" in text


def test_a_rank_that_never_enters_is_named(outcomes: dict) -> None:
    for rank in (0, 1):
        kind, phase, failures, _ = outcomes[rank]["missing"]
        assert (kind, phase, list(failures)) == ("DistributedError", "gather layout", [2])
        assert failures[2] == (
            "never entered phase 'gather layout' (it entered no phase of this group "
            "yet; did it call this on every rank?)"
        )


def test_a_rank_that_failed_before_the_phase_says_why(outcomes: dict) -> None:
    for rank in (0, 1):
        kind, phase, failures, _ = outcomes[rank]["abandoned"]
        assert (kind, phase, failures) == (
            "DistributedError",
            "gather layout",
            {2: "PlanError: strategy 'bogus' is unknown"},
        )


def test_a_local_runtime_error_is_not_taken_for_a_transport_failure(outcomes: dict) -> None:
    for rank in (0, 1, 2):
        kind, phase, failures, _ = outcomes[rank]["local RuntimeError"]
        assert (kind, phase, list(failures)) == ("DistributedError", "stream", [1]), rank
        assert failures[1].startswith("RuntimeError: The size of tensor a (4) must match"), rank


def test_every_survivor_singles_out_the_dead_rank(outcomes: dict) -> None:
    for rank in (0, 1, 2):
        kind, phase, failures, _ = outcomes[rank]["dies"]
        assert (kind, phase, failures) == (
            "DistributedError",
            "stream",
            {3: "entered phase 'stream' and then its process ended (it died or exited)"},
        )


def test_single_process_is_plain() -> None:
    assert agree("x", lambda: 3) == Agreed(3, [3])
    assert agree("x", lambda: "abc", share=len) == Agreed("abc", [3])
    with pytest.raises(KeyError), data_phase("y"):
        raise KeyError("z")


def test_transport_failures_are_classified_by_where_they_come_from() -> None:
    with pytest.raises(TransportFailure, match="Timed out") as err, transport_errors():
        raise RuntimeError("Timed out waiting 3000ms for recv operation to complete")
    assert is_transport_failure(err.value) and isinstance(err.value.__cause__, RuntimeError)
    assert is_transport_failure(dist.DistBackendError("NCCL watchdog"))
    assert not is_transport_failure(RuntimeError("The size of tensor a (4) must match"))
    with pytest.raises(KeyError), transport_errors():  # only RuntimeErrors are transport failures
        raise KeyError("w")
