"""Crash tests without forking pytest: a writer SIGKILLed at a chosen moment runs in a child of a
spawned helper interpreter that runs no other thread.

Forking a process that runs threads (pytest after torch has started its thread pools) can leave the
child holding a lock another thread had, so the tests never fork themselves. :class:`Crasher` starts
one fresh interpreter per test module (``OMP_NUM_THREADS=1``: importing torch then starts no thread),
which imports the writers once and forks one child per crash: cheap, and safe, since it checks before
every fork that it runs a single thread. The child runs ``fn(*args)`` (a module-level function,
pickled by name) and exits; the wait status comes back (``os.WIFSIGNALED`` when it killed itself).
``start``/``wait`` split the two, for a test that kills the child itself at a moment of its choosing.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["Crasher", "serve"]

HERE = Path(__file__).resolve().parent


class Crasher:
    """The spawned helper; ``run(fn, *args)`` returns the wait status of a child that ran ``fn``."""

    def __init__(self) -> None:
        path = [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path)}
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "import crash_helpers; crash_helpers.serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=HERE,
        )

    def run(self, fn: Callable[..., object], *args: Any) -> int:
        """Fork a child of the helper that runs ``fn(*args)`` and exits (1 if it raised); its status."""
        return self.wait(self.start(fn, *args))

    def start(self, fn: Callable[..., object], *args: Any) -> int:
        """Fork a child of the helper that runs ``fn(*args)``; its pid (at once)."""
        return self._ask(("start", fn, args))

    def wait(self, pid: int) -> int:
        """The wait status of a child :meth:`start` returned."""
        return self._ask(("wait", pid))

    def _ask(self, message: tuple) -> int:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        pickle.dump(message, self._proc.stdin)
        self._proc.stdin.flush()
        try:
            kind, value = pickle.load(self._proc.stdout)
        except EOFError:
            raise RuntimeError(f"the crash helper exited with code {self._proc.wait()}") from None
        if kind != "ok":
            raise RuntimeError(f"the crash helper could not {message[0]}: {value}")
        return int(value)

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> Crasher:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def serve() -> None:
    """The helper's loop: ``("start", fn, args)`` forks a child that runs it and answers its pid,
    ``("wait", pid)`` answers its wait status."""
    replies = os.fdopen(os.dup(1), "wb")  # the protocol's own channel; the children's prints go to stderr
    os.dup2(2, 1)
    while True:
        try:
            message = pickle.load(sys.stdin.buffer)
        except EOFError:
            return
        try:
            value = _fork(*message[1:]) if message[0] == "start" else os.waitpid(message[1], 0)[1]
            reply: tuple[str, object] = ("ok", value)
        except Exception as exc:  # answered, so that the test fails with the reason
            reply = ("error", f"{type(exc).__name__}: {exc}")
        pickle.dump(reply, replies)
        replies.flush()


def _fork(fn: Callable[..., object], args: tuple) -> int:
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        raise RuntimeError(f"the helper runs {threads} threads; it forks only while it runs one")
    pid = os.fork()
    if pid == 0:  # the child never returns into the loop
        code = 0
        try:
            fn(*args)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    return pid
