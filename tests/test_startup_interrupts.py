"""One SIGINT mechanism for the command (shardsync.startup): the handler guard_startup installs at
import is the one the running command notes interrupts with; a program's own handler is left alone.
(The end-to-end cases, Ctrl-C while starting and while writing, are in test_cli_safety.py.)"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from shardsync import startup


@pytest.fixture()
def python_handler() -> Iterator[None]:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, signal.default_int_handler)
    startup._installed.clear()


def test_the_running_command_notes_and_raises_with_the_startup_handler(
    python_handler: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(startup, "is_command", lambda argv=None: True)
    startup.guard_startup()
    installed = startup._installed[0]
    assert signal.getsignal(signal.SIGINT) == installed.handler and not installed.running
    with pytest.raises(KeyboardInterrupt), startup.noting_interrupts() as interrupted:
        assert interrupted is installed and interrupted.running and not interrupted
        os.kill(os.getpid(), signal.SIGINT)
    assert interrupted and not interrupted.running  # back to the start-up behaviour: line, exit 130
    assert signal.getsignal(signal.SIGINT) == installed.handler


def test_called_from_a_program_the_handler_lasts_for_the_call(python_handler: None) -> None:
    with pytest.raises(KeyboardInterrupt), startup.noting_interrupts() as interrupted:
        assert signal.getsignal(signal.SIGINT) == interrupted.handler
        os.kill(os.getpid(), signal.SIGINT)
    assert interrupted
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_programs_own_handler_is_kept(python_handler: None, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    monkeypatch.setattr(startup, "is_command", lambda argv=None: True)
    startup.guard_startup()  # a program that owns SIGINT keeps it, even named shardsync
    assert startup._installed == []
    with startup.noting_interrupts() as interrupted:
        os.kill(os.getpid(), signal.SIGINT)
    assert seen == [signal.SIGINT] and not interrupted
