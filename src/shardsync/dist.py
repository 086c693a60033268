"""The cross-rank layer: phases that fail together instead of hanging, and group-rank bookkeeping.

Every other layer that talks to other ranks (``exec``, ``replicas``) goes through this module.

Two kinds of phase:

* :func:`agree` - local work followed by one ``all_gather_object`` that carries either the result or
  the error of every rank. Every rank reaches that collective, so a failure on any rank is raised on
  all of them as one :class:`DistributedError` naming the phase and each failing rank. Use it for
  everything before data moves (layout, validation, preflight).
* :func:`data_phase` - a context manager around collectives that move data. A local exception is
  published to the process group's store (so peers can name it) and raised at once; a peer that is
  left waiting fails with the group timeout and raises a :class:`DistributedError` naming the phase and
  whatever the store says about the failing ranks.
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from .errors import DistributedError, ShardsyncError

__all__ = ["is_distributed", "group_rank", "group_size", "agree", "data_phase", "GroupRanks"]

log = logging.getLogger(__name__)
T = TypeVar("T")
_STORE_PREFIX = "shardsync/failure"
_occurrences: dict[tuple[str, str], int] = {}


def is_distributed(group: Any = None) -> bool:
    """Whether collectives are needed: torch.distributed is up and the group has several ranks.

    Example:
        >>> is_distributed()   # a plain process
        False
    """
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def group_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (0 when not distributed).

    Example:
        >>> group_rank()
        0
    """
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def group_size(group: Any = None) -> int:
    """Number of ranks in ``group`` (1 when not distributed).

    Example:
        >>> group_size()
        1
    """
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ShardsyncError):
        return f"{type(exc).__name__}: {exc}"
    frame = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {frame[0].filename}:{frame[0].lineno})" if frame else ""
    return f"{type(exc).__name__}: {exc}{where}"


def agree(phase: str, fn: Callable[[], T], group: Any = None, *, unanimous: bool = False) -> list[T]:
    """Run ``fn`` on every rank and gather the results; raise on all ranks if any rank failed.

    Args:
        phase: name used in errors.
        fn: the local work; its result must be picklable.
        group: process group (None: the default group).
        unanimous: when every rank raised a :class:`ShardsyncError` with the same message (they all
            saw the same bad input), re-raise that error itself on every rank, so callers can catch its
            class (``LayoutError``, ``PlanError``...), instead of a :class:`DistributedError`.

    Returns:
        the results of all ranks, by group rank (a one-element list when not distributed).

    Raises:
        DistributedError: one or more ranks raised; every rank raises the same error. A single
            process re-raises the original exception instead.

    Example:
        >>> agree("count keys", lambda: len(state))     # doctest: +SKIP
        [12, 12]
    """
    if not is_distributed(group):
        return [fn()]
    try:
        payload: tuple[bool, Any] = (True, fn())
        local_exc: BaseException | None = None
    except Exception as exc:  # gathered below, raised on every rank
        payload, local_exc = (False, _describe(exc)), exc
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, payload, group=group)
    failures = {r: msg for r, (ok, msg) in enumerate(gathered) if not ok}
    if failures:
        same = len(failures) == len(gathered) and len(set(failures.values())) == 1
        if unanimous and same and isinstance(local_exc, ShardsyncError):
            raise local_exc
        raise DistributedError(phase, failures) from local_exc
    return [value for _, value in gathered]


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no store behind this group (private API moved): peers just time out
        return None


def _group_name(group: Any) -> str:
    g = group if group is not None else dist.group.WORLD
    return str(getattr(g, "group_name", None) or "world")


def _next_tag(phase: str, group: Any) -> str:
    # Keys are per (group, phase, occurrence): a failure published in one phase never leaks into a
    # later one. Every rank of a group enters the same phases in the same order, so tags agree.
    key = (_group_name(group), phase)
    n = _occurrences.get(key, 0)
    _occurrences[key] = n + 1
    return f"{key[0]}/{phase}/{n}"


def _publish(tag: str, rank: int, message: str) -> None:
    store = _store()
    if store is not None:
        with contextlib.suppress(Exception):
            store.set(f"{_STORE_PREFIX}/{tag}/{rank}", message)


def _read_failures(tag: str, ranks: list[int]) -> dict[int, str]:
    store = _store()
    found: dict[int, str] = {}
    if store is None:
        return found
    for r in ranks:
        key = f"{_STORE_PREFIX}/{tag}/{r}"
        with contextlib.suppress(Exception):
            if store.check([key]):
                found[r] = store.get(key).decode()
    return found


@contextlib.contextmanager
def data_phase(phase: str, group: Any = None) -> Iterator[None]:
    """Wrap collectives that move data so that no failure is silent and no rank waits forever.

    A local exception is published for the peers and raised as a :class:`DistributedError` naming
    this rank (and any peer that already reported a failure); an exception from a collective (a peer
    died, timed out or raised) names the ranks that reported a failure, or all other ranks if none
    did. A generator suspended inside the phase that is closed early (its caller stopped
    iterating) publishes that, so the peers left waiting can name it.

    Example:
        >>> with data_phase("stream"):             # doctest: +SKIP
        ...     dist.broadcast(t, src=0)
    """
    if not is_distributed(group):
        yield
        return
    rank = dist.get_rank()
    tag = _next_tag(phase, group)
    try:
        yield
    except GeneratorExit:
        _publish(tag, rank, f"stopped iterating during phase {phase!r} (the caller left the loop or "
                            "raised)")
        raise
    except DistributedError:
        raise
    except Exception as exc:
        local = not _looks_like_comm_error(exc)
        if local:
            _publish(tag, rank, _describe(exc))
        members = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        failures = {r: m for r, m in _read_failures(tag, members).items() if r != rank}
        if local:
            failures[rank] = _describe(exc)
        elif not failures:  # a peer died or hangs without a word
            failures = {r: f"did not answer ({_describe(exc)})" for r in members if r != rank}
        log.error("phase %r failed on rank %d: %s", phase, rank, exc)
        raise DistributedError(phase, failures) from exc


def _looks_like_comm_error(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return isinstance(exc, (RuntimeError, dist.DistBackendError)) and any(
        w in text for w in ("timeout", "timed out", "connection", "gloo", "nccl", "peer", "closed",
                            "broken pipe", "reset"))


@dataclass(frozen=True, slots=True)
class GroupRanks:
    """A process group and this process's place in it; translates group ranks to global ranks.

    Example:
        >>> GroupRanks(None, rank=1, world=2, global_ranks=(4, 6)).to_global(1)
        6
    """

    group: Any
    rank: int
    world: int
    global_ranks: tuple[int, ...]

    @classmethod
    def of(cls, group: Any) -> GroupRanks:
        """Describe ``group`` (None: the default group) for this process."""
        ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        return cls(group, dist.get_rank(group), len(ranks), ranks)

    def to_global(self, rank: int) -> int:
        return self.global_ranks[rank]
