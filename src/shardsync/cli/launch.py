"""``--nproc N``: N local worker processes started through torch's own launcher (the elastic agent
that ``torchrun`` runs), joined in a gloo group; each reads and writes its part.

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
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import ShardsyncError
from ..io.commit import CheckpointNames, remove_uncommitted
from .common import command_logging
from .convert import ConvertConfig, Converted, prepare, write
from .messages import INTERRUPTED, one_line

__all__ = ["launch", "launched_world", "run_launched", "WorkerFailed"]

#: Seconds between the launcher's checks on its workers.
MONITOR_SECONDS = 0.1
log = logging.getLogger(__name__)
#: The loggers of torch's launcher (the elastic agent, and the multiprocessing it starts workers with).
_LAUNCHER_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")


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


def _worker(cfg: ConvertConfig, warn: bool = False, die_on_interrupt: bool = False) -> _Outcome:
    """One worker: join the gloo group, convert its part, leave; errors come back as their line.
    With ``die_on_interrupt`` (workers of :func:`launch`), Ctrl-C ends it at once, cleaned up after
    by the launching process."""
    if die_on_interrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    import torch
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    try:
        with command_logging("convert", quiet=not warn):  # the launching process already warned
            return _Outcome(write(cfg, prepare(cfg), group=dist.group.WORLD))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back as one line
        line, status = one_line("convert", exc)
        return _Outcome(None, line, status)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _launcher_logs() -> Iterator[None]:
    """torch's launcher logs each worker's failure as a multi-line report; the command says it in one
    line, so the report shows only with ``--debug``."""
    if logging.getLogger("shardsync").isEnabledFor(logging.DEBUG):
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
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if nproc > cores:
        log.warning(
            "--nproc %d starts more workers than this machine gives the process cores (%d): "
            "they share the cores and each starts slower; --nproc %d is usually faster",
            nproc,
            cores,
            cores,
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
        start_method="spawn",
    )
    try:
        with _launcher_logs():
            outcomes: dict[int, Any] = elastic_launch(config, _worker)(cfg, False, True)
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
