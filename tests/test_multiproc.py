"""The multi-process harness itself: ranks forked from the preloaded forkserver start where a spawned
rank would, in the parent's environment and working directory of the moment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import multiproc
from multiproc import run_ranks
from rank_pool import RankPool


def _where(rank: int, world: int) -> tuple[str | None, str, bool]:
    import sys

    return os.environ.get("SHARDSYNC_TEST_PROBE"), os.getcwd(), "torch" in sys.modules


def test_ranks_see_the_environment_and_directory_of_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_ranks(_where, 2)  # the forkserver is up before the variable exists
    monkeypatch.setenv("SHARDSYNC_TEST_PROBE", "odd value 17")
    monkeypatch.chdir(tmp_path)
    assert run_ranks(_where, 2) == [("odd value 17", str(tmp_path), True)] * 2
    pool = RankPool(2)
    try:
        assert pool.run(_where) == [("odd value 17", str(tmp_path), True)] * 2
    finally:
        pool.close()
    monkeypatch.delenv("SHARDSYNC_TEST_PROBE")
    assert run_ranks(_where, 2)[0][0] is None


def test_an_unknown_start_method_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(multiproc, "START", "fork")
    with pytest.raises(ValueError, match="SHARDSYNC_TEST_START='fork'"):
        multiproc.context()
