"""The roll call behind :mod:`shardsync.dist`: who entered which phase, who failed, and who to blame.

Every rank of a group enters the same phases in the same order, so phases are numbered per group
(``seq``). In the group's store each rank keeps one key saying the last phase it entered
(``shardsync/at/<rank>`` = ``"<seq>|<phase>"``, ``"<seq>|<phase>|done"`` once it finished a data
phase), and writes ``shardsync/<seq>/<rank>`` = ``"<kind>|<message>"`` when it fails in phase ``seq``
- the store only grows on failures.

When a collective fails this rank cannot tell from the exception which peer is at fault (a timeout
only says that someone did not come). The roll call can: a peer that recorded a failure of its own
is the cause; a peer whose process is gone (:mod:`shardsync.liveness`: each rank publishes where its
process runs, once, as ``shardsync/proc/<global rank>`` in the default group's store) is the culprit
at once (unless it finished the phase: a rank that has all its data may end its program while
another still waits for a dead one); a peer that never entered the phase, or entered it and then
neither finished nor reported anything within a grace period, is the culprit; peers that recorded a
transport failure are victims like this rank. A live peer on another machine is waited for (up to
the group timeout), unless the failure says a connection closed: then silent peers whose process
cannot be checked are named after the grace period. Transport failures are classified by where they
come from: ``torch.distributed``'s own error classes, or any ``RuntimeError`` raised inside
:func:`transport_errors` (gloo raises plain ``RuntimeError`` for timeouts and closed connections, as
a failed local copy would).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import traceback
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from .errors import ShardsyncError
from .liveness import ProcessRecord, is_gone, peer_left, this_process

if TYPE_CHECKING:
    from .dist import GroupRanks

__all__ = [
    "TransportFailure",
    "transport_errors",
    "group_timeout",
    "is_transport_failure",
    "describe",
    "RollCall",
    "Report",
    "FAILED",
    "STOPPED",
    "TRANSPORT",
    "ABSENT",
    "MAX_GRACE_SECONDS",
    "POLL_SECONDS",
]

#: Kinds of failure record: this rank raised; it stopped iterating; a collective failed under it; it
#: raised before the phase and will not come (:func:`shardsync.dist.abandon`).
FAILED, STOPPED, TRANSPORT, ABSENT = "failed", "stopped", "transport", "absent"
#: Longest a rank whose collective failed waits for silent peers to report before blaming them
#: (at most the group timeout). Survivors of a dead peer see their collectives fail within about a
#: second of each other; this covers far slower ones.
MAX_GRACE_SECONDS = 10.0
#: How often the store is read while waiting.
POLL_SECONDS = 0.1
_PREFIX = "shardsync"
_DONE = "done"
log = logging.getLogger(__name__)
_entered: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # phases per group
_published: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()  # stores with our record
# default group -> the record of the process that hosts its store (read once, while the store answers;
# None: no rank of the group hosts it, or this one does)
_host_records: weakref.WeakKeyDictionary[Any, ProcessRecord | None] = weakref.WeakKeyDictionary()


class TransportFailure(RuntimeError):
    """A torch.distributed call failed: a peer died, timed out, or left the collective.

    Attributes:
        waited: seconds the failing call ran (a timeout waited the whole group timeout; a peer that
            closed its connection fails the call at once).
        culprit: ``(group rank, why)`` when the code that raised it knows the peer at fault without
            the group's store (shared memory checks its peers' processes itself): what
            :meth:`RollCall.blame` names when the store is gone.
    """

    def __init__(self, message: str, waited: float = 0.0, culprit: tuple[int, str] | None = None) -> None:
        super().__init__(message)
        self.waited = waited
        self.culprit = culprit


@contextlib.contextmanager
def transport_errors() -> Iterator[None]:
    """Mark code that only calls torch.distributed: a ``RuntimeError`` in it is a transport failure.

    Example:
        >>> with transport_errors():
        ...     raise RuntimeError("Timed out waiting 3000ms for recv operation to complete")
        Traceback (most recent call last):
        ...
        shardsync.roll_call.TransportFailure: Timed out waiting 3000ms for recv operation to complete
    """
    start = time.monotonic()
    try:
        yield
    except TransportFailure:
        raise
    except RuntimeError as exc:  # gloo: timeouts and closed connections; torch's own DistError too
        raise TransportFailure(str(exc), time.monotonic() - start) from exc


def is_transport_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came from communication (not from this rank's own work).

    Example:
        >>> is_transport_failure(TransportFailure("peer closed")), is_transport_failure(KeyError("w"))
        (True, False)
    """
    return isinstance(exc, (TransportFailure, dist.DistError))


def describe(exc: BaseException) -> str:
    """One line for an error on some rank: class, message, and where (unless it is our own error).

    Example:
        >>> describe(ValueError("bad"))
        'ValueError: bad'
    """
    if isinstance(exc, ShardsyncError):
        return f"{type(exc).__name__}: {exc}"
    frame = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {frame[0].filename}:{frame[0].lineno})" if frame else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _timeout_seconds(pg: Any, store: Any) -> float:
    # The group's own timeout lives in its backend's options (not public); the store's timeout is
    # the one given to init_process_group.
    for device in ("cpu", "cuda"):
        with contextlib.suppress(Exception):
            return float(pg._get_backend(torch.device(device)).options._timeout.total_seconds())
    with contextlib.suppress(Exception):
        return float(store.timeout.total_seconds())
    return 1800.0


def group_timeout(group: Any) -> float:
    """Seconds a collective of ``group`` (None: the default group) waits before it fails: what a rank
    waiting for its peers outside collectives waits too.

    Example:
        >>> group_timeout(None) > 0
        True
    """
    pg = group if group is not None else dist.group.WORLD
    store = None
    with contextlib.suppress(Exception):
        store = pg.get_group_store()  # type: ignore[union-attr]
    return _timeout_seconds(pg, store)


def _default_store() -> Any:
    """The default group's store, where each process's record lives (one for every group)."""
    with contextlib.suppress(Exception):
        return dist.distributed_c10d._get_default_store()
    return None


def _publish_process() -> None:
    """Note where this process runs in the default store, once per default group (cheap: one set)."""
    world = dist.group.WORLD
    if world is None or _published.get(world):
        return
    store = _default_store()
    if store is not None:
        with contextlib.suppress(Exception):
            store.set(f"{_PREFIX}/proc/{dist.get_rank()}", this_process().dump())
            _published[world] = True


def _store_host() -> int | None:
    """The global rank whose process hosts the default group's store, where that is known: rank 0
    for the TCP store ``init_process_group`` makes itself (``tcp://``, ``env://``); None for a file
    store, a store the caller made, and torchrun's (its launcher hosts it)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):  # torch.distributed.rendezvous's own test
        return None
    store = _default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return 0 if isinstance(store, dist.TCPStore) else None


class Report(NamedTuple):
    """A rank's failure in a phase: ``kind`` (FAILED, STOPPED, TRANSPORT or ABSENT) and its message."""

    kind: str
    message: str


class _Position(NamedTuple):
    seq: int  # -1: no phase of this group yet
    phase: str
    done: bool = False  # it finished phase ``seq`` (a data phase; see :meth:`RollCall.leave`)


@dataclass
class RollCall:
    """This rank's part in the roll call of one phase of one group.

    Example:
        >>> roll = RollCall.enter("stream", GroupRanks.of(group))   # doctest: +SKIP
        >>> failures = roll.blame(exc)   # after a collective failed   # doctest: +SKIP
    """

    phase: str
    ranks: GroupRanks
    seq: int
    pg: Any
    store: Any
    started: float
    store_down: bool = False

    @classmethod
    def enter(cls, phase: str, ranks: GroupRanks) -> RollCall:
        """Enter ``phase`` of ``ranks.group``: take its number and note it in the store."""
        pg = ranks.group if ranks.group is not None else dist.group.WORLD
        seq = _entered.get(pg, 0)
        _entered[pg] = seq + 1
        store = None
        with contextlib.suppress(Exception):  # no store behind this group: peers just time out
            store = pg.get_group_store()  # type: ignore[union-attr]
        _publish_process()
        roll = cls(phase, ranks, seq, pg, store, time.monotonic())
        roll._set(f"at/{ranks.rank}", f"{seq}|{phase}")
        roll._remember_store_host()
        return roll

    def _remember_store_host(self) -> None:
        """Keep the record of the process that hosts the default store (:func:`_store_host`), so that
        this rank can still tell whether that process is gone once the store stops answering. Read
        once per default group, as soon as that process has published it (one look at the store per
        phase until then)."""
        world = dist.group.WORLD
        if world is None or world in _host_records:
            return
        host = _store_host()
        if host is None or host == dist.get_rank():
            _host_records[world] = None
            return
        record = self._record(host)
        if record is not None:
            _host_records[world] = record

    def _store_host_rank(self) -> tuple[int, bool | None] | None:
        """The store's host when it is another rank of this group: its group rank, and whether its
        process has ended (None: this rank cannot tell - no record kept, another machine)."""
        host = _store_host()
        if host is None or host not in self.ranks.global_ranks or host == self.ranks.to_global(self.ranks.rank):
            return None
        record = _host_records.get(dist.group.WORLD)
        return self.ranks.global_ranks.index(host), is_gone(record) if record is not None else None

    def store_host_gone(self) -> bool:
        """Whether the store stopped answering because its host died, that host being another rank of
        this group (rank 0 for the TCP store ``init_process_group`` makes): a collective of this group
        can then never complete. Only where this rank can check that process (the same machine, its
        record read while the store answered): a store the caller made and hosts elsewhere, or one
        that failed once while its host lives, is not that."""
        host = self._store_host_rank()
        return host is not None and host[1] is True

    def leave(self) -> None:
        """This rank finished the phase: it made every collective of it (one set in the store). Not
        noted when the rank entered a later phase meanwhile (a phase inside this one): its position
        there says more, and peers count a rank in a later phase as gone on anyway."""
        if self.pg is not None and _entered.get(self.pg, 0) != self.seq + 1:
            return
        self._set(f"at/{self.ranks.rank}", f"{self.seq}|{self.phase}|{_DONE}")

    def _set(self, key: str, value: str) -> None:
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.set(f"{_PREFIX}/{key}", value)

    def _get(self, key: str, store: Any = None) -> str | None:
        store = self.store if store is None else store
        if store is None:
            return None
        try:
            if store.check([f"{_PREFIX}/{key}"]):
                return str(store.get(f"{_PREFIX}/{key}").decode())
        except Exception:  # the store's host is gone (or it never answers): nobody can report
            self.store_down = True
        return None

    def _record(self, global_rank: int) -> ProcessRecord | None:
        """Where the process of global rank ``global_rank`` runs, as it published it (None: not yet)."""
        text = self._get(f"proc/{global_rank}", _default_store() or self.store)
        return ProcessRecord.parse(text) if text is not None else None

    def _gone(self, rank: int) -> bool | None:
        """Whether group rank ``rank``'s process has ended (None: this process cannot tell)."""
        record = self._record(self.ranks.to_global(rank))
        return is_gone(record) if record is not None else None

    def record(self, kind: str, message: str) -> None:
        """Publish that this rank failed in this phase (``kind``: FAILED, STOPPED, TRANSPORT or ABSENT), and
        count it, for :meth:`reported`."""
        self._set(f"{self.seq}/{self.ranks.rank}", f"{kind}|{message}")
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.add(f"{_PREFIX}/{self.seq}/reported", 1)

    def reported(self) -> bool:
        """Whether a rank reported a failure in this phase: one request to the store (the waits of a
        phase ask every second; :meth:`reports` reads every rank's report)."""
        if self.store is None:
            return False
        try:
            return int(self.store.add(f"{_PREFIX}/{self.seq}/reported", 0)) > 0
        except Exception:  # the store's host is gone: nobody can report
            self.store_down = True
            return False

    def record_failure(self, message: str) -> None:
        """Publish that this rank's own work failed in this phase."""
        self.record(FAILED, message)

    def reports(self) -> dict[int, Report]:
        """What the peers reported in this phase, by group rank (this rank's own report left out)."""
        out = {}
        for r in range(self.ranks.world):
            value = self._get(f"{self.seq}/{r}") if r != self.ranks.rank else None
            if value is not None:
                kind, _, message = value.partition("|")
                out[r] = Report(kind, message)
        return out

    def _position(self, rank: int) -> _Position:
        """The last phase ``rank`` entered in this group."""
        value = self._get(f"at/{rank}")
        if value is None:
            return _Position(-1, "")
        seq, _, rest = value.partition("|")
        phase, _, done = rest.partition("|")
        return _Position(int(seq), phase, done == _DONE)

    def culprits(self) -> dict[int, str]:
        """Peers that reported a failure of their own (not a transport failure) in this phase."""
        return {r: rep.message for r, rep in self.reports().items() if rep.kind != TRANSPORT}

    def blame(self, exc: BaseException) -> dict[int, str]:
        """After a transport failure here: ``{group rank: why}`` for the ranks at fault.

        Publishes this rank's own transport failure, then reads the roll call until a peer's own
        failure shows up, a silent peer's process is found gone, every silent peer is accounted for, or
        the wait ends. Blames, in that order of preference: peers that reported a failure; silent peers
        whose process has ended; peers that never entered the phase or fell silent in it; else every
        rank, each with the transport failure it saw.

        The wait: a peer may be stuck in a collective with a rank that has already left it, until the
        group timeout. So a rank whose call failed early waits out the rest of a timeout, and every
        rank then a grace period for peers that fail a little later - unless the wait can end sooner:
        a silent peer whose process is gone is named at once, and when the failure says a connection
        closed (a process went away), silent peers that cannot be checked are named after the grace
        period. A live, silent peer on this machine is a victim, stuck in a collective like this rank.
        """
        mine = describe(exc)
        self.record(TRANSPORT, mine)
        timeout = _timeout_seconds(self.pg, self.store)
        waited = getattr(exc, "waited", 0.0)
        now = time.monotonic()
        grace = min(timeout, MAX_GRACE_SECONDS)
        closed = peer_left(exc)
        short, long = now + grace, now + max(0.0, timeout - waited) + grace
        warn = waited < timeout  # once, unless a peer's report already names the one at fault
        while True:
            reports = self.reports()
            causes = {r: rep.message for r, rep in reports.items() if rep.kind != TRANSPORT}
            if causes:
                return causes
            silent = self._silent(reports)
            gone = {r: pos for r, pos in silent.items() if self._gone(r)}
            if gone:
                return self._departed(gone)
            # a peer that timed out closes its connections too: then a closed one proves nobody left
            timed_out = any(rep.kind == TRANSPORT and not peer_left(rep.message) for rep in reports.values())
            left = closed and not timed_out
            deadline = short if left else long
            overdue = time.monotonic() - self.started >= timeout  # the absent are not coming
            waiting = [r for r, pos in silent.items() if pos.seq == self.seq or not overdue]
            if not waiting or self.store_down or time.monotonic() >= deadline:
                break
            if warn:
                warn = False
                log.warning(
                    "phase %r: a collective failed on %s (%s); waiting up to %.0f s for the other "
                    "ranks to report, to name the one at fault",
                    self.phase,
                    self.ranks.label(self.ranks.rank),
                    exc,
                    deadline - now,
                )
            time.sleep(POLL_SECONDS)
        if self.store_down:
            return self._without_store(exc, mine)
        if silent:
            if left:  # live peers on this machine are victims; name the ones that may be gone
                suspects = {r: pos for r, pos in silent.items() if self._gone(r) is None}
                silent = suspects or silent
            return {r: self._silence(pos, left) for r, pos in silent.items()}
        return {
            self.ranks.rank: f"transport failure: {mine}",
            **{r: f"transport failure: {rep.message}" for r, rep in reports.items()},
        }

    def _without_store(self, exc: BaseException, mine: str) -> dict[int, str]:
        """``{rank: why}`` when the group's store stopped answering, so no peer can be asked: the peer
        the failure itself names (:attr:`TransportFailure.culprit`), else the rank whose process hosts
        the store (rank 0, for the store ``init_process_group`` makes; its end took the store with it),
        else this rank with what it saw."""
        culprit = getattr(exc, "culprit", None)
        if culprit is not None:
            return {culprit[0]: culprit[1]}
        host = self._store_host_rank()
        if host is not None and host[1] is not False:  # not a host this rank found alive
            return {
                host[0]: "its process hosts the group's store (the TCP store "
                "init_process_group makes), which stopped answering: it has probably died or exited (a "
                f"collective failed with: {mine})"
            }
        return {
            self.ranks.rank: f"transport failure: {mine}; the group's store stopped answering, "
            "so the other ranks cannot be asked (the process that hosts it, "
            "rank 0 or the launcher, has probably died)"
        }

    def _departed(self, gone: dict[int, _Position]) -> dict[int, str]:
        """``{rank: why}`` for silent peers whose process has ended (a failure one of them recorded
        just before it ended wins: it says why)."""
        causes = {r: rep.message for r, rep in self.reports().items() if rep.kind != TRANSPORT and r in gone}
        if causes:
            return causes
        out = {}
        for r, pos in gone.items():
            if pos.seq == self.seq:
                out[r] = f"entered phase {self.phase!r} and then its process ended (it died or exited)"
            else:
                out[r] = (
                    f"its process ended (it died or exited) before it entered phase {self.phase!r} ({self._last(pos)})"
                )
        return out

    def _silent(self, reports: dict[int, Report]) -> dict[int, _Position]:
        """Peers that reported nothing here and have neither finished this phase nor moved on to a
        later one."""
        positions = {r: self._position(r) for r in range(self.ranks.world) if r != self.ranks.rank and r not in reports}
        return {r: pos for r, pos in positions.items() if pos.seq < self.seq or (pos.seq == self.seq and not pos.done)}

    @staticmethod
    def _last(position: _Position) -> str:
        if position.seq >= 0:
            return f"the last phase it entered was {position.phase!r}"
        return "it entered no phase of this group yet"

    def _silence(self, position: _Position, left: bool = False) -> str:
        closed = "; a connection to it closed, so it probably exited or died" if left else ""
        if position.seq == self.seq:
            return (
                f"entered phase {self.phase!r} and then stopped answering (it died, or hangs outside shardsync){closed}"
            )
        return f"never entered phase {self.phase!r} ({self._last(position)}; did it call this on every rank?){closed}"
