"""The roll call's blame, on a store in this process: which silent peer is named after a collective
failed (the multi-process cases are in test_liveness.py and test_stream_failures.py)."""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from shardsync import roll_call
from shardsync.dist import GroupRanks
from shardsync.liveness import ProcessRecord, this_process
from shardsync.roll_call import _PREFIX, RollCall


def _roll(store: dist.Store, rank: int, world: int, seq: int) -> RollCall:
    ranks = GroupRanks(None, rank, world, tuple(range(world)))
    return RollCall("stream", ranks, seq, None, store, time.monotonic())


def test_a_peer_that_finished_the_phase_and_exited_is_not_blamed_for_one_still_dying() -> None:
    # rank 1 has all its data, leaves the phase and its program ends; rank 2 was killed, its sockets
    # closed before /proc shows its process gone: the one to name is rank 2, once it is gone
    store = dist.HashStore()
    gone = ProcessRecord(this_process().machine, 2**22 + 17, 1).dump()  # no such pid
    roll = _roll(store, 0, 3, seq=4)
    for r in (1, 2):
        store.set(f"{_PREFIX}/at/{r}", "4|stream")
    _roll(store, 1, 3, seq=4).leave()
    store.set(f"{_PREFIX}/proc/1", gone)
    store.set(f"{_PREFIX}/proc/2", this_process().dump())  # not gone yet
    dies = threading.Timer(0.5, lambda: store.set(f"{_PREFIX}/proc/2", gone))
    dies.start()
    try:
        failures = roll.blame(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234"))
    finally:
        dies.cancel()
    assert failures == {2: "entered phase 'stream' and then its process ended (it died or exited)"}


def test_a_peer_that_finished_an_earlier_phase_is_still_silent_in_this_one() -> None:
    store = dist.HashStore()
    _roll(store, 1, 2, seq=3).leave()  # done with phase 3
    roll = _roll(store, 0, 2, seq=4)
    store.set(f"{_PREFIX}/proc/1", ProcessRecord(this_process().machine, 2**22 + 17, 1).dump())
    failures = roll.blame(RuntimeError("Connection closed by peer"))
    why = "its process ended (it died or exited) before it entered phase 'stream'"
    assert failures == {1: f"{why} (the last phase it entered was 'stream')"}


def test_leaving_a_phase_after_a_later_one_was_entered_keeps_the_later_position() -> None:
    class Group:  # stands for a process group: the roll call numbers the phases of each
        pass

    store, group = dist.HashStore(), Group()
    ranks = GroupRanks(None, 1, 2, (0, 1))
    outer = RollCall("stream", ranks, 0, group, store, time.monotonic())
    inner = RollCall("digest", ranks, 1, group, store, time.monotonic())
    roll_call._entered[group] = 2  # both entered, in that order
    store.set(f"{_PREFIX}/at/1", "1|digest")
    inner.leave()
    outer.leave()  # the outer phase ends after the inner one: its lower number must not overwrite it
    assert store.get(f"{_PREFIX}/at/1").decode() == "1|digest|done"
