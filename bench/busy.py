"""Another busy process on the machine, for the benchmarks' runs "with one other busy process".

A training node is never quiet: next to shardsync run the trainer, data loaders and other ranks.
:func:`busy_process` starts one stand-in for them, a second Python process running torch matmuls with
its own default threads, and stops it at the end of the block.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

__all__ = ["busy_process", "BUSY"]

#: What the busy process runs.
BUSY = "import torch\na = torch.randn(512, 512)\nwhile True:\n    a = (a @ a).clamp_(-1, 1)\n"


@contextlib.contextmanager
def busy_process(settle: float = 2.0) -> Iterator[None]:
    """Run the block with the busy process computing (started ``settle`` seconds before)."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        time.sleep(settle)
        yield
    finally:
        proc.kill()
        proc.wait()
