"""``--nproc N``: N local worker processes started through torch's own launcher (the elastic agent
that ``torchrun`` runs), joined in a gloo group; each reads and writes its part.

In the ``shardsync`` command on Linux the workers are forked (:func:`start_method`): the command has
imported torch and opened nothing distributed, so a worker starts at once instead of starting an
interpreter that imports torch again (seconds per worker on a busy machine). The command pins torch to
one thread first (:func:`pin_threads`): GNU OpenMP is not fork-safe, a child of a process that has
used its thread pool hangs in its first parallel op. Each worker resets the signal handlers it
inherited and sets its own thread count. A program that calls :func:`launch` may hold threads, CUDA or
an OpenMP pool of its own: its workers are spawned, as are the command's with
``SHARDSYNC_START_METHOD=spawn``.

A worker never prints an error itself: it returns its one-line message (errors are agreed across
ranks, so every worker has the same one) and the command prints rank 0's. A worker that dies
(killed, out of memory) is reported as one line too, without the launcher's own report (``--debug``
shows it). Ctrl-C ends the workers at once (one in a collective could not react to it) and the
command removes what they had written but not committed: one line, exit status 130.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import ShardsyncError
from ..exec.copies import cores
from ..io.commit import CheckpointNames, remove_uncommitted
from ..startup import is_command
from .common import command_logging
from .convert import ConvertConfig, Converted, prepare, write
from .messages import INTERRUPTED, UsageError, one_line

__all__ = [
    "launch",
    "launched_world",
    "run_launched",
    "start_method",
    "pin_threads",
    "WorkerFailed",
    "START_METHOD_ENV",
]

#: Seconds between the launcher's checks on its workers.
MONITOR_SECONDS = 0.1
log = logging.getLogger(__name__)
#: The loggers of torch's launcher (the elastic agent, and the multiprocessing it starts workers with).
_LAUNCHER_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")
#: Set to ``spawn`` to spawn the command's workers instead of forking them.
START_METHOD_ENV = "SHARDSYNC_START_METHOD"
#: The signals torch's launcher handles while it runs (its default ``signals_to_handle``): a forked
#: worker inherits its handlers, and the command's own are put back after the launch.
_LAUNCHER_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, name)
)


class WorkerFailed(ShardsyncError, RuntimeError):
    """A worker failed: its one-line message, or how it died, and the exit status to return.

    Attributes:
        line: the whole line to print (``shardsync convert: ...``).
        status: the exit status.
    """

    def __init__(self, line: str, status: int) -> None:
        super().__init__(line)
        self.line, self.status = line, status


@dataclass(frozen=True)
class _Outcome:
    converted: Converted | None
    line: str = ""
    status: int = 0


def start_method() -> Literal["fork", "spawn"]:
    """How :func:`launch` starts its workers: ``fork`` in the ``shardsync`` command on Linux (unless
    ``SHARDSYNC_START_METHOD=spawn``), ``spawn`` in a program that calls it and on other systems.

    Raises:
        UsageError: ``SHARDSYNC_START_METHOD`` is set to something other than ``spawn``.
    """
    forced = os.environ.get(START_METHOD_ENV, "")
    if forced not in ("", "spawn"):
        raise UsageError(
            f"{START_METHOD_ENV}={forced!r} is not a start method for the workers",
            f"set {START_METHOD_ENV}=spawn to spawn them, or unset it",
        )
    return "fork" if sys.platform == "linux" and is_command() and not forced else "spawn"


def pin_threads() -> None:
    """Run torch's parallel ops on this thread only, so that no OpenMP pool exists when the workers are
    forked (a child of a process that used GNU OpenMP's pool hangs in its first parallel op). Called by
    the command before it opens the source; each worker then sets its own thread count."""
    import torch

    torch.set_num_threads(1)


def _default_signals() -> None:
    """A forked worker inherits the handlers torch's launcher installed in the command (they raise an
    exception, caught as the worker's error): put back the defaults, so that Ctrl-C, or the launcher's
    SIGTERM, ends the worker at once (one in a collective could not react to it); the launching
    process cleans up after it."""
    for sig in _LAUNCHER_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


@contextlib.contextmanager
def _worker_logging(debug: bool) -> Iterator[None]:
    """A launched worker's log: nothing (its error comes back as its line, which the command prints
    once; the command already warned), or every record with ``--debug``, each line naming the worker.
    A forked worker's logger holds the command's handler: it is set aside, not written to twice."""
    logger = logging.getLogger("shardsync")
    inherited, level = logger.handlers[:], logger.level
    for h in inherited:
        logger.removeHandler(h)
    try:
        if debug:
            with command_logging(f"convert: worker {os.environ.get('RANK', '0')}", debug=True):
                yield
        else:
            logger.setLevel(logging.CRITICAL + 1)
            yield
    finally:
        logger.setLevel(level)
        for h in inherited:
            logger.addHandler(h)


def _convert_part(cfg: ConvertConfig) -> _Outcome:
    """Join the gloo group, convert this worker's part, leave; an error comes back as its line."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, cores() // int(os.environ["WORLD_SIZE"])))
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    try:
        return _Outcome(write(cfg, prepare(cfg), group=dist.group.WORLD))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back as one line
        line, status = one_line("convert", exc)
        return _Outcome(None, line, status)
    finally:
        dist.destroy_process_group()


def _launched(cfg: ConvertConfig, debug: bool) -> _Outcome:
    """One worker of :func:`launch`."""
    _default_signals()
    with _worker_logging(debug):
        return _convert_part(cfg)


def _worker(cfg: ConvertConfig, warn: bool = False) -> _Outcome:
    """One worker ``torchrun`` started: rank 0 warns (there is no launching process to)."""
    with command_logging("convert", quiet=not warn):
        return _convert_part(cfg)


@contextlib.contextmanager
def _launcher_logs(debug: bool) -> Iterator[None]:
    """torch's launcher logs each worker's failure as a multi-line report; the command says it in one
    line, so the report shows only with ``--debug``."""
    if debug:
        yield
        return
    # each of torch's elastic modules sets its logger's own level, so each is raised
    loggers = [
        x
        for name, x in logging.root.manager.loggerDict.items()
        if name.startswith(_LAUNCHER_LOGGERS) and isinstance(x, logging.Logger)
    ]
    saved = [x.level for x in loggers]
    for x in loggers:
        x.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for x, level in zip(loggers, saved):
            x.setLevel(level)


def _remove_uncommitted(cfg: ConvertConfig) -> None:
    """After the workers died or were interrupted: remove what they wrote and did not commit."""
    if cfg.to == "hf":
        remove_uncommitted(cfg.out, CheckpointNames())
    else:
        from ..io.dcp_writer import remove_partial  # local: torch DCP is slow to import

        remove_partial(cfg.out)


def launched_world() -> int:
    """How many workers ``torchrun`` started this process among (1 when it did not start it)."""
    return int(os.environ.get("WORLD_SIZE", "1")) if "TORCHELASTIC_RUN_ID" in os.environ else 1


def run_launched(cfg: ConvertConfig) -> tuple[str, int]:
    """Convert as one of the workers ``torchrun -m shardsync convert ...`` started: rank 0's line
    (the summary, or the error every rank shares) and the exit status."""
    rank = int(os.environ.get("RANK", "0"))
    outcome = _worker(cfg, warn=rank == 0)
    if outcome.converted is not None:
        text = outcome.converted.summary(cfg.out)
    else:
        text = outcome.line
    return (text if rank == 0 else ""), outcome.status


def launch(cfg: ConvertConfig, nproc: int) -> list[Converted]:
    """Run the conversion on ``nproc`` local workers; every worker's result, by rank.

    Raises:
        WorkerFailed: a worker failed (rank 0's line) or died.
        UsageError: ``SHARDSYNC_START_METHOD`` is not ``spawn``.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    usable = cores()
    if nproc > usable:
        log.warning(
            "--nproc %d starts more workers than this machine gives the process cores (%d): "
            "they share the cores and each starts slower; --nproc %d is usually faster",
            nproc,
            usable,
            usable,
        )
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=MONITOR_SECONDS,
        start_method=start_method(),
    )
    debug = logging.getLogger("shardsync").isEnabledFor(logging.DEBUG)
    try:
        with _launcher_logs(debug), _signals_kept():
            outcomes: dict[int, Any] = elastic_launch(config, _launched)(cfg, debug)
    except ChildFailedError as exc:
        _remove_uncommitted(cfg)
        rank, failure = min(exc.failures.items())
        raise WorkerFailed(
            f"shardsync convert: worker {rank} died with exit code {failure.exitcode} "
            "(out of memory or killed? run with --debug to see the launcher's report)",
            2,
        ) from exc
    except (SignalException, KeyboardInterrupt) as exc:  # the launcher turns Ctrl-C into SignalException
        _remove_uncommitted(cfg)
        raise WorkerFailed("shardsync convert: interrupted", INTERRUPTED) from exc
    failed = [outcomes[r] for r in sorted(outcomes) if outcomes[r].status]
    if failed:
        raise WorkerFailed(failed[0].line, max(o.status for o in failed))
    return [o.converted for o in (outcomes[r] for r in sorted(outcomes)) if o.converted is not None]


@contextlib.contextmanager
def _signals_kept() -> Iterator[None]:
    """torch's launcher installs its own handlers for the signals it handles and leaves them: the
    command's (its Ctrl-C handler) are put back after the launch."""
    if threading.current_thread() is not threading.main_thread():  # where torch's launcher installs none
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in _LAUNCHER_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:  # None: a handler not installed from Python, left as it is
                signal.signal(sig, handler)
