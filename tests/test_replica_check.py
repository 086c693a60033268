"""``replica_check=``: replicas that differ in one element of a million pass the sampled check (issue
19); ``"exact"`` hashes every byte and stops them on every rank before any data moves; ``"off"``
takes replicas on trust. Pure tests of the digests, then one spawn (world 2) through full_params,
load and reshard."""

from __future__ import annotations

import pytest
import torch

import shardsync
from multiproc import run_ranks
from reference import arange_tensor
from shardsync.errors import LayoutError
from shardsync.layout import GlobalLayout, LocalShard
from shardsync.layout.meta import check_replicas
from shardsync.sources import LocalSource
from shardsync.sources import fingerprint as fp
from shardsync.sources.fingerprint import exact_digest, fingerprints, sample_positions

N = 1_000_003  # odd: the last chunk of rows is short


def _one_off(n: int = N) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A tensor and a copy differing in one element that the sample does not read."""
    a = arange_tensor((n,), step=0.5)
    pos = next(p for p in range(n // 2, n) if p not in set(sample_positions(n)))
    b = a.clone()
    b[pos] += 1.0
    return a, b, pos


def test_sampled_misses_one_element_in_a_million_exact_sees_it() -> None:
    a, b, _ = _one_off()
    assert fingerprints([a])[0] == fingerprints([b])[0]  # the documented blind spot
    assert fingerprints([a], "exact")[0] != fingerprints([b], "exact")[0]
    assert fingerprints([a, b], "off") == [None, None]


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.bool, torch.int8, torch.complex64, torch.float8_e4m3fn, torch.uint16],
    ids=str,
)
def test_exact_digest_covers_every_byte_in_any_dtype(dtype: torch.dtype) -> None:
    t = arange_tensor((17, 127), torch.float64, step=0.37).to(dtype)
    base = exact_digest(t)
    assert base.startswith(fp.EXACT_PREFIX) and base == exact_digest(t.clone())
    flipped = t.clone()
    flipped.view(torch.uint8).view(-1)[-1] ^= 1  # the last bit of the last element
    assert exact_digest(flipped) != base
    assert exact_digest(t.reshape(127, 17)) != base  # the shape is part of it


def test_exact_digest_is_independent_of_strides_and_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    t = arange_tensor((127, 17), step=1.5)
    strided = t.T.contiguous().T  # same values, column-major storage
    assert not strided.is_contiguous() and exact_digest(strided) == exact_digest(t)
    whole = exact_digest(t)
    monkeypatch.setattr(fp, "_CHUNK_BYTES", 3 * 17 * 4 + 5)  # 3 rows per chunk, 127 = 42 * 3 + 1
    assert exact_digest(t) == whole and exact_digest(strided) == whole
    assert exact_digest(torch.tensor(2.5)) != exact_digest(torch.tensor([2.5]))
    assert exact_digest(torch.zeros(0, 3)) != exact_digest(torch.zeros(3, 0))


def test_exact_replicas_that_differ_are_named_as_exact() -> None:
    a, b, _ = _one_off(10_007)
    per_rank = [LocalSource({"w": x}, replica_check=m).entries() for x, m in ((a, "exact"), (b, "exact"))]
    with pytest.raises(
        LayoutError,
        match=r"'w': ranks \[0\] vs ranks \[1\] hold box \[0:10007\] with "
        r"different values \(exact digests differ\)",
    ):
        check_replicas(per_rank)
    sampled = [LocalSource({"w": x}).entries() for x in (a, b)]
    check_replicas(sampled)  # passes: the difference is outside the sample
    assert len(GlobalLayout.merge(sampled)["w"].shards) == 2


def test_a_bad_mode_is_refused_before_anything_runs() -> None:
    state = {"w": torch.zeros(3)}
    for call in (
        lambda: shardsync.full_params(state, replica_check="full"),
        lambda: shardsync.load({"w": torch.zeros(3)}, state, replica_check="full"),
        lambda: LocalSource(state, replica_check="full"),
    ):  # type: ignore[arg-type]
        with pytest.raises(LayoutError, match="replica_check='full': use 'sampled'"):
            call()


def _worker(rank: int, world: int) -> dict:
    a, b, pos = _one_off()
    mine = a if rank == 0 else b
    out: dict = {}
    for mode in ("sampled", "off", "exact"):
        try:
            got = dict(shardsync.full_params({"w": mine}, replica_check=mode))["w"]
            out[mode] = ("ok", float(got[pos]))
        except LayoutError as exc:
            out[mode] = ("LayoutError", str(exc))
    for verb in ("load", "reshard"):
        dst = {"w": LocalShard(torch.zeros(N // 2 + rank), (N,), (0 if rank == 0 else N // 2,))}
        try:
            getattr(shardsync, verb)(
                *(({"w": mine}, dst) if verb == "reshard" else (dst, {"w": mine})), replica_check="exact"
            )
            out[verb] = ("ok", "")
        except LayoutError as exc:
            out[verb] = ("LayoutError", str(exc))
        out[verb + "_untouched"] = bool((dst["w"].local == 0).all())
    return out


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    return run_ranks(_worker, 2, timeout=150)


def test_sampled_and_off_let_the_one_off_replicas_through(outcomes: list[dict]) -> None:
    a, _, pos = _one_off()
    for mode in ("sampled", "off"):
        kinds = {o[mode][0] for o in outcomes}
        assert kinds == {"ok"}, outcomes
        # each rank got the element from a rank the planner chose: not checked, whatever it is
        assert {o[mode][1] for o in outcomes} <= {float(a[pos]), float(a[pos]) + 1.0}


def test_exact_stops_full_params_load_and_reshard_on_every_rank(outcomes: list[dict]) -> None:
    for o in outcomes:
        for what in ("exact", "load", "reshard"):
            kind, message = o[what]
            assert kind == "LayoutError", (what, message)
            assert (
                "'w': ranks [0] vs ranks [1] hold box [0:1000003] with different values (exact digests "
                "differ)" in message
            ), message
        assert o["load_untouched"] and o["reshard_untouched"]


def _fingerprinted(rank: int, world: int) -> dict:
    """Count the shards each call fingerprints: a first call (the layout gathered) every one, a call
    on the fast path only the replicated one, whose drift it still catches."""
    import shardsync.sources.local as local

    counted: list[int] = []
    real = local.fingerprints

    def counting(tensors: list, mode: str = "sampled") -> list:
        counted.append(len(tensors) if mode != "off" else 0)  # "off": no fingerprint made
        return real(tensors, mode)

    local.fingerprints = counting  # type: ignore[assignment]  # this spawned rank only
    full = {k: arange_tensor((6, 5), start=100 * i) for i, k in enumerate("abc")}
    state: dict = {k: shardsync.shard_dim(v, 0, rank, world) for k, v in full.items()}
    state["norm"] = arange_tensor((7,))  # every rank holds all of it: a replica
    out: dict = {}
    for label in ("first", "again"):
        counted.clear()
        got = dict(shardsync.full_params(state))
        out[label] = (sum(counted), all(torch.equal(got[k], v) for k, v in full.items()))
    state["norm"] = state["norm"] + rank  # rank 1's replica drifts
    try:
        list(shardsync.full_params(state))
        out["drift"] = "no error"
    except LayoutError as exc:
        out["drift"] = str(exc).splitlines()[0]
    return out


def test_a_repeated_call_fingerprints_only_the_replicated_shards() -> None:
    for o in run_ranks(_fingerprinted, 2):
        assert o["first"] == (4, True) and o["again"] == (1, True), o
        assert o["drift"] == "replicas differ:", o


def _unreadable_replica(rank: int, world: int) -> tuple[str, float]:
    """A repeated call whose replica cannot be sampled on rank 1 (its storage was freed, as FSDP
    frees unsharded parameters): the layout is unchanged, so the ranks are on the fast path."""
    import time

    state = {"r": arange_tensor((64,)), "s": shardsync.shard_dim(arange_tensor((8, 8)), 0, rank, world)}
    list(shardsync.full_params(state))
    if rank == 1:
        state["r"].untyped_storage().resize_(0)
    t0 = time.monotonic()
    try:
        list(shardsync.full_params(state))
        return "no error", time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}", time.monotonic() - t0


def test_a_replica_that_cannot_be_sampled_fails_the_check_on_every_rank() -> None:
    for message, took in run_ranks(_unreadable_replica, 2, group_timeout=120):
        assert message == "DistributedError: phase 'check layout' failed on rank(s) [1]:", message
        assert took < 20, took


def test_deferred_fingerprints_are_each_shards_own() -> None:
    """Fingerprinted on demand, every entry gets its own shard's fingerprint, as when every shard is
    fingerprinted at once: a box held twice (different values) and boxes nested in one another."""
    full = arange_tensor((16,))
    for shards in (
        [LocalShard(full[:8], (16,), (0,)), LocalShard(full[:8] + 1, (16,), (0,))],
        [LocalShard(full, (16,), (0,)), LocalShard(full[:8] + 1, (16,), (0,))],
    ):
        eager = LocalSource({"w": shards}).entries()
        live = LocalSource({"w": shards}, deferred=True)
        assert all(e.fingerprint is None for e in live.entries())
        assert list(live.fingerprinted(live.entries())) == eager
        assert len({e.fingerprint for e in eager}) == 2
