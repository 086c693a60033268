"""Rank processes kept for several multi-process runs (the docs' examples: one start per world size
instead of one per example).

``RankPool(world)`` starts ``world`` processes (forked like ``run_ranks``' ranks, from
:func:`multiproc.context`); ``pool.run(fn, *args)`` calls
``fn(rank, world, *args)`` in each and returns the results by rank, raising
:class:`multiproc.RankFailure` like ``run_ranks`` when a rank raises. Unlike ``run_ranks`` it makes no
process group: ``fn`` makes its own (as under torchrun), and one still open after ``fn`` is destroyed
so that the next run starts clean. A run still going at its deadline kills the pool (a hang fails the
test; the next ``run`` starts a fresh pool).
"""

from __future__ import annotations

import contextlib
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from multiproc import RankFailure, adopt, context

__all__ = ["RankPool"]


def _serve(rank: int, world: int, tasks: Any, results: Any, where: tuple[dict[str, str], str]) -> None:
    import torch
    import torch.distributed as dist

    adopt(*where)
    torch.set_num_threads(1)
    while True:
        task = tasks.get()
        if task is None:
            return
        fn, args = task
        try:
            outcome: tuple = ("ok", fn(rank, world, *args))
        except BaseException as exc:  # reported to the parent
            outcome = ("error", type(exc).__name__, f"{exc}\n{traceback.format_exc()}")
        finally:
            if dist.is_initialized():
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
        results.put((rank, outcome))


class RankPool:
    """``world`` processes that run one function after another on every rank."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._procs: list[Any] = []

    def _start(self) -> None:
        ctx = context()
        where = (dict(os.environ), os.getcwd())
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_serve, args=(r, self.world, self._tasks[r], self._results, where), daemon=True)
            for r in range(self.world)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 240.0) -> list[Any]:
        """``fn(rank, world, *args)`` on every rank; the results by rank (``timeout``: the deadline)."""
        if not self._procs:
            self._start()
        for q in self._tasks:
            q.put((fn, args))
        outcomes: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout  # one deadline for every rank
        try:
            while len(outcomes) < self.world:
                rank, outcome = self._results.get(timeout=max(0.0, deadline - time.monotonic()))
                outcomes[rank] = outcome
        except queue.Empty:
            self.close()
            dead = {
                r: ("error", "Hang", f"rank {r} still running (or dead) at the deadline")
                for r in range(self.world)
                if r not in outcomes
            }
            raise RankFailure({**outcomes, **dead}) from None
        if any(o[0] != "ok" for o in outcomes.values()):
            raise RankFailure(outcomes)
        return [outcomes[r][1] for r in range(self.world)]

    def close(self) -> None:
        """Stop the processes (killed if they do not stop at once)."""
        for p, q in zip(self._procs, self._tasks):
            if p.is_alive():
                with contextlib.suppress(Exception):
                    q.put(None)
        for p in self._procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []
