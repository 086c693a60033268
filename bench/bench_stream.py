"""Benchmark: full_params strategies on a 0.3 GB synthetic state, TP=2 over 2 gloo processes.

Each strategy is timed against

* a naive baseline: all_gather every shard to every rank, then cut the full tensors out; and
* the ceiling: the bytes each rank must receive divided by the gloo broadcast bandwidth measured in the
  same run (64 MiB broadcast, best of 3).

Every variant is run ``--repeats`` times, round-robin with the others (best time kept); its output is
checked against the unsharded reference once, and its peak memory (``stats.peak_bytes``) is reported.
Two shapes: ``llama`` (the main case: 6 layers, hidden 1024) and ``wide`` (2 layers, hidden 2048: fewer,
larger tensors). Results go to ``bench/results/stream.json`` and ``stream.md``.

Both ranks run with torch's default threads (nothing here sets them). Run: ``.venv/bin/python
bench/bench_stream.py`` (about a minute on 2 cores; ``--shapes wide --thp '' --repeats 1 --out /tmp/x``
for a quick check); ``--busy`` measures next to another busy process (bench/busy.py) and writes
``stream_busy.{json,md}``.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardsync.layout import shard_dim
from shardsync.stream import full_params

sys.path.insert(0, str(Path(__file__).parent))
import busy  # noqa: E402

__all__ = ["main", "build_model", "naive", "Shape", "SHAPES"]

RESULTS = Path(__file__).parent / "results"
MIB = 1 << 20


def build_model(layers: int, hidden: int, ffn: int) -> dict[str, tuple[torch.Tensor, int | None]]:
    """Full tensors of a Llama-style stack and the dim each is sharded on (None: replicated)."""
    g = torch.Generator().manual_seed(0)
    out: dict[str, tuple[torch.Tensor, int | None]] = {}
    for i in range(layers):
        p = f"layers.{i}"
        for name in ("q", "k", "v"):
            out[f"{p}.attn.{name}.weight"] = (torch.randn(hidden, hidden, generator=g), 0)
        out[f"{p}.attn.o.weight"] = (torch.randn(hidden, hidden, generator=g), 1)
        out[f"{p}.mlp.gate.weight"] = (torch.randn(ffn, hidden, generator=g), 0)
        out[f"{p}.mlp.up.weight"] = (torch.randn(ffn, hidden, generator=g), 0)
        out[f"{p}.mlp.down.weight"] = (torch.randn(hidden, ffn, generator=g), 1)
        out[f"{p}.input_norm.weight"] = (torch.randn(hidden, generator=g), None)
        out[f"{p}.post_norm.weight"] = (torch.randn(hidden, generator=g), None)
    return out


def naive(model: dict, state: dict, world: int) -> Iterator[tuple[str, torch.Tensor]]:
    """all_gather every shard (replicated tensors too) to every rank, then cut the full tensor."""
    for key in sorted(state):
        local = state[key].local if hasattr(state[key], "local") else state[key]
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous())
        dim = model[key][1]
        yield key, parts[0] if dim is None else torch.cat(parts, dim)


def local_clone(model: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Not a strategy: every full tensor cloned locally, no communication - the cost of producing the
    targets' fresh memory alone, a floor under every variant."""
    for key in sorted(model):
        yield key, model[key][0].clone()


def wire_only(model: dict, state: dict, world: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Not a strategy: each shard broadcast once from its owner into a reused buffer, nothing
    assembled or yielded - what gloo alone takes to move the same messages as per-read broadcast."""
    scratch = torch.empty(max(x.nbytes for x, _ in model.values()), dtype=torch.uint8)
    mine = [
        state[k].local.contiguous().reshape(-1).view(torch.uint8)  # packed before the clock starts
        for k in sorted(state)
        if model[k][1] is not None
    ]

    def run() -> Iterator[tuple[str, torch.Tensor]]:
        for buf in mine:
            for src in range(world):
                dist.broadcast(buf if src == dist.get_rank() else scratch[: buf.numel()], src=src)
        yield from ()

    return run()


def bandwidth(nbytes: int, op: str, world: int) -> float:
    """Best-of-3 seconds of one gloo broadcast (or all_gather) moving ``nbytes`` to every rank."""
    buf = torch.ones(nbytes, dtype=torch.uint8)
    parts = [torch.empty(nbytes // world, dtype=torch.uint8) for _ in range(world)]
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        if op == "broadcast":
            dist.broadcast(buf, src=0)
        else:
            dist.all_gather(parts, buf[: nbytes // world])
        dist.barrier()
        best = min(best, time.perf_counter() - t0)
    return best


def timed(make: Callable[[], Any], check: Callable[[str, torch.Tensor], None] | None) -> dict[str, Any]:
    """Run one variant once (checking every tensor if ``check``); seconds are the slowest rank's."""
    stream = make()
    dist.barrier()
    t0 = time.perf_counter()
    got = 0
    for name, tensor in stream:
        if check is not None:
            check(name, tensor)
        got += tensor.nbytes
    dist.barrier()
    rec: dict[str, Any] = {"seconds": time.perf_counter() - t0, "bytes_yielded": got}
    stats = getattr(stream, "stats", None)
    if stats is not None:
        plan = stream.plan
        rec |= {
            "peak_bytes": stats.peak_bytes,
            "collectives": stats.collectives,
            "bytes_received": stats.bytes_received,
            "bytes_sent": stats.bytes_sent,
            "plan_seconds": stats.plan_seconds,
            "plan_peak_bytes": plan.costs.peak_bytes[dist.get_rank()],
            "strategy": plan.strategy,
            "bucket_bytes": plan.bucket_bytes,
        }
    return rec


def variants(model: dict, state: dict, world: int, budget: int) -> dict[str, Callable[[], Any]]:
    return {
        "floor: local clone, no communication": lambda: local_clone(model),
        "floor: gloo broadcasts only, no assembly": lambda: wire_only(model, state, world),
        "naive all_gather": lambda: naive(model, state, world),
        "broadcast": lambda: full_params(state, strategy="broadcast", transport="backend"),
        "bucketed": lambda: full_params(state, strategy="bucketed", transport="backend"),
        "p2p (all ranks)": lambda: full_params(state, strategy="p2p", transport="backend"),
        "mesh2d (1x2)": lambda: full_params(state, strategy="mesh2d", mesh=(dist.group.WORLD, None)),
        "auto, transport='backend'": lambda: full_params(state, transport="backend"),
        "auto (shared memory)": lambda: full_params(state),
        f"auto, memory_budget={budget / MIB:.1f} MiB": lambda: full_params(state, memory_budget=budget),
        "consumers=0 (p2p)": lambda: full_params(state, consumers=0, transport="backend"),
        "consumers=0 (shared memory)": lambda: full_params(state, consumers=0),
    }


@dataclass(frozen=True)
class Shape:
    """A synthetic model: Llama-style layers of fp32 weights."""

    name: str
    layers: int
    hidden: int
    ffn: int


SHAPES = {"llama": Shape("llama", 6, 1024, 2816), "wide": Shape("wide", 2, 2048, 4096)}


def worker(rank: int, world: int, shape: Shape, args: argparse.Namespace, store: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600)
    )
    model = build_model(shape.layers, shape.hidden, shape.ffn)
    state = {k: (x if d is None else shard_dim(x, d, rank, world)) for k, (x, d) in model.items()}

    def check(name: str, tensor: torch.Tensor) -> None:
        if not torch.equal(tensor, model[name][0]):
            raise AssertionError(f"rank {rank}: {name} differs from the reference")

    # Repeats go round-robin over the variants (best time kept), so that load from other processes
    # on the machine hits every variant alike; the first round also checks every tensor.
    budget = int(args.budget_factor * max(x.nbytes for x, _ in model.values()))
    makers = variants(model, state, world, budget)
    res: dict[str, Any] = {name: {"seconds": float("inf")} for name in makers}
    bcast = gather = float("inf")
    for rep in range(args.repeats):
        bcast = min(bcast, bandwidth(64 * MIB, "broadcast", world))
        gather = min(gather, bandwidth(64 * MIB, "all_gather", world))
        for name, make in makers.items():
            rec = timed(make, check if rep == 0 else None)
            if rec["seconds"] < res[name]["seconds"]:
                res[name] = rec
    res |= {
        "threads": torch.get_num_threads(),
        "broadcast_64MiB_s": bcast,
        "all_gather_64MiB_s": gather,
        "total_bytes": sum(x.nbytes for x, _ in model.values()),
        "own_bytes": sum(
            x.nbytes if d is None else shard_dim(x, d, rank, world).local.nbytes for x, d in model.values()
        ),
    }
    torch.save(res, os.path.join(out, f"{rank}.pt"))
    dist.destroy_process_group()


def report(shape: Shape, per_rank: list[dict], args: argparse.Namespace) -> dict[str, Any]:
    r0 = per_rank[0]
    bw = 64 * MIB / max(r["broadcast_64MiB_s"] for r in per_rank)
    total = r0["total_bytes"]
    must = {"all": [total - r["own_bytes"] for r in per_rank], "one": [total - r0["own_bytes"], 0]}
    base = max(r["naive all_gather"]["seconds"] for r in per_rank)
    rows = []
    for name in (k for k, v in r0.items() if isinstance(v, dict)):
        secs = max(r[name]["seconds"] for r in per_rank)
        need = must["one" if name.startswith("consumers") else "all"]
        rows.append(
            {
                "variant": name,
                "strategy": r0[name].get("strategy"),
                "seconds": secs,
                "GB_per_s": total / secs / 1e9,
                "speedup_vs_naive": base / secs,
                "ceiling_seconds": max(need) / bw,
                "x_ceiling": secs / (max(need) / bw),
                "serial_wire_seconds": sum(need) / bw,
                "x_serial_wire": secs / (sum(need) / bw),
                "plan_seconds": max(r[name].get("plan_seconds", 0.0) for r in per_rank),
                "peak_MiB": max(r[name].get("peak_bytes", 0) for r in per_rank) / MIB,
                "plan_peak_MiB": max(r[name].get("plan_peak_bytes", 0) for r in per_rank) / MIB,
                "collectives": r0[name].get("collectives"),
            }
        )
    return {
        "shape": shape.__dict__,
        "total_bytes": total,
        "broadcast_GBps": bw / 1e9,
        "all_gather_GBps": 64 * MIB / max(r["all_gather_64MiB_s"] for r in per_rank) / 1e9,
        "rank_threads": sorted({r["threads"] for r in per_rank}),
        "rows": rows,
    }


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        f"# full_params benchmark ({doc['date']})",
        "",
        f"TP=2 over 2 gloo processes on {doc['cpus']} CPUs ({doc['host']}), torch {doc['torch']}, "
        f"best of {doc['repeats']} interleaved runs; the memory budget run allows "
        f"{doc['budget_factor']}x the largest target. Conditions: {doc['conditions']}; torch threads "
        f"in the ranks: {sorted({t for c in doc['configs'] for t in c['rank_threads']})}.",
        "",
    ]
    for res in doc["configs"]:
        sh = res["shape"]
        thp = ", with transparent huge pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1)" if res["thp"] else ""
        lines += [
            f"## {sh['name']}{thp}: {res['total_bytes'] / 1e9:.3f} GB fp32, {sh['layers']} layers, "
            f"hidden {sh['hidden']}, ffn {sh['ffn']}",
            "",
            f"gloo bandwidth in this run (64 MiB): broadcast {res['broadcast_GBps']:.2f} GB/s, "
            f"all_gather {res['all_gather_GBps']:.2f} GB/s "
            f"({res['broadcast_GBps'] / res['all_gather_GBps']:.1f}x slower).",
            "",
            "| variant | strategy | s | GB/s | vs naive | x ceiling | x serial wire | plan s | "
            "peak MiB (plan) | collectives |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in res["rows"]:
            calls = r["collectives"] if r["collectives"] is not None else "-"
            lines.append(
                f"| {r['variant']} | {r['strategy'] or '-'} | {r['seconds']:.3f} | "
                f"{r['GB_per_s']:.2f} | {r['speedup_vs_naive']:.1f}x | {r['x_ceiling']:.2f} | "
                f"{r['x_serial_wire']:.2f} | {r['plan_seconds']:.3f} | {r['peak_MiB']:.0f} "
                f"({r['plan_peak_MiB']:.0f}) | {calls} |"
            )
        lines.append("")
    lines += [
        "s: slowest rank, planning included. GB/s: full-tensor bytes yielded per rank per second. "
        "x ceiling: s over (bytes the busiest rank must receive / broadcast bandwidth). x serial "
        "wire: s over (bytes all ranks must receive / broadcast bandwidth) - what the transfers "
        "alone take when gloo's broadcasts run one after another, as they do here."
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="llama,wide", help=f"comma-separated, of {sorted(SHAPES)}")
    ap.add_argument(
        "--thp",
        default="llama",
        help="shapes to run again with glibc's transparent huge "
        "pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1); empty for none",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--budget-factor",
        type=float,
        default=1.5,
        help="memory budget of the budget run, in multiples of the largest target",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    busy.add_flag(ap)
    args = ap.parse_args(argv)
    doc: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "world": 2,
        "repeats": args.repeats,
        "budget_factor": args.budget_factor,
        "configs": [],
    }
    runs = [(name, False) for name in args.shapes.split(",")]
    runs += [(name, True) for name in args.thp.split(",") if name]
    with busy.run(args.busy) as conditions:
        doc["conditions"] = conditions
        for name, thp in runs:
            _run_shape(doc, args, name, thp)
    stem = busy.stem("stream", args.busy)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    (args.out / f"{stem}.md").write_text(markdown(doc))
    sys.stdout.write(markdown(doc))
    return doc


def _run_shape(doc: dict[str, Any], args: argparse.Namespace, name: str, thp: bool) -> None:
    """One shape on two spawned ranks (with transparent huge pages when ``thp``), added to ``doc``."""
    env = os.environ.get("GLIBC_TUNABLES")
    if thp:  # read by glibc when the spawned workers start
        os.environ["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(worker, args=(2, SHAPES[name], args, os.path.join(tmp, "store"), tmp), nprocs=2)
            per_rank = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(2)]
    finally:
        os.environ.pop("GLIBC_TUNABLES", None)
        if env is not None:
            os.environ["GLIBC_TUNABLES"] = env
    doc["configs"].append(report(SHAPES[name], per_rank, args) | {"thp": thp})


if __name__ == "__main__":
    main()
