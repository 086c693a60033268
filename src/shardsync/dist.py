"""The cross-rank layer: phases that fail together instead of hanging, and group-rank bookkeeping.

Every other layer that talks to other ranks (``exec``, ``replicas``, the verbs) goes through this module.

Two kinds of phase:

* :func:`agree` - local work followed by one gather (an ``all_gather`` of pickles, two for a large
  one) that carries either the result or the error of every rank. Every rank reaches that gather, so
  a failure on any rank is raised on all of them as one :class:`DistributedError` naming the phase
  and each failing rank. Use it for everything before data moves (layout, plan, preflight).
* :func:`data_phase` - a context manager around collectives that move data. A local exception is
  published to the group's store (so peers can name it) and raised at once; a peer that is left
  waiting finds the report (:func:`wait_for`, under gloo) or fails with the group timeout, and
  raises a :class:`DistributedError` naming the phase and the rank the store says is to blame.

Both kinds keep a roll call in the group's store (:mod:`shardsync.roll_call`): each rank notes the
phase it enters, and what went wrong when it fails. When a collective fails (a peer died, hangs, or
never came), the roll call singles out the culprit: a rank that reported a failure, else a rank that
never entered the phase, else one that entered it and fell silent.

Ranks in errors are group ranks, with the global rank in brackets where they differ
(``rank 1 [global 3]``).
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import torch
import torch.distributed as dist

from .errors import DistributedError, ShardsyncError
from .roll_call import (
    ABSENT,
    STOPPED,
    TRANSPORT,
    RollCall,
    TransportFailure,
    describe,
    is_transport_failure,
    transport_errors,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "is_distributed",
    "group_rank",
    "group_size",
    "GroupRanks",
    "Agreed",
    "agree",
    "GATHER_BYTES",
    "data_phase",
    "wait_for",
    "WATCH_SECONDS",
    "abandon",
    "abort_group",
    "transport_errors",
    "TransportFailure",
]

log = logging.getLogger(__name__)
T = TypeVar("T")
S = TypeVar("S")


def is_distributed(group: ProcessGroup | None = None) -> bool:
    """Whether collectives are needed: torch.distributed is up and the group has several ranks.

    Example:
        >>> is_distributed()   # a plain process
        False
    """
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def group_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (0 when not distributed).

    Example:
        >>> group_rank()
        0
    """
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def group_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (1 when not distributed).

    Example:
        >>> group_size()
        1
    """
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


@dataclass(frozen=True, slots=True)
class GroupRanks:
    """A process group and this process's place in it; translates group ranks to global ranks.

    Example:
        >>> ranks = GroupRanks(None, rank=1, world=2, global_ranks=(4, 6))
        >>> ranks.to_global(1), ranks.label(1)
        (6, 'rank 1 [global 6]')
    """

    group: ProcessGroup | None
    rank: int
    world: int
    global_ranks: tuple[int, ...]

    @classmethod
    def of(cls, group: ProcessGroup | None) -> GroupRanks:
        """Describe ``group`` (None: the default group) for this process."""
        ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        return cls(group, dist.get_rank(group), len(ranks), ranks)

    def to_global(self, rank: int) -> int:
        """The global rank of group rank ``rank``."""
        return self.global_ranks[rank]

    def label(self, rank: int) -> str:
        """``rank`` as errors name it: the group rank, and the global one in brackets if different."""
        glob = self.global_ranks[rank]
        return f"rank {rank}" if glob == rank else f"rank {rank} [global {glob}]"


@dataclass(frozen=True, slots=True)
class Agreed(Generic[T, S]):
    """What :func:`agree` returns: this rank's own result, and what every rank shared, by group rank.

    Attributes:
        mine: this rank's result, the object itself (not a copy that went through pickling).
        all: every rank's shared part (``share(result)``, or the result), by group rank.

    Example:
        >>> agreed = agree("count", lambda: [1, 2, 3], share=len)
        >>> agreed.mine, agreed.all
        ([1, 2, 3], [3])
    """

    mine: T
    all: list[S]


@overload
def agree(
    phase: str, fn: Callable[[], T], group: ProcessGroup | None = None, *, unanimous: bool = False
) -> Agreed[T, T]: ...


@overload
def agree(
    phase: str,
    fn: Callable[[], T],
    group: ProcessGroup | None = None,
    *,
    share: Callable[[T], S],
    unanimous: bool = False,
) -> Agreed[T, S]: ...


def agree(
    phase: str,
    fn: Callable[[], Any],
    group: ProcessGroup | None = None,
    *,
    share: Callable[[Any], Any] | None = None,
    unanimous: bool = False,
) -> Agreed[Any, Any]:
    """Run ``fn`` on every rank and gather what it shares; raise on all ranks if any rank failed.

    Args:
        phase: name used in errors.
        fn: the local work.
        group: process group (None: the default group).
        share: what of ``fn``'s result the other ranks get (must be picklable); None: all of it. It
            runs inside the phase, so its errors are gathered like ``fn``'s.
        unanimous: when every rank raised a :class:`ShardsyncError` with the same message (they all
            saw the same bad input), re-raise that error itself on every rank, so callers can catch its
            class (``LayoutError``, ``PlanError``...), instead of a :class:`DistributedError`.

    Returns:
        an :class:`Agreed`: this rank's result of ``fn`` (``.mine``) and every rank's shared part by
        group rank (``.all``; one element when not distributed).

    Raises:
        DistributedError: one or more ranks raised, or a rank died, hung or never entered the phase;
            every rank raises the same error. A single process re-raises the original exception.

    Example:
        >>> agree("count keys", lambda: len({"w": 1})).all     # on each of 2 ranks: [1, 1]
        [1]
    """
    if not is_distributed(group):
        mine = fn()
        return Agreed(mine, [mine if share is None else share(mine)])
    roll = RollCall.enter(phase, GroupRanks.of(group))
    mine, local_exc = None, None
    try:
        mine = fn()
        data = _pickled((True, mine if share is None else share(mine), phase))
    except Exception as exc:  # gathered below, raised on every rank (a share that cannot be pickled too)
        local_exc, why = exc, describe(exc)
        roll.record_failure(why)  # found by peers if the gather itself fails
        data = _pickled((False, why, phase))
    try:
        with transport_errors():
            shares = _gather_pickled(data, group, roll)
    except TransportFailure as exc:
        failures = roll.blame(exc)
        if local_exc is not None:
            failures[roll.ranks.rank] = describe(local_exc)
        raise _error(roll, failures) from exc
    gathered = [pickle.loads(share) for share in shares]
    elsewhere = {r: other for r, (_, _, other) in enumerate(gathered) if other != phase}
    if elsewhere:  # out of step: e.g. shardsync.release() called on some ranks only
        raise _error(roll, {r: _out_of_step(other) for r, other in elsewhere.items()})
    failures = {r: msg for r, (ok, msg, _) in enumerate(gathered) if not ok}
    if failures:
        same = len(failures) == len(gathered) and len(set(failures.values())) == 1
        if unanimous and same and isinstance(local_exc, ShardsyncError):
            raise local_exc
        raise _error(roll, failures) from local_exc
    return Agreed(mine, [value for _, value, _ in gathered])


#: Pickled bytes a rank's part of an agreed phase may have for the phase to take one ``all_gather``:
#: the layout checks, plan ids and segment tables of a stream that runs again are a few hundred bytes.
GATHER_BYTES = 4096
_SIZE = 8  # bytes of the length in front of each rank's share


def _pickled(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _gather_pickled(data: bytes, group: ProcessGroup | None, roll: RollCall) -> list[Any]:
    """Every rank's ``data`` (a pickle), by group rank, as bytes-like objects: ``all_gather_object``
    in one ``all_gather`` where every rank's pickle has at most :data:`GATHER_BYTES` bytes, else two
    (the first tells every rank every size, the second carries the pickles padded to the largest).
    ``all_gather_object`` always takes two and goes through pickled tensors; a stream that runs again
    makes three of these gathers. A gloo gather is waited for with :func:`wait_for` (``agreed``)."""
    first = bytearray(_SIZE + GATHER_BYTES)
    first[:_SIZE] = len(data).to_bytes(_SIZE, "little")
    if len(data) <= GATHER_BYTES:
        first[_SIZE : _SIZE + len(data)] = data
    got = _all_gather(first, group, roll)
    sizes = [int.from_bytes(g[:_SIZE].tobytes(), "little") for g in got]
    if max(sizes) <= GATHER_BYTES:
        return [g[_SIZE : _SIZE + n] for g, n in zip(got, sizes)]
    second = bytearray(max(sizes))  # every rank saw the same sizes: the same second gather
    second[: len(data)] = data
    return [g[:n] for g, n in zip(_all_gather(second, group, roll), sizes)]


def _all_gather(buf: bytearray, group: ProcessGroup | None, roll: RollCall) -> list[Any]:
    """Every rank's ``buf`` (the same length on every rank) as numpy byte arrays, by group rank; on
    the device ``all_gather_object`` uses for the group (the current GPU under NCCL, whose
    collectives move nothing else; the CPU where the group has a CPU backend)."""
    device = dist.distributed_c10d._get_object_coll_device(group)
    mine = torch.frombuffer(buf, dtype=torch.uint8).to(device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(out, mine, group=group, async_op=True)
    wait_for(work, roll, agreed=True)
    return [t.cpu().numpy() for t in out]


def _out_of_step(other: str) -> str:
    return (
        f"was in phase {other!r} at the same collective: the ranks are out of step (was "
        "shardsync.release() called on some ranks only? call it on every rank of the group, or on none)"
    )


@contextlib.contextmanager
def data_phase(phase: str, group: ProcessGroup | None = None) -> Iterator[RollCall | None]:
    """Wrap collectives that move data so that no failure is silent and no rank waits forever.

    Mark the torch.distributed calls inside with :func:`transport_errors`: a failure there is a
    transport failure (a peer died, timed out or left), anything else a local one. A local exception is
    published for the peers and raised as a :class:`DistributedError` naming this rank (and any peer
    that already reported a failure); a transport failure names the culprit the roll call finds. After a
    local failure this rank's collectives are out of step with its peers' (they wait in one it will
    never join), so the group is aborted (:func:`abort_group`) and not used again: this rank's pending
    collectives are released, so its program can exit, and the peers fail and name this rank when its
    process exits or, if it keeps running, when their waits for its broadcasts find its report
    (:func:`wait_for`, given the roll call this yields; None when not distributed); else after the
    group's timeout. A generator suspended inside the phase that
    is closed early (its caller stopped iterating) publishes that, so the peers left waiting can name
    it.

    Example:
        >>> import torch
        >>> with data_phase("stream"), transport_errors():   # a plain process: runs as is
        ...     t = torch.zeros(2)
    """
    if not is_distributed(group):
        yield None
        return
    roll = RollCall.enter(phase, GroupRanks.of(group))
    try:
        yield roll
        roll.leave()  # a peer still waiting for a dead rank does not blame this one when it exits
    except GeneratorExit:
        roll.record(STOPPED, f"stopped iterating during phase {phase!r} (the caller left the loop or raised)")
        raise
    except DistributedError:
        raise
    except Exception as exc:
        if is_transport_failure(exc):
            failures = roll.blame(exc)
        else:
            roll.record_failure(describe(exc))  # first: the peers woken by the abort read it
            failures = {**roll.culprits(), roll.ranks.rank: describe(exc)}
            abort_group(group)
        log.error("phase %r failed on %s: %s", phase, roll.ranks.label(roll.ranks.rank), exc)
        raise _error(roll, failures) from exc


#: Seconds between looks at the roll call while :func:`wait_for` waits for a gloo broadcast.
WATCH_SECONDS = 1.0
_POLL_TIMED_OUT = "Operation timed out!"  # how gloo's Work.wait(timeout) starts when it only timed out


def wait_for(work: dist.Work, roll: RollCall | None, *, agreed: bool = False) -> None:
    """``work.wait()`` for a broadcast (or another collective, not a send or receive) posted in the
    phase whose roll call is ``roll`` (:func:`data_phase` yields it; None: wait plainly). On gloo the
    wait looks at the roll call every :data:`WATCH_SECONDS`: a peer that reported a failure there - of its
    own (it raised, or its caller stopped iterating), or of a collective under it (a peer of its died)
    - has left the phase and never posts its part, even if its process keeps running, so this rank
    raises :class:`TransportFailure` at once - and the phase names the rank at fault - instead of
    waiting out the group's timeout. (Gloo's ``all_gather`` passes the parts around a ring: only a dead
    rank's neighbours see its connection close, and the others wait on those neighbours.) The group
    cannot be used again, as after any failure in a data phase (its collectives still posted end with
    the group's timeout). Other backends wait plainly (an NCCL wait with a timeout aborts the
    communicator), and so do gloo's sends and receives (a timed-out wait closes the group's
    connections).

    When the store stops answering (nobody can report) because its host - rank 0 for the TCP store
    ``init_process_group`` makes, a rank of this group - is gone (its process checked on this machine),
    the collective can never complete: this rank raises at its next look. Otherwise (a store hosted
    elsewhere, its host alive or on another machine) the wait goes on as a plain wait.

    ``agreed``: the gathers of :func:`agree`, where a rank whose own work failed still takes part (its
    failure is what it shares): only a peer's transport failure, or a peer that will not come
    (:func:`abandon`), stops the wait.

    Example:
        >>> import torch, torch.distributed as dist
        >>> with data_phase("stream") as roll:   # doctest: +SKIP
        ...     wait_for(dist.broadcast(torch.zeros(2), src=0, async_op=True), roll)
    """
    if roll is None or dist.get_backend(roll.ranks.group) != "gloo":
        work.wait()
        return
    while True:
        try:
            work.wait(timeout=timedelta(seconds=WATCH_SECONDS))
            return
        except RuntimeError as exc:
            if not str(exc).startswith(_POLL_TIMED_OUT):
                raise
        reports = roll.reports() if roll.reported() else {}
        if roll.store_down:  # nobody can report
            if roll.store_host_gone():  # and the store's host, a rank of this collective, is gone
                raise TransportFailure("the group's store stopped answering", time.monotonic() - roll.started)
            work.wait()  # a store hosted elsewhere: wait as a plain wait would
            return
        away = {r: rep for r, rep in reports.items() if rep.kind in (TRANSPORT, ABSENT) or not agreed}
        if away:
            r, rep = min(away.items())
            how = "left the phase" if rep.kind == TRANSPORT else "will not take part"
            raise TransportFailure(f"{roll.ranks.label(r)} {how}: {rep.message}", time.monotonic() - roll.started)


def abort_group(group: ProcessGroup | None) -> None:
    """Abort ``group`` (None: the default group) on this rank: its pending collectives are released.
    Under gloo this does not close its connections: a peer blocked in one of its collectives fails
    ("Connection closed by peer") when this process exits, or after the group's timeout. The group cannot
    be used again on this rank; make a new one (``destroy_process_group()``, ``init_process_group()``).
    A no-op when not distributed, or on a torch whose process groups cannot abort.
    """
    if not is_distributed(group):
        return
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    abort = getattr(pg, "abort", None)  # ProcessGroup.abort: torch >= 2.6
    if abort is not None:
        with contextlib.suppress(Exception):  # an abort that fails leaves the peers to the timeout
            abort()


def abandon(phase: str, group: ProcessGroup | None, exc: BaseException) -> None:
    """Tell the peers that this rank failed before entering ``phase`` and will not come.

    For errors raised before a phase (bad arguments on one rank): the peers, left waiting in the
    phase, time out and then name this rank with ``exc`` instead of "never entered". Call it right
    before raising ``exc``; a no-op when not distributed.

    Example:
        >>> abandon("gather layout", None, ValueError("bad strategy"))   # a plain process: no-op
    """
    if is_distributed(group):
        RollCall.enter(phase, GroupRanks.of(group)).record(ABSENT, describe(exc))


def _error(roll: RollCall, failures: dict[int, str]) -> DistributedError:
    return DistributedError(roll.phase, failures, roll.ranks.global_ranks)
