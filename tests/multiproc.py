"""Run a function on N spawned processes joined in a process group (test tier 2).

``run_ranks(fn, world, *args)`` calls ``fn(rank, world, *args)`` in every process after
``init_process_group(BACKEND)`` and returns the per-rank results. ``BACKEND`` is gloo unless the
environment says ``SHARDSYNC_TEST_BACKEND=nccl`` (``make gpu-check``): then each rank owns GPU
``rank``, a test needing more GPUs than there are is skipped, and :func:`on_device` moves a test's
state to the rank's GPU. A rank that raises makes
``run_ranks`` raise :class:`RankFailure` carrying every rank's outcome, so tests can also assert that
all ranks raised. Processes still running ``timeout`` seconds after the start (one deadline shared by
all ranks) are killed: a hang fails the test instead of CI. A rank whose ``init_process_group`` fails
(gloo failing to connect on loopback, a rare flake of the machine) gets the others killed at once and
the whole run is started again, once, on a fresh store; :func:`new_group` does the same for a
subgroup whose creation fails (gloo connects every pair of its ranks, which can flake on loopback).

The ranks are forked from a forkserver that has imported torch, shardsync and the heavy test
dependencies once for the whole session (:func:`context`): a spawned rank spends seconds of CPU
importing torch, on 2 cores most of a small test (``SHARDSYNC_TEST_START=spawn`` spawns them all the
same). Each rank starts from the parent's environment and working directory of the moment
(:func:`adopt`), as a spawned one would.

Failure tests wait on events, not on clocks: :func:`short_wait_group` connects a group under a
generous timeout and only then shortens it, so the short timeout bounds the wait for a rank that
never comes, never the connect of a busy machine.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = [
    "run_ranks",
    "run_ranks_one_dies",
    "RankFailure",
    "BACKEND",
    "on_device",
    "new_group",
    "short_wait_group",
    "CONNECT_TIMEOUT",
]

#: Imported once in the forkserver the ranks are forked from (an ImportError is ignored there): what
#: a rank would otherwise import each time, megatron-core and transformers the slowest.
PRELOAD = ["torch", "torch.distributed", "numpy", "safetensors.torch", "shardsync", "multiproc"]
PRELOAD += ["transformers", "megatron.core"]

#: ``SHARDSYNC_TEST_START=spawn`` starts every rank as a fresh interpreter instead (slower: each imports
#: torch), for a failure that might depend on how the ranks start.
START = os.environ.get("SHARDSYNC_TEST_START", "forkserver")


def context() -> Any:
    """The multiprocessing context the tests start ranks in: by default a forkserver that has imported
    :data:`PRELOAD` (it runs nothing else, so its forks start as a DataLoader worker does)."""
    if START not in ("forkserver", "spawn"):
        raise ValueError(f"SHARDSYNC_TEST_START={START!r}: use forkserver (the default) or spawn")
    ctx = mp.get_context(START)
    if START == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def adopt(env: dict[str, str], cwd: str) -> None:
    """Give this (forked) rank the environment and working directory its parent had at the start."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)


#: The process group backend of the multi-process tests.
BACKEND = os.environ.get("SHARDSYNC_TEST_BACKEND", "gloo")


def on_device(state: dict) -> dict:
    """``state`` with its tensors (and LocalShard shards) on this rank's GPU under NCCL, else as is."""
    if BACKEND != "nccl":
        return state
    import torch

    from shardsync.layout import LocalShard

    dev = torch.device("cuda", torch.cuda.current_device())

    def move(v: Any) -> Any:
        if isinstance(v, LocalShard):
            return LocalShard(v.local.to(dev), v.global_shape, v.global_offset)
        plain = isinstance(v, torch.Tensor) and type(v).__name__ != "DTensor"  # DTensors: on their mesh
        return v.to(dev) if plain else v

    return {k: move(v) for k, v in state.items()}


#: How long a group's ranks may take to connect (a busy 2-core machine can take seconds).
CONNECT_TIMEOUT = datetime.timedelta(seconds=60)
_out_dir: list[str] = []  # this rank's result folder, set by _entry: where a failed setup is marked


def new_group(ranks: list[int] | None = None, timeout: datetime.timedelta = CONNECT_TIMEOUT) -> Any:
    """``dist.new_group`` that, when the connect fails on this rank, makes ``run_ranks`` start the
    whole run again on a fresh store (as for a failed ``init_process_group``). Call it on every rank."""
    import torch.distributed as dist

    try:
        return dist.new_group(ranks, timeout=timeout)
    except BaseException:
        if _out_dir:
            open(os.path.join(_out_dir[0], f"{os.getpid()}{INIT_FAILED}"), "w").close()
        raise


def short_wait_group(seconds: float, ranks: list[int] | None = None) -> Any:
    """A new group (every rank calls this) whose collectives give up after ``seconds``: connected
    under :data:`CONNECT_TIMEOUT` first, then shortened, then a barrier of the whole world so that
    every rank starts the scenario together (the short clock only runs against a rank that does not
    come, never against one that is slow to connect)."""
    import torch.distributed as dist

    group = new_group(ranks)
    if dist.get_rank() in (ranks if ranks is not None else range(dist.get_world_size())):
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), group)
    dist.barrier()
    return group


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a ``tcp://`` store or MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankFailure(Exception):
    """Some rank raised. ``outcomes[r]`` is ``("ok", value)`` or ``("error", exc_type, text)``."""

    def __init__(self, outcomes: dict[int, tuple]) -> None:
        self.outcomes = outcomes
        text = "\n".join(f"--- rank {r}: {o[0]} {o[1:]!s:.3000}" for r, o in sorted(outcomes.items()))
        super().__init__(text)

    def errors(self) -> dict[int, tuple[str, str]]:
        return {r: (o[1], o[2]) for r, o in self.outcomes.items() if o[0] == "error"}


def _entry(
    rank: int,
    world: int,
    store_dir: str,
    group_timeout: float,
    fn: Callable,
    args: tuple,
    out_dir: str,
    where: tuple[dict[str, str], str],
    init_method: str | None = None,
) -> None:
    import torch
    import torch.distributed as dist

    adopt(*where)
    torch.set_num_threads(1)
    _out_dir[:] = [out_dir]
    result: tuple
    try:
        try:
            if BACKEND == "nccl":
                torch.cuda.set_device(rank)
            connect = max(group_timeout, CONNECT_TIMEOUT.total_seconds())  # a busy machine connects slowly
            dist.init_process_group(
                BACKEND,
                init_method=init_method or f"file://{store_dir}/store",
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=connect),
            )
            if group_timeout < connect:  # the short timeout bounds waits for peers, not the connect
                dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=group_timeout))
        except BaseException:  # the parent stops the others (left waiting to connect) and retries
            open(os.path.join(out_dir, f"{rank}{INIT_FAILED}"), "w").close()
            raise
        try:
            result = ("ok", fn(rank, world, *args))
        finally:
            with contextlib.suppress(Exception):  # a failed group may not tear down cleanly
                dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent
        result = ("error", type(exc).__name__, f"{exc}\n{traceback.format_exc()}")
    tmp = os.path.join(out_dir, f"{rank}.tmp")
    with open(tmp, "wb") as fh:
        pickle.dump(result, fh)
    os.replace(tmp, os.path.join(out_dir, f"{rank}.pkl"))


#: Marker file of a rank whose ``init_process_group`` failed.
INIT_FAILED = ".init-failed"


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 120.0,
    group_timeout: float = 60.0,
    init_method: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks; return results by rank.

    ``timeout`` bounds the whole run (every rank shares one deadline); ``group_timeout`` is the
    process group's timeout, how long a collective waits for a peer (the group connects under at least
    :data:`CONNECT_TIMEOUT`, and is shortened to ``group_timeout`` after). ``init_method``: the
    group's rendezvous (default: a file store in a fresh folder; ``tcp://...``: rank 0 hosts the store).
    """
    if BACKEND == "nccl":
        import pytest
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < world:
            pytest.skip(f"SHARDSYNC_TEST_BACKEND=nccl: {world} ranks need {world} GPUs, {have} present")
    deadline = time.monotonic() + timeout
    outcomes = _spawn(fn, world, args, deadline, group_timeout, init_method)
    if outcomes is None:  # gloo failed to connect the ranks (a loopback flake): once more, fresh store
        outcomes = _spawn(fn, world, args, deadline, group_timeout, init_method)
    if outcomes is None:
        raise RankFailure({r: ("error", "InitFailed", "init_process_group failed twice") for r in range(world)})
    if any(o[0] != "ok" for o in outcomes.values()):
        raise RankFailure(outcomes)
    return [outcomes[r][1] for r in range(world)]


def _spawn(
    fn: Callable[..., Any], world: int, args: tuple, deadline: float, group_timeout: float, init_method: str | None
) -> dict[int, tuple] | None:
    """Every rank's outcome, or None when a rank failed to join the process group (the others,
    left waiting to connect, are killed)."""
    ctx = context()
    where = (dict(os.environ), os.getcwd())
    with tempfile.TemporaryDirectory() as store_dir, tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(
                target=_entry,
                args=(r, world, store_dir, group_timeout, fn, args, out_dir, where, init_method),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        init_failed = False
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            init_failed = any(n.endswith(INIT_FAILED) for n in os.listdir(out_dir))
            if init_failed:
                break
            time.sleep(0.05)
        init_failed = init_failed or any(n.endswith(INIT_FAILED) for n in os.listdir(out_dir))
        if init_failed:
            for p in procs:
                p.kill()
                p.join()
            return None
        outcomes: dict[int, tuple] = {}
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
                outcomes[r] = ("error", "Hang", f"rank {r} still running at the deadline")
                continue
            path = os.path.join(out_dir, f"{r}.pkl")
            if not os.path.exists(path):
                outcomes[r] = ("error", "Died", f"rank {r} exited with code {p.exitcode}")
                continue
            with open(path, "rb") as fh:
                outcomes[r] = pickle.load(fh)
    return outcomes


def run_ranks_one_dies(
    fn: Callable[..., Any],
    world: int,
    dead: int,
    *args: Any,
    timeout: float = 120.0,
    group_timeout: float = 60.0,
    init_method: str | None = None,
) -> dict[int, Any]:
    """Run ``fn`` on ``world`` ranks where rank ``dead`` exits the process (its last scenario);
    check that it died and return the other ranks' results by rank."""
    try:
        run_ranks(fn, world, *args, timeout=timeout, group_timeout=group_timeout, init_method=init_method)
    except RankFailure as err:
        got = err.outcomes
    else:
        raise AssertionError(f"rank {dead} was meant to die, but every rank returned")
    assert got[dead][:2] == ("error", "Died"), got[dead]
    bad = {r: o for r, o in got.items() if r != dead and o[0] != "ok"}
    assert not bad, bad
    return {r: o[1] for r, o in got.items() if r != dead}
