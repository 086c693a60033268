"""load from a torch DCP checkpoint saved as TP=2 shards into a TP=4 layout (4 gloo ranks), exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardsync
from multiproc import run_ranks
from shardsync import LocalShard, shard_dim

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _full() -> dict[str, torch.Tensor]:
    return {
        "qkv": torch.arange(17 * 6, dtype=torch.float32).reshape(17, 6),
        "o": torch.arange(5 * 13, dtype=torch.float32).reshape(5, 13) / 7,
    }


def _load_tp4(rank: int, world: int, path: str) -> tuple[bool, int]:
    full = _full()
    dst = {"qkv": shard_dim(torch.zeros(17, 6), 0, rank, world), "o_t": shard_dim(torch.zeros(13, 5), 1, rank, world)}
    result = shardsync.load(dst, path, ["o^T -> o_t"])
    exact = torch.equal(dst["qkv"].local, shard_dim(full["qkv"], 0, rank, world).local) and torch.equal(
        dst["o_t"].local, shard_dim(full["o"].T.contiguous(), 1, rank, world).local
    )
    return exact, result.stats.bytes_received


def test_dcp_tp2_loads_into_tp4(tmp_path: Path) -> None:
    full = _full()
    # the TP=2 shards of both ranks, saved from one process (boxes of any shape become DCP chunks)
    state = {
        "qkv": [shard_dim(full["qkv"], 0, r, 2) for r in range(2)],
        "o": [shard_dim(full["o"], 1, r, 2) for r in range(2)],
    }
    assert all(isinstance(s, LocalShard) for shards in state.values() for s in shards)
    shardsync.save(state, tmp_path / "dcp")
    results = run_ranks(_load_tp4, 4, str(tmp_path / "dcp"))
    assert [exact for exact, _ in results] == [True] * 4
    assert [received for _, received in results] == [0] * 4  # every rank reads its own boxes
