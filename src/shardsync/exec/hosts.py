"""Which ranks share a machine: what each rank tells the others when the layout is gathered.

The same-host transport (:mod:`shardsync.exec.shm`) applies when every rank of the group reports the
same hostname, boot id and ``/dev/shm`` device; its senders write into their consumers' targets only
when every rank is also in the same pid namespace (they open the targets' blocks through ``/proc``).
"""

from __future__ import annotations

import functools
import itertools
import os
import socket
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["HostInfo", "host_info", "same_host", "same_processes", "describe_hosts", "neighbours", "SHM_DIR"]

#: Where shared-memory segments live (a tmpfs on Linux).
SHM_DIR = "/dev/shm"
_streams = itertools.count()  # per process; every rank of a group opens its streams in the same order


class HostInfo(NamedTuple):
    """What a rank tells the others about its machine when the layout is gathered.

    Ranks are on one host when hostname, boot id and the device of ``/dev/shm`` all agree (two
    containers on one machine with separate ``/dev/shm`` mounts are not one host).
    """

    hostname: str
    boot_id: str
    shm_device: int
    shm_free: int
    pid: int
    stream: int  # this process's stream counter: names this stream's segments (rank 0's is used)
    segments: str  # token of the segments kept for the group ("" if none, see :func:`release`)
    data_device: str = "cpu"  # where this rank's targets live ("cpu", "cuda")
    pid_ns: int = -1  # the inode of its pid namespace (-1: unknown): peers in another cannot see its /proc

    @property
    def machine(self) -> tuple[str, str, int]:
        return self.hostname, self.boot_id, self.shm_device


def host_info(segments: str = "", data_device: str = "cpu") -> HostInfo:
    """This process's :class:`HostInfo` (``shm_device`` -1 and ``shm_free`` 0 without a writable
    /dev/shm); ``segments`` is what the transport keeps for the stream's group, ``data_device`` the
    device type this rank's targets are on.

    Example:
        >>> host_info().pid == os.getpid()
        True
    """
    try:
        st, vfs = os.stat(SHM_DIR), os.statvfs(SHM_DIR)
        dev, free = st.st_dev, vfs.f_bavail * vfs.f_frsize if os.access(SHM_DIR, os.W_OK) else 0
    except OSError:
        dev, free = -1, 0
    pid = os.getpid()
    boot, pid_ns = _fixed(pid)
    stream = next(_streams)
    return HostInfo(socket.gethostname(), boot, dev, free, pid, stream, segments, data_device, pid_ns)


@functools.lru_cache(maxsize=4)
def _fixed(pid: int) -> tuple[str, int]:
    """What does not change while process ``pid`` runs: the boot id, the inode of its pid namespace
    (read once per process, not once per stream: a forked child reads its own)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = ""
    try:
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pid_ns = -1
    return boot, pid_ns


def describe_hosts(hosts: Sequence[HostInfo]) -> str:
    """``"rank 0: node1, rank 1: node2"``-style text for errors.

    Example:
        >>> describe_hosts([HostInfo("a", "x", 1, 0, 7, 0, ""), HostInfo("b", "y", 1, 0, 8, 0, "")])
        'rank 0: a, rank 1: b'
    """
    return ", ".join(f"rank {r}: {h.hostname}" for r, h in enumerate(hosts))


def same_host(hosts: Sequence[HostInfo]) -> bool:
    """Whether every rank runs on one machine and sees the same ``/dev/shm``.

    Example:
        >>> same_host([HostInfo("a", "x", 1, 0, 7, 0, ""), HostInfo("a", "x", 1, 0, 8, 0, "")])
        True
    """
    return len({h.machine for h in hosts}) == 1 and hosts[0].shm_device >= 0


def same_processes(hosts: Sequence[HostInfo]) -> bool:
    """Whether every rank runs on one machine in one pid namespace: each can reach the others'
    descriptors through ``/proc/<pid>/fd`` (two containers that share ``/dev/shm`` may not).

    Example:
        >>> a = HostInfo("a", "x", 1, 0, 7, 0, "", "cpu", 4026531836)
        >>> same_processes([a, a._replace(pid=8)]), same_processes([a, a._replace(pid_ns=42)])
        (True, False)
    """
    return same_host(hosts) and len({h.pid_ns for h in hosts}) == 1 and hosts[0].pid_ns >= 0


def neighbours(hosts: Sequence[HostInfo], rank: int) -> int:
    """How many processes copy on this machine at once, ``rank`` included: the ranks of its group on
    the same machine, or the local processes torchrun started (``LOCAL_WORLD_SIZE``) if more.

    Example:
        >>> a, b = HostInfo("a", "x", 1, 0, 7, 0, ""), HostInfo("b", "y", 1, 0, 8, 0, "")
        >>> neighbours([a, a, b], 0) >= 2   # ranks 0 and 1 share machine "a"
        True
    """
    here = sum(1 for h in hosts if h.machine == hosts[rank].machine) if rank < len(hosts) else 1
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return max(here, int(local) if local.isdigit() else 1)
