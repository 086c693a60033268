"""``make gpu-check`` (``scripts/gpu_check.py``) runs on machines without a GPU too: its dry run, with
the CPU standing in for the GPU, passes every step a single GPU would run, so the script cannot rot
between the (rare) sessions on a GPU machine; without the dry run and without CUDA it says plainly
that nothing was checked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def _run(**env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "SHARDSYNC_GPU_CHECK_DEVICE"}
    return subprocess.run([sys.executable, str(SCRIPT)], env=base | env, capture_output=True, text=True, timeout=240)


def test_the_dry_run_passes_every_single_gpu_step() -> None:
    run = _run(SHARDSYNC_GPU_CHECK_DEVICE="cpu")
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("gpu-check: dry run")
    passed = [line.split(" (")[0].removeprefix("PASS").strip() for line in lines if line.startswith("PASS")]
    assert passed == ["single process on the GPU", "gloo ranks with GPU state", "stream benchmark on one GPU"]
    assert sum(line.startswith("SKIPPED") for line in lines) == 2  # the NCCL steps need 2 GPUs
    assert "5 strategies" in run.stdout and "ratio" in run.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: make gpu-check runs for real")
def test_without_cuda_it_says_nothing_was_checked() -> None:
    run = _run()
    assert run.returncode == 0 and "no CUDA: skipped" in run.stdout and "NOT checked" in run.stdout
