"""shardsync against its peers on one workload (issue 11), each peer in its own environment.

The workload (``bench/workload.py``): 8 layers, hidden 1024, fp32, 0.336 GB of ``[in, out]`` Linear
weights, TP=2 (qkv and gate_up sharded along dim 1, o and down along dim 0); mapping = qkv split along
axis 1, gate_up split along axis 1, ``o^T``. Every consumer receives every target.

Jobs, each a fresh process, run in interleaved rounds (the order rotates every round) so that load
from other processes on the machine hits all of them alike; a job checks every target against the
numpy reference once, then times ``--repeats`` passes and keeps the best:

* one process: shardsync (``reuse="dropped"``, the default; ``reuse="never"``; ``never`` with glibc
  told to keep freed memory by :func:`shardsync.exec.memory.tune_allocator`), Paddle 3.3.1's
  ``full_param`` (``--mode single``), and the memcpy ceiling: every target's bytes copied once into
  memory already touched (and, for reference, into fresh memory);
* two gloo processes: shardsync through shared memory (``transport="auto"``; also with the shards
  moved to shared memory once with ``share_memory_()``, so that they are published in place) and
  through gloo (``transport="backend"``), Paddle's single-group and 2-D mesh paths (``paddle.distributed.launch
  --nproc_per_node 2``), torch DCP's consolidation routes (``_gather_state_dict``: DTensor
  ``full_tensor`` per weight, as ``get_state_dict(full_state_dict=True)`` does; ``dcp.save`` to a tmpfs
  directory then ``dcp_to_torch_save`` and ``torch.load`` on rank 0 - only rank 0 gets targets), a
  naive ``all_gather``; and the ceilings: bytes each rank must receive over gloo's broadcast bandwidth
  (64 MiB, same run), and the memcpy of every target's bytes on both ranks at once.

Paddle lives in ``bench/.peers-venv`` (``make bench-peers`` creates it: ``pip install
paddlepaddle==3.3.1``), never in shardsync's environment. Writes ``bench/results/peers.json`` and
``peers.md`` (one table, ratios = medians of per-round ratios).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
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


def job_single(variant: str, repeats: int) -> dict[str, float]:
    from shardsync.exec.memory import tune_allocator
    from shardsync.stream import full_params

    torch.set_num_threads(1)
    weights = W.full_weights()
    ref = W.reference(weights)
    state = {k: torch.from_numpy(v) for k, v in weights.items()}
    if variant == "tuned":
        tune_allocator()
    reuse = "dropped" if variant == "dropped" else "never"
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
        out["memcpy warm"] = _best(lambda _: [d.copy_(s) for d, s in zip(warm, srcs)] and None, repeats)
        out["memcpy fresh"] = _best(lambda _: [torch.empty_like(s).copy_(s) for s in srcs] and None, repeats)
    return out


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
        if kind == "qkv":
            yield from zip((f"{p}.q", f"{p}.k", f"{p}.v"), (x.contiguous() for x in w.chunk(3, 1)))
        elif kind == "gate_up":
            yield from zip((f"{p}.gate", f"{p}.up"), (x.contiguous() for x in w.chunk(2, 1)))
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


def _variants(rank: int, world: int, tmp: str) -> dict[str, Callable[[], Iterator]]:
    from torch.distributed._state_dict_utils import _gather_state_dict

    from shardsync import LocalShard
    from shardsync.stream import full_params

    weights = W.full_weights()
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
        "shardsync shm, shards in shared memory": lambda: full_params(shared, W.MAPPING),
        "shardsync gloo": lambda: full_params(state, W.MAPPING, transport="backend"),
        "torch DCP _gather_state_dict": lambda: _map_full(_gather_state_dict(dstate)),
        "torch DCP save + dcp_to_torch_save": lambda: _dcp_files(dstate, rank, tmp),
        "naive all_gather": lambda: _naive(local, world),
    }


def _ceilings(ref: dict, world: int) -> dict[str, float]:
    buf = torch.ones(64 * MIB, dtype=torch.uint8)
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(buf, src=0)
        dist.barrier()
        best = min(best, time.perf_counter() - t0)
    receive = W.total_bytes(ref) * (world - 1) // world
    srcs = [
        torch.from_numpy(w).reshape(-1) if w.flags.c_contiguous else torch.from_numpy(w.copy()).reshape(-1)
        for w in ref.values()
    ]
    warm = [torch.empty_like(s) for s in srcs]
    copy = float("inf")
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        for d, s in zip(warm, srcs):
            d.copy_(s)
        dist.barrier()
        copy = min(copy, time.perf_counter() - t0)
    return {
        "ceiling: gloo broadcast of the received bytes": receive / (64 * MIB / best),
        "ceiling: memcpy of every target, both ranks at once": copy,
    }


def _worker(rank: int, world: int, store: str, out: str, repeats: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600)
    )
    ref = W.reference(W.full_weights())
    variants = _variants(rank, world, tmp)
    res: dict[str, float] = {name: float("inf") for name in variants}
    for rep in range(repeats + 1):  # round-robin; the first pass checks every target
        for name, make in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            n = _targets(make(), ref if rep == 0 else None)
            dist.barrier()
            if rep == 0 and n != (len(ref) if rank == 0 or "dcp_to" not in name else 0):
                raise AssertionError(f"{name}: {n} targets on rank {rank}")
            if rep > 0:
                res[name] = min(res[name], time.perf_counter() - t0)
    res |= _ceilings(ref, world)
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


def job_pair(repeats: int) -> dict[str, float]:
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # DCP's files on tmpfs: no disk in the timing
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=shm, prefix="bench-dcp-") as files:
        out = os.path.join(tmp, "res.json")
        mp.spawn(_worker, args=(2, os.path.join(tmp, "store"), out, repeats, files), nprocs=2)
        return json.loads(Path(out).read_text())


# -- Paddle (its own venv) --------------------------------------------------------------------------


def job_paddle(mode: str, repeats: int) -> dict[str, float]:
    script = HERE / "peers" / "paddle_full_param.py"
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res")
        args = [str(script), "--mode", mode, "--repeats", str(repeats + 1), "--out", out]
        if mode != "single":
            args = [
                "-m",
                "paddle.distributed.launch",
                "--nproc_per_node",
                "2",
                "--log_dir",
                os.path.join(tmp, "log"),
                *args,
            ]
        run = subprocess.run([str(PEERS_PY), *args], env=env, capture_output=True, text=True, timeout=600)
        if run.returncode != 0:
            logs = "".join(p.read_text()[-2000:] for p in Path(tmp).glob("log/workerlog.*"))
            raise RuntimeError(f"paddle {mode} failed:\n{run.stderr[-3000:]}\n{logs}")
        secs = [json.loads(Path(f"{out}.{r}").read_text())["seconds"] for r in range(1 if mode == "single" else 2)]
    best = min(max(per) for per in zip(*(s[1:] for s in secs)))  # slowest rank, best pass
    label = {
        "single": "Paddle full_param",
        "group": "Paddle full_param, single group",
        "mesh": "Paddle full_param, 2-D mesh (h_group, v_group)",
    }[mode]
    return {label: best}


# -- driver and report ------------------------------------------------------------------------------


def _run_job(name: str, repeats: int) -> dict[str, float]:
    """Each job in a fresh process: allocator state and caches never carry over."""
    if name.startswith("paddle"):
        return job_paddle(name.split("-")[1], repeats)
    cmd = [sys.executable, __file__, "--job", name, "--repeats", str(repeats)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        raise RuntimeError(f"job {name} failed:\n{run.stderr[-4000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


ONE = ["single-dropped", "single-never", "single-tuned", "paddle-single"]
TWO = ["pair", "paddle-group", "paddle-mesh"]

#: (row, world, what the ratio is against) - the order of the table.
ROWS = [
    ("dropped", 1),
    ("never", 1),
    ("tuned", 1),
    ("Paddle full_param", 1),
    ("memcpy warm", 1),
    ("memcpy fresh", 1),
    ("shardsync shm", 2),
    ("shardsync shm, shards in shared memory", 2),
    ("shardsync gloo", 2),
    ("Paddle full_param, single group", 2),
    ("Paddle full_param, 2-D mesh (h_group, v_group)", 2),
    ("torch DCP _gather_state_dict", 2),
    ("torch DCP save + dcp_to_torch_save", 2),
    ("naive all_gather", 2),
    ("ceiling: gloo broadcast of the received bytes", 2),
    ("ceiling: memcpy of every target, both ranks at once", 2),
]
LABELS = {
    "dropped": "shardsync (reuse='dropped', default)",
    "never": "shardsync (reuse='never')",
    "tuned": "shardsync (reuse='never', tune_allocator())",
    "memcpy warm": "ceiling: memcpy of every target into touched memory",
    "memcpy fresh": "memcpy of every target into fresh memory",
}


def _ratios(rounds: list[dict[str, float]], ours: str, other: str) -> float:
    return statistics.median(r[other] / r[ours] for r in rounds)


def report(rounds: list[dict[str, float]], doc: dict[str, Any]) -> str:
    ours = {1: "dropped", 2: "shardsync shm"}
    lines = [
        f"# shardsync vs peers ({doc['date']})",
        "",
        f"Workload: {doc['workload']}. Machine: {doc['machine']}; load average before / after: "
        f"{doc['load_before']} / {doc['load_after']}. {len(rounds)} interleaved rounds, each job "
        f"the best of {doc['repeats']} passes in a fresh process; seconds are medians over the "
        "rounds, ratios medians of per-round ratios (x = row's time / shardsync's: above 1, "
        "shardsync is faster; for a ceiling, how far shardsync is from it is 1 / x).",
        "",
        "| world | variant | s (median) | s (best) | x vs shardsync |",
        "|---|---|---|---|---|",
    ]
    for key, world in ROWS:
        if key not in rounds[0]:
            continue
        secs = [r[key] for r in rounds]
        x = _ratios(rounds, ours[world], key)
        lines.append(
            f"| {world} | {LABELS.get(key, key)} | {statistics.median(secs):.3f} | {min(secs):.3f} | {x:.2f} |"
        )
    lines += [
        "",
        "Targets (issue 11): >= 2.5x Paddle single-process, >= 4x Paddle's 2-D mesh path, within "
        "2x of the ceilings measured in the same run.",
        "",
    ]
    return "\n".join(lines) + "\n"


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.job:  # inside a job process: print one JSON line
        res = job_pair(args.repeats) if args.job == "pair" else job_single(args.job.split("-")[1], args.repeats)
        print(json.dumps(res))
        return res
    if not PEERS_PY.exists():
        raise SystemExit(f"{PEERS_PY} is missing: run `make bench-peers` (it creates the peers' venv)")
    doc: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "workload": f"{W.LAYERS} layers, hidden {W.HIDDEN}, ffn {W.FFN}, fp32, "
        f"{W.total_bytes(W.full_weights()) / 1e9:.3f} GB, TP=2",
        "repeats": args.repeats,
        "load_before": _load(),
    }
    jobs, rounds = ONE + TWO, []
    for k in range(args.rounds):
        res: dict[str, float] = {}
        for name in jobs[k % len(jobs) :] + jobs[: k % len(jobs)]:
            res |= _run_job(name, args.repeats)
        rounds.append(res)
        print(f"round {k}: " + ", ".join(f"{n} {s:.3f}" for n, s in res.items()), file=sys.stderr, flush=True)
    doc |= {"load_after": _load(), "rounds": rounds}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peers.json").write_text(json.dumps(doc, indent=1))
    text = report(rounds, doc)
    (args.out / "peers.md").write_text(text)
    sys.stdout.write(text)
    return doc


if __name__ == "__main__":
    main()
