"""Benchmark: coalesced replica sync against one collective per tensor (Paddle's approach), on gloo.

A model of ``--layers`` blocks with two LayerNorms each (4 replicated tensors per block: 200 by
default) in bf16, fp32 masters held by AdamW, Adam moments present. For each scenario, both methods
run in the same processes, alternating, and the per-step time is the slowest rank's, best of
``--rounds``. Collectives are counted by wrapping ``dist.broadcast`` / ``dist.all_reduce``.

Every rank runs with torch's default threads (nothing here sets them). Run: ``python
bench/bench_replicas.py`` (defaults ``--world 2 4 --steps 10 --rounds 2``; about 6 minutes on 2 cores,
world 4 oversubscribed; ``--world 2 --layers 2 --steps 1 --rounds 1 --out /tmp/x`` for a quick check);
``--busy`` measures next to another busy process (bench/busy.py). Writes
``bench/results/replicas.json`` and ``.md`` (``replicas_busy.*`` with ``--busy``).
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
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import busy  # noqa: E402
from shardsync.replicas import ReplicaSync  # noqa: E402

__all__ = ["main"]

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

#: name -> (description, ReplicaSync kwargs, phase, per-tensor kinds, per-tensor mode)
SCENARIOS: dict[str, tuple[str, dict[str, Any], str, tuple[str, ...], str]] = {
    "params_broadcast": (
        "param + fp32 master, broadcast (Paddle's default)",
        {"params": "broadcast", "optimizer_states": ()},
        "params",
        ("param", "master"),
        "broadcast",
    ),
    "grads_mean": ("grads, mean (SUM then divide)", {"params": None, "grads": "mean"}, "grads", ("grad",), "mean"),
    "repair_broadcast": (
        "param + master + exp_avg + exp_avg_sq, broadcast",
        {"params": "broadcast"},
        "params",
        ("param", "master", "exp_avg", "exp_avg_sq"),
        "broadcast",
    ),
    "repair_mean": (
        "master + exp_avg + exp_avg_sq mean, param re-derived (per tensor: param too)",
        {"params": "mean"},
        "params",
        ("param", "master", "exp_avg", "exp_avg_sq"),
        "mean",
    ),
}


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.ln_2 = nn.LayerNorm(hidden)


def _setup(layers: int, hidden: int) -> tuple[nn.Module, dict, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.ModuleList(Block(hidden) for _ in range(layers)).to(torch.bfloat16)
    masters = {p: p.detach().float().clone().requires_grad_(True) for p in model.parameters()}
    opt = torch.optim.AdamW(list(masters.values()), lr=1e-3)
    for m in masters.values():
        m.grad = torch.ones_like(m)
    opt.step()  # creates the moments
    return model, masters, opt


def _per_tensor(tensors: list[torch.Tensor], mode: str, world: int) -> Callable[[], None]:
    """Paddle's approach: one broadcast, or one all_reduce SUM + scale, per tensor."""

    def run() -> None:
        for t in tensors:
            if mode == "broadcast":
                dist.broadcast(t, src=0)
            else:
                dist.all_reduce(t)
                t.div_(world)

    return run


def _tensors(model: nn.Module, masters: dict, opt: Any, kinds: tuple[str, ...]) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        m = masters[p]
        pick = {
            "param": p.data,
            "master": m.data,
            "grad": m.grad,
            "exp_avg": opt.state[m]["exp_avg"],
            "exp_avg_sq": opt.state[m]["exp_avg_sq"],
        }
        out += [pick[k] for k in kinds]
    return out


def _count(fn: Callable[[], None]) -> int:
    calls = []
    real = {n: getattr(dist, n) for n in ("broadcast", "all_reduce")}
    for n, f in real.items():
        setattr(dist, n, lambda *a, _f=f, **k: (calls.append(1), _f(*a, **k))[1])
    try:
        fn()
    finally:
        for n, f in real.items():
            setattr(dist, n, f)
    return len(calls)


def _time(fn: Callable[[], None], steps: int) -> float:
    """Seconds per step, the slowest rank's."""
    for _ in range(2):
        fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    dist.barrier()
    elapsed = torch.tensor([(time.perf_counter() - t0) / steps], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _scenario(name: str, layers: int, hidden: int, steps: int, rounds: int, world: int) -> dict:
    desc, kwargs, phase, kinds, mode = SCENARIOS[name]
    model, masters, opt = _setup(layers, hidden)
    sync = ReplicaSync(model, opt, master_params=masters, **kwargs)
    coalesced = sync.sync_grads if phase == "grads" else sync.sync_params
    coalesced()  # fixes the optimizer-state layout (one all_gather_object, once)
    baseline = _per_tensor(_tensors(model, masters, opt, kinds), mode, world)
    counts = (_count(baseline), _count(coalesced))
    best = [float("inf"), float("inf")]
    for _ in range(rounds):  # alternate, keep the best round of each
        best[0] = min(best[0], _time(baseline, steps))
        best[1] = min(best[1], _time(coalesced, steps))
    plan = sync.plan()
    base_bytes = sum(t.numel() * t.element_size() for t in _tensors(model, masters, opt, kinds))
    return {
        "world": world,
        "scenario": name,
        "description": desc,
        "tensors": len(sync.selection),
        "per_tensor": {"collectives": counts[0], "ms_per_step": best[0] * 1e3, "bytes": base_bytes},
        "coalesced": {
            "collectives": counts[1],
            "ms_per_step": best[1] * 1e3,
            "bytes": plan.nbytes if phase == "params" else plan.phases[0].nbytes,
            "buckets": plan.collectives_per_step,
        },
        "collective_ratio": counts[0] / counts[1],
        "time_ratio": best[0] / best[1],
    }


def _adamw_ms(layers: int, hidden: int, steps: int) -> float:
    """Context: one AdamW step over the same replicated tensors (the work the sync follows)."""
    _, _, opt = _setup(layers, hidden)
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - t0) / steps * 1e3


def _rank(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    try:
        rows = [_scenario(name, args.layers, args.hidden, args.steps, args.rounds, world) for name in SCENARIOS]
        if rank == 0:
            with open(out, "w") as fh:
                adamw = _adamw_ms(args.layers, args.hidden, args.steps)
                json.dump({"rows": rows, "adamw_ms": adamw, "threads": torch.get_num_threads()}, fh)
    finally:
        dist.destroy_process_group()


def _run_world(world: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(_rank, args=(world, os.path.join(tmp, "store"), args, out), nprocs=world)
        with open(out) as fh:
            return json.load(fh)


def _markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [
        f"# Replica sync benchmark ({cfg['date']})",
        "",
        f"{cfg['tensors']} replicated tensors ({cfg['layers']} blocks x 2 LayerNorms x "
        f"(weight, bias), hidden {cfg['hidden']}, bf16 params, fp32 masters and Adam moments), "
        f"gloo on CPU, {cfg['cpus']} CPU(s), torch {cfg['torch']}; best of {cfg['rounds']} "
        f"rounds of {cfg['steps']} steps, slowest rank. Conditions: {cfg['conditions']}; torch threads in "
        f"every rank: {cfg['rank_threads']}.",
        "",
        "| world | scenario | collectives per step: per tensor / coalesced (ratio) | "
        "ms per step: per tensor / coalesced (ratio) | bytes per step |",
        "|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['world']} | {r['scenario']} | {r['per_tensor']['collectives']} / "
            f"{r['coalesced']['collectives']} ({r['collective_ratio']:.0f}x) | "
            f"{r['per_tensor']['ms_per_step']:.2f} / {r['coalesced']['ms_per_step']:.2f} "
            f"({r['time_ratio']:.1f}x) | {r['coalesced']['bytes']} |"
        )
    lines += [
        "",
        "Scenarios: " + "; ".join(f"`{k}`: {v[0]}" for k, v in SCENARIOS.items()) + ".",
        "",
        f"Context: one AdamW step over these tensors takes {result['adamw_ms']:.2f} ms on one rank.",
        "",
        f"Targets (>= 5x fewer collectives, >= 3x less time): "
        f"{'met' if result['targets_met'] else 'NOT met'} in every row.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=RESULTS, help="the results' folder")
    busy.add_flag(parser)
    args = parser.parse_args(argv)
    rows, adamw, threads = [], 0.0, set()
    with busy.run(args.busy) as conditions:
        for world in args.world:
            got = _run_world(world, args)
            rows += got["rows"]
            adamw = got["adamw_ms"]
            threads.add(got["threads"])
            for r in got["rows"]:
                print(
                    f"world {world} {r['scenario']:<17} collectives {r['per_tensor']['collectives']:>4} -> "
                    f"{r['coalesced']['collectives']:<2} ({r['collective_ratio']:>5.0f}x)   ms/step "
                    f"{r['per_tensor']['ms_per_step']:8.2f} -> {r['coalesced']['ms_per_step']:7.2f} "
                    f"({r['time_ratio']:5.1f}x)",
                    flush=True,
                )
    met = all(r["collective_ratio"] >= 5 and r["time_ratio"] >= 3 for r in rows)
    result = {
        "config": {
            "date": datetime.date.today().isoformat(),
            "layers": args.layers,
            "hidden": args.hidden,
            "tensors": 4 * args.layers,
            "steps": args.steps,
            "rounds": args.rounds,
            "worlds": args.world,
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "conditions": conditions,
            "rank_threads": ", ".join(map(str, sorted(threads))),
        },
        "rows": rows,
        "adamw_ms": adamw,
        "targets_met": met,
    }
    name = os.path.join(args.out, busy.stem("replicas", args.busy))
    os.makedirs(args.out, exist_ok=True)
    with open(f"{name}.json", "w") as fh:
        json.dump(result, fh, indent=2)
    with open(f"{name}.md", "w") as fh:
        fh.write(_markdown(result))
    print(
        f"targets (>= 5x fewer collectives, >= 3x less time): {'met' if met else 'NOT met'}; wrote {name}.json and .md"
    )
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
