"""Single-process export throughput of ``full_params`` (issue: core export).

A synthetic Megatron-style state of about 0.3 GB (8 layers, hidden 1024, fp32) is exported to HF names
through a mapping that splits a GQA-fused QKV, splits a fused gate/up, transposes one matrix per layer
and renames the rest. Baselines measured in the same run, on the same bytes:

* ``memcpy ceiling``: ``torch.empty_like(x).copy_(x)`` of every source (the least any copy can cost);
* ``hand-written torch``: the same export written directly (slices + ``torch.cat``, ``.t().contiguous()``,
  ``clone``), as a user would without shardsync.

Also: the identity export with ``copy=False`` must copy nothing (every output shares its source's memory).
Run: ``make bench`` or ``.venv/bin/python bench/bench_export.py``. Writes bench/results/export.{json,md}.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

import shardsync

LAYERS, HIDDEN, FFN, HEADS, GROUPS = 8, 1024, 2048, 16, 4
HEAD = HIDDEN // HEADS
MAPPING = [
    "layers.$LAYER_ID.qkv -> model.layers.$LAYER_ID.q_proj, model.layers.$LAYER_ID.k_proj, "
    f"model.layers.$LAYER_ID.v_proj, fused_qkv, num_heads={HEADS}, num_key_value_groups={GROUPS}, axis=0",
    "layers.$LAYER_ID.fc1 -> model.layers.$LAYER_ID.gate_proj, model.layers.$LAYER_ID.up_proj, "
    "fused_ffn, axis=0",
    "layers.$LAYER_ID.fc2^T -> model.layers.$LAYER_ID.down_proj_t",
    "layers.$LAYER_ID.proj -> model.layers.$LAYER_ID.o_proj",
    "layers.$LAYER_ID.norm -> model.layers.$LAYER_ID.norm",
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


def timed(fn, state, repeats: int = 5) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn(state)
        times.append(time.perf_counter() - t0)
        del out
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)  # fair and stable on a shared 2-core machine
    state = build_state()
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    # correctness first: the mapped export equals the hand-written one, bit for bit
    ours, ref = shardsync_export(state), hand_written(state)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        pairs = [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("gate_proj", "g"), ("up_proj", "u"),
                 ("down_proj_t", "d"), ("o_proj", "o"), ("norm", "n")]
        assert all(torch.equal(ours[p + a], ref[f"{b}{i}"]) for a, b in pairs)
    del ours, ref
    t_mem, t_hand, t_ours = timed(memcpy, state), timed(hand_written, state), timed(shardsync_export, state)
    t0 = time.perf_counter()
    ident = list(shardsync.full_params(state, copy=False))
    t_ident = time.perf_counter() - t0
    shared = sum(t.data_ptr() == state[n].data_ptr() for n, t in ident)
    gbs = lambda t: nbytes / t / 1e9  # noqa: E731
    res = {
        "state_bytes": nbytes, "threads": 1,
        "memcpy_ceiling_gbps": round(gbs(t_mem), 3), "hand_written_gbps": round(gbs(t_hand), 3),
        "shardsync_gbps": round(gbs(t_ours), 3),
        "ratio_vs_memcpy_ceiling": round(t_mem / t_ours, 3),
        "ratio_vs_hand_written": round(t_hand / t_ours, 3),
        "identity_copy_false_seconds": round(t_ident, 4),
        "identity_copy_false_outputs_sharing_memory": f"{shared}/{len(ident)}",
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "export.json").write_text(json.dumps(res, indent=2) + "\n")
    md = ["| measure | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in res.items()]
    (RESULTS / "export.md").write_text("\n".join(md) + "\n")
    print(f"state {nbytes / 1e9:.3f} GB, median of 5, 1 thread")
    print(f"  memcpy ceiling     {res['memcpy_ceiling_gbps']:.2f} GB/s")
    print(f"  hand-written torch {res['hand_written_gbps']:.2f} GB/s")
    print(f"  shardsync          {res['shardsync_gbps']:.2f} GB/s  = {res['ratio_vs_memcpy_ceiling']:.2f}x "
          f"the ceiling, {res['ratio_vs_hand_written']:.2f}x hand-written (target >= 0.7x ceiling)")
    print(f"  identity, copy=False: {t_ident * 1e3:.1f} ms, {shared}/{len(ident)} outputs share memory")


if __name__ == "__main__":
    main()
