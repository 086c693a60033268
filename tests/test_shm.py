"""The same-host transport (shardsync.exec.shm) on 2 and 4 gloo ranks, against the broadcast path.

Every scenario of the strategy tests runs twice on the same ranks: through shared memory and through
gloo's broadcasts; the targets must be byte-identical (and equal to the dense reference). A rank that
dies - during setup or mid-stream - must leave no segment in /dev/shm once the survivors have failed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardsync.exec.shm as shm
import shardsync.exec.shm_plan as shm_plan
import shardsync.exec.shm_segments as segments
from multiproc import RankFailure, run_ranks
from reference import arange_tensor
from shardsync.errors import DistributedError, PlanError
from shardsync.exec.copies import copy_threads
from shardsync.exec.hosts import HostInfo, host_info, neighbours, same_host
from shardsync.layout import shard_dim
from shardsync.planning.schedule import aligned
from shardsync.stream import full_params
from test_stream_dist import case_empty_rank, case_experts, case_fused, case_tp
from test_stream_dist4 import case_replicas, case_tp_pp

CASES = (case_tp, case_fused, case_experts, case_empty_rank)
STRATEGIES = (("broadcast", {}), ("bucketed", {"bucket_bytes": 256}), ("p2p", {}), ("auto", {}))
GROUP_TIMEOUT = 5


def digest(t: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    data = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return str(t.dtype), tuple(t.shape), hashlib.sha1(data).hexdigest()


def stream(state: dict, mapping: Any, ref: dict, **kw: Any) -> dict[str, Any]:
    """Targets (digests, in yield order), mismatches against ``ref``, and the counters."""
    s = full_params(state, mapping, **kw)
    out, bad = {}, []
    for name, t in s:
        out[name] = digest(t)
        want = ref[name]
        if t.dtype != want.dtype or t.shape != want.shape or not torch.equal(t, want):
            bad.append(name)
    rank, c = dist.get_rank(kw.get("group")), s.plan.costs
    return {
        "targets": out,
        "bad": bad,
        "transport": s.stats.transport,
        "peak": s.stats.peak_bytes,
        "stats": (s.stats.bytes_sent, s.stats.bytes_received, s.stats.collectives),
        "costs": (c.bytes_sent[rank], c.bytes_received[rank], c.collectives[rank]),
        "plan_peak": c.peak_bytes[rank],
    }


def both(state: dict, mapping: Any, ref: dict, **kw: Any) -> tuple[dict, dict]:
    return (
        stream(state, mapping, ref, transport="shm", **kw),
        stream(state, mapping, ref, transport="backend", **({"strategy": "broadcast"} | kw)),
    )


def leftovers(pid0: int) -> list[str]:
    return sorted(n for n in os.listdir(segments.SHM_DIR) if n.startswith(f"{segments.SHM_PREFIX}{pid0}-"))


def _errors(rank: int, world: int) -> dict[str, str]:
    state, _, _ = case_tp(rank, world)
    out = {}
    for label, kw in (
        ("mesh2d", {"strategy": "mesh2d", "mesh": (dist.group.WORLD, None)}),
        ("differ", {"transport": "shm" if rank == 0 else "backend"}),
        ("budget", {"memory_budget": 1000}),
    ):
        try:
            list(full_params(state, **({"transport": "shm"} | kw)))
            out[label] = "no error"
        except (PlanError, DistributedError) as exc:
            out[label] = f"{type(exc).__name__}: {exc}"
    return out


def _two_hosts(rank: int, world: int) -> tuple:
    """Each rank claims a host of its own: auto moves data over gloo, shm says why it cannot."""
    import shardsync.pipeline as stream_module

    real = stream_module.host_info
    stream_module.host_info = lambda *a, **k: real(*a, **k)._replace(hostname=f"node{rank}")
    try:
        state, _, ref = case_tp(rank, world)
        auto = stream(state, None, ref)
        try:
            list(full_params(state, transport="shm"))
            err = "no error"
        except PlanError as exc:
            err = str(exc)
    finally:
        stream_module.host_info = real
    return auto["transport"], auto["bad"], err


def scenarios(rank: int, world: int, cases: tuple) -> dict:
    """Every case with every strategy, consumers of part of the targets, and zero copy, each through
    shared memory and through gloo's broadcasts (:func:`both`)."""
    out: dict = {}
    for case in cases:
        state, mapping, ref = case(rank, world)
        for name, kw in STRATEGIES:
            out[(case.__name__, name)] = both(state, mapping, ref, strategy=name, **kw)
    state, _, ref = case_tp(rank, world)
    out["consumers=1"] = both(state, None, ref, consumers=1, strategy="p2p")
    out["consumers=[1,0]"] = both(state, None, ref, consumers=[1, 0], strategy="p2p", split_by="bytes")
    out["copy=False"] = both(state, None, ref, copy=False)
    return out


def worker_w2(rank: int, world: int) -> dict:
    out: dict = {"pid0": os.getpid() if rank == 0 else None} | scenarios(rank, world, CASES)
    state, _, ref = case_tp(rank, world)
    # the next stream writes into the segment the last one made; release() drops it
    segments.release()
    kept = []
    for _ in range(2):
        got = stream(state, None, ref, transport="shm")
        own = segments.kept_by_name()[segments.group_name(None)].own
        kept.append((got["bad"], got["stats"][2], None if own is None else own[2].data_ptr()))
    segments.release()
    stream(state, None, ref, transport="shm")
    out["kept"] = (kept, segments.kept_by_name()[segments.group_name(None)].own[2].data_ptr())
    # shards already in shared memory are published in place: no segment, nothing copied to publish
    shared = {k: (v.share_memory_() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    for v in shared.values():
        if hasattr(v, "local"):  # column shards are views of the full tensor: contiguous first
            v.local = v.local.contiguous().share_memory_()
    segments.release()
    out["in place"] = (
        stream(shared, None, ref, transport="shm"),
        segments.kept_by_name()[segments.group_name(None)].own,
    )
    out["errors"] = _errors(rank, world)
    out["two hosts"] = _two_hosts(rank, world)
    budget = stream(state, None, ref, memory_budget=1000)  # auto: over budget with shm, so gloo
    out["budget auto"] = (budget["transport"], budget["bad"], budget["peak"] <= 1000)
    dist.barrier()
    out["leftovers"] = leftovers(os.getpid()) if rank == 0 else []
    return out


def check_pair(records: list[dict], key: Any, names: list[str] | None = None) -> None:
    for rank, rec in enumerate(records):
        got, via_broadcast = rec[key]
        assert got["transport"] == "shm" and via_broadcast["transport"] == "gloo", (key, rank)
        assert got["bad"] == [] == via_broadcast["bad"], (key, rank, got["bad"], via_broadcast["bad"])
        assert got["targets"] == via_broadcast["targets"], (key, rank)  # same names, dtypes, bytes
        assert got["stats"][:2] == got["costs"][:2], (key, rank, got["stats"], got["costs"])
        # the setup's collectives, or none: a stream that publishes nothing after one that set up
        # (test_push.py::test_a_repeated_stream_that_publishes_nothing_sets_up_without_a_collective)
        assert got["stats"][2] in (got["costs"][2], 0), (key, rank, got["stats"], got["costs"])
        assert got["peak"] <= got["plan_peak"], (key, rank)
        if names is not None:
            assert sorted(got["targets"]) == sorted(names), (key, rank)


def test_two_ranks_shm_matches_broadcast() -> None:
    records = run_ranks(worker_w2, 2, timeout=300)
    for case in CASES:
        for name, _ in STRATEGIES:
            check_pair(records, (case.__name__, name), list(case(0, 2)[2]))
    tp = sorted(case_tp(0, 2)[2])
    check_pair(records, "consumers=1")
    got = [list(rec["consumers=1"][0]["targets"]) for rec in records]
    assert got[0] == [] and sorted(got[1]) == tp
    check_pair(records, "consumers=[1,0]")
    check_pair(records, "copy=False", tp)
    for rec in records:
        (first, second), fresh = rec["kept"]
        assert first[:2] == second[:2] == ([], 2) and first[2] == second[2] is not None  # same segment
        got, own = rec["in place"]
        assert got["bad"] == [] and got["stats"] == got["costs"] and own is None  # no segment at all
    errors = [rec["errors"] for rec in records]
    assert errors[0]["mesh2d"] == errors[1]["mesh2d"]
    assert errors[0]["mesh2d"].startswith("PlanError: transport='shm' cannot be used: the strategy is mesh2d")
    assert errors[0]["differ"] == errors[1]["differ"]
    assert "ranks passed different transport= values ['backend', 'shm']" in errors[0]["differ"]
    assert errors[0]["budget"] == errors[1]["budget"]
    assert "its segments raise the peak to" in errors[0]["budget"]
    assert "over memory_budget=1000 B" in errors[0]["budget"]
    assert [rec["budget auto"] for rec in records] == [("gloo", [], True)] * 2
    for rec in records:
        transport, bad, err = rec["two hosts"]
        assert (transport, bad) == ("gloo", [])
        assert err.startswith(
            "transport='shm' cannot be used: the ranks are on several hosts (rank 0: node0, rank 1: node1)"
        )
    assert records[0]["leftovers"] == []


def worker_w4(rank: int, world: int) -> dict:
    out: dict = {}
    for case in (*CASES, case_tp_pp, case_replicas):
        state, mapping, ref = case(rank, world)
        for name, kw in STRATEGIES:
            out[(case.__name__, name)] = both(state, mapping, ref, strategy=name, **kw)
    state, _, ref = case_tp(rank, world)
    out["consumers=[1,3]"] = both(state, None, ref, consumers=[1, 3], strategy="p2p")
    return out


def test_four_ranks_shm_matches_broadcast() -> None:
    records = run_ranks(worker_w4, 4, timeout=300)
    for case in (*CASES, case_tp_pp, case_replicas):
        for name, _ in STRATEGIES:
            check_pair(records, (case.__name__, name), list(case(0, 4)[2]))
    check_pair(records, "consumers=[1,3]")


def _dies(rank: int, world: int, when: str) -> tuple:
    state, _, _ = case_tp(rank, world)
    if rank == 1 and when == "setup":  # after creating its segment, before the others map it
        shm.ShmTransport._open = lambda self, *args: os._exit(3)  # type: ignore[method-assign]
    names = []
    try:
        for name, _ in full_params(state, transport="shm", strategy="broadcast"):
            names.append(name)
            if rank == 1 and when == "mid-stream":
                os._exit(3)
    except DistributedError as exc:
        return ("DistributedError", exc.phase, sorted(exc.failures), os.getpid(), names)
    return ("finished", os.getpid(), names)


@pytest.mark.parametrize("when", ["setup", "mid-stream"])
def test_killed_rank_leaves_no_segment(when: str) -> None:
    with pytest.raises(RankFailure) as err:
        run_ranks(_dies, 2, when, timeout=90, group_timeout=GROUP_TIMEOUT)
    out = err.value.outcomes
    assert out[1][:2] == ("error", "Died")
    kind, phase, failed, pid0, names = out[0][1]
    # dead while the others map its segment: the setup phase names it; later, the data phase
    assert (kind, phase, failed) == ("DistributedError", "shm open" if when == "setup" else "stream", [1])
    assert sorted(names) == ([] if when == "setup" else ["a", "b", "h", "ids", "norm"])
    assert leftovers(pid0) == []


def test_segment_of_a_dead_process_is_swept() -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    ).stdout.strip()
    path = os.path.join(segments.SHM_DIR, f"{segments.SHM_PREFIX}{dead}-0-0-{dead}")
    with open(path, "wb") as fh:
        fh.write(b"x" * 64)
    mine = os.path.join(segments.SHM_DIR, f"{segments.SHM_PREFIX}{os.getpid()}-0-0-{os.getpid()}")
    with open(mine, "wb") as fh:
        fh.write(b"y")
    try:
        segments.sweep()
        assert not os.path.exists(path) and os.path.exists(mine)  # only the dead creator's
    finally:
        for p in (path, mine):
            if os.path.exists(p):
                os.unlink(p)


def test_neighbours_are_the_group_ranks_on_this_machine_or_torchruns_local_world(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a = host_info()
    hosts = [a, a._replace(pid=11), a._replace(hostname="n2"), a._replace(pid=12)]
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert [neighbours(hosts, r) for r in range(4)] == [3, 3, 1, 3]
    assert neighbours([], 0) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert neighbours(hosts, 2) == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "junk")
    assert neighbours(hosts, 2) == 1


def _lane_threads(rank: int, world: int) -> list[int]:
    import shardsync.exec.executor as executor

    seen: list[int] = []

    class Recorded(executor.Lane):  # type: ignore[misc,name-defined]
        def __init__(self, threads: int | None = None) -> None:
            super().__init__(threads)
            seen.append(self.threads)

    executor.Lane = Recorded  # this spawned process only
    state, _, full = case_tp(rank, world)
    got = dict(full_params(state))
    assert all(torch.equal(got[k], full[k]) for k in full)
    return seen


def test_ranks_on_one_machine_share_its_copy_threads() -> None:
    out = run_ranks(_lane_threads, 2)
    assert out == [[copy_threads(processes=2)]] * 2


def test_same_host_needs_machine_and_shm_mount() -> None:
    a = HostInfo("n1", "boot", 25, 1 << 30, 10, 0, "")
    assert same_host([a, a._replace(pid=11, shm_free=5)])
    assert not same_host([a, a._replace(hostname="n2")])
    assert not same_host([a, a._replace(boot_id="other")])
    assert not same_host([a, a._replace(shm_device=26)])  # a container with its own /dev/shm
    assert not same_host([a._replace(shm_device=-1)] * 2)  # no /dev/shm at all
    me = host_info()
    assert me.pid == os.getpid() and me.segments == "" and me.stream + 1 == host_info().stream


def _receivers_change(rank: int, world: int) -> list:
    state, mapping, ref = case_tp(rank, world)
    out = []
    for consumers in ([1], [2], [1]):  # the senders' kept segments reach a rank that never mapped them
        s = full_params(state, mapping, consumers=consumers, strategy="p2p", transport="shm")
        bad = sorted(n for n, t in s if not torch.equal(t, ref[n]))
        out.append((s.stats.transport, bad))
    return out


def test_streams_whose_receivers_change_reuse_no_segment_a_new_receiver_cannot_open() -> None:
    for rank, rec in enumerate(run_ranks(_receivers_change, 3, timeout=120)):
        assert rec == [("shm", [])] * 3, rank


def _in_place_file_system(rank: int, world: int) -> tuple:
    """Shards moved to shared memory under torch's "file_system" sharing strategy (a file whose
    storage starts after a header of torch's), published in place: twice, with new values between."""
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        state, _, ref = case_tp(rank, world)
        ref = {k: v.clone() for k, v in ref.items()}  # the shards may be views of these
        state = {k: (v.share_memory_() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
        for v in state.values():
            if hasattr(v, "local"):
                v.local = v.local.contiguous().share_memory_()
        segments.release()
        first = stream(state, None, ref, transport="shm")
        own = segments.kept_by_name()[segments.group_name(None)].own
        for v in state.values():
            getattr(v, "local", v).mul_(-1)  # in place: the same files
        second = stream(state, None, {k: -v for k, v in ref.items()}, transport="shm")
        return first["transport"], first["bad"], own is None, second["bad"], len(first["targets"])
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)


def test_shards_shared_under_the_file_system_strategy_are_read_after_torchs_header() -> None:
    for rank, rec in enumerate(run_ranks(_in_place_file_system, 2, timeout=120)):
        assert rec[:4] == ("shm", [], True, []) and rec[4] > 0, (rank, rec)


def _same_bytes_new_views(rank: int, world: int) -> list:
    """Small tensors (published and pulled, not pushed) streamed again with new values in place, then
    with the same bytes in another dtype and shape: each stream reads what the state holds then."""
    full = {f"e.{i}": arange_tensor((6, 4), start=100 * i) for i in range(5)}
    out = []
    for step in range(4):
        if step == 1:  # new values, same tensors: the kept views see them
            full = {k: v * 3 - 1 for k, v in full.items()}
        if step == 2:  # same bytes per read, another dtype: views of the same places, reinterpreted
            full = {k: (v.to(torch.int32) * 7 + 5) for k, v in full.items()}
        if step == 3:  # same bytes and dtype, another shape
            full = {k: v.reshape(4, 6).clone() for k, v in full.items()}
        state = {k: shard_dim(v, 0, rank, world) for k, v in full.items()}
        s = full_params(state, transport="shm")
        got = dict(s)
        out.append((s.stats.transport, sorted(k for k in full if not torch.equal(got[k], full[k])), len(got)))
    return out


def test_kept_views_follow_new_values_dtypes_and_shapes() -> None:
    for rank, rec in enumerate(run_ranks(_same_bytes_new_views, 2, timeout=120)):
        assert rec == [("shm", [], 5)] * 4, rank


def test_ranks_with_targets_off_cpu_make_every_rank_use_the_backend() -> None:
    import shardsync

    plan = shardsync.plan({"w": torch.zeros(3)})
    plan = dataclasses.replace(plan, reads=tuple(dataclasses.replace(r, receivers=(1,)) for r in plan.reads))
    cpu, gpu = host_info(), host_info(data_device="cuda")
    assert shm_plan.use_shm(plan, [(cpu, "auto")] * 2, None)  # both on cpu: shared memory
    assert not shm_plan.use_shm(plan, [(cpu, "auto"), (gpu, "auto")], None)  # the same answer on both ranks
    with pytest.raises(PlanError, match="targets of some ranks are on cuda, not cpu"):
        shm_plan.use_shm(plan, [(gpu, "shm"), (cpu, "shm")], None)


def _arranged_case(rank: int, world: int) -> tuple[dict, list[str], dict]:
    """Reads a sender publishes in target form (transposed, narrowed, a chain of casts, several
    transposed pieces of one read) and reads it must not (pieces that overlap, a widening cast)."""
    # each transposed piece has more than TORCH_GRAIN elements, so that it goes through the kernel
    full = {
        "p": arange_tensor((181, 2 * 191)),  # column shards, transposed whole
        "q": arange_tensor((183, 2 * 181), start=0.5, step=0.37),  # column shards: transposed and narrowed
        "c": arange_tensor((2 * 5, 3), step=0.37),  # narrowed only: half the bytes published
        "e": arange_tensor((2 * 3, 4), step=0.37),  # a chain: float32 -> bfloat16 -> float32
        "x": arange_tensor((2 * 187, 2 * 181), start=100),  # each row block feeds two transposed pieces
        "w": arange_tensor((2 * 185, 179), start=-50),  # two overlapping pieces: published as it is
        "h": arange_tensor((2 * 3, 5), step=0.37).to(torch.bfloat16),  # widened: published as it is
    }
    state = {k: shard_dim(v, 1 if k in ("p", "q") else 0, rank, world) for k, v in full.items()}
    mapping = [
        "p^T -> pt",
        "q^T -> qt, dtype='bfloat16'",
        "c -> c16, dtype='bfloat16'",
        "e -> e, dtype='bfloat16'",
        "e -> e, dtype='float32'",
        "x -> x1, x2, axis=1",
        "x1^T -> y1",
        "x2^T -> y2",
        "w -> w2",
        "w -> wt, permute='[1, 0]'",
        "h -> h32, dtype='float32'",
    ]
    ref = {
        "pt": full["p"].T,
        "qt": full["q"].T.to(torch.bfloat16),
        "c16": full["c"].to(torch.bfloat16),
        "e": full["e"].to(torch.bfloat16).to(torch.float32),
        "y1": full["x"][:, :181].T,
        "y2": full["x"][:, 181:].T,
        "w2": full["w"],
        "wt": full["w"].T,
        "h32": full["h"].to(torch.float32),
    }
    return state, mapping, ref


def count_transposes() -> list[int]:
    """From now on in this forked rank, count the elements it transposes (every transposed copy goes
    through this kernel) in the returned one-element list."""
    import shardsync.exec.copies as copies

    moved = [0]
    real = copies.transpose_into

    def counted(dst: torch.Tensor, src: torch.Tensor) -> None:
        moved[0] += dst.numel()
        real(dst, src)

    copies.transpose_into = counted  # type: ignore[assignment]
    return moved


def both_counted(state: dict, mapping: Any, ref: dict, moved: list[int]) -> tuple[dict, Any]:
    """The case through shared memory and through gloo, each with the elements this rank transposed
    (``moved``, from :func:`count_transposes`); and the plan of the shared-memory stream."""
    out = {}
    for transport in ("shm", "backend"):
        moved[0] = 0
        out[transport] = stream(state, mapping, ref, transport=transport, strategy="broadcast")
        out[transport]["moved"] = moved[0]
    s = full_params(state, mapping, transport="shm", strategy="broadcast")
    list(s)
    return out, s.plan


def _arranged(rank: int, world: int) -> dict:
    import shardsync.exec.push_schedule as push_schedule

    push_schedule.PUSH_MIN_BYTES = 1 << 62  # this forked rank only: every read published (test_push pushes them)
    moved = count_transposes()
    state, mapping, ref = _arranged_case(rank, world)
    segments.release()
    out, plan = both_counted(state, mapping, ref, moved)
    arranged = shm_plan.arranged_pieces(plan)
    sent = [i for i in arranged if plan.reads[i].sender == rank]
    out["arranged"] = sorted((plan.reads[i].source, len(arranged[i])) for i in sent)
    half = {"c", "q"}  # published narrowed to bfloat16: half of each read's bytes
    out["segment"] = (
        segments.kept_by_name()[segments.group_name(None)].own[2].numel(),
        sum(
            aligned(r.nbytes // 2 if r.source in half else r.nbytes)
            for r in plan.reads
            if r.sender == rank and r.receivers
        ),
    )
    return out


def test_senders_publish_pieces_cast_and_transposed_once() -> None:
    """Each rank transposes only the pieces of the reads it sends (its own shard, once), where
    receivers and itself used to transpose every piece they build: half of it on 2 ranks; the
    targets are the same bytes as through gloo and equal to the reference."""
    world = 2
    records = run_ranks(_arranged, world)
    full = _arranged_case(0, world)[2]
    for rank, rec in enumerate(records):
        got, via_gloo = rec["shm"], rec["backend"]
        assert got["transport"] == "shm" and got["bad"] == [] == via_gloo["bad"], rank
        assert got["targets"] == via_gloo["targets"] and sorted(got["targets"]) == sorted(full), rank
        assert got["stats"] == got["costs"] and got["peak"] <= got["plan_peak"], rank
        # transposed without a cast (qt's cast and transpose is one torch copy): pt, y1, y2, wt;
        # through gloo each rank transposes all of them
        every = sum(full[k].numel() for k in ("pt", "y1", "y2", "wt"))
        assert via_gloo["moved"] == every, rank
        # through shm only its own halves of pt, y1 and y2 (wt's read is published as it is)
        assert got["moved"] == (every - full["wt"].numel()) // world + full["wt"].numel(), rank
        assert rec["arranged"] == [("c", 1), ("e", 1), ("p", 1), ("q", 1), ("x", 2)], rank
        size, expected = rec["segment"]
        assert size == expected, rank
