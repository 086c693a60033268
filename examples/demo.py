"""Demo: export a tensor-parallel Megatron-style Llama to one HuggingFace ``model.safetensors``.

Two gloo processes each hold their TP=2 shards of a small Llama-style model under Megatron-core names:
fused QKV (GQA-interleaved per query group) and fused gate/up (``[gate_r; up_r]`` per TP rank), vocab-
and row-parallel layers, replicated norms. They stream HF-named full tensors through the shipped
mapping to rank 0, which writes ``model.safetensors``; rank 0 then checks every tensor against the
unsharded reference and prints a summary.

Run: ``make demo`` or ``.venv/bin/python examples/demo.py [--mapping NAME|FILE] [--out DIR]`` (default
``megatron-llama`` and ``demo-out/``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import shardsync
from shardsync.layout import StateValue, local_layout
from shardsync.sources.megatron import tp_shards

__all__ = ["main", "Config", "hf_reference", "megatron_full", "tp_state"]

MAPPING = "megatron-llama"  # shipped; its num_heads, num_key_value_groups, vocab_size come from the config
TP = 2


@dataclass(frozen=True)
class Config:
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_groups: int = 2
    ffn: int = 688
    vocab: int = 1000

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def hf_config(self) -> dict[str, int]:
        """The keys of a HuggingFace ``config.json`` that fill the mapping's parameters."""
        return {"num_attention_heads": self.heads, "num_key_value_heads": self.kv_groups, "vocab_size": self.vocab}


def hf_reference(c: Config) -> dict[str, torch.Tensor]:
    """The unsharded model under HuggingFace Llama names (fixed seed)."""
    g = torch.Generator().manual_seed(1234)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    d, h = c.head_dim, c.hidden
    ref = {"model.embed_tokens.weight": r(c.vocab, h), "model.norm.weight": r(h), "lm_head.weight": r(c.vocab, h)}
    for i in range(c.layers):
        p = f"model.layers.{i}"
        ref |= {
            f"{p}.input_layernorm.weight": r(h),
            f"{p}.post_attention_layernorm.weight": r(h),
            f"{p}.self_attn.q_proj.weight": r(c.heads * d, h),
            f"{p}.self_attn.k_proj.weight": r(c.kv_groups * d, h),
            f"{p}.self_attn.v_proj.weight": r(c.kv_groups * d, h),
            f"{p}.self_attn.o_proj.weight": r(h, c.heads * d),
            f"{p}.mlp.gate_proj.weight": r(c.ffn, h),
            f"{p}.mlp.up_proj.weight": r(c.ffn, h),
            f"{p}.mlp.down_proj.weight": r(h, c.ffn),
        }
    return ref


def megatron_full(c: Config, ref: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int | None]]:
    """Megatron-core names and fused layouts, with the dim each is sharded on (None: replicated)."""
    d, per = c.head_dim, c.heads // c.kv_groups
    out: dict[str, tuple[torch.Tensor, int | None]] = {
        "embedding.word_embeddings.weight": (ref["model.embed_tokens.weight"], 0),
        "decoder.final_layernorm.weight": (ref["model.norm.weight"], None),
        "output_layer.weight": (ref["lm_head.weight"], 0),
    }
    for i in range(c.layers):
        hf, mg = f"model.layers.{i}", f"decoder.layers.{i}"
        q, k, v = (ref[f"{hf}.self_attn.{x}_proj.weight"] for x in "qkv")
        qkv = torch.cat(
            [
                torch.cat([q[g * per * d : (g + 1) * per * d], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]])
                for g in range(c.kv_groups)
            ]
        )  # [q heads | k | v] per query group
        # [gate; up]; TP rank r holds [gate_r; up_r] (Megatron's partition_stride 2)
        fc1 = torch.cat([ref[f"{hf}.mlp.gate_proj.weight"], ref[f"{hf}.mlp.up_proj.weight"]])
        out |= {
            f"{mg}.input_layernorm.weight": (ref[f"{hf}.input_layernorm.weight"], None),
            f"{mg}.pre_mlp_layernorm.weight": (ref[f"{hf}.post_attention_layernorm.weight"], None),
            f"{mg}.self_attention.linear_qkv.weight": (qkv, 0),
            f"{mg}.self_attention.linear_proj.weight": (ref[f"{hf}.self_attn.o_proj.weight"], 1),
            f"{mg}.mlp.linear_fc1.weight": (fc1, 0),
            f"{mg}.mlp.linear_fc2.weight": (ref[f"{hf}.mlp.down_proj.weight"], 1),
        }
    return out


def tp_state(c: Config, rank: int) -> dict[str, StateValue]:
    """This rank's TP shards as Megatron splits them (replicated tensors whole)."""
    state: dict[str, StateValue] = {}
    for k, (x, dim) in megatron_full(c, hf_reference(c)).items():
        if dim is None:
            state[k] = x
            continue
        stride = 2 if k.endswith("linear_fc1.weight") else 1
        local = torch.cat(x.chunk(TP * stride, dim)[rank::TP], dim)  # how Megatron splits it
        shards = tp_shards(local, dim, rank, TP, stride, key=k)
        state[k] = shards[0] if len(shards) == 1 else shards
    return state


def worker(rank: int, mapping: str | Path, out: str, store: str) -> None:
    # One intra-op thread per core: idle OpenMP threads spinning next to gloo's cost ~10x here.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // TP))
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=TP, timeout=datetime.timedelta(seconds=60)
    )
    c = Config()
    parsed = shardsync.Mapping.parse(mapping, config=c.hf_config())
    stream = shardsync.full_params(tp_state(c, rank), parsed, consumers=0)
    t0 = time.perf_counter()
    if rank == 0:
        shardsync.save_safetensors(stream, out, overwrite=True)
    else:
        for _ in stream:  # rank 1 only sends; it still runs every step
            pass
    seconds = time.perf_counter() - t0
    stats = [None] * TP
    dist.all_gather_object(stats, (stream.stats, seconds))
    if rank == 0:
        report(c, Path(out), parsed, stats)
    dist.destroy_process_group()


def table(c: Config, mapping: shardsync.Mapping, got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> str:
    """One row per tensor role (layer numbers folded into ``*``): count, shape, source, check."""
    layout = shardsync.GlobalLayout.merge([local_layout(tp_state(c, r)) for r in range(TP)])
    fold = lambda name: re.sub(r"layers\.\d+\.", "layers.*.", name)  # noqa: E731
    rows: dict[str, list] = {}
    for t in shardsync.resolve(mapping, layout):
        row = rows.setdefault(fold(t.name), [0, list(t.shape), t.dtype, fold(t.sources[0]), True])
        row[0] += 1
        row[4] &= t.name in got and torch.equal(got[t.name], ref[t.name])
    body = [
        (name, str(n), str(shape), dtype, src, "yes" if ok else "NO")
        for name, (n, shape, dtype, src, ok) in sorted(rows.items())
    ]
    head = ("HF tensor", "n", "shape", "dtype", f"from (Megatron names, TP={TP} shards)", "equal")
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [head, *body]]
    return "\n".join(lines)


def report(c: Config, out: Path, mapping: shardsync.Mapping, stats: list) -> None:
    from safetensors.torch import load_file

    ref = hf_reference(c)
    got = load_file(str(out / "model.safetensors"))
    wrong = sorted(k for k in ref if k not in got or not torch.equal(got[k], ref[k]))
    extra = sorted(set(got) - set(ref))
    print(table(c, mapping, got, ref))
    s0, seconds = stats[0]
    total = sum(t.nbytes for t in got.values())
    print(f"wrote {out / 'model.safetensors'}: {len(got)} tensors, {total / 1e6:.1f} MB in {seconds:.3f} s")
    print(
        f"streaming: {s0.seconds:.3f} s ({total / s0.seconds / 1e9:.2f} GB/s) after "
        f"{s0.plan_seconds:.3f} s of planning; the rest is the safetensors writer"
    )
    for r, (s, _) in enumerate(stats):
        print(
            f"  rank {r}: sent {s.bytes_sent / 1e6:.1f} MB, received {s.bytes_received / 1e6:.1f} MB, "
            f"{s.collectives} messages, peak {s.peak_bytes / 1e6:.1f} MB held"
        )
    if wrong or extra:
        print(f"MISMATCH: wrong or missing {wrong}, unexpected {extra}")
        raise SystemExit(1)
    print(f"verified: all {len(ref)} tensors equal the unsharded reference")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mapping", default=MAPPING, help="shipped mapping name or mapping file (Megatron -> HF names)")
    ap.add_argument("--out", default="demo-out", help="directory for model.safetensors")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args.mapping, args.out, os.path.join(tmp, "store")), nprocs=TP)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
