"""Several workers: ``convert --nproc 2`` (torch's launcher started by the command), ``torchrun -m
shardsync convert`` (started by the user), and ``plan --nproc 2`` against the plan two real ranks build.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardsync
from cli_checkpoints import MAPPING, Checkpoints, build, mapped
from multiproc import free_port, run_ranks
from shardsync.cli import main
from shardsync.cli.common import MappingFlags
from shardsync.cli.plan import PlanConfig, dry_run

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ck(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return build(tmp_path_factory.mktemp("ckpts"))


def test_two_workers_write_the_files_one_writes(
    ck: Checkpoints, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    flags = ["-m", str(ck.mapping), "--max-shard-size", "100B", "--dtype", "fp16"]
    assert main(["convert", str(ck.dcp), str(tmp_path / "one"), *flags]) == 0
    capsys.readouterr()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # one core: 2 workers oversubscribe
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    assert main(["convert", str(ck.dcp), str(tmp_path / "two"), *flags, "--nproc", "2"]) == 0
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # torch's launcher left its own: undone
    out = capsys.readouterr()
    assert " with 2 workers " in out.out
    assert (
        "--nproc 2 starts more workers than this machine gives the process cores (1): they share "
        "the cores and each starts slower; --nproc 1 is usually faster"
    ) in out.err
    one = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert one == sorted(p.name for p in (tmp_path / "two").iterdir())
    assert len(one) == 5  # four files (one straddles the workers' shares) and the index
    for name in one:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def test_torchrun_workers_write_dcp(ck: Checkpoints, tmp_path: Path) -> None:
    out = tmp_path / "dcp"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "shardsync",
            "convert",
            str(ck.sharded),
            str(out),
            "--to",
            "dcp",
            "-m",
            str(ck.mapping),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )  # torchrun and two workers importing torch on a busy machine
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"wrote 9 tensors (840 B) in 2 files to {out} in "), run.stdout
    want = mapped()
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(got, checkpoint_id=out, no_dist=True)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _real_plan(rank: int, world: int, path: str) -> str:
    return shardsync.plan(path, MAPPING, split_by="bytes", consumers=(0, 1), copy=False).fingerprint()


def test_plan_without_processes_is_the_plan_of_two_ranks(ck: Checkpoints) -> None:
    planned = dry_run(PlanConfig(ck.dcp, MappingFlags(str(ck.mapping)), nproc=2))
    assert run_ranks(_real_plan, 2, str(ck.dcp)) == [planned.fingerprint()] * 2


_LEAVES = """
import sys, weakref
import torch.distributed as dist
from shardsync import __version__
from shardsync.cli import convert_config, launch
from shardsync.cli.args import parser

groups = []
init = dist.init_process_group
def noted(*args, **kwargs):
    init(*args, **kwargs)
    groups.append(weakref.ref(dist.distributed_c10d._get_default_group()))
dist.init_process_group = noted
cfg = convert_config(parser(__version__).parse_args(["convert", *sys.argv[1:], "--to", "dcp"]), None)
outcome = launch._worker(cfg)
assert outcome.converted is not None, outcome.line
print("alive" if groups[0]() is not None else "gone")
"""


def test_a_worker_leaves_no_process_group_alive(ck: Checkpoints, tmp_path: Path) -> None:
    # a destroyed group still alive at exit lets gloo's threads finish their last work while the
    # interpreter finalises, which aborts the worker now and then (SIGABRT after a good conversion);
    # torch DCP, imported once the group exists, keeps it alive through a default argument
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
    }
    run = subprocess.run(
        [sys.executable, "-c", _LEAVES, str(ck.sharded), str(tmp_path / "dcp"), "-m", str(ck.mapping)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["gone"], run.stdout
