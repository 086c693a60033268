"""Is a peer process still there? What the roll call uses to tell a dead rank from a slow one.

A rank that waits in a collective cannot tell from the collective whether a silent peer is slow
(still computing, or stuck in another collective) or gone (crashed, killed, or exited). Two things
can:

* its process: every rank publishes, once per group, where it runs (:func:`this_process`); a peer on
  the same machine (same boot, same pid namespace) is alive exactly while its pid names the same
  process (same start time) and that process is not a zombie. Peers on other machines cannot be
  checked this way (:func:`is_gone` answers None: unknown).
* its connections: gloo fails a collective with "Connection closed by peer" (or "reset by peer") as
  soon as a peer's process has exited, while a peer that is merely slow leaves the collective waiting.
  :func:`peer_left` recognises such failures.
"""

from __future__ import annotations

import os
import socket
from typing import NamedTuple

__all__ = ["ProcessRecord", "this_process", "is_gone", "peer_left"]

#: Substrings of transport errors raised because a peer's end of a connection went away (gloo's TCP
#: pairs, and the errors of sockets underneath the store and NCCL's bootstrap).
_LEFT = (
    "closed by peer",
    "reset by peer",
    "broken pipe",
    "connection refused",
    "remote process exited",
    "socket closed",
)


class ProcessRecord(NamedTuple):
    """Where a rank's process runs: enough to check, from the same machine, whether it still does.

    Example:
        >>> ProcessRecord.parse(ProcessRecord("host|boot|4026531836", 42, 123).dump())
        ProcessRecord(machine='host|boot|4026531836', pid=42, start=123)
    """

    machine: str  # hostname, boot id and pid namespace: pids compare only within one
    pid: int
    start: int  # start time of the process (clock ticks after boot): a reused pid differs

    def dump(self) -> str:
        """The record as one string (for the group's store)."""
        return f"{self.pid}|{self.start}|{self.machine}"

    @classmethod
    def parse(cls, text: str) -> ProcessRecord | None:
        """The record :meth:`dump` wrote, or None for anything else."""
        pid, _, rest = text.partition("|")
        start, _, machine = rest.partition("|")
        if not (pid.isdigit() and start.isdigit() and machine):
            return None
        return cls(machine, int(pid), int(start))


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _machine() -> str:
    try:
        pid_ns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pid_ns = ""
    return f"{socket.gethostname()}|{_read('/proc/sys/kernel/random/boot_id')}|{pid_ns}"


def _stat(pid: int) -> tuple[str, int] | None:
    """``(state, start time)`` of process ``pid`` from ``/proc``, or None when there is none."""
    text = _read(f"/proc/{pid}/stat")
    if not text:
        return None
    fields = text.rpartition(")")[2].split()  # the name (in parentheses) may hold spaces
    if len(fields) < 20:
        return None
    return fields[0], int(fields[19])


_mine: dict[int, ProcessRecord] = {}  # by pid: a forked child has a record of its own


def this_process() -> ProcessRecord:
    """This process's record (start time 0 where ``/proc`` is missing: then peers cannot check it).

    Example:
        >>> this_process().pid == os.getpid()
        True
    """
    pid = os.getpid()
    record = _mine.get(pid)
    if record is None:
        stat = _stat(pid)
        record = _mine[pid] = ProcessRecord(_machine(), pid, stat[1] if stat else 0)
    return record


def is_gone(record: ProcessRecord) -> bool | None:
    """Whether the process of ``record`` has ended: True, False, or None when this process cannot tell
    (another machine or pid namespace, or no ``/proc``).

    Example:
        >>> is_gone(this_process())
        False
    """
    if record.start == 0 or record.machine != _machine():
        return None
    stat = _stat(record.pid)
    if stat is None:
        return True
    state, start = stat
    return start != record.start or state in ("Z", "X", "x")  # a reused pid, or a zombie


def peer_left(exc: BaseException | str) -> bool:
    """Whether a transport failure (or its message) says a peer's connection went away (its process
    exited or died, or it gave up on the collective), as opposed to a timeout.

    Example:
        >>> peer_left(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234"))
        True
        >>> peer_left(RuntimeError("Timed out waiting 3000ms for recv operation to complete"))
        False
    """
    text = str(exc).lower()
    return any(s in text for s in _LEFT)
