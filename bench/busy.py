"""Another busy process on the machine, for the benchmarks' runs "with one other busy process".

A training node is never quiet: next to shardsync run the trainer, data loaders and other ranks.
:func:`busy_process` starts one stand-in for them, a second Python process running torch matmuls with
its own default threads, and stops it at the end of the block. Every benchmark takes ``--busy``
(:func:`add_flag`), measures inside :func:`run` and states :func:`conditions` in its results, which go
to ``NAME_busy.{json,md}`` (:func:`stem`) so that the quiet ones are kept.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

__all__ = ["busy_process", "BUSY", "threads", "conditions", "run", "add_flag", "stem"]

#: What the busy process runs: matmuls until its parent is gone (a benchmark killed by a signal runs
#: no ``finally``; its busy process must not outlive it and load the next run).
BUSY = (
    "import os, sys, torch\na = torch.randn(512, 512)\n"
    "while os.getppid() == int(sys.argv[1]):\n    a = (a @ a).clamp_(-1, 1)\n"
)
BUSY_TEXT = "one other busy process (bench/busy.py)"


@contextlib.contextmanager
def busy_process(settle: float = 2.0) -> Iterator[None]:
    """Run the block with the busy process computing (started ``settle`` seconds before)."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY, str(os.getpid())])
    try:
        time.sleep(settle)
        yield
    finally:
        proc.kill()
        proc.wait()


def threads() -> str:
    """This process's thread settings: torch's intra-op threads and ``OMP_NUM_THREADS``."""
    import torch

    return f"torch threads {torch.get_num_threads()} (OMP_NUM_THREADS {os.environ.get('OMP_NUM_THREADS', 'unset')})"


def conditions(busy: bool) -> str:
    """The conditions of a run, for a result's header: this process's :func:`threads`, the cores it
    may run on, the load average now, quiet or busy."""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{threads()}, {len(os.sched_getaffinity(0))} cores, load average before {load}, " + (
        BUSY_TEXT if busy else "quiet"
    )


@contextlib.contextmanager
def run(busy: bool) -> Iterator[str]:
    """Measure the block quiet, or next to :func:`busy_process` when ``busy``; yields the run's
    :func:`conditions`, taken before the busy process starts."""
    text = conditions(busy)
    with busy_process() if busy else contextlib.nullcontext():
        yield text


def add_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--busy", action="store_true", help=f"measure next to {BUSY_TEXT}; results go to NAME_busy.{{json,md}}"
    )


def stem(name: str, busy: bool) -> str:
    """The results' file stem: ``name``, or ``name_busy`` for a run next to the busy process."""
    return f"{name}_busy" if busy else name
