"""The cost of a digest against reading the bytes once, and of ``verify=True`` in a reshard loop.

Part 1, one process, default threads. A state of fp32 and bf16 tensors (rows of 4099: odd, ``--mb``
MB in all, 256 by default) is written as safetensors in 64 MiB files and read once to warm the page
cache. Then ``--rounds`` interleaved rounds (the order rotates each round, so a burst of load from
another process falls on every variant alike) of:

* ``read``: every file read once into a preallocated buffer (the bytes, nothing else);
* ``digest files``: ``shardsync.digest(path)`` (reads and hashes every box);
* ``digest live``: ``shardsync.digest(state)`` of the tensors in memory (hashing alone);
* ``digest column shards``: the same tensors as two column shards (strided boxes), in one process.

Each is the median of its rounds; the ratios are against ``read`` of the same run. The goal is
``digest files / read`` within 2.

Part 2, two spawned gloo ranks (torch's default threads each, as a user starts them): the layers of
bench/workload.py (``--layers``, default 4: 168 MB of fp32), each rank holding its tensor-parallel
shards, resharded every step into the other split (column-parallel weights into row shards and back:
half the bytes cross ranks), the same layouts every step, as an RL loop does. ``--steps``
interleaved pairs of ``reshard(..., verify=False)`` and ``verify=True`` (the order alternates), each
timed as the slowest rank's; medians and their ratio.

Run: ``.venv/bin/python bench/bench_digest.py`` (writes bench/results/digest.json and digest.md, or
``--out``); ``--busy`` measures next to another busy process (bench/busy.py) and writes
``digest_busy.{json,md}``;
``--mb 8 --layers 1 --rounds 1 --steps 1`` for a quick check that it runs (writes nothing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import shardsync
from shardsync.layout import LocalShard

sys.path.insert(0, str(Path(__file__).parent))
import busy  # noqa: E402
import workload  # noqa: E402  (bench/workload.py, beside this file)

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


def interleaved(
    variants: dict[str, Callable[[], object]], rounds: int, timer: Callable[[Callable[[], object]], float]
) -> dict[str, float]:
    """Median seconds of each variant over ``rounds`` rounds, the order rotating each round."""
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(timer(variants[name]))
    return {n: statistics.median(ts) for n, ts in times.items()}


def wall(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def read_files(path: Path, buffer: bytearray) -> None:
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            view = memoryview(buffer)
            while fh.readinto(view):
                pass


def column_shards(state: dict[str, torch.Tensor]) -> dict[str, list[LocalShard]]:
    """Each tensor as two column shards that are views into it (strided boxes)."""
    out = {}
    for k, t in state.items():
        half = t.shape[1] // 2
        out[k] = [LocalShard(t[:, :half], tuple(t.shape), (0, 0)), LocalShard(t[:, half:], tuple(t.shape), (0, half))]
    return out


def digest_part(a: argparse.Namespace) -> dict[str, Any]:
    state = build_state(a.mb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        shardsync.save_safetensors(state.items(), path, max_shard_bytes=64 * MIB)
        buffer = bytearray(64 * MIB + MIB)
        read_files(path, buffer)  # warm the page cache
        cols = column_shards(state)
        want = shardsync.digest(state)
        assert shardsync.digest(path) == want == shardsync.digest(cols)
        seconds = interleaved(
            {
                "read": lambda: read_files(path, buffer),
                "digest files": lambda: shardsync.digest(path),
                "digest live": lambda: shardsync.digest(state),
                "digest column shards": lambda: shardsync.digest(cols),
            },
            a.rounds,
            wall,
        )
    return {
        "bytes": nbytes,
        "tensors": len(state),
        "threads": torch.get_num_threads(),
        "rounds": a.rounds,
        "seconds": seconds,
        "GB/s": {k: nbytes / v / 1e9 for k, v in seconds.items()},
        "x read": {k: v / seconds["read"] for k, v in seconds.items() if k != "read"},
    }


def _shards(layers: int, rank: int, world: int, flip: bool) -> dict[str, LocalShard]:
    """This rank's shards of the workload: each along its tensor-parallel dim, or the other one."""
    out = {}
    for key, full in workload.full_weights(layers).items():
        dim = workload.shard_spec(key) ^ int(flip)
        t = torch.from_numpy(full)
        size = t.shape[dim] // world
        local = t.narrow(dim, rank * size, size).clone()
        out[key] = LocalShard(
            local if not flip else torch.zeros_like(local),
            tuple(t.shape),
            tuple(rank * size if d == dim else 0 for d in range(t.dim())),
        )
    return out


def _slowest(fn: Callable[[], object]) -> float:
    dist.barrier()
    seconds = torch.tensor([wall(fn)], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds.item())


def verify_worker(rank: int, world: int, a: argparse.Namespace, store: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600)
    )
    src, dst = _shards(a.layers, rank, world, False), _shards(a.layers, rank, world, True)
    first = wall(lambda: shardsync.reshard(src, dst, verify=True))  # plans once (and checks once)
    full = workload.full_weights(a.layers)
    exact = all(torch.equal(v.local, torch.from_numpy(full[k])[v.box.slices()]) for k, v in dst.items())
    seconds = interleaved(
        {
            "reshard": lambda: shardsync.reshard(src, dst),
            "reshard verify": lambda: shardsync.reshard(src, dst, verify=True),
        },
        2 * a.steps,
        _slowest,
    )
    if rank == 0:
        Path(out).write_text(json.dumps({"first_seconds": first, "seconds": seconds, "exact": exact}))
    dist.destroy_process_group()


def verify_part(a: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "verify.json")
        mp.spawn(verify_worker, args=(2, a, os.path.join(tmp, "store"), out), nprocs=2)
        doc = json.loads(Path(out).read_text())
    nbytes = sum(w.nbytes for w in workload.full_weights(a.layers).values())
    s = doc["seconds"]
    return {
        "world": 2,
        "layers": a.layers,
        "bytes": nbytes,
        "steps": a.steps,
        **doc,
        "verify / no verify": s["reshard verify"] / s["reshard"],
    }


def markdown(doc: dict[str, Any]) -> str:
    d, v = doc["digest"], doc["verify"]
    rows = "\n".join(
        f"| {k} | {s:.3f} | {d['GB/s'][k]:.2f} | {d['x read'].get(k, 1.0):.2f} |" for k, s in d["seconds"].items()
    )
    return (
        f"# Digest cost ({doc['date']}, {doc['machine']}, {doc['cpus']} CPUs)\n\nConditions: "
        f"{doc['conditions']}.\n\n"
        f"{d['bytes'] / 1e6:.0f} MB of fp32/bf16 in {d['tensors']} tensors, {d['threads']} threads, "
        f"median of {d['rounds']} interleaved rounds.\n\n| variant | seconds | GB/s | x read |\n"
        f"|---|---|---|---|\n{rows}\n\n`reshard` loop, 2 gloo ranks, {v['bytes'] / 1e6:.0f} MB, median of "
        f"{v['steps']} interleaved steps each: {v['seconds']['reshard']:.3f} s without verify, "
        f"{v['seconds']['reshard verify']:.3f} s with: **{v['verify / no verify']:.2f}x**.\n"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--note", default="", help="the conditions (e.g. 'taskset -c 1, other jobs running')")
    busy.add_flag(p)
    p.add_argument(
        "--out", type=Path, help="the JSON, .md beside it (default bench/results/digest.json, digest_busy.json)"
    )
    a = p.parse_args()
    out = a.out or RESULTS / f"{busy.stem('digest', a.busy)}.json"
    with busy.run(a.busy) as conditions:
        doc = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(),
            "cpus": len(os.sched_getaffinity(0)),
            "conditions": "; ".join(x for x in (conditions, a.note) if x),
            "digest": digest_part(a),
            "verify": verify_part(a),
        }
    print(json.dumps(doc, indent=1))
    if a.mb >= 256:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
        out.with_suffix(".md").write_text(markdown(doc))


if __name__ == "__main__":
    main()
