"""``make gpu-check``: run the NCCL paths on the GPUs of this machine, or say plainly that there are none.

CI never runs this; it exists so that the NCCL code paths are checked the moment a GPU machine is
available. Under 5 minutes. Steps, each printed with PASS / FAIL / SKIPPED and why:

1. one process on ``cuda:0``: ``full_params`` of CUDA shards (the peers workload at 2 layers, with
   the mapping: splits, a transpose) against the reference, ``reuse`` and ``transport`` included;
2. with 2+ GPUs: the multi-process stream tests with ``SHARDSYNC_TEST_BACKEND=nccl`` (one GPU per
   rank; the 4-rank file needs 4 GPUs and is skipped by pytest otherwise);
3. with 2+ GPUs: the stream benchmark on NCCL: every strategy on 2 ranks, timed, checked.

Exit status 0 when everything that could run passed (also with no CUDA at all: "no CUDA: skipped"),
1 otherwise.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "src")]
import workload as W  # noqa: E402

__all__ = ["main"]

LIMIT_S = 280  # stay under 5 minutes with the process start-up
STRATEGIES = ("broadcast", "bucketed", "p2p", "mesh2d", "auto")


def _state(layers: int, rank: int, world: int, device: torch.device) -> tuple[dict, dict]:
    from shardsync import LocalShard

    weights = W.full_weights(layers)
    state = {}
    for k, w in weights.items():
        loc, off = W.local_shard(w, k, rank, world) if world > 1 else (w, (0,) * w.ndim)
        state[k] = LocalShard(torch.from_numpy(loc).to(device), w.shape, off)
    return state, W.reference(weights)


def _check(stream, ref: dict) -> int:
    n = 0
    for name, t in stream:
        if t.device.type != "cuda" or not torch.equal(t.cpu(), torch.from_numpy(ref[name])):
            raise AssertionError(f"{name}: wrong values or not on the GPU ({t.device})")
        n += 1
    if n != len(ref):
        raise AssertionError(f"{n} targets, expected {len(ref)}")
    return n


def single_gpu() -> str:
    from shardsync.stream import full_params

    state, ref = _state(2, 0, 1, torch.device("cuda", 0))
    for kw in ({}, {"reuse": "never"}, {"transport": "backend"}):
        _check(full_params(state, W.MAPPING, **kw), ref)
    return f"{len(ref)} targets on cuda:0, 3 variants"


def _bench_worker(rank: int, world: int, store: str, out: str) -> None:
    from shardsync.stream import full_params

    torch.cuda.set_device(rank)
    import torch.distributed as dist

    dist.init_process_group(
        "nccl", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    state, ref = _state(8, rank, world, torch.device("cuda", rank))
    lines = []
    for s in STRATEGIES:
        kw = {"mesh": (dist.group.WORLD, None)} if s == "mesh2d" else {}
        _check(full_params(state, W.MAPPING, strategy=s, **kw), ref)  # checked, then timed
        best = float("inf")
        for _ in range(3):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            stream = full_params(state, W.MAPPING, strategy=s, **kw)
            for _name, _t in stream:
                pass
            torch.cuda.synchronize()
            dist.barrier()
            best = min(best, time.perf_counter() - t0)
        lines.append(
            f"{s:10s} {best:.4f} s  {W.total_bytes(ref) / best / 1e9:6.1f} GB/s per rank  "
            f"strategy={stream.plan.strategy} transport={stream.stats.transport} "
            f"collectives={stream.stats.collectives}"
        )
    if rank == 0:
        Path(out).write_text("\n".join(lines))
    dist.destroy_process_group()


def nccl_bench() -> str:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.txt")
        mp.spawn(_bench_worker, args=(2, os.path.join(tmp, "store"), out), nprocs=2)
        return "0.336 GB, 2 ranks, best of 3:\n    " + Path(out).read_text().replace("\n", "\n    ")


def nccl_tests() -> str:
    env = os.environ | {"SHARDSYNC_TEST_BACKEND": "nccl", "PYTHONPATH": str(ROOT / "src")}
    files = ["tests/test_stream_dist.py", "tests/test_stream_dist4.py"]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=LIMIT_S,
    )
    tail = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-500:]
    if run.returncode != 0:
        raise AssertionError(f"pytest failed:\n{run.stdout[-3000:]}\n{run.stderr[-1500:]}")
    return tail


def main() -> int:
    if not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA: skipped (torch {torch.__version__}, "
            f"built with CUDA {torch.version.cuda or 'none'}). The NCCL paths were NOT checked."
        )
        return 0
    n = torch.cuda.device_count()
    print(
        f"gpu-check: {n} GPU(s): {', '.join(torch.cuda.get_device_name(i) for i in range(n))}; "
        f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
    )
    steps = [
        ("single process on cuda:0", single_gpu, 1),
        ("multi-process tests on NCCL", nccl_tests, 2),
        ("stream benchmark on NCCL", nccl_bench, 2),
    ]
    failed = 0
    for label, fn, gpus in steps:
        if n < gpus:
            print(f"SKIPPED {label}: needs {gpus} GPUs (NCCL runs one rank per GPU), {n} present")
            continue
        t0 = time.perf_counter()
        try:
            detail = fn()
            print(f"PASS    {label} ({time.perf_counter() - t0:.1f} s): {detail}")
        except Exception as exc:  # report every step, then fail
            failed += 1
            print(f"FAIL    {label} ({time.perf_counter() - t0:.1f} s): {type(exc).__name__}: {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
