"""A DTensor's region from its placements (``Shard``, ``_StridedShard``) against torch's own splitting.

The reference is torch itself, without a process group: a full arange tensor cut left to right over
the mesh dims by each placement's ``_split_tensor`` (what ``distribute_tensor`` does), and torch's
``_compute_local_shape_and_global_offset`` for the local shape and first offset.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard, _StridedShard

from reference import arange_tensor
from shardsync.layout import Box, Split, shard_boxes
from shardsync.layout.placements import dim_runs


def torch_local(
    full: torch.Tensor, mesh: tuple[int, ...], coord: tuple[int, ...], placements: list[Placement]
) -> torch.Tensor:
    """The rank's local tensor as torch cuts it."""
    t = full
    for m, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            t = p._split_tensor(t, mesh[m], with_padding=False)[0][coord[m]]
    return t


def ours(
    full: torch.Tensor, mesh: tuple[int, ...], coord: tuple[int, ...], placements: list[Placement]
) -> tuple[torch.Tensor, list[tuple[Box, Box]]]:
    splits = [
        Split(p.dim, mesh[m], coord[m], p.split_factor if isinstance(p, _StridedShard) else 1)
        for m, p in enumerate(placements)
        if isinstance(p, (Shard, _StridedShard))
    ]
    boxes = shard_boxes(tuple(full.shape), splits)
    local = torch.full(boxes[-1][1].stops, -1.0)
    for glob, loc in boxes:
        local[loc.slices()] = full[glob.slices()]
    return local, boxes


def placement(kind: str, dim: int, factor: int) -> Placement:
    return {"S": Shard(dim), "R": Replicate(), "SS": _StridedShard(dim, split_factor=factor)}[kind]


@settings(max_examples=300, deadline=None)
@given(
    shape=st.lists(st.integers(0, 13), min_size=1, max_size=2),
    mesh=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    data=st.data(),
)
def test_regions_equal_torch_splitting(shape: list[int], mesh: list[int], data: st.DataObject) -> None:
    placements = [
        placement(
            data.draw(st.sampled_from(["S", "R", "SS"])),
            data.draw(st.integers(0, len(shape) - 1)),
            data.draw(st.integers(1, 4)),
        )
        for _ in mesh
    ]
    coord = tuple(data.draw(st.integers(0, n - 1)) for n in mesh)
    full = arange_tensor(shape)
    want = torch_local(full, tuple(mesh), coord, placements)
    got, boxes = ours(full, tuple(mesh), coord, placements)
    assert torch.equal(got, want)
    shape_t, offset_t = _compute_local_shape_and_global_offset(shape, mesh, list(coord), placements)
    assert tuple(got.shape) == shape_t
    if got.numel():
        assert boxes[0][0].offsets == offset_t
    covered = sum(g.numel for g, _ in boxes)
    assert covered == got.numel()  # boxes do not overlap: each local element is one global element


@pytest.mark.parametrize("n", [17, 127, 8, 3])
def test_fsdp_over_tp_ranks_tile_the_tensor(n: int) -> None:
    """(dp, tp) = 2 x 2, placements (_StridedShard(0, 2), Shard(0)): the four regions tile [0, n)."""
    seen: list[int] = []
    for dp in range(2):
        for tp in range(2):
            for start, length in dim_runs(n, [Split(0, 2, dp, split_factor=2), Split(0, 2, tp)]):
                seen += range(start, start + length)
    assert sorted(seen) == list(range(n))


def test_strided_rank_holds_several_runs() -> None:
    assert dim_runs(17, [Split(0, 2, 1, split_factor=2)]) == [(5, 4), (13, 4)]
    assert dim_runs(127, [Split(0, 4, 3, split_factor=2)]) == [(48, 16), (112, 15)]
    boxes = shard_boxes((17, 3), [Split(0, 2, 1, split_factor=2)])
    assert boxes == [(Box((5, 0), (4, 3)), Box((0, 0), (4, 3))), (Box((13, 0), (4, 3)), Box((4, 0), (4, 3)))]


def test_empty_region_and_bad_split() -> None:
    assert shard_boxes((1, 4), [Split(0, 2, 1)]) == [(Box((1, 0), (0, 4)), Box((0, 0), (0, 4)))]
    with pytest.raises(ValueError, match="index < parts"):
        Split(0, 2, 2)
