"""Benchmark: the cost per tensor of a repeated stream of many small tensors (MoE experts, unfused).

A model with many experts stored one tensor per expert and weight has thousands of small tensors;
moving them is bound by what each tensor costs, not by bytes. Two spawned gloo ranks each hold half of
every tensor (rows, ``shard_dim(..., 0)``) of ``n`` expert weights of ``[64, 32]`` fp32 (8 KiB), and
every rank receives every full tensor, the same call repeated as a training loop repeats its sync:

* ``shardsync``: ``full_params(state)`` (``transport="auto"``: shared memory on one host), and through
  gloo (``transport="backend"``);
* ``torch DTensor full_tensor()``: each tensor a DTensor ``Shard(0)`` on a 1-D gloo mesh, gathered one
  by one - what a torch user writes;
* ``one all_gather of every shard``: each rank packs all its shards into one buffer, one gloo
  ``all_gather``, then every full tensor is cut and concatenated from the gathered buffers - a
  hand-written floor for one collective (no mapping, no checks);

and the same full tensors in one process (the parent, before the ranks start), where no transport
runs and what is left is shardsync's own work per tensor:

* ``1 process: shardsync full_params``: ``full_params(full)`` (each tensor copied once);
* ``1 process: clone() of every tensor``: the floor for the same copies;

each at ``n`` = 1024 and 4096 tensors, ``--repeats`` interleaved rounds of one pass each after a
warm-up pass (seconds: the slowest rank's; medians over the rounds). shardsync is also timed with
Python's cyclic GC off (``gc.disable()`` around the pass) to show what full collections of the
heap add at this many objects. Every rank runs with torch's default threads (nothing here sets
them). Run: ``.venv/bin/python bench/bench_targets.py`` (``--counts 1024 --repeats 3 --out /tmp/x``:
a quick check); ``--busy`` measures next to another busy process (bench/busy.py). Writes
``bench/results/targets.{json,md}`` (``targets_busy.*`` with ``--busy``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardsync.layout import shard_dim
from shardsync.stream import full_params

sys.path.insert(0, str(Path(__file__).parent))
import busy  # noqa: E402

__all__ = ["main", "model"]

RESULTS = Path(__file__).parent / "results"
ROWS, COLS = 64, 32
SHARDSYNC = "shardsync (shared memory)"
ONE = "1 process: shardsync full_params"


def model(n: int) -> dict[str, torch.Tensor]:
    """``n`` expert weights, each ``[ROWS, COLS]`` fp32 filled with distinct values."""
    per = ROWS * COLS
    return {
        f"layers.{i // 64}.experts.{i % 64}.w{i % 3}": torch.arange(i * per, (i + 1) * per, dtype=torch.float32).view(
            ROWS, COLS
        )
        for i in range(n)
    }


def _dtensors(full: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    return {k: DTensor.from_local(shard_dim(v, 0, rank, world).local, mesh, [Shard(0)]) for k, v in full.items()}


def _one_all_gather(state: dict, world: int) -> Iterator[tuple[str, torch.Tensor]]:
    keys = sorted(state)
    mine = torch.cat([state[k].local.reshape(-1) for k in keys])
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    sizes = [state[k].local.numel() for k in keys]
    split = [p.split(sizes) for p in parts]
    for j, k in enumerate(keys):
        yield k, torch.cat([s[j].view(-1, COLS) for s in split])


def _variants(full: dict, state: dict, dts: dict, world: int) -> dict[str, Callable[[], Iterator]]:
    return {
        SHARDSYNC: lambda: iter(full_params(state)),
        "shardsync (gloo)": lambda: iter(full_params(state, transport="backend")),
        "torch DTensor full_tensor()": lambda: ((k, v.full_tensor()) for k, v in dts.items()),
        "one all_gather of every shard": lambda: _one_all_gather(state, world),
    }


def _barrier() -> None:
    if dist.is_initialized():  # the ranks' passes; the one-process ones run before the ranks start
        dist.barrier()


def _pass(make: Callable[[], Iterator], ref: dict | None, no_gc: bool = False) -> float:
    _barrier()
    enabled = gc.isenabled()
    if no_gc:
        gc.disable()
    t0 = time.perf_counter()
    try:
        n = 0
        for name, t in make():
            if ref is not None and not torch.equal(t, ref[name]):
                raise AssertionError(f"{name} differs from the reference")
            n += 1
    finally:
        if no_gc and enabled:
            gc.enable()
    _barrier()
    if ref is not None and n != len(ref):
        raise AssertionError(f"{n} targets, not {len(ref)}")
    return time.perf_counter() - t0


def _single(counts: list[int], repeats: int) -> dict[str, dict[str, list[float]]]:
    """Seconds of each one-process variant, by ``n`` and name: a checked warm-up pass, then
    ``repeats`` interleaved rounds."""
    res = {}
    for n in counts:
        full = model(n)
        makers: dict[str, Callable[[], Iterator]] = {
            ONE: lambda full=full: iter(full_params(full)),
            "1 process: clone() of every tensor": lambda full=full: ((k, v.clone()) for k, v in full.items()),
        }
        for make in makers.values():  # warm-up, checking every tensor
            _pass(make, full)
        times: dict[str, list[float]] = {name: [] for name in makers}
        for _ in range(repeats):
            for name, make in makers.items():
                times[name].append(_pass(make, None))
        res[str(n)] = times
    return res


def worker(rank: int, world: int, counts: list[int], repeats: int, store: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600)
    )
    res: dict[str, Any] = {"threads": busy.threads()}
    for n in counts:
        full = model(n)
        state = {k: shard_dim(v, 0, rank, world) for k, v in full.items()}
        makers = _variants(full, state, _dtensors(full, rank, world), world)
        for make in makers.values():  # warm-up, checking every tensor
            _pass(make, full)
        _pass(makers[SHARDSYNC], full, no_gc=True)
        times: dict[str, list[float]] = {name: [] for name in (*makers, f"{SHARDSYNC}, GC off")}
        for _ in range(repeats):
            for name, make in makers.items():
                times[name].append(_pass(make, None))
            times[f"{SHARDSYNC}, GC off"].append(_pass(makers[SHARDSYNC], None, no_gc=True))
        res[str(n)] = times
    torch.save(res, os.path.join(out, f"{rank}.pt"))
    dist.destroy_process_group()


def report(per_rank: list[dict], counts: list[int], single: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    rows = []
    for n in counts:
        names = list(per_rank[0][str(n)])
        # per round: the slowest rank's time
        ranks = {k: [max(times) for times in zip(*(r[str(n)][k] for r in per_rank))] for k in names}
        one = single[str(n)]  # the one-process rows, against the one-process shardsync
        for k, times in (ranks | one).items():
            ours = one[ONE] if k in one else ranks[SHARDSYNC]
            rows.append(
                {
                    "tensors": n,
                    "variant": k,
                    "seconds": statistics.median(times),
                    "range": [min(times), max(times)],
                    "us_per_tensor": statistics.median(times) / n * 1e6,
                    "x_vs_shardsync": statistics.median([a / b for a, b in zip(times, ours)]),
                }
            )
    return rows


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        f"# Many small tensors: cost per tensor of a repeated stream ({doc['date']})",
        "",
        f"2 spawned gloo ranks on {doc['cpus']} CPUs ({doc['host']}), torch {doc['torch']}; every tensor "
        f"`[{ROWS}, {COLS}]` fp32 in two row shards, every rank receives every full tensor. Conditions: "
        f"{doc['conditions']}; the ranks: {doc['rank_threads']}. {doc['repeats']} interleaved rounds after "
        "a checked warm-up pass; seconds are medians over the rounds (the slowest rank's), ranges over "
        "the rounds; x = the row's time / shardsync's, median of the per-round ratios (above 1: shardsync "
        'is faster). The rows "1 process": the same full tensors in the parent process (no ranks), '
        "x against the one-process shardsync row.",
        "",
        "| tensors | variant | s (median) | s (range) | us per tensor | x vs shardsync |",
        "|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        lo, hi = r["range"]
        lines.append(
            f"| {r['tensors']} | {r['variant']} | {r['seconds']:.3f} | {lo:.3f}-{hi:.3f} | "
            f"{r['us_per_tensor']:.0f} | {r['x_vs_shardsync']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(RESULTS))
    busy.add_flag(parser)
    args = parser.parse_args(argv)
    with busy.run(args.busy) as conditions, tempfile.TemporaryDirectory() as tmp:
        single = _single(args.counts, args.repeats)
        mp.spawn(worker, args=(2, args.counts, args.repeats, os.path.join(tmp, "store"), tmp), nprocs=2)
        per_rank = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(2)]
    doc = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "conditions": conditions,
        "rank_threads": per_rank[0]["threads"],
        "repeats": args.repeats,
        "rows": report(per_rank, args.counts, single),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = busy.stem("targets", args.busy)
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    (out / f"{stem}.md").write_text(markdown(doc))
    print(markdown(doc))
    return doc


if __name__ == "__main__":
    main()
