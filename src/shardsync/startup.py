"""Ctrl-C in the ``shardsync`` command: one SIGINT handler, from the first import to the exit.

The command turns Ctrl-C into one line and exit status 130. :func:`guard_startup`, called first thing
when the package is imported, installs the handler, and only in the process that is the command
(``shardsync ...`` or ``python -m shardsync ...``): a program that imports shardsync keeps its own
handling. While the command is still starting (importing torch takes a second or more) an interrupt
prints the line and exits at once: nothing has been written that needs cleaning up. While it runs
(:func:`noting_interrupts`, entered by :func:`shardsync.cli.main`) the handler notes the interrupt and
raises ``KeyboardInterrupt`` as Python's own does, so that the command removes what it wrote and reports
the interrupt even where a library turned it into another error.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

__all__ = ["guard_startup", "is_command", "noting_interrupts", "Interrupts", "INTERRUPTED"]

#: Exit status after Ctrl-C, as a shell reports SIGINT (the same as the command's own).
INTERRUPTED = 130


class Interrupts:
    """Whether SIGINT arrived (truthy once it did), and whether the command runs (then it raises)."""

    def __init__(self) -> None:
        self.seen = False
        self.running = False

    def __bool__(self) -> bool:
        return self.seen

    def handler(self, signum: int, frame: FrameType | None) -> None:
        """The SIGINT handler: note it; before the command runs, one line and exit 130."""
        self.seen = True
        if not self.running:
            print("shardsync: interrupted", file=sys.stderr, flush=True)
            os._exit(INTERRUPTED)
        raise KeyboardInterrupt


_installed: list[Interrupts] = []  # the handler guard_startup installed in this process, if any


def is_command(argv: list[str] | None = None) -> bool:
    """Whether ``argv`` (default: this process's command line) runs the ``shardsync`` command.

    Example:
        >>> is_command(["python", "-m", "shardsync", "inspect", "ck"]), is_command(["/venv/bin/shardsync"])
        (True, True)
        >>> is_command(["python", "-m", "pytest"]), is_command(["python", "train.py"])
        (False, False)
    """
    if argv is None:
        argv = list(getattr(sys, "orig_argv", sys.argv))
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1] == "shardsync"
    return any(Path(a).name == "shardsync" for a in argv[:2])


def _can_install() -> bool:
    return (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )


def guard_startup() -> None:
    """In the ``shardsync`` command, install the command's SIGINT handler (an interrupt before the
    command runs: one line and exit 130)."""
    if not is_command() or not _can_install():
        return
    interrupts = Interrupts()
    signal.signal(signal.SIGINT, interrupts.handler)
    _installed[:] = [interrupts]


@contextlib.contextmanager
def noting_interrupts() -> Iterator[Interrupts]:
    """While the command runs: SIGINT is noted and raises ``KeyboardInterrupt``.

    In the command, the handler :func:`guard_startup` installed switches to raising; where ``main`` is
    called from a program (tests), the handler is installed for the call and Python's restored after,
    unless the program has a handler of its own (then interrupts are its business and none is noted).

    Example:
        >>> with noting_interrupts() as interrupted:
        ...     pass
        >>> bool(interrupted)
        False
    """
    mine = _installed[0] if _installed and signal.getsignal(signal.SIGINT) == _installed[0].handler else None
    if mine is None and not _can_install():
        yield Interrupts()
        return
    interrupts = mine if mine is not None else Interrupts()
    if mine is None:
        signal.signal(signal.SIGINT, interrupts.handler)
    interrupts.running = True
    try:
        yield interrupts
    finally:
        interrupts.running = False
        if mine is None:
            signal.signal(signal.SIGINT, signal.default_int_handler)
