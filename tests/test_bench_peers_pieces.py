"""bench/bench_peers.py's pieces ceiling copies exactly the mapping's pieces: every rank's shards once
per consumer, each split piece into its place in its target (the reference's values there), and, on
every consumer's copy, every column of every split target from exactly one rank."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import bench_peers  # noqa: E402
import workload as W  # noqa: E402


@pytest.mark.parametrize("world", [2, 4])
def test_pieces_are_the_mappings_pieces_once_per_consumer(world: int) -> None:
    weights = W.full_weights(1)
    ref = W.reference(weights)
    parts = {part for split_into in W.SPLITS.values() for part in split_into}
    split = {name: t for name, t in ref.items() if name.rsplit(".", 1)[1] in parts}  # q, k, v, gate, up
    columns: Counter[tuple[str, int]] = Counter()  # (split target, column) -> pieces written there
    for rank in range(world):
        pairs = bench_peers.pieces(weights, rank, world)
        shards = sum(W.local_shard(w, k, rank, world)[0].nbytes for k, w in weights.items())
        assert sum(d.nbytes for d, _ in pairs) == world * shards
        for d, s in pairs:
            assert d.shape == s.shape
            if d.base is None:  # o, down: a shard's whole rows, into a buffer of their own
                assert d.flags.c_contiguous and s.flags.c_contiguous
                continue
            offset = (d.ctypes.data - d.base.ctypes.data) // d.itemsize
            width = d.shape[1]
            (name,) = [n for n, t in split.items() if np.array_equal(t[:, offset : offset + width], s)]
            assert d.base.shape == split[name].shape
            columns.update((name, c) for c in range(offset, offset + d.shape[1]))
    assert set(columns.values()) == {world}  # each consumer's copy: every column once
    assert {name for name, _ in columns} == set(split)
    assert len(columns) == sum(t.shape[1] for t in split.values())
