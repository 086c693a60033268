"""Peak memory of exporting a checkpoint from files, against a ``memory_budget`` (issue: Sources).

A synthetic Megatron-style checkpoint of about 0.43 GB (12 layers, hidden 1024, fp32; the state and
mapping of bench_export.py) is written once as safetensors (100 MB shards with an index) and once as a
torch DCP checkpoint. Each export - ``full_params(path, mapping, copy=False, memory_budget=...)``, its
targets dropped as they come ("discard": the source and streamer alone) or written by
``save_safetensors`` with 64 MiB output shards - runs in a fresh child process, which reports its
resident set size after its imports (``rss_before``) and its peak (``VmHWM``).
``growth = peak - rss_before`` is what the export itself cost, compared with the budget (plus the
writer's shard, which the writer holds before writing). Baseline: the old way, ``read_tensors`` (the
whole checkpoint in memory) and then the same export.

torch's default threads (nothing here sets them). Run: ``make bench`` or ``.venv/bin/python
bench/bench_sources.py`` (``--out /tmp/x`` to write elsewhere); ``--busy`` measures next to another busy
process (bench/busy.py). Writes bench/results/sources.json (``sources_busy.json`` with ``--busy``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import shardsync

sys.path.insert(0, str(Path(__file__).parent))
import busy  # noqa: E402
from bench_export import MAPPING, build_state  # noqa: E402  (same state and mapping)

LAYERS = 12
MIB = 1 << 20
BUDGET = 64 * MIB
SHARD = 64 * MIB
RESULTS = Path(__file__).parent / "results"
#: glibc raises its mmap threshold as large blocks are freed, then keeps freed heap memory; fixing the
#: threshold returns every large block to the OS at once, which isolates the export's own memory.
FIXED = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


def _status(field: str) -> int:
    """A memory field of /proc/self/status (``VmRSS``: now, ``VmHWM``: peak), in bytes. VmHWM belongs
    to this process image; ``getrusage``'s ru_maxrss is not used because Linux carries it over from
    the parent through fork and exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(how: str, path: str, out: str, budget: int) -> dict:
    """One export in this (fresh) process; returns sizes and memory."""
    import torch.distributed.checkpoint  # noqa: F401  (46 MiB of modules: fixed cost, not the export's)

    before = _status("VmRSS")
    start = time.perf_counter()
    source = shardsync.read_tensors(path) if how == "read_tensors" else path
    stream = shardsync.full_params(source, MAPPING, copy=False, memory_budget=budget or None)
    if how == "discard":  # the source and streamer alone
        written = sum(t.numel() * t.element_size() for _, t in stream)
    else:  # into the writer, which holds one output shard (and serialises it) before writing
        written = shardsync.save_safetensors(stream, out, max_shard_bytes=SHARD).total_bytes
    peak = _status("VmHWM")
    return {
        "seconds": round(time.perf_counter() - start, 2),
        "bytes_out": written,
        "bytes_read": stream.stats.bytes_read,
        "rss_before": before,
        "peak_rss": peak,
        "growth": peak - before,
    }


def _shift(key: str) -> str:
    """``layers.3.qkv`` -> ``layers.15.qkv`` (LAYERS further on)."""
    _, i, rest = key.split(".", 2)
    return f"layers.{int(i) + LAYERS}.{rest}"


def run_child(how: str, path: Path, out: Path, budget: int, malloc_env: dict[str, str]) -> dict:
    cmd = [sys.executable, __file__, "--child", how, str(path), str(out), str(budget)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ | malloc_env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def cases(root: Path) -> list[tuple[str, str, Path, int, dict[str, str]]]:
    """(name, how, checkpoint, budget, extra environment) of every run."""
    st, dc, st2 = root / "st", root / "dcp", root / "st2"
    out = [
        (f"{fmt} -> discard, budget {b >> 20} MiB", "discard", path, b, {})
        for fmt, path in (("safetensors", st), ("dcp", dc))
        for b in (32 * MIB, BUDGET)
    ]
    out += [
        (f"{fmt} -> discard, budget 64 MiB, fixed malloc threshold", "discard", path, BUDGET, FIXED)
        for fmt, path in (("safetensors", st), ("dcp", dc))
    ]
    x2 = f"safetensors x2 ({2 * LAYERS} layers) -> discard, budget 64 MiB"
    out += [(x2, "discard", st2, BUDGET, {}), (x2 + ", fixed malloc threshold", "discard", st2, BUDGET, FIXED)]
    out += [
        ("safetensors -> discard, no budget", "discard", st, 0, {}),
        ("safetensors -> safetensors, budget 64 MiB", "write", st, BUDGET, {}),
        ("dcp -> safetensors, budget 64 MiB", "write", dc, BUDGET, {}),
        ("read_tensors, then -> safetensors (old CLI)", "read_tensors", st, BUDGET, {}),
    ]
    return out


def main() -> None:
    import torch.distributed.checkpoint as dcp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS)
    busy.add_flag(ap)
    a = ap.parse_args()

    import bench_export

    bench_export.LAYERS = LAYERS
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        state = build_state()
        size = sum(t.numel() * t.element_size() for t in state.values())
        shardsync.save_safetensors(state.items(), root / "st", max_shard_bytes="100MB")
        dcp.save(state, checkpoint_id=root / "dcp", no_dist=True)
        # twice the layers (the same tensors again under new names): growth must not follow size
        doubled = list(state.items()) + [(_shift(k), t) for k, t in state.items()]
        shardsync.save_safetensors(doubled, root / "st2", max_shard_bytes="100MB")
        del state
        with busy.run(a.busy) as conditions:
            for i, (name, how, path, budget, env) in enumerate(cases(root)):
                r = run_child(how, path, root / f"out{i}", budget, env)
                shard = 0 if how == "discard" else SHARD
                r |= {
                    "memory_budget": budget or None,
                    "writer_shard_bytes": shard or None,
                    "growth_over_budget_and_shard": r["growth"] - budget - shard if budget else None,
                }
                rows[name] = r
                print(
                    f"{name:55s} growth {r['growth'] / MIB:6.1f} MiB (budget {budget / MIB:4.0f} + shard "
                    f"{shard / MIB:3.0f}), peak {r['peak_rss'] / MIB:6.1f} MiB, {r['seconds']:5.2f} s"
                )
    doc = {
        "conditions": conditions,
        "checkpoint_bytes": size,
        "checkpoint_over_budget_64MiB": round(size / BUDGET, 1),
        "fixed_malloc_threshold_env": FIXED,
        "threads": torch.get_num_threads(),
        "cases": rows,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{busy.stem('sources', a.busy)}.json").write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        how, path, out, budget = sys.argv[2:6]
        print(json.dumps(child(how, path, out, int(budget))))
    else:
        main()
