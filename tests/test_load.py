"""shardsync.load: strict checks, in-place writes, casts, mapping forms (one process), and a Megatron
TP=2 -> HF safetensors -> load round trip into TP=4, TP=1, uneven and replicated layouts (4 ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardsync
from dest_helpers import HF_DIMS, MAPPING, SliceSource, hf_state, megatron_shards
from multiproc import run_ranks
from reference import arange_tensor, assemble
from shardsync import LayoutError, LoadError, LocalShard, load
from shardsync.layout import Box
from shardsync.mapping import Piece, TargetSpec
from shardsync.planning.destinations import restrict_target


def _strict_case() -> tuple[dict, dict, list[str]]:
    src = {
        "a": arange_tensor((3, 4)),
        "ids": torch.arange(5),
        "extra": torch.ones(2),
        "wide": arange_tensor((2, 5)),
        "h": arange_tensor((6,), step=0.3),
    }
    dst = {
        "a": torch.zeros(3, 4),
        "ids_f": torch.zeros(5),
        "missing": torch.zeros(7),
        "narrow": torch.zeros(2, 4),
        "h": torch.zeros(6),
    }
    mapping = ["ids -> ids_f", "wide -> narrow", "h -> h, dtype='float16'"]
    return src, dst, mapping


def test_strict_names_every_problem_in_one_report_and_writes_nothing() -> None:
    src, dst, mapping = _strict_case()
    with pytest.raises(LoadError) as info:
        load(dst, src, mapping)
    e = info.value
    assert isinstance(e, ValueError)
    assert e.missing == ("missing",) and e.unexpected == ("extra",)
    assert [(m.name, m.kind, m.expected, m.got) for m in e.mismatched] == [
        ("h", "dtype", "float32", "float16"),
        ("ids_f", "dtype", "float32", "int64"),
        ("narrow", "shape", "[2, 4]", "[2, 5]"),
    ]
    lines = str(e).splitlines()
    assert lines[0].startswith("the source does not fit the destination (5 problems; nothing was written")
    assert lines[1] == (
        "  missing 'missing': nothing in the source maps to it; map a source to it, or "
        "declare it untouched with `_ -> missing`"
    )
    assert lines[2] == (
        "  unexpected 'extra' (source 'extra'): the destination has no such key; map it "
        "to one, or drop it with `extra -> _`"
    )
    assert lines[3].startswith(
        "  dtype of 'h': statement 2 `h -> h, dtype='float16'` gives float16, the destination is float32"
    )
    assert lines[4].startswith("  dtype of 'ids_f': statement 0 `ids -> ids_f` gives int64")
    assert lines[5].startswith(
        "  shape of 'narrow': statement 1 `wide -> narrow` gives [2, 5], the destination is [2, 4]"
    )
    assert all(not t.any() for t in dst.values())  # nothing written


def test_not_strict_loads_what_fits_and_returns_the_lists() -> None:
    src, dst, mapping = _strict_case()
    r = load(dst, src, mapping, strict=False)
    assert (r.missing, r.unexpected) == (("missing",), ("extra",))
    assert [m.name for m in r.mismatched] == ["h", "ids_f", "narrow"]
    assert torch.equal(dst["a"], src["a"])
    assert not dst["h"].any() and not dst["narrow"].any() and not dst["missing"].any()


def test_module_written_in_place_with_casts_to_its_dtype() -> None:
    model = torch.nn.ModuleDict({"lin": torch.nn.Linear(5, 3), "ln": torch.nn.LayerNorm(3)})
    model.to(torch.bfloat16)
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    ckpt = {
        "proj.w": arange_tensor((5, 3), step=0.37),
        "proj.b": arange_tensor((3,), start=2),
        "norm.w": arange_tensor((3,), step=0.11),
        "norm.b": arange_tensor((3,), start=-1),
    }
    mapping = ["proj.w^T -> lin.weight", "proj.b -> lin.bias", "norm.w -> ln.weight", "norm.b -> ln.bias"]
    r = load(model, ckpt, mapping)
    assert r.missing == r.unexpected == r.mismatched == ()
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before
    assert torch.equal(model["lin"].weight, ckpt["proj.w"].T.to(torch.bfloat16))
    assert torch.equal(model["ln"].weight, ckpt["norm.w"].to(torch.bfloat16))
    assert model["lin"].weight.requires_grad  # still the module's parameter


def test_untouched_dropped_and_star_on_the_destination_side() -> None:
    experts = arange_tensor((3 * 4, 5))
    dst = {f"experts.{e}.w": torch.zeros(4, 5) for e in range(3)} | {"keep": torch.full((2,), 7.0)}
    src = {"fused": experts, "stale": torch.ones(3)}
    load(dst, src, ["fused -> experts.*.w, axis=0", "stale -> _", "_ -> keep"])
    assert all(torch.equal(dst[f"experts.{e}.w"], experts[4 * e : 4 * e + 4]) for e in range(3))
    assert dst["keep"].tolist() == [7.0, 7.0]


def test_list_of_shards_on_one_rank_each_filled() -> None:
    full = arange_tensor((17, 3))
    mine = [LocalShard(torch.zeros(5, 3), (17, 3), (0, 0)), LocalShard(torch.zeros(4, 3), (17, 3), (13, 0))]
    load({"w": mine}, {"w": full})
    assert torch.equal(mine[0].local, full[:5]) and torch.equal(mine[1].local, full[13:])


def test_bad_arguments_are_layout_errors() -> None:
    with pytest.raises(LayoutError, match="the destination is a int; pass a state dict"):
        load(3, {})  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_restricting_a_target_to_a_box_equals_slicing_it(data: st.DataObject) -> None:
    tshape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    perm = tuple(data.draw(st.permutations(range(len(tshape)))))  # target dim i is source dim perm[i]
    src_shape = [0] * len(tshape)
    for i, p in enumerate(perm):
        src_shape[p] = tshape[i]
    src = arange_tensor(src_shape)
    cut = data.draw(st.integers(0, tshape[0]))  # two pieces along target dim 0
    pieces = []
    for lo, hi in ((0, cut), (cut, tshape[0])):
        if hi > lo:
            tbox = Box((lo,) + (0,) * (len(tshape) - 1), (hi - lo,) + tshape[1:])
            offsets, sizes = [0] * len(perm), [0] * len(perm)
            for i, p in enumerate(perm):
                offsets[p], sizes[p] = tbox.offsets[i], tbox.sizes[i]
            pieces.append(Piece("s", Box(tuple(offsets), tuple(sizes)), tbox, perm))
    spec = TargetSpec("t", tshape, "float32", tuple(pieces))
    offsets = tuple(data.draw(st.integers(0, n - 1)) for n in tshape)
    box = Box(offsets, tuple(data.draw(st.integers(1, n - o)) for n, o in zip(tshape, offsets)))
    cut_spec = restrict_target(spec, box, "t[box]", "float64", {"s": "float32"})
    want = assemble(spec, {"s": src})[box.slices()].to(torch.float64)
    assert torch.equal(assemble(cut_spec, {"s": src}), want)


# -- Megatron TP=2 -> HF safetensors -> load into other layouts, on 4 ranks ---------------------------


def _uneven(full: dict[str, torch.Tensor], rank: int) -> dict[str, Any]:
    """HF names, cut along each weight's TP dim at odd places (sizes differ per rank, some 1), bf16."""
    out: dict[str, Any] = {}
    for k, x in full.items():
        d = next(v for kind, v in HF_DIMS.items() if kind in k)
        if d is None:
            out[k] = torch.zeros_like(x, dtype=torch.bfloat16)
            continue
        n = x.shape[d]
        bounds = [0, n // 5, n // 5 + 1, n // 2 + 1, n]
        off = [0] * x.dim()
        off[d] = bounds[rank]
        size = list(x.shape)
        size[d] = bounds[rank + 1] - bounds[rank]
        out[k] = LocalShard(torch.zeros(size, dtype=torch.bfloat16), x.shape, off)
    return out


def _local(v: Any) -> torch.Tensor:
    return v.local if isinstance(v, LocalShard) else v


def _nbytes(state: dict[str, Any], itemsize: int = 4) -> int:
    return sum(_local(v).numel() * itemsize for v in state.values())


def _compare(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    return [
        k
        for k in want
        if not torch.equal(_local(got[k]), _local(want[k]).to(_local(got[k]).dtype))
        or _local(got[k]).dtype != _local(want[k]).dtype
    ]


def _load_worker(rank: int, world: int, path: str) -> dict:
    hf = hf_state()
    zeros = {k: torch.zeros_like(v) for k, v in hf.items()}
    uneven_ref = _cut_like(hf, _uneven(hf, rank))
    layouts = {  # name: (this rank's destination, its reference, mapping, reverse)
        "tp4": (megatron_shards(zeros, rank, 4), megatron_shards(hf, rank, 4), MAPPING, True),
        "tp1": (
            (megatron_shards(zeros, 0, 1), megatron_shards(hf, 0, 1), MAPPING, True)
            if rank == 0
            else ({}, {}, MAPPING, True)
        ),
        "replicated": (megatron_shards(zeros, rank % 2, 2), megatron_shards(hf, rank % 2, 2), MAPPING, True),
        "uneven bf16": (_uneven(hf, rank), {k: v.to(torch.bfloat16) for k, v in uneven_ref.items()}, None, False),
    }
    out = {}
    for name, (dst, want, mapping, reverse) in layouts.items():
        src = SliceSource(path)
        r = load(dst, src, mapping, reverse=reverse)
        out[name] = {
            "bad": _compare(dst, want),
            "read": src.bytes_read,
            "mine": _nbytes(dst),
            "received": r.stats.bytes_received,
            "sent": r.stats.bytes_sent,
            "keys": len(dst),
        }
    return out


def _cut_like(full: dict[str, torch.Tensor], shards: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in shards.items():
        out[k] = full[k][v.box.slices()] if isinstance(v, LocalShard) else full[k]
    return out


def test_megatron_tp2_to_hf_to_tp4_tp1_uneven_and_replicated(tmp_path: Path) -> None:
    hf = hf_state()
    tp2 = [megatron_shards(hf, r, 2) for r in range(2)]
    both = {k: [tp2[0][k], tp2[1][k]] if isinstance(tp2[0][k], LocalShard) else tp2[0][k] for k in tp2[0]}
    shardsync.save_safetensors(shardsync.full_params(both, MAPPING), tmp_path)
    back = shardsync.read_tensors(tmp_path)
    assert sorted(back) == sorted(hf) and all(torch.equal(back[k], hf[k]) for k in hf)

    records = run_ranks(_load_worker, 4, str(tmp_path), timeout=300)
    for rank, rec in enumerate(records):
        for name, r in rec.items():
            assert r["bad"] == [], (rank, name, r["bad"])
            assert r["received"] == r["sent"] == 0  # every rank reads the file itself
            assert r["read"] == r["mine"], (rank, name)  # ... only the boxes of its own shards
    assert records[0]["tp1"]["keys"] == 3 + 6 * 2 and records[1]["tp1"]["read"] == 0


def test_tied_weights_load_through_the_first_name() -> None:
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(7, 3), "head": torch.nn.Linear(3, 7, bias=False)})
    model["head"].weight = model["embed"].weight
    ckpt = {"embed.weight": arange_tensor((7, 3))}  # a tied checkpoint stores the weight once
    assert load(model, ckpt).missing == ()
    assert torch.equal(model["head"].weight, ckpt["embed.weight"])


def test_fused_qkv_reblocked_for_the_destination_shard_count() -> None:
    q, k, v = arange_tensor((16, 3)), arange_tensor((8, 3), start=100), arange_tensor((8, 3), start=200)

    def blocked(t: int) -> torch.Tensor:  # Megatron's older layout: [Q_r | K_r | V_r] per TP rank r
        return torch.cat([x for r in range(t) for x in (q.chunk(t)[r], k.chunk(t)[r], v.chunk(t)[r])])

    src = [LocalShard(x, (32, 3), (16 * r, 0)) for r, x in enumerate(blocked(2).chunk(2))]
    dst = [LocalShard(torch.zeros(8, 3), (32, 3), (8 * r, 0)) for r in range(4)]
    load({"w4": dst}, {"w2": src}, ["w2 -> w4, fused_qkv_old, num_heads=8, num_key_value_groups=4, axis=0"])
    assert torch.equal(torch.cat([s.local for s in dst]), blocked(4))


def test_a_training_step_keeps_the_cached_plan() -> None:
    # values change every step, the layout does not: the RL loop plans once and still moves new values
    src = {"w": torch.arange(17 * 3, dtype=torch.float32).reshape(17, 3)}
    dst = {"w": torch.zeros(3, 17)}
    first = shardsync.reshard(src, dst, ["w^T -> w"])
    src["w"].add_(0.5)
    second = shardsync.reshard(src, dst, ["w^T -> w"])
    assert second.plan is first.plan
    assert torch.equal(dst["w"], src["w"].T)
