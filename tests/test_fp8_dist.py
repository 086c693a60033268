"""Block FP8 on 2 gloo ranks (tier 2): tensor-parallel shards that cut through blocks, and
``convert --nproc 2``.

Each rank holds a shard of the codes and the scales of the blocks its shard touches (the block rows
or columns on a shard boundary are held by both ranks). Values are checked against the block-by-block
reference of test_fp8.py, exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from multiproc import run_ranks
from reference import arange_tensor
from shardsync import full_params, load, save_hf
from shardsync.cli import main
from shardsync.errors import ShardsyncError
from shardsync.layout import Box, LocalShard, shard_dim
from shardsync.quant import quantize, scale_box, scale_shape
from shardsync.sources import Fp8Source
from test_fp8 import SHAPES, codes, fp8_checkpoint, reference, scales

BLOCK = (128, 128)
#: name -> (shape, the dim tensor parallelism cuts): 300 rows cut 150 | 150 and 257 columns cut 129 | 128
#: both cut through a block of 128
WEIGHTS = {"rows.weight": ((300, 17), 0), "cols.weight": ((129, 257), 1)}


def full_fp8() -> dict[str, torch.Tensor]:
    out = {}
    for k, (name, (shape, _)) in enumerate(WEIGHTS.items()):
        out[name], out[name + "_scale_inv"] = codes(shape, start=k), scales(shape, BLOCK)
    return out


def scale_shard(full: dict[str, torch.Tensor], name: str, box: Box, drop_last: bool = False) -> LocalShard:
    """The scales of the blocks ``box`` touches (``drop_last``: one block short, to provoke the error)."""
    s = full[name + "_scale_inv"]
    need = scale_box(box, BLOCK)
    if drop_last:
        need = Box(
            need.offsets, (need.sizes[0], need.sizes[1] - 1) if WEIGHTS[name][1] else (need.sizes[0] - 1, need.sizes[1])
        )
    return LocalShard(s[need.slices()].clone(), s.shape, need.offsets)


def tp_state(rank: int, world: int, drop: bool = False) -> dict[str, Any]:
    full = full_fp8()
    state: dict[str, Any] = {"norm": arange_tensor((17,), step=0.5)}
    for name, (_, dim) in WEIGHTS.items():
        shard = shard_dim(full[name], dim, rank, world)
        state[name] = shard
        state[name + "_scale_inv"] = scale_shard(full, name, shard.box, drop and rank == 1)
    return state


def _stream_and_save(rank: int, world: int, tmp: str) -> dict[str, Any]:
    full = full_fp8()
    want = {name: reference(full[name], full[name + "_scale_inv"], BLOCK) for name in WEIGHTS}
    got = dict(full_params(Fp8Source(tp_state(rank, world), block=BLOCK)))
    out: dict[str, Any] = {"names": sorted(got), "exact": {n: torch.equal(got[n], want[n]) for n in WEIGHTS}}
    save_hf(Fp8Source(tp_state(rank, world), block=BLOCK), Path(tmp) / "bf16", dtype="bf16", max_file_size=6000)
    try:
        list(full_params(Fp8Source(tp_state(rank, world, drop=True), block=BLOCK)))
    except ShardsyncError as exc:
        out["missing scales"] = str(exc)
    return out


def test_tp2_shards_cutting_blocks_dequantise_exactly(tmp_path: Path) -> None:
    results = run_ranks(_stream_and_save, 2, str(tmp_path), timeout=600)
    full = full_fp8()
    for r in results:
        assert r["names"] == ["cols.weight", "norm", "rows.weight"]  # no scale key
        assert r["exact"] == {"rows.weight": True, "cols.weight": True}
        # rank 1 holds cols 129..256 but only the scales of block column 1: both ranks name it
        assert "'cols.weight'" in r["missing scales"] and "rank 1" in r["missing scales"]
    written = {k: v for f in (tmp_path / "bf16").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert sorted(written) == ["cols.weight", "norm", "rows.weight"]
    for name in WEIGHTS:
        want = reference(full[name], full[name + "_scale_inv"], BLOCK).to(torch.bfloat16)
        assert torch.equal(written[name], want), name


def _into_fp8_shards(rank: int, world: int, ckpt: str, tmp: str) -> dict[str, Any]:
    """Load an FP8 checkpoint as it is into TP shards of codes and scales; quantise TP state out."""
    full = full_fp8()
    dest: dict[str, Any] = {"norm": torch.zeros(17)}
    for name, (shape, dim) in WEIGHTS.items():
        shard = shard_dim(torch.zeros(shape, dtype=torch.float8_e4m3fn), dim, rank, world)
        dest[name] = shard
        dest[name + "_scale_inv"] = scale_shard(
            {name + "_scale_inv": torch.zeros_like(full[name + "_scale_inv"])}, name, shard.box
        )
    load(dest, ckpt)
    same = {}
    for key, value in dest.items():
        if isinstance(value, LocalShard):
            want = full[key][value.box.slices()]
            same[key] = torch.equal(value.local.view(torch.uint8), want.view(torch.uint8))
    names = {
        new + sfx: old + sfx for old, new in (("rows.weight", "r"), ("cols.weight", "c")) for sfx in ("", "_scale_inv")
    }
    renamed = {
        new: LocalShard(torch.zeros_like(dest[old].local), dest[old].global_shape, dest[old].box.offsets)
        for new, old in names.items()
    }
    load(renamed | {"n": torch.zeros(17)}, ckpt, ["rows.weight -> r", "cols.weight -> c", "norm -> n"])
    for new, value in renamed.items():
        same["renamed " + new] = torch.equal(value.local.view(torch.uint8), dest[names[new]].local.view(torch.uint8))
    values = {
        name: shard_dim(arange_tensor(shape, step=0.0137, start=-30), dim, rank, world)
        for name, (shape, dim) in WEIGHTS.items()
    }
    save_hf(values, Path(tmp) / "fp8", quantize="fp8", max_file_size=6000)
    return same


def test_tp2_fp8_shards_and_quantised_writes(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    save_hf(full_fp8() | {"norm": arange_tensor((17,), step=0.5)}, ckpt)  # no dtype: written as they are
    results = run_ranks(_into_fp8_shards, 2, str(ckpt), str(tmp_path), timeout=600)
    for r in results:
        assert r == {
            k: True
            for k in (
                "rows.weight",
                "rows.weight_scale_inv",
                "cols.weight",
                "cols.weight_scale_inv",
                "renamed r",
                "renamed r_scale_inv",
                "renamed c",
                "renamed c_scale_inv",
            )
        }
    written = {k: v for f in (tmp_path / "fp8").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert len(list((tmp_path / "fp8").glob("*.safetensors"))) > 1  # files split across the two writers
    for name, (shape, _) in WEIGHTS.items():
        q, s = quantize(arange_tensor(shape, step=0.0137, start=-30), BLOCK)
        assert torch.equal(written[name].view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(written[name + "_scale_inv"], s), name


def test_convert_nproc2_dtype_dequantises_exactly(tmp_path: Path) -> None:
    held = fp8_checkpoint(tmp_path / "src", block=(64, 32))
    assert (
        main(
            [
                "convert",
                str(tmp_path / "src"),
                str(tmp_path / "out"),
                "--dtype",
                "bf16",
                "--nproc",
                "2",
                "--max-shard-size",
                "8000",
                "--quiet",
            ]
        )
        == 0
    )
    files = list((tmp_path / "out").glob("*.safetensors"))
    got = {k: v for f in files for k, v in load_file(str(f)).items()}
    assert len(files) > 1 and not [k for k in got if k.endswith("_scale_inv")]
    for name in SHAPES:
        want = reference(held[name], held[name + "_scale_inv"], (64, 32)).to(torch.bfloat16)
        assert torch.equal(got[name], want), name


def _quantise_into_fp8_shards(rank: int, world: int, ckpt: str) -> dict[str, bool]:
    """Load a checkpoint of values into TP shards of codes and scales that cut blocks."""
    dest: dict[str, Any] = {"norm": torch.zeros(17)}
    for name, (shape, dim) in WEIGHTS.items():
        shard = shard_dim(torch.zeros(shape, dtype=torch.float8_e4m3fn), dim, rank, world)
        dest[name] = shard
        s = torch.zeros(scale_shape(shape, BLOCK))
        dest[name + "_scale_inv"] = scale_shard({name + "_scale_inv": s}, name, shard.box)
    load(dest, ckpt)
    same = {}
    for name, (shape, _) in WEIGHTS.items():
        q, s = quantize(arange_tensor(shape, step=0.0137, start=-30), BLOCK)
        codes_shard, scale_shard_ = dest[name], dest[name + "_scale_inv"]
        same[name] = torch.equal(codes_shard.local.view(torch.uint8), q[codes_shard.box.slices()].view(torch.uint8))
        same[name + "_scale_inv"] = torch.equal(scale_shard_.local, s[scale_shard_.box.slices()])
    return same


def test_tp2_values_quantised_into_fp8_and_scale_shards(tmp_path: Path) -> None:
    values = {name: arange_tensor(shape, step=0.0137, start=-30) for name, (shape, _) in WEIGHTS.items()}
    save_hf(values | {"norm": arange_tensor((17,), step=0.5)}, tmp_path / "values")
    results = run_ranks(_quantise_into_fp8_shards, 2, str(tmp_path / "values"), timeout=600)
    # the block rows (columns) on the shard boundary are held by both ranks, with the same scales
    assert (
        results
        == [{k: True for k in ("rows.weight", "rows.weight_scale_inv", "cols.weight", "cols.weight_scale_inv")}] * 2
    )
