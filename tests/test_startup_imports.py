"""The command starts fast: importing shardsync (and its CLI) does not pull in torch DCP or DTensor,
which cost about a second; they load on first use (issue 17, start-up)."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch.distributed.checkpoint", "torch.distributed.tensor")


def test_import_of_the_package_and_the_cli_leaves_dcp_and_dtensor_unloaded() -> None:
    code = f"import sys, shardsync, shardsync.cli; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"


def test_save_still_loads_on_first_use() -> None:
    code = "import shardsync; print(shardsync.save.__module__)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "shardsync.io.dcp_writer"
