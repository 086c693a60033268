"""Senders write their pieces straight into their consumers' targets in shared memory (exec/push.py).

Every scenario of the shared-memory tests runs again with every target pushed (``PUSH_MIN_BYTES`` 0 in
the ranks): targets byte-identical to gloo's broadcasts and equal to the dense reference, the counters
equal to the plan's costs, and no read published. Then what pushing changes: targets the caller keeps
are never written again, no two consumers share memory, a rank that dies or fails while others wait
for its pieces is named within seconds (not after the group's timeout), and a rank that leaves early
still writes its pieces.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import shardsync.exec.push as push
import shardsync.exec.push_schedule as push_schedule
import shardsync.exec.shm as shm
from multiproc import RankFailure, run_ranks
from reference import arange_tensor
from shardsync.dist import GroupRanks
from shardsync.errors import DistributedError
from shardsync.exec.shm_blocks import BlockHandle
from shardsync.exec.shm_segments import release
from shardsync.layout import shard_dim
from shardsync.liveness import ProcessRecord, this_process
from shardsync.planning.model import Costs, Plan, Step, TargetPlan
from shardsync.roll_call import TransportFailure
from shardsync.stream import full_params
from test_phases import _all_gathers
from test_shm import (
    CASES,
    STRATEGIES,
    _arranged_case,
    both,
    both_counted,
    check_pair,
    count_transposes,
    scenarios,
)
from test_stream_dist import case_tp
from test_stream_dist4 import case_replicas, case_tp_pp


@contextlib.contextmanager
def counting() -> Iterator[dict[str, int]]:
    """Count the steps whose pieces this rank pushed and the segments it filled, in this process."""
    counts = {"marks": 0, "fills": 0}
    mark, fill = push.Pusher.mark, shm.ShmTransport._fill

    def marked(self: push.Pusher, k: int) -> None:
        counts["marks"] += 1
        mark(self, k)

    def filled(self: shm.ShmTransport, *args: Any) -> Any:
        counts["fills"] += 1
        return fill(self, *args)

    push.Pusher.mark, shm.ShmTransport._fill = marked, filled  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        push.Pusher.mark, shm.ShmTransport._fill = mark, fill  # type: ignore[method-assign]


#: Targets of these tests are small: pushed from this size on, in the forked ranks only.
SMALL = 128 << 10


def _push_from(nbytes: int) -> None:
    """In this forked rank: push targets of ``nbytes`` or more (the tests' targets are small)."""
    push_schedule.PUSH_MIN_BYTES = nbytes


def _every_case(rank: int, world: int, cases: tuple) -> dict:
    _push_from(0)  # every target with pieces from elsewhere
    with counting() as counts:
        out = scenarios(rank, world, cases)
        state, _, ref = case_tp(rank, world)
        out["num_splits"] = both(state, None, ref, num_splits=2, split_index=1)
        for reuse in ("until-next", "never"):
            out[reuse] = both(state, None, ref, reuse=reuse)
    out["counts"] = counts
    return out


def test_two_ranks_pushing_every_target_matches_broadcast() -> None:
    records = run_ranks(_every_case, 2, CASES, timeout=300)
    for case in CASES:
        for name, _ in STRATEGIES:
            check_pair(records, (case.__name__, name), list(case(0, 2)[2]))
    for key in ("consumers=1", "consumers=[1,0]", "copy=False", "num_splits", "until-next", "never"):
        check_pair(records, key)
    assert [rec["consumers=1"][0]["targets"] == {} for rec in records] == [True, False]
    for rec in records:
        # every target's pieces from elsewhere were pushed: no read was published into a segment
        assert rec["counts"]["marks"] > 0 and rec["counts"]["fills"] == 0, rec["counts"]


def test_four_ranks_pushing_every_target_matches_broadcast() -> None:
    records = run_ranks(_every_case, 4, (*CASES, case_tp_pp, case_replicas), timeout=300)
    for case in (*CASES, case_tp_pp, case_replicas):
        for name, _ in STRATEGIES:
            check_pair(records, (case.__name__, name), list(case(0, 4)[2]))
    for rec in records:
        assert rec["counts"]["marks"] > 0 and rec["counts"]["fills"] == 0, rec["counts"]


def _transposed(rank: int, world: int) -> dict:
    """The cast and transposed pieces of test_shm's case, at the real threshold (they are large)."""
    _push_from(SMALL)
    moved = count_transposes()
    state, mapping, ref = _arranged_case(rank, world)
    with counting() as counts:
        out, plan = both_counted(state, mapping, ref, moved)
    out["pushed"] = sorted(plan.targets[t].name for t in push_schedule.pushed_targets(plan))
    out["counts"] = counts
    return out


def test_pieces_are_cast_and_transposed_once_by_their_sender() -> None:
    """A sender that builds a transposed piece into its own target copies it from there into the
    other consumers' targets: every element is transposed once, by the rank that holds it."""
    world = 2
    records = run_ranks(_transposed, world)
    full = _arranged_case(0, world)[2]
    large = sorted(k for k, v in full.items() if v.numel() * v.element_size() >= SMALL)
    for rank, rec in enumerate(records):
        got, via_gloo = rec["shm"], rec["backend"]
        assert got["transport"] == "shm" and got["bad"] == [] == via_gloo["bad"], rank
        assert got["targets"] == via_gloo["targets"] and sorted(got["targets"]) == sorted(full), rank
        assert got["stats"] == got["costs"] and got["peak"] <= got["plan_peak"], rank
        assert rec["pushed"] == large == ["pt", "qt", "w2", "wt", "y1", "y2"], rank
        every = sum(full[k].numel() for k in ("pt", "y1", "y2", "wt"))
        assert via_gloo["moved"] == every, rank
        assert got["moved"] == every // world, rank  # its own halves, once
        # the small targets (c16, e, h32) are still published: one segment per stream (the counted
        # one and the one that gives the plan)
        assert rec["counts"]["fills"] == 2 and rec["counts"]["marks"] > 0, rank


def _kept_and_private(rank: int, world: int) -> dict:
    """Targets the caller keeps, and targets it writes into, while more streams run."""
    _push_from(SMALL)
    full = arange_tensor((2 * 131, 257))  # 269 KB: pushed at the real threshold
    state = {"w": shard_dim(full.clone(), 0, rank, world), "v": shard_dim(full + 0.5, 1, rank, world)}
    mapping = ["w^T -> wt", "v -> v"]
    ref = {"wt": full.T, "v": full + 0.5}  # the shards are copies: changing them leaves these
    kept = [dict(full_params(state, mapping)) for _ in range(2)]  # the second stream on new memory
    state["w"].local.add_(1000)  # the sources change between streams (a training step)
    state["v"].local.add_(1000)
    third = dict(full_params(state, mapping))
    unchanged = [all(torch.equal(k[n], ref[n]) for n in ref) for k in kept]
    kept[0]["wt"].add_(rank + 1)  # a consumer writes into its target: nobody else's changes
    dist.barrier()
    return {
        "kept": unchanged,
        "third": all(torch.equal(third[n], ref[n] + 1000) for n in ref),
        "mine": torch.equal(kept[0]["wt"], ref["wt"] + rank + 1),
        "other": torch.equal(kept[1]["wt"], ref["wt"]),
        "own": kept[0]["wt"].untyped_storage().nbytes() == full.numel() * 4,
        "blocks": len({t.untyped_storage().data_ptr() for k in (*kept, third) for t in k.values()}),
    }


def test_targets_kept_by_the_caller_are_never_written_again_nor_shared() -> None:
    records = run_ranks(_kept_and_private, 2)
    for rec in records:
        assert rec["kept"] == [True, True] and rec["third"] and rec["mine"] and rec["other"], rec
        assert rec["own"] and rec["blocks"] == 6, rec  # each target its own block, owning its bytes


def _export(rank: int, world: int) -> dict:
    _push_from(SMALL)
    full = arange_tensor((4 * 97, 2 * 181), start=-7)  # every target pushed (b in bfloat16 too)
    state = {"w": shard_dim(full, 1, rank, world)}
    ref = {"a": full[:, :181], "b": full[:, 181:].T.to(torch.bfloat16), "w": full}
    mapping = ["w -> a, b2, axis=1", "b2^T -> b, dtype='bfloat16'", "w -> w"]
    s = full_params(state, mapping, consumers=0)
    got = {n: torch.equal(t, ref[n]) and t.dtype == ref[n].dtype for n, t in s}
    c = s.plan.costs
    return {
        "got": got,
        "stats": (s.stats.bytes_sent, s.stats.bytes_received),
        "costs": (c.bytes_sent[rank], c.bytes_received[rank]),
        "columns": state["w"].local.shape[1],
    }


def test_export_to_one_rank_is_written_by_every_sender() -> None:
    records = run_ranks(_export, 4)
    assert records[0]["got"] == {"a": True, "b": True, "w": True}
    assert all(rec["got"] == {} for rec in records[1:])
    for rec in records:
        assert rec["stats"] == rec["costs"]
    # rank 0 receives every column it does not hold, of every target, as the senders wrote them
    rows, mine = 4 * 97, records[0]["columns"]
    total = rows * 181 * 4 + rows * 181 * 2 + rows * 2 * 181 * 4
    own = rows * mine * 4 + rows * mine * 4  # its columns of "a" and "w" ("b" is the other half)
    assert records[0]["stats"] == (0, total - own) and sum(rec["stats"][0] for rec in records[1:]) == total - own


# -- failures ----------------------------------------------------------------------------------------

#: A group timeout no failure below waits out: each must be found well within it.
LONG_TIMEOUT = 120


def _failing(rank: int, world: int, how: str, signal_dir: str) -> tuple:
    _push_from(SMALL)
    full = {k: arange_tensor((2 * 129, 263), start=100 * i) for i, k in enumerate("abcd")}
    state = {k: shard_dim(v, 0, rank, world) for k, v in full.items()}
    mapping = [f"{k}^T -> {k}" for k in full]  # each target pushed, each rank writing half of it
    names: list[str] = []
    start = time.monotonic()
    try:
        for name, _ in full_params(state, mapping, strategy="broadcast"):
            names.append(name)
            if rank == 1 and how == "dies":
                os._exit(3)
            if rank == 1 and how == "raises":  # its next step reads a shard it no longer holds
                state["c"].local = state["c"].local[:0]
    except DistributedError as exc:
        seconds = time.monotonic() - start
        if rank == 0:
            open(os.path.join(signal_dir, "told"), "w").close()
        else:  # alive, and in no collective, until rank 0 has its error
            for _ in range(LONG_TIMEOUT * 10):
                if os.path.exists(os.path.join(signal_dir, "told")):
                    break
                time.sleep(0.1)
        return ("DistributedError", exc.phase, exc.failures, names, seconds)
    return ("finished", names)


@pytest.mark.parametrize("how", ["dies", "raises"])
def test_a_rank_that_dies_or_fails_while_others_wait_for_its_pieces_is_named_at_once(how: str, tmp_path: Any) -> None:
    args = (how, str(tmp_path))
    if how == "dies":
        with pytest.raises(RankFailure) as err:
            run_ranks(_failing, 2, *args, timeout=90, group_timeout=LONG_TIMEOUT)
        out = err.value.outcomes
        assert out[1][:2] == ("error", "Died")
        kind, phase, failures, names, seconds = out[0][1]
        assert failures == {1: "entered phase 'stream' and then its process ended (it died or exited)"}
    else:
        out = dict(enumerate(run_ranks(_failing, 2, *args, timeout=90, group_timeout=LONG_TIMEOUT)))
        kind, phase, failures, names, seconds = out[0]
        assert list(failures) == [1] and "LayoutError: 'c': this rank holds no shard containing" in failures[1]
        assert out[1][:3] == (kind, phase, failures)
    # rank 0 finds out while it waits for rank 1's pieces of some target, or writes into rank 1's
    # targets of a later step: after some of the targets in order, never all of them
    assert (kind, phase) == ("DistributedError", "stream") and names == list("abcd")[: len(names)] != list("abcd")
    assert seconds < LONG_TIMEOUT / 4, seconds  # found, not waited out


def _leaves(rank: int, world: int) -> dict:
    _push_from(SMALL)
    full = {k: arange_tensor((2 * 129, 263), start=100 * i) for i, k in enumerate("abc")}
    state = {k: shard_dim(v, 0, rank, world) for k, v in full.items()}
    mapping = [f"{k}^T -> {k}" for k in full]
    got = {}
    for name, t in full_params(state, mapping):
        got[name] = torch.equal(t, full[name].T)
        if rank == 1:
            break  # rank 1 leaves: it still writes its pieces of every target into rank 0's
    again = {name: torch.equal(t, full[name].T) for name, t in full_params(state, mapping)}
    return {"got": got, "again": again}


def test_a_rank_that_leaves_early_still_writes_its_pieces() -> None:
    records = run_ranks(_leaves, 2)
    assert records[0]["got"] == {"a": True, "b": True, "c": True} and records[1]["got"] == {"a": True}
    assert all(rec["again"] == {"a": True, "b": True, "c": True} for rec in records)


# -- pure parts ----------------------------------------------------------------------------------------


def _plan(sizes: list[int], opens: list[list[int]]) -> Plan:
    targets = tuple(TargetPlan(f"t{i}", (n,), "uint8", (0,), ()) for i, n in enumerate(sizes))
    steps = tuple(Step("broadcast", (), tuple(o), tuple(o)) for o in opens)
    return Plan("broadcast", 1, targets, (), steps, 0, Costs((0,), (0,), (0,), (0,)))


def test_consumers_allocate_pushed_targets_up_to_the_window_ahead_of_their_step() -> None:
    plan = _plan([10, 20, 30, 40, 50], [[0], [1, 2], [], [3], [4]])
    mine = {0, 1, 2, 3, 4}
    assert push_schedule.allocations(plan, mine, 0) == ([[0], [1, 2], [], [3], [4]], 0)
    # window 50: step 1's 50 bytes ahead from step 0; step 3's 40 once step 1's are no longer ahead
    assert push_schedule.allocations(plan, mine, 50) == ([[0, 1, 2], [3], [], [4], []], 50)
    assert push_schedule.allocations(plan, mine, 1000) == ([[0, 1, 2, 3, 4], [], [], [], []], 140)
    # only the targets this rank allocates count: t4 (50) waits until t1 (20) is no longer ahead
    assert push_schedule.allocations(plan, {1, 4}, 60) == ([[1], [4], [], [], []], 50)
    assert push_schedule.allocations(plan, {1, 4}, 70) == ([[1, 4], [], [], [], []], 70)


def _ahead(rank: int, world: int) -> dict:
    """Where each stream of one plan allocates its pushed targets (the step each is posted in), and
    whether its targets are exact: four targets of 2 * 129 * 263 fp32 bytes (271 KB) each, one every
    other step, the first stream's window one target, the later ones' every target. The plan is
    inspected first (``shardsync.plan``: no stream), and the last stream runs with ``reuse="never"``
    (no pool: fresh blocks)."""
    import shardsync
    import shardsync.exec.executor as executor

    _push_from(SMALL)
    push_schedule.PUSH_AHEAD_FIRST_BYTES, push_schedule.PUSH_AHEAD_BYTES = 300_000, 4 * 300_000
    full = {k: arange_tensor((2 * 129, 263), start=100 * i) for i, k in enumerate("abcd")}
    state = {k: shard_dim(v, 0, rank, world) for k, v in full.items()}
    mapping = [f"{k}^T -> {k}" for k in full]  # each target pushed, each rank writing half of it
    posted: list[tuple[str, int]] = []
    real = executor._Run.allocate

    def allocate(self: executor._Run, t: int) -> None:
        posted.append((self.plan.targets[t].name, self.posting))
        real(self, t)

    executor._Run.allocate = allocate  # type: ignore[method-assign]  # this spawned rank only
    options: dict[str, Any] = {"transport": "shm", "strategy": "broadcast"}  # target i opens in step 2i
    shardsync.plan(state, mapping, **options)
    out: dict[str, Any] = {}
    for label, reuse in (("first", "dropped"), ("second", "dropped"), ("third", "dropped"), ("never", "never")):
        posted.clear()
        got = {k: torch.equal(t, full[k].T) for k, t in full_params(state, mapping, reuse=reuse, **options)}
        out[label] = (got, sorted(posted))
    return out


def test_a_plans_first_stream_allocates_less_ahead_than_its_repeats() -> None:
    """A plan's first stream in the process (inspecting the plan does not count) and a stream without a
    pool allocate pushed targets up to PUSH_AHEAD_FIRST_BYTES ahead (fresh memory), repeats with a
    pool up to PUSH_AHEAD_BYTES (the blocks the last stream left): here one target ahead, then all of
    them at the first step."""
    exact = {k: True for k in "abcd"}
    near = (exact, [("a", 0), ("b", 0), ("c", 2), ("d", 4)])
    for rec in run_ranks(_ahead, 2):
        assert rec["first"] == rec["never"] == near, rec
        assert rec["second"] == rec["third"] == (exact, [("a", 0), ("b", 0), ("c", 0), ("d", 0)]), rec


def _pusher(world: int, gen: int, timeout: float, records: list[ProcessRecord | None]) -> push.Pusher:
    plan = _plan([4], [[0]])
    p = push.Pusher(GroupRanks(None, 0, world, tuple(range(world))), plan, push_schedule.Pushing())
    boards = [push.Board(torch.zeros(push.Board.nbytes(1, world), dtype=torch.uint8), 1, world) for _ in range(world)]
    p.attach(gen, boards, records, {}, lambda h: torch.zeros(0, dtype=torch.uint8), timeout)
    return p


def test_a_wait_ends_when_the_awaited_rank_failed_ended_or_timed_out() -> None:
    gone = ProcessRecord(this_process().machine, 2**22 + 17, 1)  # no such pid
    p = _pusher(3, 5, 60.0, [this_process(), this_process(), gone])
    p.boards[1].words[1] = 5  # rank 1 failed in this stream
    with pytest.raises(TransportFailure, match=r"rank 1 failed, while waiting for the end"):
        p._await(lambda: (p.boards[1].at_words, 0), (1,), "the end")
    p.boards[1].words[1] = 4  # an earlier stream's failure is not this one's
    with pytest.raises(TransportFailure, match=r"rank 2 ended: its process is gone, while waiting for x"):
        p._await(lambda: (p.boards[1].at_words, 0), (1, 2), "x")
    # rank 2 wrote the word and then ended, between this rank's look at the word and at rank 2: done
    looks = iter([(p.boards[1].at_words, 0)] * 2)
    p._await(lambda: next(looks, None), (1, 2), "z")
    p = _pusher(2, 5, 0.2, [this_process(), this_process()])
    start = time.monotonic()
    with pytest.raises(TransportFailure, match=r"Timed out after 0 s waiting for rank 1: y"):
        p._await(lambda: (p.boards[1].at_words, 0), (1,), "y")
    assert time.monotonic() - start < 5


def test_a_change_wakes_a_sleeping_peer_and_skips_the_call_when_none_sleeps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(push, "LOOK_SECONDS", 60.0)  # a wake-up skipped wrongly would leave rank 1 asleep
    plan = _plan([4], [[0]])
    boards = [push.Board(torch.zeros(push.Board.nbytes(1, 2), dtype=torch.uint8), 1, 2) for _ in range(2)]
    p0, p1 = (push.Pusher(GroupRanks(None, r, 2, (0, 1)), plan, push_schedule.Pushing()) for r in (0, 1))
    for p in (p0, p1):
        p.attach(3, boards, [this_process()] * 2, {}, lambda h: torch.zeros(0, dtype=torch.uint8), 600.0)
    wakes: list[int] = []
    real_wake = push.futex.wake
    monkeypatch.setattr(push.futex, "wake", lambda word: (wakes.append(word), real_wake(word)))
    if push._SKIP_WAKES:  # nobody sleeps: no system call
        p0._wake(boards[0].at_words, (1,))
        assert wakes == []
    closed = boards[0].at_words + 4 * push._CLOSED
    sleeper = threading.Thread(
        target=p1._await, args=(lambda: None if boards[0].words[0] == 3 else (closed, 0), (0,), "x")
    )
    sleeper.start()
    while not boards[1].words[push._SLEEPING]:  # rank 1 counts itself before it sleeps
        time.sleep(0.01)
    boards[0].words[push._CLOSED] = 3
    p0._wake(closed, (1,))
    sleeper.join(timeout=20)
    assert not sleeper.is_alive() and wakes == [closed]
    assert boards[1].words[push._SLEEPING] == 0


class _ChangedAfterFirstLook(np.ndarray):
    """Words of a board that the peer changes right after this rank's first look at ``at`` (``then``)."""

    at: int = -1
    then: Any = None

    def __getitem__(self, i: Any) -> Any:
        v = np.ndarray.__getitem__(self, i)
        if i == type(self).at and type(self).then is not None:
            then, type(self).then = type(self).then, None
            then()
        return v


def test_a_word_changed_between_two_looks_is_not_slept_on(monkeypatch: pytest.MonkeyPatch) -> None:
    # a wait reads the word once: had it slept on a value read after the peer's change (and wake-up), it
    # would sleep until its next look (LOOK_SECONDS: 50 ms a stream, here 5 s)
    monkeypatch.setattr(push, "LOOK_SECONDS", 5.0)
    sleeps: list[int] = []
    real_wait = push.futex.wait
    monkeypatch.setattr(
        push.futex, "wait", lambda word, seen, *a, **k: (sleeps.append(seen), real_wait(word, seen, *a, **k))
    )
    p = _pusher(2, 3, 600.0, [this_process()] * 2)
    p.opener = lambda h: torch.zeros(64, dtype=torch.uint8)
    words = p.boards[1].words.view(_ChangedAfterFirstLook)
    p.boards[1].words = words
    _ChangedAfterFirstLook.at, _ChangedAfterFirstLook.then = (
        push._CLOSED,
        lambda: words.view(np.ndarray).__setitem__(push._CLOSED, 3),
    )
    p.close()  # rank 1 closes stream 3 right after rank 0's first look
    board = p.boards[1]
    board.posted = board.posted.view(_ChangedAfterFirstLook)
    _ChangedAfterFirstLook.at, _ChangedAfterFirstLook.then = (
        0,
        lambda: board.post(0, BlockHandle(0, 5, 6, 64), False, 3),
    )
    assert p._target(0, 1).nbytes == 4  # rank 1 shows its memory for target 0 right after the first look
    assert 3 not in sleeps, sleeps


def test_the_end_waits_for_every_rank_to_close_this_stream_or_a_later_one() -> None:
    p = _pusher(3, 7, 0.3, [this_process()] * 3)
    p.boards[1].words[0], p.boards[2].words[0] = 7, 8  # rank 2 is in a later stream already
    p.close()
    assert int(p.boards[0].words[0]) == 7
    p.boards[2].words[0] = 6
    with pytest.raises(TransportFailure, match="waiting for rank 1, rank 2: the end"):
        p.close()


def test_a_board_posts_where_a_target_lies_before_its_flag_and_seals_it() -> None:
    b = push.Board(torch.zeros(push.Board.nbytes(3, 2), dtype=torch.uint8), 3, 2)
    assert b.lies(2, 9) is None
    b.post(2, BlockHandle(11, 5, 2**40 + 3, 4096), kept=True, gen=9)
    assert b.posted.tolist() == [0, 0, 9] and b.where[2, :4].tolist() == [5, 2**40 + 3, 4096, 1]
    assert b.lies(2, 9) == (BlockHandle(0, 5, 2**40 + 3, 4096), True) and b.lies(2, 10) is None
    b.where[2, 2] = 8192  # seen half written: the seal no longer matches
    assert b.lies(2, 9) is None
    b.done[2, 1] = 9
    assert b.done.tolist() == [[0, 0], [0, 0], [0, 9]]
    assert np.shares_memory(b.done, b.memory.numpy()) and b.memory.numel() == push.Board.nbytes(3, 2)


# -- what the review found: descriptors, mappings kept by writers, failed streams, pid namespaces --


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _descriptors(rank: int, world: int) -> dict:
    """A caller that keeps 300 pushed targets, one that drops each (reuse="never"), one that drops each
    (the default): descriptors and the peers' blocks writers keep mapped."""
    _push_from(0)  # every target, however small
    import shardsync.exec.memory as memory
    import shardsync.exec.shm_segments as segments

    full = {f"w{i}": arange_tensor((2 * 64, 257), start=i) for i in range(300)}  # 128.5 KiB each
    state = {k: shard_dim(v, 0, rank, world) for k, v in full.items()}
    mapping = [f"{k}^T -> {k}" for k in full]
    before = _fds()
    kept = dict(full_params(state, mapping))
    grown = _fds() - before
    ok = all(torch.equal(kept[k], v.T) for k, v in full.items())
    del kept
    never = all(torch.equal(t, full[n].T) for n, t in full_params(state, mapping, reuse="never"))
    mapped_never = len(segments.kept_by_name()[segments.group_name(None)].blocks)
    dropped = all(torch.equal(t, full[n].T) for n, t in full_params(state, mapping))
    mapped = len(segments.kept_by_name()[segments.group_name(None)].blocks)
    return {
        "ok": (ok, never, dropped),
        "grown": grown,
        "never": mapped_never,
        "mapped": mapped,
        "limit": memory.SHM_POOL_BLOCKS + push_schedule.PUSH_AHEAD_TARGETS,
    }


def test_descriptors_stay_bounded_and_writers_map_only_blocks_handed_out_again() -> None:
    for rec in run_ranks(_descriptors, 2, timeout=240):
        assert rec["ok"] == (True, True, True), rec
        # 300 targets kept, opened in one step: at most PUSH_OPEN_TARGETS of them pushed at once, and
        # descriptors only for the pool's blocks and the blocks still being written
        assert rec["grown"] <= rec["limit"] < 300, rec
        assert rec["never"] == 0, rec  # blocks nobody hands out again are unmapped once written
        assert 0 < rec["mapped"] <= 128, rec  # the pool's blocks, kept mapped for the next stream


def _after_failure(rank: int, world: int, signal_dir: str) -> dict:
    """Rank 1 fails mid-stream while rank 0 has targets open: none of their blocks is handed out again
    (rank 1 might still be writing into them)."""
    _push_from(SMALL)
    import shardsync.exec.memory as memory

    full = {k: arange_tensor((2 * 129, 263), start=100 * i) for i, k in enumerate("abcdefgh")}
    state = {k: shard_dim(v, 0, rank, world) for k, v in full.items()}
    mapping = [f"{k}^T -> {k}" for k in full]
    yielded = []
    try:
        for name, t in full_params(state, mapping, strategy="broadcast"):
            yielded.append(t.untyped_storage().data_ptr())
            if rank == 1 and name == "b":
                state["e"].local = state["e"].local[:0]  # its next reads fail
    except DistributedError:
        pass
    pool = memory._pools.get(True)
    blocks = [] if pool is None else [b.ctypes.data for b in pool._blocks.values()]
    out = {"strays": sorted(set(blocks) - set(yielded)), "yielded": len(yielded)}
    state["e"] = shard_dim(full["e"], 0, rank, world)  # mended: the same layout as before
    for label in ("next", "after"):  # the boards of the failed stream serve the next ones
        got = {n: t.clone() for n, t in full_params(state, mapping, strategy="broadcast")}
        out[label] = sorted(got) == sorted(full) and all(torch.equal(got[k], full[k].T) for k in full)
    return out


def test_blocks_of_a_failed_stream_are_never_handed_out_again(tmp_path: Any) -> None:
    records = run_ranks(_after_failure, 2, str(tmp_path), timeout=120, group_timeout=LONG_TIMEOUT)
    for rec in records:
        assert rec["strays"] == [] and 0 < rec["yielded"] < 8, rec
        assert rec["next"] and rec["after"], rec


def _other_pid_namespace(rank: int, world: int) -> dict:
    """Rank 1 says it runs in another pid namespace (two containers sharing /dev/shm): nothing is
    pushed (peers could not open its blocks through /proc), everything moves through shared memory."""
    _push_from(SMALL)
    import shardsync.pipeline as pipeline

    real = pipeline.host_info
    pipeline.host_info = lambda *a, **k: real(*a, **k)._replace(pid_ns=rank)
    full = arange_tensor((2 * 129, 263))
    state = {"w": shard_dim(full, 0, rank, world)}
    with counting() as counts:
        s = full_params(state, "w^T -> wt")
        ok = [torch.equal(t, full.T) for _, t in s]
    c = s.plan.costs
    return {
        "ok": ok,
        "transport": s.stats.transport,
        "counts": counts,
        "stats": (s.stats.bytes_sent, s.stats.bytes_received),
        "costs": (c.bytes_sent[rank], c.bytes_received[rank]),
    }


def test_ranks_in_different_pid_namespaces_publish_instead_of_pushing() -> None:
    for rec in run_ranks(_other_pid_namespace, 2):
        assert rec["ok"] == [True] and rec["transport"] == "shm" and rec["stats"] == rec["costs"], rec
        assert rec["counts"] == {"marks": 0, "fills": 1}, rec


def _repeated(rank: int, world: int) -> dict:
    """Streams of one group one after another: those that publish nothing, after one that set up,
    skip setup; a stream while another is live, one after ``release()`` and ones that publish do not."""
    _push_from(SMALL)
    full = arange_tensor((2 * 131, 257))  # 269 KB: pushed
    state = {"w": shard_dim(full.clone(), 0, rank, world), "v": shard_dim(full + 0.5, 1, rank, world)}
    mapping = ["w^T -> wt", "v -> v"]
    ref = {"wt": full.T, "v": full + 0.5}
    out: dict[str, Any] = {}

    def exact(got: dict) -> bool:
        return sorted(got) == sorted(ref) and all(torch.equal(got[n], ref[n]) for n in ref)

    def run(label: str) -> None:
        s = full_params(state, mapping, transport="shm")
        got, gathers = _all_gathers(lambda: {n: t.clone() for n, t in s})
        out[label] = (exact(got), s.stats.collectives, gathers)

    run("first")
    run("second")
    run("third")
    live = full_params(state, mapping, transport="shm")
    it = iter(live)
    taken = dict([next(it)])  # this stream is live (between two of its targets) while another runs
    run("while another is live")
    taken |= dict(it)
    out["the live one"] = (exact(taken), live.stats.collectives)
    run("after both")
    release()  # on every rank
    run("released")
    run("after release")
    _push_from(1 << 40)  # nothing pushed: every read is published in a segment
    run("published")
    run("published again")
    return out


def test_a_repeated_stream_that_publishes_nothing_sets_up_without_a_collective() -> None:
    """(exact, setup collectives, all_gathers) of each stream: the first gathers the layout, agrees
    on the plan and sets up (2); a repeated one only checks the layout - the last stream's boards
    serve, and the plan is the cached one."""
    for rec in run_ranks(_repeated, 2):
        assert rec["first"] == (True, 2, 4), rec
        assert rec["second"] == rec["third"] == (True, 0, 1), rec
        # the live stream holds the kept boards: the other sets up fresh memory of its own
        assert rec["while another is live"] == (True, 2, 3), rec
        assert rec["the live one"] == (True, 0), rec
        assert rec["after both"] == (True, 0, 1), rec
        assert rec["released"] == (True, 2, 3) and rec["after release"] == (True, 0, 1), rec
        assert rec["published"] == rec["published again"] == (True, 2, 3), rec


def _fails_before_setup(rank: int, world: int) -> dict:
    """A repeated stream whose setup needs no collective; rank 1 fails after the layout check and
    before its data phase (its memory pool cannot be made), catches the error and goes on."""
    import shardsync.exec.executor as executor

    _push_from(SMALL)
    full = arange_tensor((2 * 131, 257))
    state = {"w": shard_dim(full.clone(), 0, rank, world)}
    out: dict[str, Any] = {}
    for label in ("first", "second"):
        s = full_params(state, transport="shm")
        out[label] = (all(torch.equal(t, full) for _, t in s), s.stats.collectives)
    real = executor._pool
    if rank == 1:

        def failing(*args: Any, **kwargs: Any) -> Any:
            executor._pool = real
            raise MemoryError("no memory for the pool (simulated)")

        executor._pool = failing  # type: ignore[assignment]  # this spawned rank only
    t0 = time.monotonic()
    try:
        list(full_params(state, transport="shm"))
        out["failed"] = ("no error", 0.0)
    except DistributedError as exc:
        out["failed"] = (str(exc).splitlines()[0], time.monotonic() - t0)
    s = full_params(state, transport="shm")  # the caller goes on: the next stream sets up again
    out["next"] = (all(torch.equal(t, full) for _, t in s), s.stats.collectives)
    return out


def test_a_rank_failing_before_a_stream_without_setup_is_named_at_once() -> None:
    """Its peers start the data phase without a collective and wait on its board: it marks the board
    failed and reports in the stream phase, so they raise in well under the 120 s group timeout."""
    for rec in run_ranks(_fails_before_setup, 2, timeout=90, group_timeout=LONG_TIMEOUT):
        assert rec["first"] == (True, 2) and rec["second"] == (True, 0), rec
        message, took = rec["failed"]
        assert message == "phase 'stream' failed on rank(s) [1]:" and took < 20, rec
        assert rec["next"] == (True, 2), rec
