"""What shardsync keeps between calls: replicas are checked on the fast path of reshard, caches do
not outlive their process group, ``shardsync.release()`` drops them all, and the multicast strategy
is refused on a subgroup (its subgroups need the whole world)."""

from __future__ import annotations

import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import shardsync
from multiproc import new_group, run_ranks
from shardsync import LayoutError, PlanError, full_params, pipeline, reshard, shard_dim
from shardsync.exec import multicast, registry, shm_segments


def _source(rank: int) -> dict:
    return {
        "w": shard_dim(torch.arange(17 * 3.0).reshape(17, 3), 0, rank, 2),
        "norm": torch.arange(5.0) + 0.5,
    }  # a replica on both ranks


def _dest() -> dict:
    return {"w": torch.zeros(17, 3), "norm": torch.zeros(5)}


def _exact(dst: dict) -> bool:
    return torch.equal(dst["w"], torch.arange(17 * 3.0).reshape(17, 3)) and torch.equal(
        dst["norm"], torch.arange(5.0) + 0.5
    )


def _fast_path_and_caches(rank: int, world: int, store: str) -> dict:
    src, dst = _source(rank), _dest()
    first = reshard(src, dst, transport="backend")
    second = reshard(src, dst, transport="backend")
    out = {"fast": second.plan is first.plan, "exact": _exact(dst)}
    if rank == 1:
        src["norm"][0] += 1.0  # this replica drifts after the plan was cached
    try:
        reshard(src, dst, transport="backend")
        out["drift"] = "no error"
    except LayoutError as exc:
        out["drift"] = str(exc)
    src["norm"] = torch.arange(5.0) + 0.5
    # a group made after destroy_process_group finds nothing the old one left
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    out["fresh slot"] = pipeline._last.get(dist.distributed_c10d._get_default_group()) is None
    dst = _dest()
    out["exact after re-init"] = _exact(dst) if reshard(src, dst) and _exact(dst) else False
    _ = [t for _, t in full_params(src, strategy="broadcast")]
    shardsync.release()
    out["released"] = (
        len(pipeline._last),
        len(multicast._subgroups),
        len(shm_segments._caches),
        len(registry._shm_plans),
        pipeline._planned.cache_info().currsize,
    )
    _ = [t for _, t in full_params(src, strategy="broadcast")]
    if rank == 0:
        shardsync.release()  # on one rank only: the next call is out of step, named on both
    try:
        _ = [t for _, t in full_params(src, strategy="broadcast")]
        out["released on one rank"] = "no error"
    except shardsync.DistributedError as exc:
        out["released on one rank"] = str(exc)
    return out


def test_fast_path_checks_replicas_and_caches_follow_the_group() -> None:
    with tempfile.TemporaryDirectory() as d:
        out = run_ranks(_fast_path_and_caches, 2, os.path.join(d, "store2"), timeout=240)
    for rank in (0, 1):
        o = out[rank]
        assert o["fast"] and o["exact"] and o["fresh slot"] and o["exact after re-init"], (rank, o)
        assert o["drift"].startswith(
            "replicas differ:\n  'norm': ranks [0] vs ranks [1] hold box [0:5] with different values"
        ), (rank, o["drift"])
        assert o["released"] == (0, 0, 0, 0, 0), rank
        assert o["released on one rank"] == (
            f"phase '{'check layout' if rank == 1 else 'gather layout'}' failed on rank(s) [{1 - rank}]:\n"
            f"  rank {1 - rank}: was in phase '{'gather layout' if rank == 1 else 'check layout'}' at the same "
            "collective: the ranks are out of step (was shardsync.release() called on some ranks only? "
            "call it on every rank of the group, or on none)"
        ), (rank, o["released on one rank"])


def test_release_in_a_single_process() -> None:
    _ = [t for _, t in full_params({"w": torch.zeros(3)}, "w -> v")]
    assert pipeline._planned.cache_info().currsize > 0
    shardsync.release()
    assert pipeline._planned.cache_info().currsize == 0


def _on_a_subgroup(rank: int, world: int) -> dict[str, object]:
    """Both subgroup checks in one 3-rank spawn (one connect of the world, one of the subgroup)."""
    sub = new_group([0, 1])  # every rank of the world calls new_group; a failed connect is retried
    if rank == 2:
        return {"multicast": "not a member", "p2p": "not a member"}
    out: dict[str, object] = {}
    try:
        full_params({"w": torch.zeros(3)}, group=sub, strategy="multicast", consumers=0)
        out["multicast"] = "no error"
    except PlanError as exc:
        out["multicast"] = str(exc)
    got = dict(full_params({"w": shard_dim(torch.arange(7.0), 0, rank, 2)}, group=sub, strategy="p2p", consumers=0))
    out["p2p"] = torch.equal(got["w"], torch.arange(7.0)) if rank == 0 else got == {}
    return out


@pytest.fixture(scope="module")
def on_a_subgroup() -> list[dict[str, object]]:
    return run_ranks(_on_a_subgroup, 3, timeout=240)


def test_multicast_is_refused_on_a_subgroup(on_a_subgroup: list[dict[str, object]]) -> None:
    want = (
        "strategy='multicast' broadcasts on subgroups, which every rank of the whole world must create, "
        "and this group has 2 of the 3 ranks; use strategy='p2p' (or 'auto') on a subgroup"
    )
    assert [o["multicast"] for o in on_a_subgroup] == [want, want, "not a member"]


def test_the_strategy_the_error_names_works_on_a_subgroup(on_a_subgroup: list[dict[str, object]]) -> None:
    assert [o["p2p"] for o in on_a_subgroup] == [True, True, "not a member"]


class _FailingSource:
    """A live source whose reads fail on one rank, after the layout was gathered and planned."""

    def __init__(self, state: dict, fail: bool) -> None:
        from shardsync.sources import LocalSource

        self.inner, self.fail = LocalSource(state), fail

    def entries(self):  # type: ignore[no-untyped-def]
        return self.inner.entries()

    def read(self, key, box):  # type: ignore[no-untyped-def]
        if self.fail:
            raise OSError(f"disk gone while reading {key!r}")
        return self.inner.read(key, box)

    def device(self):  # type: ignore[no-untyped-def]
        return self.inner.device()


def _data_failure(rank: int, world: int, verb: str) -> tuple:
    src = _FailingSource(_source(rank), fail=rank == 1)
    try:
        if verb == "load":
            shardsync.load(_dest(), src, transport="backend")
        else:
            reshard(src, _dest(), transport="backend")
    except shardsync.DistributedError as exc:
        return exc.phase, sorted(exc.failures)
    return ("no error",)


#: The group's timeout: far longer than the test may take (the failing rank aborts the group, so its
#: peer learns at once; before, it waited out this timeout).
PEER_WAIT = 600


def test_a_data_failure_names_the_verb_as_its_phase() -> None:
    for verb in ("load", "reshard"):
        # the run's limit (240 s) is far below the group's timeout: the peer did not wait it out
        out = run_ranks(_data_failure, 2, verb, timeout=240, group_timeout=PEER_WAIT)
        assert out == [(verb, [1]), (verb, [1])], verb
