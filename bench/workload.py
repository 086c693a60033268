"""The peers workload (issue 11), shared by shardsync's and the peers' benchmark workers.

A Paddle-style stack of ``[in, out]`` Linear weights, fp32: per layer a fused ``qkv`` ``[h, 3h]`` and a
fused ``gate_up`` ``[h, 2f]`` (column parallel: sharded along dim 1), ``o`` ``[h, h]`` and ``down``
``[f, h]`` (row parallel: sharded along dim 0). With 8 layers, hidden 1024 and ffn 2048 that is
0.336 GB. The mapping splits qkv and gate_up along axis 1 and transposes ``o``; ``down`` passes
through. Only numpy is imported here, so the Paddle worker (another venv) can use it too.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "LAYERS",
    "HIDDEN",
    "FFN",
    "MAPPING",
    "SPLITS",
    "full_weights",
    "shard_spec",
    "local_shard",
    "reference",
    "total_bytes",
]

LAYERS, HIDDEN, FFN = 8, 1024, 2048
MAPPING = [
    "layers.$LAYER_ID.qkv -> layers.$LAYER_ID.q, layers.$LAYER_ID.k, layers.$LAYER_ID.v, axis=1",
    "layers.$LAYER_ID.gate_up -> layers.$LAYER_ID.gate, layers.$LAYER_ID.up, axis=1",
    "layers.$LAYER_ID.o^T -> layers.$LAYER_ID.o_t",
    "layers.$LAYER_ID.down -> layers.$LAYER_ID.down",
]
#: The fused weights the mapping splits along axis 1 (their sharded dim), into these parts, in order.
SPLITS = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}


def full_weights(layers: int = LAYERS, hidden: int = HIDDEN, ffn: int = FFN) -> dict[str, np.ndarray]:
    """Every full weight (float32, seeded), by source key."""
    rng = np.random.default_rng(0)
    out: dict[str, np.ndarray] = {}
    for i in range(layers):
        p = f"layers.{i}"
        out[f"{p}.qkv"] = rng.standard_normal((hidden, 3 * hidden), dtype=np.float32)
        out[f"{p}.o"] = rng.standard_normal((hidden, hidden), dtype=np.float32)
        out[f"{p}.gate_up"] = rng.standard_normal((hidden, 2 * ffn), dtype=np.float32)
        out[f"{p}.down"] = rng.standard_normal((ffn, hidden), dtype=np.float32)
    return out


def shard_spec(key: str) -> int:
    """The dim ``key`` is sharded along: 1 for column parallel, 0 for row parallel."""
    return 1 if key.endswith(("qkv", "gate_up")) else 0


def local_shard(full: np.ndarray, key: str, rank: int, world: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """Rank ``rank``'s contiguous shard of ``full`` (equal parts) and its global offset."""
    dim = shard_spec(key)
    size = full.shape[dim] // world
    index = [slice(None)] * full.ndim
    index[dim] = slice(rank * size, (rank + 1) * size)
    offset = [0] * full.ndim
    offset[dim] = rank * size
    return np.ascontiguousarray(full[tuple(index)]), tuple(offset)


def reference(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The mapped targets, by name, computed directly with numpy (views, not copies)."""
    out: dict[str, np.ndarray] = {}
    for key, w in weights.items():
        p, kind = key.rsplit(".", 1)
        if kind in SPLITS:
            out.update(zip((f"{p}.{part}" for part in SPLITS[kind]), np.split(w, len(SPLITS[kind]), axis=1)))
        elif kind == "o":
            out[f"{p}.o_t"] = w.T
        else:
            out[key] = w
    return out


def total_bytes(weights: dict[str, np.ndarray]) -> int:
    """Bytes of every full target (what each consumer receives)."""
    return sum(w.nbytes for w in weights.values())
