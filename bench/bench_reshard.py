"""Benchmark: reshard trainer weights into inference workers, on 4 gloo processes.

Ranks 0-1 train: a Llama-style stack in Megatron form (fused QKV with GQA, fused gate/up), TP=2.
Ranks 2-3 serve: the same model in HF form (separate q/k/v, gate, up), TP=2 with a different cut, so
that each inference shard is assembled from pieces of both trainers' shards. Two cuts:

* ``transposed``: every matrix is cut along the other dim than in training (the embeddings by
  columns): each piece is a strided region on one side, so every byte is copied once (packed by the
  sender, or unpacked by the receiver) besides travelling;
* ``shifted``: the same dims as in training, cut at 3/8 instead of 1/2: pieces are contiguous on
  both sides, sent straight from the trainers' shards and received straight into the destination.

Variants per cut:

* ``reshard``: :func:`shardsync.reshard` with its defaults - on one host, through shared memory
  (warm: the plan is cached after the first call; the first call's time, planning included, is
  reported separately);
* ``reshard gloo``: the same through gloo's collectives (``transport="backend"``);
* ``full then slice``: :func:`shardsync.full_params` to every rank, then each inference rank copies
  its cut out of each full tensor (what one does without a sharded destination);
* ``ceiling``: each trainer sends each inference rank, in one message, exactly the bytes that rank
  needs from it (all four messages at once) - the wire alone, no packing, mapping or assembly;
* ``ceiling memcpy``: each inference rank copies its shards' bytes once, from memory already touched
  into memory already touched (what a same-host transport cannot beat).

Each variant runs ``--repeats`` times, round-robin; the time of a run is the slowest rank's; the best
run is kept. The reshard output is checked against the reference once. Results go to
``bench/results/reshard.json``.

Every rank runs with torch's default threads (nothing here sets them; four ranks on a 2-core machine
oversubscribe it). Run: ``.venv/bin/python bench/bench_reshard.py`` (about a minute on 2 cores;
``--layers 1 --repeats 1 --out /tmp/r.json`` for a quick check); ``--busy`` measures next to another
busy process (bench/busy.py) and writes ``reshard_busy.json``.
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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import shardsync
from shardsync import LocalShard

sys.path.insert(0, str(Path(__file__).parent))
import busy  # noqa: E402

__all__ = ["main", "mapping", "hf_model", "megatron_state", "inference_cut", "inference_state", "CUTS"]

RESULTS = Path(__file__).parent / "results"
SHIPPED = Path(shardsync.__file__).parent / "mappings" / "megatron-llama.txt"
TRAINERS, WORKERS = (0, 1), (2, 3)
CUTS = ("transposed", "shifted")


def _filled(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    # cheap, deterministic and distinct per tensor (randn of 0.3 GB on 4 ranks would dominate set-up)
    n = 1
    for s in shape:
        n *= s
    return ((torch.arange(n, dtype=torch.float32) * 0.001 + seed) % 7.0).reshape(shape)


def mapping(a: argparse.Namespace) -> str:
    """The shipped Megatron -> HF mapping (``megatron-llama``) with this model's parameters."""
    values = {"num_heads": a.heads, "num_key_value_groups": a.groups, "vocab_size": a.vocab}
    text = SHIPPED.read_text()
    for name, value in values.items():
        text = text.replace("{" + name + "}", str(value))
    # the trainers' fc1 shards are hand-made, each [gate_r; up_r] (the shipped file's own note)
    for what in ("weight", "bias"):
        text = text.replace(f"mlp.up_proj.{what}, axis=0", f"mlp.up_proj.{what}, fused_ffn, axis=0")
    return text


def hf_model(a: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The full HF tensors (built on every rank alike)."""
    h, d = a.heads, a.hidden // a.heads
    shapes = {
        "model.embed_tokens.weight": (a.vocab, a.hidden),
        "lm_head.weight": (a.vocab, a.hidden),
        "model.norm.weight": (a.hidden,),
    }
    for i in range(a.layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (h * d, a.hidden),
            f"{p}.self_attn.k_proj.weight": (a.groups * d, a.hidden),
            f"{p}.self_attn.v_proj.weight": (a.groups * d, a.hidden),
            f"{p}.self_attn.o_proj.weight": (a.hidden, h * d),
            f"{p}.mlp.gate_proj.weight": (a.ffn, a.hidden),
            f"{p}.mlp.up_proj.weight": (a.ffn, a.hidden),
            f"{p}.mlp.down_proj.weight": (a.hidden, a.ffn),
            f"{p}.input_layernorm.weight": (a.hidden,),
            f"{p}.post_attention_layernorm.weight": (a.hidden,),
        }
    return {k: _filled(s, i) for i, (k, s) in enumerate(sorted(shapes.items()))}


def _part(x: torch.Tensor, dim: int, rank: int, world: int) -> LocalShard:
    s = shardsync.shard_dim(x, dim, rank, world)
    return LocalShard(s.local.clone(), s.global_shape, s.global_offset)


def megatron_state(hf: dict[str, torch.Tensor], a: argparse.Namespace, rank: int) -> dict[str, Any]:
    """Trainer ``rank``'s Megatron TP=2 shards."""
    per, d = a.heads // a.groups, a.hidden // a.heads
    out: dict[str, Any] = {
        "embedding.word_embeddings.weight": _part(hf["model.embed_tokens.weight"], 0, rank, 2),
        "output_layer.weight": _part(hf["lm_head.weight"], 0, rank, 2),
        "decoder.final_layernorm.weight": hf["model.norm.weight"].clone(),
    }
    for i in range(a.layers):
        m, p = f"decoder.layers.{i}", f"model.layers.{i}"
        q, k, v = (hf[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv")
        qkv = torch.cat(
            [
                t
                for g in range(a.groups)
                for t in (q[g * per * d : (g + 1) * per * d], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d])
            ]
        )
        gate, up = hf[f"{p}.mlp.gate_proj.weight"].chunk(2), hf[f"{p}.mlp.up_proj.weight"].chunk(2)
        fc1 = torch.cat([gate[0], up[0], gate[1], up[1]])
        out |= {
            f"{m}.self_attention.linear_qkv.weight": _part(qkv, 0, rank, 2),
            f"{m}.self_attention.linear_proj.weight": _part(hf[f"{p}.self_attn.o_proj.weight"], 1, rank, 2),
            f"{m}.mlp.linear_fc1.weight": _part(fc1, 0, rank, 2),
            f"{m}.mlp.linear_fc2.weight": _part(hf[f"{p}.mlp.down_proj.weight"], 1, rank, 2),
            f"{m}.input_layernorm.weight": hf[f"{p}.input_layernorm.weight"].clone(),
            f"{m}.pre_mlp_layernorm.weight": hf[f"{p}.post_attention_layernorm.weight"].clone(),
        }
    return out


def inference_cut(key: str, cut: str) -> int | None:
    """The dim an inference weight is cut along: the other dim than training's (``transposed``) or
    the same (``shifted``); None for replicated norms."""
    if key.endswith("norm.weight") or "layernorm" in key:
        return None
    rowwise = "o_proj" in key or "down_proj" in key  # cut along dim 1 in training
    return int(rowwise == (cut == "shifted"))


def inference_state(hf: dict[str, torch.Tensor], cut: str, worker: int) -> dict[str, Any]:
    """Worker ``worker`` (0 or 1)'s zero-filled destination for ``cut``."""
    out: dict[str, Any] = {}
    for k, x in hf.items():
        dim = inference_cut(k, cut)
        if dim is None:
            out[k] = torch.zeros_like(x)
        elif cut == "transposed":
            out[k] = _part(torch.zeros_like(x), dim, worker, 2)
        else:
            edge = x.shape[dim] * 3 // 8
            lo, hi = (0, edge) if worker == 0 else (edge, x.shape[dim])
            shape, offset = list(x.shape), [0, 0]
            shape[dim], offset[dim] = hi - lo, lo
            out[k] = LocalShard(torch.zeros(shape), x.shape, offset)
    return out


def _local(v: Any) -> torch.Tensor:
    return v.local if isinstance(v, LocalShard) else v


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    return _slowest(time.perf_counter() - start), out


def _ceiling(plan: shardsync.planning.Plan, rank: int) -> Callable[[], None]:
    """One message per (trainer, worker) pair holding exactly the bytes the reshard plan moves
    between them, all posted at once: the wire alone."""
    need: dict[tuple[int, int], int] = {}
    for r in plan.reads:
        for w in r.receivers:
            if r.sender is not None:
                need[(r.sender, w)] = need.get((r.sender, w), 0) + r.nbytes
    bufs = {pair: torch.ones(n, dtype=torch.uint8) for pair, n in need.items() if rank in pair}

    def run() -> None:
        ops = [
            dist.P2POp(dist.isend if rank == t else dist.irecv, buf, w if rank == t else t)
            for (t, w), buf in bufs.items()
        ]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    return run


def _memcpy(nbytes: int) -> Callable[[], None]:
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.ones(nbytes, dtype=torch.uint8)
    return lambda: dst.copy_(src)


def run_cut(
    rank: int, a: argparse.Namespace, hf: dict[str, torch.Tensor], program: str, src: dict[str, Any] | None, cut: str
) -> dict[str, Any]:
    """Time the three variants for one cut on this rank; check the reshard output once."""
    dst = inference_state(hf, cut, rank - 2) if rank in WORKERS else None

    def full_then_slice() -> None:
        for name, full in shardsync.full_params(src or {}, program):
            if dst is not None:
                v = dst[name]
                _local(v).copy_(full[v.box.slices()] if isinstance(v, LocalShard) else full)

    first, result = _timed(lambda: shardsync.reshard(src, dst, program))
    bad = (
        []
        if dst is None
        else [
            k
            for k, v in dst.items()
            if not torch.equal(_local(v), hf[k][v.box.slices()] if isinstance(v, LocalShard) else hf[k])
        ]
    )
    mine = 0 if dst is None else sum(_local(v).numel() * 4 for v in dst.values())
    variants: dict[str, Callable[[], Any]] = {
        "reshard": lambda: shardsync.reshard(src, dst, program),
        "reshard gloo": lambda: shardsync.reshard(src, dst, program, transport="backend"),
        "full then slice": full_then_slice,
        "ceiling": _ceiling(result.plan, rank),
        "ceiling memcpy": _memcpy(mine),
    }
    best: dict[str, float] = {}
    for _ in range(a.repeats):
        for name, fn in variants.items():
            seconds, _ = _timed(fn)
            best[name] = min(best.get(name, seconds), seconds)
    return {
        "first_reshard_seconds": first,
        "plan_seconds": result.stats.plan_seconds,
        "best": best,
        "bad": bad,
        "received": result.stats.bytes_received,
        "sent": result.stats.bytes_sent,
        "peak_bytes": result.stats.peak_bytes,
        "strategy": result.plan.strategy,
        "steps": len(result.plan.steps),
        "transport": result.stats.transport,
        "shard_bytes": mine,
        "threads": torch.get_num_threads(),
    }


def worker(rank: int, world: int, a: argparse.Namespace, store: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600)
    )
    hf, program = hf_model(a), mapping(a)
    src = megatron_state(hf, a, rank) if rank in TRAINERS else None
    record = {cut: run_cut(rank, a, hf, program, src, cut) for cut in CUTS}
    with open(os.path.join(out, f"{rank}.json"), "w") as fh:
        json.dump(record, fh)
    dist.destroy_process_group()


def report(per_rank: list[dict], cut: str) -> dict[str, Any]:
    """One cut's results: times (the slowest rank's, best run), ratios, bytes, memory."""
    ranks = [r[cut] for r in per_rank]
    best = ranks[0]["best"]  # every rank has the same (slowest-rank) times
    needed = sum(r["shard_bytes"] for r in ranks)
    return {
        "cut": cut,
        "inference_bytes_needed": needed,
        "reshard_vs_full_then_slice": best["full then slice"] / best["reshard"],
        "reshard_x_ceiling": best["reshard"] / best["ceiling"],
        "reshard_x_memcpy": best["reshard"] / best["ceiling memcpy"],
        "reshard_gloo_x_ceiling": best["reshard gloo"] / best["ceiling"],
        "transport": ranks[0]["transport"],
        "first_reshard_seconds": ranks[0]["first_reshard_seconds"],
        "plan_seconds": max(r["plan_seconds"] for r in ranks),
        "received_bytes": [r["received"] for r in ranks],
        "sent_bytes": [r["sent"] for r in ranks],
        "reshard_peak_MiB": [r["peak_bytes"] / 2**20 for r in ranks],
        "strategy": ranks[0]["strategy"],
        "steps": ranks[0]["steps"],
        "rows": {name: {"seconds": s, "GB_per_s_delivered": needed / s / 1e9} for name, s in best.items()},
        "exact": all(not r["bad"] for r in ranks),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=8191)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, help="the JSON (default bench/results/reshard.json, reshard_busy.json)")
    busy.add_flag(p)
    a = p.parse_args(argv)
    a.out = a.out or RESULTS / f"{busy.stem('reshard', a.busy)}.json"
    with busy.run(a.busy) as conditions, tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(4, a, os.path.join(tmp, "store"), tmp), nprocs=4)
        per_rank = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(4)]
    doc = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "conditions": conditions,
        "rank_threads": sorted({r[cut]["threads"] for r in per_rank for cut in CUTS}),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "world": 4,
        "repeats": a.repeats,
        "model": {k: getattr(a, k) for k in ("layers", "hidden", "heads", "groups", "ffn", "vocab")},
        "model_bytes": sum(t.numel() * 4 for t in hf_model(a).values()),
        "cuts": [report(per_rank, cut) for cut in CUTS],
    }
    doc["exact"] = all(c["exact"] for c in doc["cuts"])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"conditions: {conditions}; torch threads in the ranks: {doc['rank_threads']}")
    for c in doc["cuts"]:
        times = ", ".join(f"{name} {row['seconds']:.3f} s" for name, row in c["rows"].items())
        print(
            f"{c['cut']:>10}: {times}; reshard is {c['reshard_vs_full_then_slice']:.2f}x faster than "
            f"full-then-slice ({c['transport']}), {c['reshard_x_ceiling']:.2f}x the wire ceiling and "
            f"{c['reshard_x_memcpy']:.2f}x the memcpy one; gloo "
            f"{c['reshard_gloo_x_ceiling']:.2f}x its ceiling; exact: {c['exact']}"
        )
    return doc


if __name__ == "__main__":
    sys.exit(0 if main()["exact"] else 1)
