"""The cost of a digest against reading the bytes once, and of ``verify=True`` in a reshard loop.

A state of fp32 and bf16 tensors (odd sizes, ``--mb`` MB in all, 256 by default) is written as
safetensors in 64 MiB files, and read once to warm the page cache. Then, best of ``--repeat``:

* ``read``: every file read once into a preallocated buffer (the bytes, nothing else);
* ``digest files``: ``shardsync.digest(path)`` (reads and hashes every box);
* ``digest live``: ``shardsync.digest(state)`` of the tensors in memory (hashing alone);
* ``reshard`` and ``reshard verify``: one process resharding the state into a 2-way row split, without
  and with ``verify=True`` (what an RL loop pays per step to check every weight landed).

The goal is ``digest files / read`` within 2. Run: ``.venv/bin/python bench/bench_digest.py`` (writes
bench/results/digest.json); ``--mb 8 --repeat 1`` for a quick check that it runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import shardsync
from shardsync.layout import ShardedTensor

RESULTS = Path(__file__).parent / "results"
MIB = 1 << 20


def build_state(mb: int) -> dict[str, torch.Tensor]:
    """Tensors of about ``mb`` MB: rows of 4099 (odd), fp32 and bf16 alternating."""
    state, total, i = {}, 0, 0
    while total < mb * MIB:
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        rows = max(1, min(1021, (mb * MIB - total) // (4099 * dtype.itemsize)))
        t = torch.arange(rows * 4099, dtype=torch.float32).reshape(rows, 4099).mul_(0.37).to(dtype)
        state[f"layers.{i}.weight"] = t
        total += t.numel() * t.element_size()
        i += 1
    return state


def best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def read_files(path: Path, buffer: bytearray) -> None:
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            view = memoryview(buffer)
            while fh.readinto(view):
                pass


def split_rows(state: dict[str, torch.Tensor]) -> dict[str, list[ShardedTensor]]:
    out = {}
    for k, t in state.items():
        half = t.shape[0] // 2
        out[k] = [ShardedTensor(torch.empty_like(t[:half]), tuple(t.shape), (0, 0)),
                  ShardedTensor(torch.empty_like(t[half:]), tuple(t.shape), (half, 0))]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    state = build_state(args.mb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        shardsync.save_safetensors(state.items(), path, max_shard_bytes=64 * MIB)
        buffer = bytearray(64 * MIB + MIB)
        read_files(path, buffer)  # warm the page cache
        dst = split_rows(state)
        want = shardsync.digest(state)
        assert shardsync.digest(path) == want
        seconds = {
            "read": best(lambda: read_files(path, buffer), args.repeat),
            "digest files": best(lambda: shardsync.digest(path), args.repeat),
            "digest live": best(lambda: shardsync.digest(state), args.repeat),
            "reshard": best(lambda: shardsync.reshard(state, dst), args.repeat),
            "reshard verify": best(lambda: shardsync.reshard(state, dst, verify=True), args.repeat),
        }
    doc = {"bytes": nbytes, "tensors": len(state), "threads": torch.get_num_threads(),
           "machine": platform.processor() or platform.machine(), "seconds": seconds,
           "GB/s": {k: nbytes / v / 1e9 for k, v in seconds.items()},
           "digest files / read": seconds["digest files"] / seconds["read"],
           "reshard verify / reshard": seconds["reshard verify"] / seconds["reshard"]}
    print(json.dumps(doc, indent=1))
    if args.mb >= 256:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "digest.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
