"""A tiny Llama in HF and Megatron naming, with dense references, for the load and reshard tests.

Everything is built from one full HF state (arange-filled, odd vocab and ffn sizes). The Megatron form
is derived from it with plain torch ops written here, independently of shardsync: fused QKV
GQA-interleaved per query group ([q heads of the group | k | v]), fc1 blocked per TP rank
([gate_r | up_r] for each rank r of T).

``SliceSource`` is a lazy safetensors source for tests, implementing the Source protocol with
safetensors' own slicing and counting the bytes it reads.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from reference import arange_tensor
from shardsync.layout import Box, LayoutEntry, LocalShard, shard_dim
from shardsync.mapping import Mapping
from shardsync.sources import checkpoint_files, read_layout

__all__ = [
    "LAYERS",
    "H",
    "G",
    "D",
    "HIDDEN",
    "FFN",
    "VOCAB",
    "MAPPING",
    "hf_state",
    "megatron_full",
    "megatron_shards",
    "hf_shards",
    "SliceSource",
    "shard",
    "HF_DIMS",
    "MEGATRON_DIMS",
]

LAYERS, H, G, D, FFN, VOCAB = 2, 8, 4, 2, 20, 17
HIDDEN = H * D
#: The shipped Megatron -> HF mapping, with this model's sizes; this state holds fc1 as one
#: [gate_r; up_r] shard per rank (hand-made, not from_megatron), so fc1 is blocked per rank (fused_ffn).
_SHIPPED = (Path(__file__).resolve().parent.parent / "src/shardsync/mappings/megatron-llama.txt").read_text()
MAPPING = Mapping.parse(
    _SHIPPED.replace("mlp.up_proj.weight, axis=0", "mlp.up_proj.weight, fused_ffn, axis=0"),
    params={"num_heads": H, "num_key_value_groups": G, "vocab_size": VOCAB},
)

#: Tensor-parallel dim of each HF weight kind (None: replicated), as torch's Colwise/RowwiseParallel.
HF_DIMS = {
    "q_proj": 0,
    "k_proj": 0,
    "v_proj": 0,
    "o_proj": 1,
    "gate_proj": 0,
    "up_proj": 0,
    "down_proj": 1,
    "embed_tokens": 0,
    "lm_head": 0,
    "norm": None,
    "layernorm": None,
}
#: The same for Megatron names.
MEGATRON_DIMS = {
    "linear_qkv": 0,
    "linear_proj": 1,
    "linear_fc1": 0,
    "linear_fc2": 1,
    "word_embeddings": 0,
    "output_layer": 0,
    "layernorm": None,
}


def hf_state() -> dict[str, torch.Tensor]:
    """The full HF state; every tensor distinct (its own start) and fractional (casts show)."""
    shapes = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (HIDDEN,),
            f"{p}.post_attention_layernorm.weight": (HIDDEN,),
            f"{p}.self_attn.q_proj.weight": (H * D, HIDDEN),
            f"{p}.self_attn.k_proj.weight": (G * D, HIDDEN),
            f"{p}.self_attn.v_proj.weight": (G * D, HIDDEN),
            f"{p}.self_attn.o_proj.weight": (HIDDEN, H * D),
            f"{p}.mlp.gate_proj.weight": (FFN, HIDDEN),
            f"{p}.mlp.up_proj.weight": (FFN, HIDDEN),
            f"{p}.mlp.down_proj.weight": (HIDDEN, FFN),
        }
    return {k: arange_tensor(s, start=1000 * i, step=0.25) for i, (k, s) in enumerate(sorted(shapes.items()))}


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    per = H // G
    rows = []
    for g in range(G):
        rows += [q[g * per * D : (g + 1) * per * D], k[g * D : (g + 1) * D], v[g * D : (g + 1) * D]]
    return torch.cat(rows)


def megatron_full(hf: dict[str, torch.Tensor], tp: int) -> dict[str, torch.Tensor]:
    """The full Megatron tensors of ``hf`` for tensor-parallel degree ``tp`` (fc1 is blocked per rank)."""
    out = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        "output_layer.weight": hf["lm_head.weight"],
    }
    for i in range(LAYERS):
        m, p = f"decoder.layers.{i}", f"model.layers.{i}"
        gate, up = hf[f"{p}.mlp.gate_proj.weight"].chunk(tp), hf[f"{p}.mlp.up_proj.weight"].chunk(tp)
        out |= {
            f"{m}.input_layernorm.weight": hf[f"{p}.input_layernorm.weight"],
            f"{m}.pre_mlp_layernorm.weight": hf[f"{p}.post_attention_layernorm.weight"],
            f"{m}.self_attention.linear_qkv.weight": _qkv(*(hf[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv")),
            f"{m}.self_attention.linear_proj.weight": hf[f"{p}.self_attn.o_proj.weight"],
            f"{m}.mlp.linear_fc1.weight": torch.cat([x for r in range(tp) for x in (gate[r], up[r])]),
            f"{m}.mlp.linear_fc2.weight": hf[f"{p}.mlp.down_proj.weight"],
        }
    return out


def _dim(key: str, dims: dict[str, int | None]) -> int | None:
    return next(d for kind, d in dims.items() if kind in key)


def shard(
    full: dict[str, torch.Tensor],
    dims: dict[str, int | None],
    rank: int,
    world: int,
) -> dict[str, torch.Tensor | LocalShard]:
    """``rank``'s tensor-parallel shards of ``full`` (cloned: a destination must own its memory)."""
    out: dict[str, torch.Tensor | LocalShard] = {}
    for k, x in full.items():
        d = _dim(k, dims)
        if d is None:
            out[k] = x.clone()
        else:
            s = shard_dim(x, d, rank, world)
            out[k] = LocalShard(s.local.clone(), s.global_shape, s.global_offset)
    return out


def megatron_shards(
    hf: dict[str, torch.Tensor],
    rank: int,
    tp: int,
) -> dict[str, torch.Tensor | LocalShard]:
    return shard(megatron_full(hf, tp), MEGATRON_DIMS, rank, tp)


def hf_shards(hf: dict[str, torch.Tensor], rank: int, tp: int) -> dict[str, torch.Tensor | LocalShard]:
    return shard(hf, HF_DIMS, rank, tp)


class SliceSource:
    """A safetensors checkpoint as a Source: every rank holds every tensor whole and reads only the
    boxes asked for (safetensors slicing); ``bytes_read`` counts them.

    Example:
        >>> src = SliceSource("ckpt/")    # doctest: +SKIP
    """

    def __init__(self, path: str | Path) -> None:
        self.layout = read_layout(path)
        self.files = {}
        for f in checkpoint_files(path):
            with safe_open(str(f), framework="pt") as fh:
                self.files |= dict.fromkeys(fh.keys(), f)
        self.bytes_read = 0

    def entries(self) -> list[LayoutEntry]:
        return [LayoutEntry(k, m.shape, m.dtype, Box.full(m.shape)) for k, m in sorted(self.layout.tensors.items())]

    def read(self, key: str, box: Box) -> torch.Tensor:
        with safe_open(str(self.files[key]), framework="pt") as fh:
            x = fh.get_slice(key)[box.slices()] if box.ndim else fh.get_tensor(key)
        self.bytes_read += x.numel() * x.element_size()
        return x

    def device(self) -> torch.device:
        return torch.device("cpu")
