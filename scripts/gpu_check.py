"""``make gpu-check``: run the GPU and NCCL paths on the GPUs of this machine, or say plainly that there are none.

CI never runs this; it exists so that the code paths that need a GPU are checked the moment a GPU
machine is available. Under 5 minutes. Steps, each printed with PASS / FAIL / SKIPPED and why:

1. one process on ``cuda:0``: ``full_params`` of CUDA shards (the peers workload at 2 layers, with
   the mapping: splits, a transpose) against the reference, ``reuse`` and ``transport`` included;
   digests of CUDA tensors (the device hash path) equal to the host's, bit for bit, for every dtype;
   ``verify`` of CUDA state against CPU state; ``load`` (forward and ``reverse``) into CUDA shards;
   ``save_hf`` from CUDA state; fp8 ``quantize`` on the GPU equal to the host's;
2. two processes on gloo whose state lives on the GPUs (both on ``cuda:0`` when there is one):
   every strategy, ``digest`` and ``load`` with the group, ``ReplicaSync`` of CUDA parameters;
3. the stream benchmark on one GPU: the 0.336 GB workload (and 2 layers 4x as wide, 1.34 GB),
   ``full_params`` against the same targets computed by hand with torch (split, transpose,
   ``contiguous``), medians of interleaved rounds, with how long the stream's own loop took;
4. with 2+ GPUs: the multi-process stream tests with ``SHARDSYNC_TEST_BACKEND=nccl`` (one GPU per
   rank; the 4-rank file needs 4 GPUs and is skipped by pytest otherwise);
5. with 2+ GPUs: the stream benchmark on NCCL: every strategy on 2 ranks, timed, checked.

Every step with processes runs them under a deadline, and the whole script under one (its
tracebacks dumped): a hang is a FAIL, not a lost machine.

Exit status 0 when everything that could run passed (also with no CUDA at all: "no CUDA: skipped"),
1 otherwise. ``SHARDSYNC_GPU_CHECK_DEVICE=cpu`` runs steps 1-3 with the CPU standing in for the GPU
(the script's own test, ``tests/test_gpu_check.py``, runs it so on machines without one).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "src")]
import workload as W  # noqa: E402

__all__ = ["main"]

LIMIT_S = 280  # stay under 5 minutes with the process start-up
STEP_S = 120  # the deadline of one step's processes
STRATEGIES = ("broadcast", "bucketed", "p2p", "mesh2d", "auto")
DEVICE = os.environ.get("SHARDSYNC_GPU_CHECK_DEVICE", "cuda")  # "cpu": a dry run of steps 1-3
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8)
DTYPES += (torch.uint8, torch.bool, torch.float8_e4m3fn, torch.complex64)


def _gpu(index: int = 0) -> torch.device:
    """GPU ``index`` (of those present, round robin), or the CPU in a dry run."""
    if DEVICE == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", index % torch.cuda.device_count())


def _sync() -> None:
    if DEVICE != "cpu":
        torch.cuda.synchronize()


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
        if t.device.type != DEVICE or not torch.equal(t.cpu(), torch.from_numpy(ref[name])):
            raise AssertionError(f"{name}: wrong values or not on the {DEVICE} ({t.device})")
        n += 1
    if n != len(ref):
        raise AssertionError(f"{n} targets, expected {len(ref)}")
    return n


def _values(dtype: torch.dtype, n: int = 1001) -> torch.Tensor:
    """``n`` distinct-ish values of ``dtype`` (odd length: no chunk or vector width divides it)."""
    x = torch.arange(n, dtype=torch.float64) * 0.37 - 150
    if dtype == torch.bool:
        return (torch.arange(n) % 3) == 0
    if dtype == torch.complex64:
        return torch.complex(x, -x).to(dtype)
    if dtype == torch.float8_e4m3fn:
        return x.clamp(-448, 448).to(torch.float32).to(dtype)
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return (torch.arange(n, dtype=torch.int64) * 7919 - 3 * n).clamp(info.min, info.max).to(dtype)
    return x.to(dtype)


def _shard_zeros(state: dict, device: torch.device) -> dict:
    from shardsync import LocalShard

    return {
        k: LocalShard(torch.zeros_like(s.local, device=device), s.global_shape, s.global_offset)
        for k, s in state.items()
    }


def _same_shards(got: dict, want: dict, what: str) -> None:
    for k, s in want.items():
        g = got[k].local
        if g.device.type != DEVICE or not torch.equal(g.cpu(), s.local.cpu()):
            raise AssertionError(f"{what}: {k} wrong values or not on the {DEVICE} ({g.device})")


def single_gpu() -> str:
    import shardsync
    from shardsync.quant import dequantize, quantize
    from shardsync.stream import full_params

    gpu, cpu = _gpu(), torch.device("cpu")
    state, ref = _state(2, 0, 1, gpu)
    host, _ = _state(2, 0, 1, cpu)
    for kw in ({}, {"reuse": "never"}, {"transport": "backend"}):
        _check(full_params(state, W.MAPPING, **kw), ref)
    done = [f"full_params: {len(ref)} targets on {gpu}, 3 variants"]

    # the device hash path gives the host's sums bit for bit, for every dtype and under a mapping
    wrong = [
        str(d) for d in DTYPES if shardsync.tensor_digest(_values(d).to(gpu)) != shardsync.tensor_digest(_values(d))
    ]
    if wrong:
        raise AssertionError(f"tensor_digest on {gpu} differs from the host's for {', '.join(wrong)}")
    if shardsync.digest(state, W.MAPPING) != shardsync.digest(host, W.MAPPING):
        raise AssertionError("digest of the GPU state under the mapping differs from the host's")
    targets = {k: torch.from_numpy(v) for k, v in ref.items()}
    for b, mapping in ((host, None), (targets, W.MAPPING)):
        report = shardsync.verify(state, b, mapping)
        if not report.ok or len(report.equal) != len(b):
            raise AssertionError(f"verify(GPU state, host tensors, {mapping}): {report}")
    done.append(f"digests of {len(DTYPES)} dtypes and of the mapped state equal the host's; verify ok")

    # load into GPU shards, forward (source keys) and reverse (from the mapped targets)
    full = {k: s.local.cpu() for k, s in host.items()}
    dst = _shard_zeros(state, gpu)
    shardsync.load(dst, full, verify=True)
    _same_shards(dst, host, "load")
    dst = _shard_zeros(state, gpu)
    shardsync.load(dst, targets, W.MAPPING, reverse=True)
    _same_shards(dst, host, "load(reverse=True)")
    done.append("load and load(reverse=True) into GPU shards")

    with tempfile.TemporaryDirectory() as tmp:
        shardsync.save_hf(state, tmp, W.MAPPING)
        back = shardsync.read_tensors(tmp)
        bad = [k for k, v in ref.items() if not torch.equal(back[k], torch.from_numpy(v))]
        if bad or len(back) != len(ref):
            raise AssertionError(f"save_hf from the GPU: {len(back)} tensors read back, wrong: {bad[:3]}")
    done.append("save_hf from GPU state")

    w = torch.from_numpy(W.full_weights(1)["layers.0.o"][:300, :257].copy())
    (q, s), (qh, sh) = quantize(w.to(gpu), (64, 32)), quantize(w, (64, 32))
    if not (torch.equal(q.cpu().view(torch.uint8), qh.view(torch.uint8)) and torch.equal(s.cpu(), sh)):
        raise AssertionError("fp8 quantize on the GPU differs from the host's")
    if not torch.equal(dequantize(q, s, (64, 32)).cpu(), dequantize(qh, sh, (64, 32))):
        raise AssertionError("fp8 dequantize on the GPU differs from the host's")
    done.append("fp8 quantize/dequantize equal the host's")
    return "; ".join(done)


def _init(backend: str, rank: int, world: int, store: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=STEP_S)
    )


def _gloo_worker(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist

    import shardsync
    from shardsync.replicas import ReplicaSync
    from shardsync.stream import full_params

    _init("gloo", rank, world, store)
    gpu = _gpu(rank)
    state, ref = _state(2, rank, world, gpu)
    for s in STRATEGIES:
        kw = {"mesh": (dist.group.WORLD, None)} if s == "mesh2d" else {}
        # the backend: on one host, CPU state would go through shared memory instead (the dry run)
        _check(full_params(state, W.MAPPING, strategy=s, transport="backend", **kw), ref)
    host, _ = _state(2, rank, world, torch.device("cpu"))
    if shardsync.digest(state, W.MAPPING) != shardsync.digest(host, W.MAPPING):
        raise AssertionError("digest of the GPU shards with the group differs from the host's")
    dst = _shard_zeros(state, gpu)
    full = {k: torch.from_numpy(w) for k, w in W.full_weights(2).items()}
    shardsync.load(dst, full, group=dist.group.WORLD, transport="backend")
    _same_shards(dst, host, "load with the group")

    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.LayerNorm(3)).to(gpu)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) * (rank + 1) + i)
    ReplicaSync(model, None, dist.group.WORLD, selector=lambda name, p: True, params="mean").sync_params()
    for i, p in enumerate(model.parameters()):
        want = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) * (world + 1) / 2 + i
        if p.device.type != DEVICE or not torch.equal(p.detach().cpu(), want):
            raise AssertionError(f"ReplicaSync(params='mean') of GPU parameters: {p.detach().cpu()} != {want}")
    if rank == 0:
        Path(out).write_text(
            f"{len(ref)} targets, {len(STRATEGIES)} strategies on {gpu}; digest, load and ReplicaSync with the group"
        )
    dist.destroy_process_group()


def _run_ranks(fn: Callable, world: int) -> str:
    """``fn(rank, world, store, out)`` on ``world`` spawned processes, killed at :data:`STEP_S`;
    returns what rank 0 wrote to ``out``."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.txt")
        ctx = mp.start_processes(fn, args=(world, os.path.join(tmp, "store"), out), nprocs=world, join=False)
        deadline = time.monotonic() + STEP_S
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{world} ranks still running after {STEP_S} s")
        return Path(out).read_text()


def gloo_gpu_state() -> str:
    return _run_ranks(_gloo_worker, 2)


def _median_round(jobs: dict[str, Callable[[], object]], rounds: int = 5) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in jobs}
    for _ in range(rounds):
        for k, job in jobs.items():  # interleaved: a slow moment of the machine hits both
            _sync()
            t0 = time.perf_counter()
            job()
            _sync()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _bench_one(layers: int, hidden: int, ffn: int) -> str:
    from shardsync import LocalShard
    from shardsync.stream import full_params

    weights = W.full_weights(layers, hidden, ffn)
    full = {k: torch.from_numpy(w).to(_gpu()) for k, w in weights.items()}
    state = {k: LocalShard(w, w.shape, (0,) * w.dim()) for k, w in full.items()}
    ref = W.reference(weights)

    def by_hand() -> None:  # what a user writes with torch: the targets, contiguous
        for key, w in full.items():
            kind = key.rsplit(".", 1)[1]
            if kind in ("qkv", "gate_up"):
                for part in w.chunk(3 if kind == "qkv" else 2, dim=1):
                    part.contiguous()
            elif kind == "o":
                w.T.contiguous()
            else:
                w.clone()

    def stream() -> None:
        for _name, _t in full_params(state, W.MAPPING):
            pass

    _check(full_params(state, W.MAPPING), ref)
    t = _median_round({"torch": by_hand, "shardsync": stream})
    _sync()
    t0 = time.perf_counter()
    stream()
    loop = time.perf_counter() - t0  # the host's part: a stream bound by Python ends with little left
    _sync()
    tail = time.perf_counter() - t0 - loop
    gb = W.total_bytes(ref) / 1e9
    return (
        f"{gb:.3f} GB, {len(ref)} targets: shardsync {t['shardsync'] * 1e3:.2f} ms ({gb / t['shardsync']:.0f} "
        f"GB/s; its loop {loop * 1e3:.2f} ms, then {tail * 1e3:.2f} ms waiting for the device), torch by hand "
        f"{t['torch'] * 1e3:.2f} ms ({gb / t['torch']:.0f} GB/s), ratio {t['torch'] / t['shardsync']:.2f}x"
    )


def gpu_bench() -> str:
    """The workload, and on a real GPU also 2 layers 4x as wide (fewer, larger targets: what is left is
    the cost per target), each with medians of 5 interleaved rounds."""
    sizes = [(W.LAYERS, W.HIDDEN, W.FFN)] + ([(2, 4 * W.HIDDEN, 4 * W.FFN)] if DEVICE != "cpu" else [])
    head = f"on {_gpu()}, torch threads {torch.get_num_threads()}:\n    "
    return head + "\n    ".join(_bench_one(*size) for size in sizes)


def _bench_worker(rank: int, world: int, store: str, out: str) -> None:
    from shardsync.stream import full_params

    torch.cuda.set_device(rank)
    import torch.distributed as dist

    _init("nccl", rank, world, store)
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
    return "0.336 GB, 2 ranks, best of 3:\n    " + _run_ranks(_bench_worker, 2).replace("\n", "\n    ")


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
    # a hang anywhere (a CUDA call, a collective) ends the script with every thread's traceback, after
    # the longest the steps may take together (the NCCL tests' limit and two steps' deadlines)
    faulthandler.dump_traceback_later(LIMIT_S + 2 * STEP_S, exit=True)
    if DEVICE == "cpu":
        n = 0
        print("gpu-check: dry run, the CPU standing in for the GPU (SHARDSYNC_GPU_CHECK_DEVICE=cpu)")
    elif not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA: skipped (torch {torch.__version__}, "
            f"built with CUDA {torch.version.cuda or 'none'}). The GPU and NCCL paths were NOT checked."
        )
        return 0
    else:
        n = torch.cuda.device_count()
        print(
            f"gpu-check: {n} GPU(s): {', '.join(torch.cuda.get_device_name(i) for i in range(n))}; "
            f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
        )
    gpus = 1 if DEVICE == "cpu" else n
    steps = [
        ("single process on the GPU", single_gpu, 1),
        ("gloo ranks with GPU state", gloo_gpu_state, 1),
        ("stream benchmark on one GPU", gpu_bench, 1),
        ("multi-process tests on NCCL", nccl_tests, 2),
        ("stream benchmark on NCCL", nccl_bench, 2),
    ]
    failed = 0
    for label, fn, need in steps:
        if gpus < need:
            print(f"SKIPPED {label}: needs {need} GPUs (NCCL runs one rank per GPU), {gpus} present", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            detail = fn()
            print(f"PASS    {label} ({time.perf_counter() - t0:.1f} s): {detail}", flush=True)
        except Exception as exc:  # report every step, then fail
            failed += 1
            print(f"FAIL    {label} ({time.perf_counter() - t0:.1f} s): {type(exc).__name__}: {exc}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
