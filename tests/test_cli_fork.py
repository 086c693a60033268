"""How ``convert --nproc N`` starts its workers: forked from the ``shardsync`` command on Linux (torch
already imported), spawned from a program and with ``SHARDSYNC_START_METHOD=spawn``. A forked worker
does not hang in OpenMP, logs nothing of its own, and its error is printed once, by the command.
(Ctrl-C and dead workers, forked and spawned: test_cli_safety.py.)"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cli_checkpoints import Checkpoints, build
from shardsync.cli import launch
from shardsync.cli.common import command_logging
from shardsync.cli.messages import UsageError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ck(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return build(tmp_path_factory.mktemp("ckpts"))


@pytest.mark.parametrize(
    "command, platform, env, expected",
    [
        (True, "linux", "", "fork"),
        (True, "linux", "spawn", "spawn"),
        (False, "linux", "", "spawn"),  # a program (or pytest) that calls the launcher
        (True, "darwin", "", "spawn"),
    ],
)
def test_start_method(monkeypatch: pytest.MonkeyPatch, command: bool, platform: str, env: str, expected: str) -> None:
    monkeypatch.setattr(launch, "is_command", lambda: command)
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setenv(launch.START_METHOD_ENV, env)
    assert launch.start_method() == expected


def test_a_start_method_other_than_spawn_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(launch.START_METHOD_ENV, "fork")
    with pytest.raises(UsageError) as err:
        launch.start_method()
    assert str(err.value) == (
        "SHARDSYNC_START_METHOD='fork' is not a start method for the workers "
        "(set SHARDSYNC_START_METHOD=spawn to spawn them, or unset it)"
    )


def _records(debug: bool, capsys: pytest.CaptureFixture[str]) -> str:
    """What a worker logs, forked from a command whose log handler it inherits (both write to stderr)."""
    log = logging.getLogger("shardsync.dist")
    with command_logging("convert"), launch._worker_logging(debug):
        log.warning("stray")
        log.error("phase 'stream' failed on rank 1")
        log.debug("plan: 2 steps")
    return capsys.readouterr().err


def test_a_worker_logs_nothing_of_its_own(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RANK", "1")
    assert _records(False, capsys) == ""
    assert _records(True, capsys) == (
        "shardsync convert: worker 1: warning: stray\n"
        "shardsync convert: worker 1: error: phase 'stream' failed on rank 1\n"
        "shardsync convert: worker 1: debug: plan: 2 steps\n"
    )
    shardsync_log = logging.getLogger("shardsync")
    assert (shardsync_log.handlers, shardsync_log.level) == ([], logging.NOTSET)  # the command's back, and gone


def _run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in its own session; a run past ``timeout`` (a hung worker) is killed with all its
    processes and fails the test instead of hanging it."""
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})},
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{argv[:4]} still running after {timeout} s: hung")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


_PARALLEL_PARENT = """
import os, sys
import torch
from shardsync.cli import convert, launch, main

launch.is_command = lambda: True  # as in the shardsync command: the workers are forked
os.sched_getaffinity = lambda pid: set(range(4))  # each of the 2 workers runs 2 threads: OpenMP's pool
opened = convert.prepare

def prepare(cfg):
    torch.ones(1 << 22).add_(1)  # a parallel op, where opening a source may run one (and so in each worker)
    return opened(cfg)

convert.prepare = launch.prepare = prepare
sys.exit(main(sys.argv[1:]))
"""


def test_forked_workers_do_not_hang_after_the_parent_ran_a_parallel_op(ck: Checkpoints, tmp_path: Path) -> None:
    # without pin_threads the parent's op starts GNU OpenMP's pool and each forked worker hangs in its
    # first parallel op (then this run is killed at the timeout)
    out = tmp_path / "out"
    run = _run([sys.executable, "-c", _PARALLEL_PARENT, "convert", str(ck.dcp), str(out), "--nproc", "2"], timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"wrote 5 tensors (840 B) in 1 file to {out} in ") and " with 2 workers " in run.stdout
    assert run.stderr == ""


def _zeroed(ck: Checkpoints, tmp_path: Path) -> Path:
    """The DCP checkpoint with its data zeroed: the headers read, the workers fail on the data."""
    import shutil

    d = tmp_path / "zeroed"
    shutil.copytree(ck.dcp, d)
    for f in d.glob("*.distcp"):
        f.write_bytes(bytes(f.stat().st_size))
    return d


@pytest.mark.parametrize("debug", [False, True])
def test_a_forked_workers_error_is_printed_once_by_the_command(ck: Checkpoints, tmp_path: Path, debug: bool) -> None:
    out = tmp_path / "out"
    src = _zeroed(ck, tmp_path)
    argv = [sys.executable, "-m", "shardsync", "convert", str(src), str(out), "--nproc", "2"]
    run = _run(argv + ["--debug"] * debug)
    assert run.returncode == 2 and run.stdout == ""
    *before, line = run.stderr.splitlines()
    assert line.startswith(f"shardsync convert: {src}: cannot read 'embed' from "), run.stderr
    assert "(corrupt or truncated?): UnpicklingError: " in line and run.stderr.count("cannot read") == 1
    records = {x.split(": debug: ")[0] for x in before if x.startswith("shardsync")}  # the rest: their lines
    assert records == ({"shardsync convert: worker 0", "shardsync convert: worker 1"} if debug else set())
    assert before if debug else not before, run.stderr
    assert not out.exists()
