"""How ``full_params`` scales: time against bytes and against world size, per strategy, with ceilings.

The peers workload (``bench/workload.py``: ``[in, out]`` weights, TP along dim 1 and dim 0, qkv and
gate_up split, ``o^T``) at 1, 2, 4 and 8 layers on 2 ranks (42 MB to 336 MB), and at 4 layers on 1, 2
and 4 ranks. In each configuration every variant runs ``--repeats`` times round-robin (best kept, the
slowest rank's time), every consumer receiving every target:

* shardsync through shared memory (``transport="auto"``; and with the shards moved to shared memory
  once, ``share_memory_()``, so that they are published in place), and through gloo with each
  strategy (``transport="backend"``: broadcast, bucketed, p2p, mesh2d on a 1 x world mesh);
* naive: all_gather every shard, concatenate, then map by hand;
* ceilings, measured in the same processes: the bytes each rank must receive over gloo's broadcast
  bandwidth (64 MiB), and every target's bytes copied once into touched memory on all ranks at once.

With one rank the only variant is the local copy. Every rank runs with torch's default threads
(nothing here sets them). Writes ``bench/results/scaling.json`` (``scaling_busy.json`` with ``--busy``:
next to another busy process, bench/busy.py); ``bench/plots.py`` draws the quiet one. The ranks share
this machine's cores: above 2 ranks on 2 cores the times include waiting for a core. Quick check:
``--configs 1x2 --repeats 1 --out /tmp/x``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
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
import busy  # noqa: E402
import workload as W  # noqa: E402
from bench_peers import _naive  # noqa: E402  (the same naive all_gather as the peers table)

__all__ = ["main", "CONFIGS"]

RESULTS = Path(__file__).parent / "results"
MIB = 1 << 20
#: (layers, world): the bytes axis at 2 ranks, the world axis at 4 layers.
CONFIGS = [(1, 2), (2, 2), (4, 2), (8, 2), (4, 1), (4, 4)]
STRATEGIES = ("broadcast", "bucketed", "p2p", "mesh2d")


def _state(layers: int, rank: int, world: int) -> tuple[dict, dict, dict]:
    from shardsync import LocalShard

    weights = W.full_weights(layers)
    parts = {k: W.local_shard(w, k, rank, world) for k, w in weights.items()}
    state = {k: LocalShard(torch.from_numpy(loc), weights[k].shape, off) for k, (loc, off) in parts.items()}
    return state, {k: torch.from_numpy(loc) for k, (loc, _) in parts.items()}, W.reference(weights)


def _variants(state: dict, local: dict, world: int) -> dict[str, Callable[[], Iterator]]:
    from shardsync import LocalShard
    from shardsync.stream import full_params

    if world == 1:
        return {"local": lambda: full_params(state, W.MAPPING)}
    shared = {k: LocalShard(v.local.clone().share_memory_(), v.global_shape, v.global_offset) for k, v in state.items()}
    out: dict[str, Callable[[], Iterator]] = {
        "shm": lambda: full_params(state, W.MAPPING),
        "shm, shards shared": lambda: full_params(shared, W.MAPPING),
    }
    for s in STRATEGIES:
        mesh = {"mesh": (dist.group.WORLD, None)} if s == "mesh2d" else {}
        out[s] = lambda s=s, mesh=mesh: full_params(state, W.MAPPING, strategy=s, transport="backend", **mesh)
    out["naive all_gather"] = lambda: _naive(local, world)
    return out


def _sync() -> None:
    if dist.is_initialized():
        dist.barrier()


def _time(make: Callable[[], Iterator], ref: dict | None) -> float:
    _sync()
    t0 = time.perf_counter()
    for name, t in make():
        if ref is not None and not torch.equal(t, torch.from_numpy(ref[name])):
            raise AssertionError(f"{name} differs from the reference")
    _sync()
    return time.perf_counter() - t0


def _ceilings(ref: dict, world: int) -> dict[str, float]:
    srcs = [torch.from_numpy(w if w.flags.c_contiguous else w.copy()).reshape(-1) for w in ref.values()]
    warm = [torch.empty_like(s) for s in srcs]
    copy = min(_time(lambda: iter([d.copy_(s) for d, s in zip(warm, srcs)] and ()), None) for _ in range(3))
    out = {"ceiling: memcpy": copy}
    if world > 1:
        buf = torch.ones(64 * MIB, dtype=torch.uint8)
        bcast = min(_time(lambda: iter([dist.broadcast(buf, src=0)] and ()), None) for _ in range(3))
        out["ceiling: gloo broadcast"] = W.total_bytes(ref) * (world - 1) / world / (64 * MIB / bcast)
    return out


def _run(layers: int, world: int, rank: int, repeats: int) -> dict[str, float]:
    state, local, ref = _state(layers, rank, world)
    variants = _variants(state, local, world)
    res = {name: float("inf") for name in variants}
    for rep in range(repeats + 1):  # the first pass checks every target
        for name, make in variants.items():
            secs = _time(make, ref if rep == 0 else None)
            res[name] = min(res[name], secs) if rep else res[name]
    return res | _ceilings(ref, world)


def _worker(rank: int, world: int, layers: int, repeats: int, store: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600)
    )
    res = _run(layers, world, rank, repeats)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:  # the slowest rank's time of every variant
        Path(out).write_text(json.dumps({k: max(r[k] for r in gathered) for k in res}))
    dist.destroy_process_group()


def measure(layers: int, world: int, repeats: int) -> dict[str, float]:
    """One configuration, in fresh processes."""
    if world == 1:
        return _run(layers, 1, 0, repeats)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res.json")
        mp.spawn(_worker, args=(world, layers, repeats, os.path.join(tmp, "store"), out), nprocs=world)
        return json.loads(Path(out).read_text())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument(
        "--configs",
        type=lambda s: [tuple(int(x) for x in c.split("x")) for c in s.split(",")],
        default=CONFIGS,
        help="LAYERSxWORLD, comma-separated (default: " + ",".join(f"{x}x{y}" for x, y in CONFIGS) + ")",
    )
    busy.add_flag(ap)
    args = ap.parse_args(argv)
    doc: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "repeats": args.repeats,
        "configs": [],
    }
    with busy.run(args.busy) as conditions:
        doc["conditions"] = conditions
        for layers, world in args.configs:
            res = measure(layers, world, args.repeats)
            doc["configs"].append(
                {"layers": layers, "world": world, "bytes": W.total_bytes(W.full_weights(layers)), "seconds": res}
            )
            print(f"{layers} layers, {world} ranks: " + ", ".join(f"{k} {v:.3f}" for k, v in res.items()), flush=True)
    doc["load_after"] = os.getloadavg()[0]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{busy.stem('scaling', args.busy)}.json").write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
