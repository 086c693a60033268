"""Replica fingerprints: sampled, exact, cheap; a plain per-rank shard taken for a replica is an error."""

from __future__ import annotations

import pytest
import torch

from reference import arange_tensor
from shardsync.errors import LayoutError
from shardsync.layout import Box, GlobalLayout, LayoutEntry, LocalShard, shard_dim
from shardsync.pipeline import _planned
from shardsync.sources import LocalSource
from shardsync.sources.fingerprint import SAMPLE_SIZE, fingerprints, sample_positions
from shardsync.stream import full_params

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.bool,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.complex64,
    torch.float8_e4m3fn,
]


def test_sample_positions_are_fixed_spread_and_bounded() -> None:
    assert sample_positions(0) == [] and sample_positions(7) == list(range(7))
    for n in (17, 127, 1000, 1 << 40):
        p = sample_positions(n)
        assert p == sample_positions(n) and p == sorted(set(p)) and len(p) <= SAMPLE_SIZE
        assert p[0] == 0 and p[-1] == n - 1
        assert any(x < n // 2 for x in p[1:]) and any(n // 2 <= x < n - 1 for x in p)  # both halves
    assert len(sample_positions(1000)) == SAMPLE_SIZE


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fingerprint_sees_one_changed_sampled_element_in_any_dtype(dtype: torch.dtype) -> None:
    base = arange_tensor((17, 5))
    changed = base.clone()
    changed.view(-1)[sample_positions(base.numel())[5]] = -1  # a value no dtype confuses with 25
    cast = (lambda t: t % 3 == 0) if dtype == torch.bool else (lambda t: t.to(dtype))  # noqa: E731
    a, b = cast(base), cast(changed)
    assert not torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # the bytes differ at one place
    fa, fa2, fb = fingerprints([a, a.clone(), b])
    assert fa == fa2 and fa != fb and fa is not None and len(fa) == 16


def test_fingerprint_covers_shape_dtype_and_exact_bytes() -> None:
    a = arange_tensor((6, 4))
    same_values_other_shape = a.reshape(4, 6)
    neg_zero = torch.zeros(3)
    neg_zero[1] = -0.0
    prints = fingerprints([a, same_values_other_shape, a.double(), torch.zeros(3), neg_zero])
    assert len(set(prints)) == 5  # shape, dtype and -0.0 vs 0.0 all count


def test_fingerprint_reads_strided_views_in_place() -> None:
    a = arange_tensor((9, 7, 5))
    view = a.permute(2, 0, 1)[:, ::2]
    assert fingerprints([view]) == fingerprints([view.contiguous()])
    # 2**40 elements behind a zero stride: a copy (reshape, contiguous) would need 4 TiB
    huge = torch.ones(1).expand(1 << 40)
    assert fingerprints([huge]) == fingerprints([torch.ones(1).expand(1 << 40)])
    assert fingerprints([torch.tensor(3.5)]) != fingerprints([torch.tensor(2.5)])  # 0-d
    assert fingerprints([torch.zeros(0, 3)])[0] is not None
    assert fingerprints([torch.empty(4, device="meta")]) == [None]


def local_entries(state: dict) -> list[LayoutEntry]:
    return LocalSource(state).entries()


def test_plain_per_rank_shards_are_a_layout_error_naming_key_and_ranks() -> None:
    full = arange_tensor((6, 21))
    per_rank = [
        local_entries({"proj.weight": full.chunk(3, 1)[r].contiguous(), "norm": torch.ones(6)}) for r in range(3)
    ]
    with pytest.raises(LayoutError) as info:
        GlobalLayout.merge(per_rank)
    msg = str(info.value)
    assert "'proj.weight': ranks [0] vs ranks [1] vs ranks [2] hold box [0:6, 0:7]" in msg
    assert "this looks like a per-rank shard: wrap it in LocalShard, or use shardsync.from_megatron(model)" in msg
    assert "'norm'" not in msg


def test_replicas_that_agree_merge_and_disagreeing_ones_are_named() -> None:
    w = arange_tensor((5, 3), torch.bfloat16)
    other = w.clone()
    other[4, 2] += 1  # last element: always sampled
    per_rank = [local_entries({"w": w}), local_entries({"w": other}), local_entries({"w": w.clone()})]
    assert GlobalLayout.merge([per_rank[0], per_rank[2]])["w"].shape == (5, 3)
    with pytest.raises(LayoutError, match=r"'w': ranks \[0, 2\] vs ranks \[1\] hold box \[0:5, 0:3\]"):
        GlobalLayout.merge(per_rank)


def test_shards_of_the_same_box_are_compared_too() -> None:
    t = arange_tensor((8, 3))
    same = [local_entries({"w": shard_dim(t, 0, r % 2, 2)}) for r in range(4)]  # 2-way TP x 2-way DP
    assert [s.rank for s in GlobalLayout.merge(same)["w"].shards] == [0, 1, 2, 3]
    stage = [local_entries({"w": shard_dim(t + 100 * (r // 2), 0, r % 2, 2)}) for r in range(4)]
    with pytest.raises(LayoutError) as info:
        GlobalLayout.merge(stage)
    msg = str(info.value)
    assert "'w': ranks [0] vs ranks [2] hold box [0:4, 0:3]" in msg
    assert "'w': ranks [1] vs ranks [3] hold box [4:8, 0:3]" in msg
    assert "pipeline stages or expert-parallel ranks reuse the same names" in msg


def test_entries_without_fingerprints_are_not_compared() -> None:
    box = Box((0,), (4,))
    per_rank = [
        [("w", (4,), "float32", box)],
        [LayoutEntry("w", (4,), "float32", box)],
        local_entries({"w": torch.ones(4)}),
    ]  # a 4-tuple, no fingerprint, one fingerprint
    assert len(GlobalLayout.merge(per_rank)["w"].shards) == 3
    assert LayoutEntry("w", (4,), "float32", box).fingerprint is None


def test_list_of_shards_and_sharded_tensors_get_fingerprints() -> None:
    t = arange_tensor((4, 2))
    halves = [LocalShard(t[:2], (4, 2), (0, 0)), LocalShard(t[2:], (4, 2), (2, 0))]
    entries = local_entries({"a": halves, "b": t})
    assert [e.key for e in entries] == ["a", "a", "b"]
    assert len({e.fingerprint for e in entries}) == 3 and all(e.fingerprint for e in entries)


def test_new_values_reuse_the_cached_plan() -> None:
    # fingerprints change with the values every training step; the plan depends on the layout only
    _planned.cache_clear()
    first = full_params({"w": arange_tensor((3, 5))}, "w -> v")
    assert torch.equal(dict(first)["v"], arange_tensor((3, 5)))
    second = full_params({"w": arange_tensor((3, 5), start=7)}, "w -> v")
    assert torch.equal(dict(second)["v"], arange_tensor((3, 5), start=7))
    assert second.plan is first.plan and _planned.cache_info().hits == 1
