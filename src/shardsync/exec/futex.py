"""Sleep until a word of shared memory changes, woken by the process that changes it (Linux futexes).

The shared-memory transport's ranks wait for each other through words on their boards
(:mod:`shardsync.exec.push`). Polling such a word costs a core, or - sleeping between looks - up to
the pause each time it changes. A futex sleeps in the kernel until the writer of the word wakes it:
:func:`wait` returns as soon as :func:`wake` is called on the word (or the word no longer holds what
the waiter saw, or the timeout passes), whichever process calls it, for memory shared between
processes. Where the system has no futexes (another OS, an architecture this module does not know)
:func:`wait` sleeps ``fallback`` seconds instead and :func:`wake` does nothing: callers look again
after every return either way.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time

import numpy as np

__all__ = ["wait", "wake", "address", "available"]

#: ``SYS_futex`` by machine (the generic syscall table's number for the other 64-bit Linux ports).
_NUMBERS = {"x86_64": 202, "aarch64": 98, "arm64": 98, "riscv64": 98, "ppc64le": 221, "s390x": 238}
_WAIT, _WAKE = 0, 1  # FUTEX_WAIT and FUTEX_WAKE, not FUTEX_PRIVATE_FLAG: the memory is shared
_ALL = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _syscall() -> tuple[ctypes._CFuncPtr, int] | None:  # type: ignore[name-defined]
    number = _NUMBERS.get(platform.machine()) if os.name == "posix" and platform.system() == "Linux" else None
    if number is None:
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn, number


_FUTEX = _syscall()


def available() -> bool:
    """Whether :func:`wait` sleeps in the kernel until woken (else it sleeps its fallback).

    Example:
        >>> available() in (True, False)
        True
    """
    return _FUTEX is not None


def address(words: np.ndarray) -> int:
    """Where ``words`` (a contiguous int32 array) starts: word ``i`` is at ``address + 4 * i``.

    Example:
        >>> w = np.zeros(2, dtype=np.int32)
        >>> address(w) == w.__array_interface__["data"][0]
        True
    """
    if words.dtype != np.int32 or not words.flags.c_contiguous:
        raise ValueError("futex words are contiguous int32 arrays")
    return int(words.__array_interface__["data"][0])


def wait(word: int, seen: int, timeout: float, fallback: float = 1e-3) -> None:
    """Sleep until the int32 at address ``word`` (shared memory, see :func:`address`) is woken by
    :func:`wake`, no longer holds ``seen``, or ``timeout`` seconds pass; the caller looks at it again
    either way.

    Example:
        >>> w = np.zeros(1, dtype=np.int32)
        >>> wait(address(w), seen=1, timeout=1.0)   # it holds 0, not 1: returns at once
    """
    if _FUTEX is None:
        time.sleep(min(timeout, fallback))
        return
    fn, number = _FUTEX
    spec = _Timespec(int(timeout), int((timeout % 1) * 1e9))
    fn(
        ctypes.c_long(number),
        ctypes.c_void_p(word),
        ctypes.c_int(_WAIT),
        ctypes.c_int(seen),
        ctypes.byref(spec),
        ctypes.c_void_p(0),
        ctypes.c_int(0),
    )


def wake(word: int) -> None:
    """Wake every process and thread sleeping in :func:`wait` on the int32 at address ``word`` (after
    changing it).

    Example:
        >>> wake(address(np.zeros(2, dtype=np.int32)) + 4)
    """
    if _FUTEX is None:
        return
    fn, number = _FUTEX
    fn(
        ctypes.c_long(number),
        ctypes.c_void_p(word),
        ctypes.c_int(_WAKE),
        ctypes.c_int(_ALL),
        ctypes.c_void_p(0),
        ctypes.c_void_p(0),
        ctypes.c_int(0),
    )
