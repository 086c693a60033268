"""Single-process export throughput of ``full_params`` (issue: core export).

A synthetic Megatron-style state of about 0.3 GB (8 layers, hidden 1024, fp32) is exported to HF names
through a mapping that splits a GQA-fused QKV, splits a fused gate/up, transposes one matrix per layer
and renames the rest. Baselines measured in the same run, on the same bytes:

* ``memcpy ceiling``: ``torch.empty_like(x).copy_(x)`` of every source (the least any copy can cost);
* ``hand-written torch``: the same export written directly (slices + ``torch.cat``, ``.t().contiguous()``,
  ``clone``), as a user would without shardsync.
* ``shardsync, torch transposes``: shardsync with its SIMD transpose kernel off (``exec/transpose.py``):
  the transposed matrices copied by torch's ``copy_`` in tiles, as before the kernel.

Also: the identity export with ``copy=False`` must copy nothing (every output shares its source's memory).

Each variant allocates its outputs, so fresh-page faults are part of every timing. glibc returns large
freed blocks to the OS, and an exact same-size reallocation (what the memcpy baseline does) is cheaper
than outputs of new shapes; the run is therefore made twice: with the default allocator ("cold"), and
with glibc told to keep freed memory (``GLIBC_TUNABLES``: "warm", like a caching allocator), which
compares copy speed alone. torch's default threads in every child (OMP_NUM_THREADS as the caller
has it: unset under ``make bench``). Run: ``make bench`` or ``.venv/bin/python bench/bench_export.py``;
``--busy`` measures next to another busy process (bench/busy.py); ``--rounds 1 --out /tmp/x`` for a
quick check. Writes bench/results/export.{json,md} (``export_busy.*`` with ``--busy``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import shardsync
from shardsync.exec import transpose

sys.path.insert(0, str(Path(__file__).parent))
import busy  # noqa: E402

LAYERS, HIDDEN, FFN, HEADS, GROUPS = 8, 1024, 2048, 16, 4
HEAD = HIDDEN // HEADS
MAPPING = [
    "layers.$LAYER_ID.qkv -> model.layers.$LAYER_ID.q_proj, model.layers.$LAYER_ID.k_proj, "
    f"model.layers.$LAYER_ID.v_proj, fused_qkv, num_heads={HEADS}, num_key_value_groups={GROUPS}, axis=0",
    "layers.$LAYER_ID.fc1 -> model.layers.$LAYER_ID.gate_proj, model.layers.$LAYER_ID.up_proj, fused_ffn, axis=0",
    "layers.$LAYER_ID.fc2^T -> model.layers.$LAYER_ID.down_proj_t",
    "layers.$LAYER_ID.proj -> model.layers.$LAYER_ID.o_proj",
    "layers.$LAYER_ID.norm -> model.layers.$LAYER_ID.norm",
]
# The same without the transpose: every copy is then contiguous rows, so memcpy is a true ceiling.
MAPPING_NO_TRANSPOSE = [
    s.replace("fc2^T -> model.layers.$LAYER_ID.down_proj_t", "fc2 -> model.layers.$LAYER_ID.down_proj") for s in MAPPING
]
RESULTS = Path(__file__).parent / "results"


def build_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {}
    for i in range(LAYERS):
        state[f"layers.{i}.qkv"] = torch.randn((HEADS + 2 * GROUPS) * HEAD, HIDDEN, generator=g)
        state[f"layers.{i}.fc1"] = torch.randn(2 * FFN, HIDDEN, generator=g)
        state[f"layers.{i}.fc2"] = torch.randn(HIDDEN, FFN, generator=g)
        state[f"layers.{i}.proj"] = torch.randn(HIDDEN, HIDDEN, generator=g)
        state[f"layers.{i}.norm"] = torch.randn(HIDDEN, generator=g)
    return state


def hand_written(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    per = HEADS // GROUPS
    for i in range(LAYERS):
        qkv = state[f"layers.{i}.qkv"].view(GROUPS, per + 2, HEAD, HIDDEN)
        out[f"q{i}"] = qkv[:, :per].reshape(HEADS * HEAD, HIDDEN).clone()
        out[f"k{i}"] = qkv[:, per].reshape(GROUPS * HEAD, HIDDEN).clone()
        out[f"v{i}"] = qkv[:, per + 1].reshape(GROUPS * HEAD, HIDDEN).clone()
        fc1 = state[f"layers.{i}.fc1"]
        out[f"g{i}"], out[f"u{i}"] = fc1[:FFN].clone(), fc1[FFN:].clone()
        out[f"d{i}"] = state[f"layers.{i}.fc2"].t().contiguous()
        out[f"o{i}"] = state[f"layers.{i}.proj"].clone()
        out[f"n{i}"] = state[f"layers.{i}.norm"].clone()
    return out


def memcpy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.empty_like(v).copy_(v) for k, v in state.items()}


def shardsync_export(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(shardsync.full_params(state, MAPPING))


def shardsync_no_transpose(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(shardsync.full_params(state, MAPPING_NO_TRANSPOSE))


def shardsync_torch_transpose(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The export with transposes copied by torch in tiles (``exec/transpose.py``'s kernel off)."""
    kernel = transpose.kernel
    transpose.kernel = lambda itemsize: None  # type: ignore[assignment]
    try:
        return dict(shardsync.full_params(state, MAPPING))
    finally:
        transpose.kernel = kernel


def rounds(fns: dict, state: dict[str, torch.Tensor], n: int = 7) -> dict[str, list[float]]:  # type: ignore[type-arg]
    """Run every variant once per round, interleaved, so drift on a shared machine hits all alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(n):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            out = fn(state)
            times[name].append(time.perf_counter() - t0)
            del out
    return times


def measure(n_rounds: int) -> None:
    state = build_state()
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    # correctness first: the mapped export equals the hand-written one, bit for bit
    ours, ref = shardsync_export(state), hand_written(state)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        pairs = [
            ("q_proj", "q"),
            ("k_proj", "k"),
            ("v_proj", "v"),
            ("gate_proj", "g"),
            ("up_proj", "u"),
            ("down_proj_t", "d"),
            ("o_proj", "o"),
            ("norm", "n"),
        ]
        assert all(torch.equal(ours[p + a], ref[f"{b}{i}"]) for a, b in pairs)
    del ours, ref
    times = rounds(
        {
            "memcpy": memcpy,
            "hand": hand_written,
            "ours": shardsync_export,
            "ours_nt": shardsync_no_transpose,
            "ours_tt": shardsync_torch_transpose,
        },
        state,
        n_rounds,
    )
    t_mem, t_hand, t_ours = (statistics.median(times[k]) for k in ("memcpy", "hand", "ours"))
    vs_mem = statistics.median(m / o for m, o in zip(times["memcpy"], times["ours"]))
    vs_hand = statistics.median(h / o for h, o in zip(times["hand"], times["ours"]))
    nt_vs_mem = statistics.median(m / o for m, o in zip(times["memcpy"], times["ours_nt"]))
    t0 = time.perf_counter()
    ident = list(shardsync.full_params(state, copy=False))
    t_ident = time.perf_counter() - t0
    shared = sum(t.data_ptr() == state[n].data_ptr() for n, t in ident)
    gbs = lambda t: nbytes / t / 1e9  # noqa: E731
    res = {
        "state_bytes": nbytes,
        "threads": torch.get_num_threads(),
        "rounds": n_rounds,
        "memcpy_ceiling_gbps": round(gbs(t_mem), 3),
        "hand_written_gbps": round(gbs(t_hand), 3),
        "shardsync_gbps": round(gbs(t_ours), 3),
        "ratio_vs_memcpy_ceiling": round(vs_mem, 3),
        "ratio_vs_hand_written": round(vs_hand, 3),
        "no_transpose_shardsync_gbps": round(gbs(statistics.median(times["ours_nt"])), 3),
        "no_transpose_ratio_vs_memcpy_ceiling": round(nt_vs_mem, 3),
        "torch_transpose_shardsync_gbps": round(gbs(statistics.median(times["ours_tt"])), 3),
        "ratio_vs_torch_transpose": round(statistics.median(t / o for t, o in zip(times["ours_tt"], times["ours"])), 3),
        "identity_copy_false_seconds": round(t_ident, 4),
        "identity_copy_false_outputs_sharing_memory": f"{shared}/{len(ident)}",
    }
    print(json.dumps(res))


WARM = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=17179869184"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=RESULTS)
    busy.add_flag(ap)
    a = ap.parse_args()
    results = {}
    with busy.run(a.busy) as conditions:
        for mode, tunables in (("cold", None), ("warm", WARM)):
            env = dict(os.environ, SHARDSYNC_BENCH_CHILD=str(a.rounds))
            if tunables:
                env["GLIBC_TUNABLES"] = tunables
            run = subprocess.run([sys.executable, __file__], env=env, check=True, capture_output=True, text=True)
            results[mode] = json.loads(run.stdout.strip().splitlines()[-1])
    name = busy.stem("export", a.busy)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{name}.json").write_text(json.dumps({"conditions": conditions, **results}, indent=2) + "\n")
    md = [
        f"state {results['cold']['state_bytes'] / 1e9:.3f} GB fp32, 1 process; {conditions}; "
        f"{a.rounds} interleaved rounds; GB/s from median times, ratios are medians of per-round ratios "
        "(target: >= 0.7x the ceiling).",
        "",
        "| measure | cold allocator | warm allocator |",
        "|---|---|---|",
    ]
    md += [f"| {k} | {results['cold'][k]} | {results['warm'][k]} |" for k in results["cold"]]
    (a.out / f"{name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    if os.environ.get("SHARDSYNC_BENCH_CHILD"):
        measure(int(os.environ["SHARDSYNC_BENCH_CHILD"]))
    else:
        main()
