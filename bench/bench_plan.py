"""Planning time against shard count (issue: scale): ``resolve`` + ``build_plan`` on one key cut into
256 to 4096 shards over 8 ranks, every rank receiving every target. Pure Python, no process group.

Cases:

* ``rows``: a ``[4n, 64]`` fp32 tensor in ``n`` row shards (FSDP-style), streamed whole;
* ``fused``: the same, split by ``fused_ffn`` into gate and up (two pieces per shard);
* ``grid``: a ``[n, 64]`` tensor in a grid of ``n / 8`` row bands by 8 columns (TP x FSDP), transposed;
* ``tensors`` (issue 19, MoE-sized state dicts): ``shardsync.plan`` of 6,250 to 100,000 tiny ``[3]``
  tensors in one process through a ``$LAYER_ID`` mapping: the whole orchestrator (layout, macro
  expansion, resolve, plan, validate) against the number of tensors, on a first call (caches
  released) and repeated (the plan cached).

Baseline measured in the same run: the same planner with every box lookup scanning every shard of the
key instead of using the index, at the small shard counts where that finishes in seconds; both must
build the same plan. Reported: best-of-3 seconds, microseconds per shard, the scaling exponent ``k``
fitted to ``time ~ shards^k`` (1 is linear, 2 quadratic), and the speedup over the scan. Each point
is also timed with Python's cyclic GC off: once the objects the planner keeps pass a quarter of the
heap, CPython starts full collections of the whole heap (torch's modules included), which raise the
time per shard at the large end without being part of the algorithm. Run: ``make bench`` or
``.venv/bin/python bench/bench_plan.py`` (``--points 2 --out /tmp/x``: the two smallest sizes, a quick
check); ``--busy`` measures next to another busy process (bench/busy.py). Writes
bench/results/plan.{json,md} (``plan_busy.*`` with ``--busy``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

import shardsync
from shardsync.layout import Box, GlobalLayout
from shardsync.mapping import resolve
from shardsync.planning import Plan, PlanOptions, build_plan, reads, validate

sys.path.insert(0, str(Path(__file__).parent))
import busy  # noqa: E402

RANKS = 8
COLS = 64
SHARDS = (256, 512, 1024, 2048, 4096)
SCAN_UP_TO = 512  # the scanning baseline is quadratic: 4096 shards would take minutes
TENSORS = (6250, 12500, 25000, 50000, 100000)
TENSORS_MAPPING = ["layers.$LAYER_ID.w -> model.layers.$LAYER_ID.weight"]
RESULTS = Path(__file__).parent / "results"


def rows(n: int) -> GlobalLayout:
    per: list[list] = [[] for _ in range(RANKS)]
    for i in range(n):
        per[i % RANKS].append(("w", (4 * n, COLS), "float32", Box((4 * i, 0), (4, COLS))))
    return GlobalLayout.merge(per)


def grid(n: int) -> GlobalLayout:
    per: list[list] = [[] for _ in range(RANKS)]
    band = COLS // RANKS
    for i in range(n // RANKS):
        for j in range(RANKS):
            per[(i + j) % RANKS].append(("w", (n, COLS), "float32", Box((RANKS * i, band * j), (RANKS, band))))
    return GlobalLayout.merge(per)


CASES: dict[str, tuple[Callable[[int], GlobalLayout], list[str] | None]] = {
    "rows": (rows, None),
    "fused": (rows, ["w -> gate, up, fused_ffn, axis=0"]),
    "grid": (grid, ["w^T -> wt"]),
}


class ScanIndex:
    """The baseline's box lookup: every box checked on every query."""

    def __init__(self, boxes: list[Box]) -> None:
        self.boxes = list(boxes)

    def query(self, box: Box) -> list[int]:
        return [i for i, b in enumerate(self.boxes) if not b.empty and b.intersect(box) is not None]

    def pairs(self) -> list[tuple[int, int]]:
        return [(i, j) for i in range(len(self.boxes)) for j in self.query(self.boxes[i]) if j > i]


def plan_once(layout: GlobalLayout, mapping: list[str] | None, collect: bool = True) -> tuple[float, Plan]:
    """One timed resolve + build_plan; ``collect=False`` runs it with the cyclic GC off."""
    gc.collect()
    if not collect:
        gc.disable()
    try:
        t0 = time.perf_counter()
        plan = build_plan(resolve(mapping, layout), layout, PlanOptions())
        return time.perf_counter() - t0, plan
    finally:
        gc.enable()


def best_of(layout: GlobalLayout, mapping: list[str] | None, collect: bool, n: int = 3) -> tuple[float, Plan]:
    runs = [plan_once(layout, mapping, collect) for _ in range(n)]
    return min(t for t, _ in runs), runs[0][1]


def scanned(layout: GlobalLayout, mapping: list[str] | None) -> tuple[float, Plan]:
    with mock.patch.object(reads, "BoxIndex", ScanIndex), mock.patch.object(validate, "BoxIndex", ScanIndex):
        return plan_once(layout, mapping)


def exponent(points: list[tuple[float, float]]) -> float:
    """Slope of log(time) against log(shards): time ~ shards^k."""
    fit = statistics.linear_regression([math.log(n) for n, _ in points], [math.log(t) for _, t in points])
    return fit.slope


def measure_tensors(points: int) -> dict:
    """``shardsync.plan`` over many tiny tensors, best of 3 (GC on, as users run it): the first call
    (every cache released before it: the whole orchestrator) and a repeated one (the layout gathered and
    compared with the last call's, the cached plan returned: what a stream called every step pays)."""
    rows_out = []
    for n in TENSORS[:points]:
        state = {f"layers.{i}.w": torch.zeros(3) for i in range(n)}
        first, again = [], []
        for _ in range(3):
            shardsync.release()
            for times in (first, again):
                gc.collect()
                t0 = time.perf_counter()
                shardsync.plan(state, TENSORS_MAPPING)
                times.append(time.perf_counter() - t0)
        row = {"tensors": n, "seconds": round(min(first), 3), "us_per_tensor": round(min(first) / n * 1e6, 1)}
        row |= {"seconds_again": round(min(again), 3), "us_per_tensor_again": round(min(again) / n * 1e6, 1)}
        rows_out.append(row)
        print("tensors", row, flush=True)
    fit = {key: round(exponent([(r["tensors"], r[key]) for r in rows_out]), 2) for key in ("seconds", "seconds_again")}
    return {"exponent": fit["seconds"], "exponent_again": fit["seconds_again"], "rows": rows_out}


def measure(points: int) -> dict:
    out: dict = {"ranks": RANKS, "repeats": 3, "cases": {}}
    out["tensors"] = measure_tensors(points)
    for case, (make, mapping) in CASES.items():
        rows_out = []
        for n in SHARDS[:points]:
            layout = make(n)
            seconds, plan = best_of(layout, mapping, collect=True)
            row = {
                "shards": n,
                "pieces": plan.pieces,
                "reads": len(plan.reads),
                "seconds": round(seconds, 4),
                "us_per_shard": round(seconds / n * 1e6, 1),
                "seconds_gc_off": round(best_of(layout, mapping, collect=False)[0], 4),
            }
            if n <= SCAN_UP_TO:
                scan_seconds, scan_plan = scanned(layout, mapping)
                assert scan_plan == plan, f"{case} {n}: the scanning planner built another plan"
                row["scan_seconds"] = round(scan_seconds, 4)
                row["speedup_vs_scan"] = round(scan_seconds / seconds, 1)
            rows_out.append(row)
            print(case, row, flush=True)
        fit = {
            key: round(exponent([(r["shards"], r[key]) for r in rows_out]), 2) for key in ("seconds", "seconds_gc_off")
        }
        out["cases"][case] = {"exponent": fit["seconds"], "exponent_gc_off": fit["seconds_gc_off"], "rows": rows_out}
    return out


def markdown(res: dict) -> str:
    md = [
        f"resolve + build_plan, one key, {res['ranks']} ranks, every rank receives it; best of "
        f"{res['repeats']}. `k`: fitted exponent of time ~ shards^k (1 linear, 2 quadratic). GC off: the "
        "same with Python's cyclic GC disabled. Scan: the same planner checking every shard on every "
        f"lookup (same plan), measured up to {SCAN_UP_TO} shards. Conditions: {res['conditions']}.",
        "",
        "| case | shards | pieces | reads | seconds | us/shard | GC off | scan seconds | speedup |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case, c in res["cases"].items():
        md += [
            f"| {case} | {r['shards']} | {r['pieces']} | {r['reads']} | {r['seconds']} | {r['us_per_shard']} | "
            f"{r['seconds_gc_off']} | {r.get('scan_seconds', '')} | {r.get('speedup_vs_scan', '')} |"
            for r in c["rows"]
        ]
    md += ["", "| case | k | k, GC off |", "|---|---|---|"]
    md += [f"| {case} | {c['exponent']} | {c['exponent_gc_off']} |" for case, c in res["cases"].items()]
    tiny = res["tensors"]
    md += [
        "",
        f"`shardsync.plan` of n tiny tensors in one process, mapping `{TENSORS_MAPPING[0]}`; best of "
        f"3. First call: every cache released before it (k = {tiny['exponent']}); again: the same call "
        f"repeated, the plan cached (k = {tiny['exponent_again']}).",
        "",
        "| tensors | first call, s | us/tensor | again, s | us/tensor |",
        "|---|---|---|---|---|",
    ]
    md += [
        f"| {r['tensors']} | {r['seconds']} | {r['us_per_tensor']} | {r['seconds_again']} | "
        f"{r['us_per_tensor_again']} |"
        for r in tiny["rows"]
    ]
    return "\n".join(md) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, default=len(SHARDS), help="the first N sizes of each case (at least 2)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    busy.add_flag(ap)
    a = ap.parse_args()
    with busy.run(a.busy) as conditions:
        res = measure(max(2, a.points)) | {"conditions": conditions}
    name = busy.stem("plan", a.busy)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{name}.json").write_text(json.dumps(res, indent=2) + "\n")
    text = markdown(res)
    (a.out / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
