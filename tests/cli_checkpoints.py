"""Small checkpoints of every format for the command line tests, and what they map to.

``state``: two layers of a fused QKV (12 x 5: two query heads, one key/value group, head size 3),
bf16 norms, and an embedding of 17 rows (odd: it splits unevenly across two shards). Written as one
safetensors file, as sharded safetensors with an index, and as a TP=2 torch DCP checkpoint
(``shardsync.save``, the 2-D tensors cut along dim 0). ``MAPPING`` names them as HF does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

import shardsync
from reference import arange_tensor
from shardsync.layout import shard_dim

__all__ = ["Checkpoints", "build", "state", "mapped", "MAPPING"]

MAPPING = (
    "layers.$LAYER_ID.qkv -> model.layers.$LAYER_ID.q, model.layers.$LAYER_ID.k, "
    "model.layers.$LAYER_ID.v, fused_qkv, num_heads=2, num_key_value_groups=1, axis=0\n"
    "layers.$LAYER_ID.norm -> model.layers.$LAYER_ID.norm\n"
    "embed -> model.embed\n"
)


def state() -> dict[str, torch.Tensor]:
    out = {"embed": arange_tensor((17, 5), start=1000)}
    for i in range(2):
        out[f"layers.{i}.qkv"] = arange_tensor((12, 5), start=100 * i)
        out[f"layers.{i}.norm"] = arange_tensor((5,), torch.bfloat16, start=10 * i)
    return out


def mapped() -> dict[str, torch.Tensor]:
    """``state()`` through ``MAPPING``, written out by hand."""
    s = state()
    out = {"model.embed": s["embed"]}
    for i in range(2):
        qkv = s[f"layers.{i}.qkv"]
        out[f"model.layers.{i}.q"], out[f"model.layers.{i}.k"], out[f"model.layers.{i}.v"] = (
            qkv[0:6],
            qkv[6:9],
            qkv[9:12],
        )
        out[f"model.layers.{i}.norm"] = s[f"layers.{i}.norm"]
    return out


@dataclass(frozen=True)
class Checkpoints:
    root: Path
    single: Path  # one model.safetensors
    sharded: Path  # model-0000k-of-00003.safetensors + index
    dcp: Path  # TP=2 DCP
    mapping: Path  # MAPPING as a .txt file

    @property
    def all(self) -> dict[str, Path]:
        return {"single": self.single, "sharded": self.sharded, "dcp": self.dcp}


def build(root: Path) -> Checkpoints:
    s = state()
    shardsync.save_hf(s, root / "single")
    shardsync.save_hf(s, root / "sharded", max_file_size=400)
    tp = {k: [shard_dim(v, 0, r, 2) for r in range(2)] if v.ndim == 2 else v for k, v in s.items()}
    shardsync.save(tp, root / "dcp")
    (root / "m.txt").write_text(MAPPING)
    return Checkpoints(root, root / "single", root / "sharded", root / "dcp", root / "m.txt")
