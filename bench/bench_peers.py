"""shardsync against its peers on one workload (issues 11 and 17), each peer in its own environment.

The workload (``bench/workload.py``): 8 layers (``--layers``), hidden 1024, fp32, 0.336 GB of ``[in, out]``
Linear weights, TP=2 (qkv and gate_up sharded along dim 1, o and down along dim 0); mapping = qkv split
along axis 1, gate_up split along axis 1, ``o^T``. Every consumer receives every target.

Every side runs with the thread settings a user gets: nothing here sets ``torch.set_num_threads`` or
``OMP_NUM_THREADS``; the caller's environment passes through as it is (under ``make bench-peers``:
unset). Two launchers set it themselves, which the report states with what each job's processes saw:
torchrun sets ``OMP_NUM_THREADS=1`` in its workers when it is unset (``torch/distributed/run.py``), and
Paddle sets ``OMP_NUM_THREADS=1`` in its process's environment on import when it is unset
(``paddle/base/__init__.py``), which the workers of ``paddle.distributed.launch`` inherit.

Jobs, each a fresh process, run in interleaved rounds (the order rotates every round) so that load
from other processes on the machine hits all of them alike; a job checks every target against the
numpy reference once, then times ``--repeats`` passes and keeps the best:

* one process: shardsync (``reuse="dropped"``, the default; the same with the sources copied into
  tensors of torch's, which start on 64 bytes where the workload's numpy arrays start 16 bytes past;
  ``reuse="never"``; ``never`` with glibc
  told to keep freed memory by :func:`shardsync.exec.memory.tune_allocator`), Paddle 3.3.1's
  ``full_param`` (``--mode single``), and the memcpy ceiling: every target's bytes copied once into
  memory already touched (and, for reference, into fresh memory);
* two gloo processes spawned by ``torch.multiprocessing``: shardsync through shared memory
  (``transport="auto"``: each sender writes its pieces into the targets of every consumer; also with
  no target pushed, every read published by its sender and copied out by its receivers, as the
  transport worked before; and with the shards moved to shared memory once with ``share_memory_()``)
  and through gloo (``transport="backend"``), torch DCP's
  consolidation routes (``_gather_state_dict``: DTensor ``full_tensor`` per weight, as
  ``get_state_dict(full_state_dict=True)`` does; ``dcp.save`` to a tmpfs directory then
  ``dcp_to_torch_save`` and ``torch.load`` on rank 0 - only rank 0 gets targets), a naive
  ``all_gather``; and the ceilings: bytes each rank must receive over gloo's broadcast bandwidth (64
  MiB), and the memcpy of every target's bytes on both ranks at once (every memcpy ceiling is the
  better of torch's default threads and one thread: next to a busy process one thread is faster);
  for reference, the memcpy of the pieces themselves: each rank copies each piece of its shard into
  every consumer's target (two on two ranks, as the shared-memory transport writes them), one numpy
  copy per piece, the rows as the mapping cuts them (4 of every 6 KiB of a qkv shard row into q, ...);
  ``o``'s pieces as contiguous bytes, since a memcpy does not transpose. It is the least the copies of
  this mapping can cost; against the memcpy ceiling it says whether the mapping's row cuts cost more
  than whole tensors.
  The ceilings are timed in the same round robin as shardsync's passes, as many passes each (they
  used to be timed after them, with more passes: the busy process's load then hit them differently);
* the same two spawned processes, each calling ``os.setsid()`` first (a session of its own, as torchrun
  and Paddle's launcher start their workers: the report's notes say why it matters next to a busy
  process): shardsync through shared memory and the memcpy ceiling;
* two processes started by torchrun (``python -m torch.distributed.run --standalone --nproc_per_node
  2``): shardsync through shared memory and the same two ceilings, in those processes;
* Paddle's single-group and 2-D mesh paths (``paddle.distributed.launch --nproc_per_node 2``).

Paddle lives in ``bench/.peers-venv`` (``make bench-peers`` creates it: ``pip install
paddlepaddle==3.3.1``), never in shardsync's environment; ``--no-paddle`` leaves it out. ``--busy``
measures next to another busy process (bench/busy.py). Writes ``bench/results/peers.json`` and
``peers.md`` (``peers_busy.*`` with ``--busy``): one table, the thread settings of every side and the
targets of issue 17 (``bench/peers_report.py``). Quick check: ``--layers 1 --rounds 1 --repeats 1
--no-paddle --out /tmp/peers``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
import busy  # noqa: E402
import peers_report  # noqa: E402
import workload as W  # noqa: E402

__all__ = ["main"]

HERE = Path(__file__).parent
RESULTS = HERE / "results"
PEERS_PY = HERE / ".peers-venv" / "bin" / "python"
MIB = 1 << 20


# -- one process ------------------------------------------------------------------------------------


def _targets(stream: Iterator[tuple[str, torch.Tensor]], ref: dict | None) -> int:
    n = 0
    for name, t in stream:
        if ref is not None and not torch.equal(t, torch.from_numpy(ref[name])):
            raise AssertionError(f"{name} differs from the reference")
        n += 1
    return n


def _best(fn: Callable[[bool], None], repeats: int) -> float:
    fn(True)  # checked, not timed
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(False)
        best = min(best, time.perf_counter() - t0)
    return best


def job_single(variant: str, repeats: int, layers: int) -> dict[str, float]:
    from shardsync.exec.memory import tune_allocator
    from shardsync.stream import full_params

    weights = W.full_weights(layers)
    ref = W.reference(weights)
    state = {k: torch.from_numpy(v) for k, v in weights.items()}
    if variant == "aligned":  # torch's allocator starts a tensor on 64 bytes; numpy's large arrays 16 past
        state = {k: v.clone() for k, v in state.items()}
    if variant == "tuned":
        tune_allocator()
    reuse = "dropped" if variant in ("dropped", "aligned") else "never"
    out = {
        variant: _best(
            lambda check: _check_count(
                _targets(full_params(state, W.MAPPING, reuse=reuse), ref if check else None), ref
            ),
            repeats,
        )
    }
    if variant == "dropped":  # the ceilings, in the same process
        srcs = [torch.from_numpy(w).reshape(-1) for w in ref.values() if w.flags.c_contiguous] + [
            torch.from_numpy(w.copy()).reshape(-1) for w in ref.values() if not w.flags.c_contiguous
        ]
        warm = [torch.empty_like(s) for s in srcs]
        out["memcpy warm"] = _fastest(
            lambda: _best(lambda _: [d.copy_(s) for d, s in zip(warm, srcs)] and None, repeats)
        )
        out["memcpy fresh"] = _fastest(
            lambda: _best(lambda _: [torch.empty_like(s).copy_(s) for s in srcs] and None, repeats)
        )
    return out


def _fastest(measure: Callable[[], float]) -> float:
    """A ceiling is the fastest a copy goes here: the better of torch's default threads and one thread
    (next to a busy process, OpenMP's threads wait for a core and one thread is faster)."""
    default = torch.get_num_threads()
    try:
        first = measure()
        torch.set_num_threads(1)
        return min(first, measure())
    finally:
        torch.set_num_threads(default)


def _check_count(n: int, ref: dict) -> None:
    if n != len(ref):
        raise AssertionError(f"{n} targets, expected {len(ref)}")


# -- two gloo processes -----------------------------------------------------------------------------


def _dtensors(state_np: dict, rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {k: distribute_tensor(torch.from_numpy(w), mesh, [Shard(W.shard_spec(k))]) for k, w in state_np.items()}


def _map_full(full: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The mapping written by hand on full tensors (contiguous targets, as the others yield)."""
    for key in sorted(full):
        w, (p, kind) = full[key], key.rsplit(".", 1)
        if kind in W.SPLITS:
            parts = W.SPLITS[kind]
            yield from zip((f"{p}.{part}" for part in parts), (x.contiguous() for x in w.chunk(len(parts), 1)))
        elif kind == "o":
            yield f"{p}.o_t", w.T.contiguous()
        else:
            yield key, w


def _naive(local: dict[str, torch.Tensor], world: int) -> Iterator[tuple[str, torch.Tensor]]:
    full = {}
    for key in sorted(local):
        parts = [torch.empty_like(local[key]) for _ in range(world)]
        dist.all_gather(parts, local[key])
        full[key] = torch.cat(parts, W.shard_spec(key))
    return _map_full(full)


def _dcp_files(dstate: dict, rank: int, tmp: str) -> Iterator[tuple[str, torch.Tensor]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = os.path.join(tmp, "dcp")
    dcp.save(dict(dstate), checkpoint_id=path)
    dist.barrier()
    if rank != 0:
        return iter(())
    dcp_to_torch_save(path, os.path.join(tmp, "full.pt"))
    return _map_full(torch.load(os.path.join(tmp, "full.pt")))


def _pulled(state: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The shared-memory stream with no target pushed: every read published by its sender and copied
    out by its receivers (how the transport worked before its senders wrote into the targets)."""
    import shardsync.exec.push_schedule as push
    from shardsync.stream import full_params

    default, push.PUSH_MIN_BYTES = push.PUSH_MIN_BYTES, 1 << 62
    try:
        yield from full_params(state, W.MAPPING)
    finally:
        push.PUSH_MIN_BYTES = default


def _variants(weights: dict, rank: int, world: int, tmp: str) -> dict[str, Callable[[], Iterator]]:
    from torch.distributed._state_dict_utils import _gather_state_dict

    from shardsync import LocalShard
    from shardsync.stream import full_params

    local_np = {k: W.local_shard(w, k, rank, world) for k, w in weights.items()}
    state = {k: LocalShard(torch.from_numpy(loc), weights[k].shape, off) for k, (loc, off) in local_np.items()}
    local = {k: torch.from_numpy(loc) for k, (loc, _) in local_np.items()}
    dstate = _dtensors(weights, rank, world)
    shared = {
        k: LocalShard(torch.from_numpy(loc.copy()).share_memory_(), weights[k].shape, off)
        for k, (loc, off) in local_np.items()
    }
    return {
        "shardsync shm": lambda: full_params(state, W.MAPPING),
        peers_report.PULLED: lambda: _pulled(state),
        "shardsync shm, shards in shared memory": lambda: full_params(shared, W.MAPPING),
        "shardsync gloo": lambda: full_params(state, W.MAPPING, transport="backend"),
        "torch DCP _gather_state_dict": lambda: _map_full(_gather_state_dict(dstate)),
        "torch DCP save + dcp_to_torch_save": lambda: _dcp_files(dstate, rank, tmp),
        "naive all_gather": lambda: _naive(local, world),
    }


def pieces(weights: dict, rank: int, world: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(destination, source)`` of every piece of rank ``rank``'s shards of ``weights``
    (:func:`workload.full_weights`), once for every consumer: the
    copies the shared-memory transport makes, each piece written by its holder into every consumer's
    target. A split piece is the rows of the shard's columns that fall in its target (a view of the
    target, of memory of its own per consumer); a piece of ``o`` (transposed by the mapping) is its
    shard's bytes into a buffer of their own, since a memcpy does not transpose; ``down`` is whole rows.

    Example:
        >>> [(d.shape, s.shape) for d, s in pieces(W.full_weights(1), 0, 2)][:3]   # rank 0 holds all of q
        [((1024, 1024), (1024, 1024)), ((1024, 1024), (1024, 1024)), ((1024, 512), (1024, 512))]
    """
    out = []
    for key, w in weights.items():
        shard, offset = W.local_shard(w, key, rank, world)
        parts = W.SPLITS.get(key.rsplit(".", 1)[1])
        if parts is None:  # o, down: sharded along dim 0, whole rows
            out += [(np.empty_like(shard), shard) for _ in range(world)]
            continue
        width = w.shape[1] // len(parts)  # split along the dim it is sharded along
        lo, hi = offset[1], offset[1] + shard.shape[1]
        for start in range(0, w.shape[1], width):
            a, b = max(start, lo), min(start + width, hi)
            if a < b:
                for _ in range(world):
                    target = np.empty((w.shape[0], width), w.dtype)
                    out.append((target[:, a - start : b - start], shard[:, a - lo : b - lo]))
    return out


def _ceiling_passes(weights: dict, ref: dict, rank: int, world: int) -> dict[str, Callable[[], None]]:
    """One pass of each ceiling, timed in the same round robin as the variants (as many passes each):
    gloo's broadcast of 64 MiB, the memcpy of every target with torch's default threads and with one
    thread (next to a busy process one thread is faster), and the memcpy of this rank's pieces into
    every consumer's target (:func:`pieces`)."""
    buf = torch.ones(64 * MIB, dtype=torch.uint8)
    srcs = [
        torch.from_numpy(w).reshape(-1) if w.flags.c_contiguous else torch.from_numpy(w.copy()).reshape(-1)
        for w in ref.values()
    ]
    pairs = list(zip([torch.empty_like(s) for s in srcs], srcs))
    default = torch.get_num_threads()

    def memcpy(threads: int) -> Callable[[], None]:
        def run() -> None:
            torch.set_num_threads(threads)
            try:
                for d, s in pairs:
                    d.copy_(s)
            finally:
                torch.set_num_threads(default)

        return run

    mine = pieces(weights, rank, world)

    def copy_pieces() -> None:
        for d, s in mine:
            np.copyto(d, s)

    return {
        "gloo": lambda: dist.broadcast(buf, src=0),
        "memcpy": memcpy(default),
        "memcpy, 1 thread": memcpy(1),
        "pieces": copy_pieces,
    }


def _ceiling_rows(best: dict[str, float], ref: dict, world: int) -> dict[str, float]:
    """The ceilings' rows from their best passes: the bytes each rank must receive at gloo's broadcast
    rate, and the better memcpy of the two thread settings."""
    receive = W.total_bytes(ref) * (world - 1) // world
    return {
        peers_report.GLOO_CEILING: receive / (64 * MIB / best["gloo"]),
        peers_report.MEMCPY_CEILING: min(best["memcpy"], best["memcpy, 1 thread"]),
        peers_report.PIECES_CEILING: best["pieces"],
    }


def _timed_passes(
    variants: dict[str, Callable[[], Iterator]],
    ceilings: dict[str, Callable[[], None]],
    rank: int,
    ref: dict,
    repeats: int,
) -> tuple[dict[str, float], dict[str, float]]:
    """Best of ``repeats`` passes of each variant and each ceiling, round-robin (load from other
    processes hits them alike); the first pass is not timed, and checks every variant's targets."""
    res = {name: float("inf") for name in variants}
    best = {name: float("inf") for name in ceilings}
    for rep in range(repeats + 1):
        for name, make in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            n = _targets(make(), ref if rep == 0 else None)
            dist.barrier()
            if rep == 0 and n != (len(ref) if rank == 0 or "dcp_to" not in name else 0):
                raise AssertionError(f"{name}: {n} targets on rank {rank}")
            if rep > 0:
                res[name] = min(res[name], time.perf_counter() - t0)
        for name, run in ceilings.items():
            dist.barrier()
            t0 = time.perf_counter()
            run()
            dist.barrier()
            if rep > 0:
                best[name] = min(best[name], time.perf_counter() - t0)
    return res, best


def _pair(
    rank: int, world: int, out: str, repeats: int, tmp: str, layers: int, only: str | None, suffix: str = ""
) -> None:
    """The two-process job on an initialised group: every variant (or ``only`` that one), then the
    ceilings, every row suffixed ``suffix``; rank 0 writes ``{"seconds", "threads"}``."""
    weights = W.full_weights(layers)  # seeded: the same on every rank
    ref = W.reference(weights)
    variants = _variants(weights, rank, world, tmp)
    if only is not None:
        variants = {only: variants[only]}
    res, best = _timed_passes(variants, _ceiling_passes(weights, ref, rank, world), rank, ref, repeats)
    res |= _ceiling_rows(best, ref, world)
    res = {f"{k}{suffix}": v for k, v in res.items()}
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": res, "threads": busy.threads()}))
    dist.destroy_process_group()


def _worker(rank: int, world: int, store: str, out: str, repeats: int, tmp: str, layers: int, sessions: bool) -> None:
    if sessions:
        os.setsid()  # as torchrun and paddle.distributed.launch start their workers
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600)
    )
    only, suffix = (peers_report.SHM, peers_report.OWN_SESSIONS) if sessions else (None, "")
    _pair(rank, world, out, repeats, tmp, layers, only, suffix)


def job_pair(repeats: int, layers: int, sessions: bool = False) -> dict[str, Any]:
    """Two ranks spawned by ``torch.multiprocessing``, this process's environment as it is (with
    ``sessions``: each rank calls ``os.setsid()`` first and runs shardsync's shared-memory stream only)."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # DCP's files on tmpfs: no disk in the timing
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=shm, prefix="bench-dcp-") as files:
        out = os.path.join(tmp, "res.json")
        mp.spawn(_worker, args=(2, os.path.join(tmp, "store"), out, repeats, files, layers, sessions), nprocs=2)
        return json.loads(Path(out).read_text())


def job_torchrun(repeats: int, layers: int) -> dict[str, Any]:
    """shardsync's shared-memory stream on two ranks started by torchrun (a user's usual launcher)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__]
        cmd += ["--job", "torchrun-worker", "--repeats", str(repeats), "--layers", str(layers), "--result", out]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if run.returncode != 0:
            raise RuntimeError(f"torchrun job failed:\n{run.stderr[-4000:]}")
        return json.loads(Path(out).read_text())


def torchrun_worker(out: str, repeats: int, layers: int) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    _pair(rank, world, out, repeats, tempfile.gettempdir(), layers, peers_report.SHM, " (torchrun)")


# -- Paddle (its own venv) --------------------------------------------------------------------------

PADDLE_LABELS = {
    "single": "Paddle full_param",
    "group": "Paddle full_param, single group",
    "mesh": "Paddle full_param, 2-D mesh (h_group, v_group)",
}


def job_paddle(mode: str, repeats: int, layers: int) -> dict[str, Any]:
    script = HERE / "peers" / "paddle_full_param.py"
    env = os.environ | {"PYTHONWARNINGS": "ignore"}
    env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res")
        args = [str(script), "--mode", mode, "--repeats", str(repeats + 1), "--layers", str(layers), "--out", out]
        if mode != "single":
            args = ["-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", f"{tmp}/log", *args]
        run = subprocess.run([str(PEERS_PY), *args], env=env, capture_output=True, text=True, timeout=600)
        if run.returncode != 0:
            logs = "".join(p.read_text()[-2000:] for p in Path(tmp).glob("log/workerlog.*"))
            raise RuntimeError(f"paddle {mode} failed:\n{run.stderr[-3000:]}\n{logs}")
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(1 if mode == "single" else 2)]
    best = min(max(per) for per in zip(*(r["seconds"][1:] for r in ranks)))  # slowest rank, best pass
    omp = ranks[0]["omp_num_threads"]
    said = (
        f"OMP_NUM_THREADS {omp['before import'] or 'unset'} before `import paddle`, "
        f"{omp['after import'] or 'unset'} after"
    )
    return {"seconds": {PADDLE_LABELS[mode]: best}, "threads": said}


# -- driver -----------------------------------------------------------------------------------------

ONE = ["single-dropped", "single-aligned", "single-never", "single-tuned", "paddle-single"]
TWO = ["pair", "sessions", "torchrun", "paddle-group", "paddle-mesh"]
#: Which side of the table each job is, for the thread settings in the report.
SIDES = {
    "single": "shardsync, 1 process",
    "paddle-single": "Paddle, 1 process",
    "pair": "shardsync and torch, 2 processes spawned by torch.multiprocessing",
    "sessions": "shardsync, 2 processes spawned by torch.multiprocessing, each in a session of its own",
    "torchrun": "shardsync, 2 processes under torchrun",
    "paddle-group": "Paddle, 2 processes under paddle.distributed.launch",
    "paddle-mesh": "Paddle, 2 processes under paddle.distributed.launch",
}


def _run_job(name: str, repeats: int, layers: int) -> dict[str, Any]:
    """Each job in a fresh process: allocator state and caches never carry over."""
    if name.startswith("paddle"):
        return job_paddle(name.split("-")[1], repeats, layers)
    cmd = [sys.executable, __file__, "--job", name, "--repeats", str(repeats), "--layers", str(layers)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        raise RuntimeError(f"job {name} failed:\n{run.stderr[-4000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def _job(name: str, repeats: int, layers: int) -> dict[str, Any]:
    """Inside a job process: the job's ``{"seconds", "threads"}``."""
    if name == "pair":
        return job_pair(repeats, layers)
    if name == "sessions":
        return job_pair(repeats, layers, sessions=True)
    if name == "torchrun":
        return job_torchrun(repeats, layers)
    return {"seconds": job_single(name.split("-")[1], repeats, layers), "threads": busy.threads()}


def _autogroup() -> str:
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip()
    except OSError:
        return "not on this system"


def notes(said: dict[str, set[str]]) -> list[str]:
    """What the launchers do to the thread settings, with what their processes reported (``said``:
    by side, as in :data:`SIDES`)."""
    out = []
    if SIDES["torchrun"] in said:
        out.append(
            "torchrun sets OMP_NUM_THREADS=1 in its workers when the caller left it unset and "
            "nproc_per_node > 1 (torch/distributed/run.py); its workers here reported: "
            + " / ".join(sorted(said[SIDES["torchrun"]]))
            + "."
        )
    if SIDES["sessions"] in said:
        out.append(
            "torchrun and paddle.distributed.launch start each worker in a session of its own "
            "(Popen(start_new_session=True), os.setsid); torch.multiprocessing.spawn does not, so its "
            "ranks share the job's session - and, with --busy, the busy process's, which the driver "
            f"started. Linux's autogroup scheduler (kernel.sched_autogroup_enabled: {_autogroup()}) "
            "shares the CPU between sessions first, then between the threads of each: next to a busy "
            'process a worker with a session of its own gets a larger share. The rows "spawned, each '
            'rank in a session of its own" are the spawned job with each rank calling os.setsid() first.'
        )
    paddle = sorted(set().union(*(v for k, v in said.items() if k.startswith("Paddle"))))
    if paddle:
        out.append(
            "Paddle sets OMP_NUM_THREADS=1 in its process's environment on import when it is unset "
            "(paddle/base/__init__.py, __bootstrap__), so the workers of paddle.distributed.launch "
            "(which imports paddle) start with 1; its processes here reported: " + " / ".join(paddle) + "."
        )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (a ratio is the median of theirs)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=W.LAYERS, help=f"layers of the workload ({W.LAYERS}: 0.336 GB)")
    ap.add_argument("--no-paddle", action="store_true", help="leave Paddle's jobs out (its targets: not measured)")
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=RESULTS)
    busy.add_flag(ap)
    args = ap.parse_args(argv)
    if args.job == "torchrun-worker":
        torchrun_worker(args.result, args.repeats, args.layers)
        return {}
    if args.job:  # inside a job process: print one JSON line
        res = _job(args.job, args.repeats, args.layers)
        print(json.dumps(res))
        return res
    if not args.no_paddle and not PEERS_PY.exists():
        raise SystemExit(f"{PEERS_PY} is missing: run `make bench-peers` (it creates the peers' venv), or --no-paddle")
    jobs = [j for j in ONE + TWO if not (args.no_paddle and j.startswith("paddle"))]
    doc: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "workload": f"{args.layers} layers, hidden {W.HIDDEN}, ffn {W.FFN}, fp32, "
        f"{W.total_bytes(W.full_weights(args.layers)) / 1e9:.3f} GB, TP=2",
        "repeats": args.repeats,
    }
    rounds: list[dict[str, float]] = []
    said: dict[str, set[str]] = {}
    with busy.run(args.busy) as conditions:
        for k in range(args.rounds):
            res: dict[str, float] = {}
            for name in jobs[k % len(jobs) :] + jobs[: k % len(jobs)]:
                got = _run_job(name, args.repeats, args.layers)
                res |= got["seconds"]
                side = SIDES["single" if name.startswith("single") else name]
                said.setdefault(side, set()).add(got["threads"])
            rounds.append(res)
            print(f"round {k}: " + ", ".join(f"{n} {s:.3f}" for n, s in res.items()), file=sys.stderr, flush=True)
    doc |= {
        "conditions": conditions,
        "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "threads": {side: " / ".join(sorted(v)) for side, v in said.items()},
        "notes": notes(said),
        "rounds": rounds,
        "targets": peers_report.targets(rounds),
    }
    name = busy.stem("peers", args.busy)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    text = peers_report.report(rounds, doc)
    (args.out / f"{name}.md").write_text(text)
    sys.stdout.write(text)
    return doc


if __name__ == "__main__":
    main()
