"""A dead rank is named within seconds, with the default group timeout; a live one is waited for.

The process groups here use torch's default timeout (30 minutes) and each run has a deadline of a
few minutes: a survivor that waited for the group timeout would be killed at the deadline and the
test would fail with "Hang". No test measures a time: the deadline is the assertion.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from multiproc import RankFailure, free_port, run_ranks, run_ranks_one_dies
from shardsync.errors import DistributedError, ShardsyncError
from shardsync.layout import shard_dim
from shardsync.liveness import ProcessRecord, is_gone, peer_left, this_process
from shardsync.replicas import ReplicaSync
from shardsync.stream import full_params

DEFAULT_TIMEOUT = 1800.0  # torch's default process group timeout
DEADLINE = 240.0  # the whole run: spawning, imports on a busy machine, and the naming itself


# -- the process records (tier 1) --------------------------------------------------------------------


def test_this_process_is_alive() -> None:
    assert is_gone(this_process()) is False


def test_a_process_that_exited_is_gone() -> None:
    code = "from shardsync.liveness import this_process; print(this_process().dump())"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    record = ProcessRecord.parse(out.stdout.strip())
    assert record is not None and record.pid != os.getpid()
    assert is_gone(record) is True


def test_a_reused_pid_is_not_the_same_process() -> None:
    me = this_process()
    assert is_gone(me._replace(start=me.start + 1)) is True


def test_another_machine_cannot_be_checked() -> None:
    assert is_gone(this_process()._replace(machine="elsewhere|boot|1")) is None
    assert is_gone(this_process()._replace(start=0)) is None  # no /proc where it ran


def test_records_round_trip_and_junk_is_refused() -> None:
    me = this_process()
    assert ProcessRecord.parse(me.dump()) == me
    assert [ProcessRecord.parse(t) for t in ("", "x|1|m", "1|2|")] == [None, None, None]


def test_peer_left_tells_closed_connections_from_timeouts() -> None:
    assert peer_left(RuntimeError("[pair.cc:537] Read error [127.0.0.1]:7571: Connection reset by peer"))
    assert not peer_left(RuntimeError("[pair.cc:598] Timed out waiting 1800000ms for recv operation"))


# -- ranks that die (tier 2, default group timeout) ---------------------------------------------------


def _state(rank: int) -> dict[str, object]:
    # every target needs both ranks' shards: a survivor cannot finish without the dead rank
    return {
        "w": shard_dim(torch.arange(17 * 3.0).reshape(17, 3), 0, rank, 2),
        "b": shard_dim(torch.arange(5.0), 0, rank, 2),
    }


def _dies(rank: int, world: int, when: str, transport: str) -> tuple:
    state = _state(rank)
    if when == "after a call":
        _ = [n for n, _ in full_params(state, transport=transport)]
    if rank == 1 and when != "mid-stream":
        os._exit(0)  # exits cleanly, without calling full_params again
    names = []
    try:
        for name, _ in full_params(state, strategy="broadcast", transport=transport):
            names.append(name)
            if rank == 1:
                os._exit(3)
    except DistributedError as exc:
        return (exc.phase, exc.failures, names)
    return ("finished", names)


def _survivor(when: str, transport: str = "auto") -> tuple:
    with pytest.raises(RankFailure) as err:
        run_ranks(_dies, 2, when, transport, timeout=DEADLINE, group_timeout=DEFAULT_TIMEOUT)
    out = err.value.outcomes
    assert out[1][:2] == ("error", "Died"), out[1]
    assert out[0][0] == "ok", out[0]
    return out[0][1]


def test_a_rank_that_exits_before_its_first_call_is_named() -> None:
    phase, failures, names = _survivor("first")
    assert (phase, list(failures), names) == ("gather layout", [1], [])
    assert failures[1] == (
        "never entered phase 'gather layout' (it entered no phase of this group yet; "
        "did it call this on every rank?); a connection to it closed, so it probably "
        "exited or died"
    )


def test_a_rank_that_exits_after_a_call_is_named_as_gone() -> None:
    phase, failures, _ = _survivor("after a call")
    # the second call on the group takes the fast path first (one small collective): it is named there
    assert (phase, failures) == (
        "check layout",
        {
            1: "its process ended (it died or exited) before it entered phase 'check layout' (the last phase "
            "it entered was 'stream')"
        },
    )


@pytest.mark.parametrize("transport", ["backend", "shm"])
def test_a_rank_that_dies_mid_stream_is_named(transport: str) -> None:
    phase, failures, names = _survivor("mid-stream", transport)
    assert (phase, failures) == ("stream", {1: "entered phase 'stream' and then its process ended (it died or exited)"})
    assert names[:1] == ["b"]


def _carries_on(rank: int, world: int, marks: str, where: str) -> tuple:
    """Rank ``world - 1`` exits between two streams (``where="check layout"``) or after the first target
    of a 2 x 2 mesh stream (``"mesh2d"``); the others catch the error and carry on, alive, until every
    one of them has raised (or a minute has passed)."""
    state = {f"w{i}": shard_dim(torch.arange(4099 * 3.0).reshape(4099, 3) + i, 0, rank, world) for i in range(6)}
    if where == "check layout":
        _ = [n for n, _ in full_params(state)]
        if rank == world - 1:
            os._exit(0)
    options = {} if where == "check layout" else {"strategy": "mesh2d", "mesh": init_device_mesh("cpu", (2, 2))}
    try:
        for _ in full_params(state, **options):
            if rank == world - 1:
                os._exit(0)
    except DistributedError as exc:
        open(os.path.join(marks, str(rank)), "w").close()
        return (exc.phase, exc.failures, _marks_wait(marks, world - 1))
    return ("finished",)


@pytest.mark.parametrize("where", ["check layout", "mesh2d"])
def test_survivors_that_carry_on_do_not_leave_a_rank_waiting_in_the_ring(tmp_path: Path, where: str) -> None:
    # gloo's all_gather is a ring: only the dead rank's neighbours (0 and 2 of 4) see its connection
    # close; rank 1 waits on them (in an agreed phase's gather; in a 2 x 2 mesh, rank 0 in its row's
    # all_gather with rank 1). They catch the error and stay alive: the others must still raise (they
    # see the transport failures in the roll call), not wait for them to exit or for the timeout.
    got = run_ranks_one_dies(_carries_on, 4, 3, str(tmp_path), where, timeout=DEADLINE, group_timeout=DEFAULT_TIMEOUT)
    if where == "check layout":
        why = (
            "its process ended (it died or exited) before it entered phase 'check layout' (the last phase it "
            "entered was 'stream')"
        )
    else:
        why = "entered phase 'stream' and then its process ended (it died or exited)"
    assert got == {r: (where if where == "check layout" else "stream", {3: why}, ["0", "1", "2"]) for r in range(3)}


def _store_host_dies(rank: int, world: int, when: str) -> tuple:
    state = _state(rank)
    if rank == 0 and when == "first":
        os._exit(0)
    names = []
    try:
        for name, _ in full_params(state, transport="shm"):
            names.append(name)
            if rank == 0:
                os._exit(3)
    except DistributedError as exc:
        return (exc.phase, exc.failures)
    return ("finished", names)


@pytest.mark.parametrize("when", ["first", "mid-stream"])
def test_the_rank_that_hosts_the_store_is_named_when_it_dies(when: str) -> None:
    # tcp:// : rank 0's process hosts the group's store, so when it dies nobody can be asked; the
    # survivor names rank 0 (from its shared-memory wait, or as the store's host), not itself
    got = run_ranks_one_dies(
        _store_host_dies,
        2,
        0,
        when,
        timeout=DEADLINE,
        group_timeout=DEFAULT_TIMEOUT,
        init_method=f"tcp://127.0.0.1:{free_port()}",
    )
    phase, failures = got[1]
    assert list(failures) == [0], failures
    if when == "first":
        assert phase == "gather layout"
        assert failures[0].startswith(
            "its process hosts the group's store (the TCP store init_process_group makes), which "
            "stopped answering: it has probably died or exited (a collective failed with: TransportFailure:"
        )
    else:
        assert phase == "stream" and failures[0].startswith("ended: its process is gone, while rank 1 waited for ")


def _store_host_exits(rank: int, world: int, marks: str) -> tuple:
    """tcp:// : rank 0 (the store's host) exits between two streams; the others catch the error and
    carry on, alive, until every one of them has raised (or a minute has passed)."""
    state = {f"w{i}": shard_dim(torch.arange(4099 * 3.0).reshape(4099, 3) + i, 0, rank, world) for i in range(6)}
    _ = [n for n, _ in full_params(state)]
    if rank == 0:
        os._exit(0)
    try:
        _ = [n for n, _ in full_params(state)]
    except DistributedError as exc:
        open(os.path.join(marks, str(rank)), "w").close()
        return (exc.phase, list(exc.failures), _marks_wait(marks, world - 1))
    return ("finished",)


def test_when_the_store_s_host_dies_survivors_away_from_it_in_the_ring_do_not_wait(tmp_path: Path) -> None:
    # rank 0's neighbours in gloo's ring (1 and 3) see its connection close, name it and carry on;
    # rank 2 waits on them, and with the store gone nobody can report: it must still raise, naming
    # rank 0, not wait for them to exit or for the group timeout
    got = run_ranks_one_dies(
        _store_host_exits,
        4,
        0,
        str(tmp_path),
        timeout=DEADLINE,
        group_timeout=DEFAULT_TIMEOUT,
        init_method=f"tcp://127.0.0.1:{free_port()}",
    )
    assert got == {r: ("check layout", [0], ["1", "2", "3"]) for r in (1, 2, 3)}


_RANK_OF_A_GROUP_WITH_ITS_OWN_STORE = """
import datetime, os, sys, time, torch
import torch.distributed as dist
from shardsync.dist import data_phase, wait_for
from shardsync.roll_call import transport_errors
rank, port, marks = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, 3, False, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)  # torch's default timeout
for _ in range(3):  # phases enough for rank 1 to keep rank 0's process record
    with data_phase("stream") as roll, transport_errors():
        wait_for(dist.broadcast(torch.zeros(2), 0, async_op=True), roll)
t = torch.full((4,), float(rank))
try:
    with data_phase("stream") as roll, transport_errors():
        open(os.path.join(marks, str(rank)), "w").close()
        if rank == 0:
            time.sleep(3)  # healthy, and slow: rank 1 finds the store gone meanwhile
        wait_for(dist.broadcast(t, 0, async_op=True), roll)
    print("completed", t.tolist(), flush=True)
except Exception as exc:
    print("raised", type(exc).__name__, exc, flush=True)
os._exit(0)
"""


def test_a_store_that_stops_answering_while_its_host_is_not_a_rank_leaves_the_collective_running(
    tmp_path: Path,
) -> None:
    # the store is the caller's, hosted by this process; it goes away while both ranks are in a
    # broadcast: rank 0 (alive, slow) is not the store's host, so nobody is blamed and the broadcast ends
    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, 3, True, wait_for_workers=False)
    script = tmp_path / "rank.py"
    script.write_text(_RANK_OF_A_GROUP_WITH_ITS_OWN_STORE)
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(port), str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        for r in (0, 1)
    ]
    try:
        assert _marks_wait(str(tmp_path), 3) == ["0", "1", "rank.py"]
        del store  # its server stops
        outs = [p.communicate(timeout=120)[0].strip() for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert outs == ["completed [0.0, 0.0, 0.0, 0.0]"] * 2, outs


def _marks_wait(marks: str, want: int) -> list[str]:
    """The ranks that marked ``marks`` once ``want`` of them did, or after a minute."""
    end = time.monotonic() + 60
    while len(os.listdir(marks)) < want and time.monotonic() < end:
        time.sleep(0.05)
    return sorted(os.listdir(marks))


def _one_refuses(rank: int, world: int, marks: str) -> tuple:
    """Rank 1 passes a bad argument (refused before any phase) and carries on, alive."""
    state = _state(rank)
    try:
        _ = [n for n, _ in full_params(state, strategy="bogus" if rank == 1 else "auto")]
    except ShardsyncError as exc:
        open(os.path.join(marks, str(rank)), "w").close()
        seen = _marks_wait(marks, world)
        return (type(exc).__name__, getattr(exc, "phase", None), dict(getattr(exc, "failures", {})), seen)
    return ("finished",)


def test_a_rank_that_refuses_its_arguments_and_carries_on_is_named_at_once(tmp_path: Path) -> None:
    got = run_ranks(_one_refuses, 2, str(tmp_path), timeout=DEADLINE, group_timeout=DEFAULT_TIMEOUT)
    assert got[1][0] == "PlanError" and got[1][3] == ["0", "1"]
    name, phase, failures, seen = got[0]
    assert (name, phase, list(failures), seen) == ("DistributedError", "gather layout", [1], ["0", "1"])
    assert failures[1].startswith("PlanError: ") and "bogus" in failures[1]


def _replicas_carry_on(rank: int, world: int, marks: str) -> tuple:
    """Rank 3 exits before a replica broadcast; the others catch the error and carry on, alive."""
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.LayerNorm(3))
    sync = ReplicaSync(model, bucket_bytes=1 << 20)
    if rank == world - 1:
        os._exit(0)
    try:
        sync.broadcast_now()
    except DistributedError as exc:
        open(os.path.join(marks, str(rank)), "w").close()
        return (exc.phase, list(exc.failures), _marks_wait(marks, world - 1))
    return ("finished",)


def test_replica_sync_survivors_that_carry_on_do_not_leave_a_rank_waiting(tmp_path: Path) -> None:
    got = run_ranks_one_dies(_replicas_carry_on, 4, 3, str(tmp_path), timeout=DEADLINE, group_timeout=DEFAULT_TIMEOUT)
    assert {r: (out[1], out[2]) for r, out in got.items()} == {r: ([3], ["0", "1", "2"]) for r in range(3)}
