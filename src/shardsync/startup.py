"""Ctrl-C while the ``shardsync`` command is still starting (importing torch takes a second or more).

The command turns Ctrl-C into one line and exit status 130 (:func:`shardsync.cli.main`), but only once
it runs; before, an interrupt would end the process with Python's traceback. :func:`guard_startup`,
called first thing when the package is imported, closes that window, and only in the process that is
the command (``shardsync ...`` or ``python -m shardsync ...``): a program that imports shardsync keeps
its own handling.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import TracebackType

__all__ = ["guard_startup", "is_command"]

#: Exit status after Ctrl-C, as a shell reports SIGINT (the same as the command's own).
INTERRUPTED = 130


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


def guard_startup() -> None:
    """In the ``shardsync`` command, make an interrupt before the command runs one line and exit 130."""
    if not is_command():
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            previous(kind, exc, tb)
            return
        print("shardsync: interrupted", file=sys.stderr, flush=True)
        os._exit(INTERRUPTED)

    sys.excepthook = hook
