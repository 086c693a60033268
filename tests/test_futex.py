"""Sleeping on a word of shared memory until another process writes it (exec/futex.py)."""

from __future__ import annotations

import mmap
import os
import time
import warnings

import pytest
import torch

from shardsync.exec import futex

pytestmark = pytest.mark.skipif(not futex.available(), reason="no futexes on this system")


def _word() -> tuple[torch.Tensor, int]:
    # shared anonymous memory: a forked child writes the same words (shardsync's own blocks are
    # copied into private memory in a child)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer cannot tell the buffer is writable; it is
        words = torch.frombuffer(mmap.mmap(-1, 16), dtype=torch.int32)
    return words, futex.address(words.numpy())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_wait_ends_when_another_process_writes_the_word_and_wakes_it() -> None:
    words, at = _word()
    pid = os.fork()
    if pid == 0:  # the child: a while later, write word 1 and wake its sleepers
        time.sleep(0.3)
        words[1] = 7
        futex.wake(at + 4)
        os._exit(0)
    start = time.monotonic()
    while int(words[1]) != 7 and time.monotonic() - start < 60:
        futex.wait(at + 4, int(words[1]), timeout=30.0)
    assert int(words[1]) == 7 and time.monotonic() - start < 20  # woken, not timed out
    os.waitpid(pid, 0)


def test_a_wait_returns_at_once_for_a_word_that_no_longer_holds_what_was_seen() -> None:
    words, at = _word()
    start = time.monotonic()
    futex.wait(at, seen=1, timeout=30.0)  # the word holds 0
    assert time.monotonic() - start < 20


def test_a_wait_nobody_wakes_ends_at_its_timeout() -> None:
    words, at = _word()
    start = time.monotonic()
    futex.wait(at + 8, seen=0, timeout=0.2)
    assert time.monotonic() - start >= 0.15


def test_without_futexes_a_wait_sleeps_its_fallback_and_wake_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(futex, "_FUTEX", None)
    words, at = _word()
    start = time.monotonic()
    futex.wait(at, seen=0, timeout=30.0, fallback=0.05)
    assert 0.04 <= time.monotonic() - start < 20
    futex.wake(at)
    assert not futex.available()


def test_words_must_be_contiguous_int32() -> None:
    with pytest.raises(ValueError, match="contiguous int32"):
        futex.address(torch.zeros(4, dtype=torch.int64).numpy())
