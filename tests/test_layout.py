"""Layout model: boxes, shards, the global layout and its JSON round trip, DTensor conversion."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multiproc import run_ranks
from reference import arange_tensor
from shardsync.errors import LayoutError
from shardsync.layout import (
    Box,
    GlobalLayout,
    LocalShard,
    dtype_name,
    local_layout,
    local_shards,
    shard_dim,
    to_torch_dtype,
)


def test_box_arithmetic() -> None:
    a, b = Box((2, 0), (3, 4)), Box((0, 1), (4, 2))
    assert a.intersect(b) == Box((2, 1), (2, 2))
    assert a.intersect(Box((5, 0), (1, 1))) is None
    assert a.contains(Box((3, 1), (1, 3))) and not a.contains(b)
    assert a.permute((1, 0)) == Box((0, 2), (4, 3)) and a.stops == (5, 4) and a.numel == 12
    assert str(a) == "[2:5, 0:4]" and Box.full((3, 1)) == Box((0, 0), (3, 1))
    with pytest.raises(ValueError, match="differ in length"):
        Box((0,), (1, 2))


@pytest.mark.parametrize("n,world,sizes", [(17, 2, [9, 8]), (127, 4, [32, 32, 32, 31]), (5, 4, [2, 2, 1, 0])])
def test_shard_dim_like_torch_chunk(n: int, world: int, sizes: list[int]) -> None:
    full = arange_tensor((3, n))
    shards = [shard_dim(full, -1, r, world) for r in range(world)]
    assert [s.local.shape[1] for s in shards] == sizes
    assert torch.equal(torch.cat([s.local for s in shards], 1), full)
    assert [s.global_offset[1] for s in shards] == [sum(sizes[:r]) for r in range(world)]


def test_sharded_tensor_checks_bounds_naming_the_key() -> None:
    with pytest.raises(LayoutError, match=r"'w': shard at offset \[3, 0\].*does not fit.*\[4, 2\]"):
        LocalShard(torch.zeros(2, 2), (4, 2), (3, 0), key="w")
    with pytest.raises(LayoutError, match="same number of dims"):
        LocalShard(torch.zeros(2, 2), (4,), (0, 0))
    assert issubclass(LayoutError, ValueError)


def test_shard_box_follows_its_tensor_and_offset() -> None:
    """The box is made once, and again when the shard's tensor or offset is replaced."""
    s = LocalShard(torch.zeros(2, 3), (5, 3), (1, 0))
    assert s.box is s.box and s.box == Box((1, 0), (2, 3))
    s.local = torch.zeros(4, 3)
    assert s.box == Box((1, 0), (4, 3))
    s.global_offset = (0, 0)
    assert s.box == Box((0, 0), (4, 3))
    whole = LocalShard.whole(arange_tensor((3, 5)))
    assert (whole.global_shape, whole.global_offset, whole.box) == ((3, 5), (0, 0), Box((0, 0), (3, 5)))
    assert local_shards("w", torch.zeros(()))[0].box == Box((), ())


def test_shard_box_without_its_cache_and_with_numpy_offsets() -> None:
    """A shard made without ``__init__`` (unpickled from an older shardsync, a subclass that sets the
    fields itself) has a box; numpy offsets give a box of Python ints, and no other shard gets theirs."""
    old = LocalShard.__new__(LocalShard)
    old.local, old.global_shape, old.global_offset = torch.zeros(2, 3), (4, 3), (2, 0)
    assert old.box == Box((2, 0), (2, 3))
    s = LocalShard(torch.zeros(1, 7), (5, 7), (0, 0))  # a shape no other test makes a box of
    s.global_offset = (np.int64(3), np.int64(0))
    assert s.box == Box((3, 0), (1, 7)) and [type(o) for o in s.box.offsets] == [int, int]
    assert [type(o) for o in LocalShard(torch.zeros(1, 7), (5, 7), (3, 0)).box.offsets] == [int, int]


def test_local_shards_forms_and_errors() -> None:
    t = arange_tensor((4, 2))
    assert local_shards("a", t)[0].box == Box((0, 0), (4, 2))
    two = [shard_dim(t, 0, r, 2) for r in range(2)]
    assert [s.box for s in local_shards("a", two)] == [Box((0, 0), (2, 2)), Box((2, 0), (2, 2))]
    with pytest.raises(LayoutError, match="'a': unsupported state value int"):
        local_shards("a", 3)  # type: ignore[arg-type]
    bad = [two[0], LocalShard(torch.zeros(1, 2), (5, 2), (4, 0))]
    with pytest.raises(LayoutError, match="disagree on global shape"):
        local_shards("a", bad)


def test_global_layout_merge_and_json_round_trip() -> None:
    t = arange_tensor((17, 3), torch.bfloat16)
    per_rank = [local_layout({"w": shard_dim(t, 0, r, 2), "n": torch.ones(3)}) for r in range(2)]
    lay = GlobalLayout.merge(per_rank)
    assert lay.world_size == 2 and lay.keys() == ["n", "w"]
    assert lay["w"].dtype == "bfloat16" and lay["w"].offsets_along(0) == [0, 9]
    assert [s.rank for s in lay["n"].shards] == [0, 1]
    assert GlobalLayout.from_json(lay.to_json()) == lay


def test_merge_reports_every_disagreement() -> None:
    r0 = [("a", (4,), "float32", Box((0,), (2,))), ("b", (2,), "float32", Box((0,), (2,)))]
    r1 = [
        ("a", (5,), "float32", Box((2,), (2,))),
        ("b", (2,), "float16", Box((0,), (2,))),
        ("c", (2,), "float32", Box((1,), (2,))),
    ]
    with pytest.raises(LayoutError) as info:
        GlobalLayout.merge([r0, r1])
    msg = str(info.value)
    assert "'a': ranks disagree" in msg and "'b': ranks disagree" in msg
    assert "'c': rank 1 holds box [1:3] outside global shape [2]" in msg


def test_dtype_names() -> None:
    assert dtype_name(torch.bfloat16) == "bfloat16" and dtype_name("bf16") == "bfloat16"
    assert to_torch_dtype("half") is torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'f33'"):
        dtype_name("f33")


def _dtensor_worker(rank: int, world: int) -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from shardsync.layout import from_dtensor

    mesh = init_device_mesh("cpu", (world,))
    full = arange_tensor((7, 4))
    out = []
    for placement in (Shard(0), Shard(1), Replicate()):
        st = from_dtensor(distribute_tensor(full, mesh, [placement]))
        out.append((st.global_shape, st.global_offset, bool(torch.equal(st.local, full[st.box.slices()]))))
    return out


def test_from_dtensor_on_two_ranks() -> None:
    r0, r1 = run_ranks(_dtensor_worker, 2)
    assert r0 == [((7, 4), (0, 0), True), ((7, 4), (0, 0), True), ((7, 4), (0, 0), True)]
    assert r1 == [((7, 4), (4, 0), True), ((7, 4), (0, 2), True), ((7, 4), (0, 0), True)]


def test_shard_dim_refuses_a_rank_outside_the_world() -> None:
    from shardsync.errors import LayoutError

    with pytest.raises(LayoutError, match=r"shard_dim: rank 2 is outside a world of size 2; give 0 <= rank < world"):
        shard_dim(torch.zeros(4), 0, 2, 2)
