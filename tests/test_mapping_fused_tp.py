"""Blocked fused forms (fused_ffn, fused_qkv_old): ``tp=`` fixes the block count however the source is
chunked; without it, unequal shards along the fused dim are an error; and the fused-form registry."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from reference import arange_tensor, assemble
from shardsync.errors import MappingError
from shardsync.layout import Box, GlobalLayout, dtype_name
from shardsync.mapping import resolve
from shardsync.mapping.fused import FUSED_FORMS, FusedForm
from shardsync.mapping.vtensor import concat, split


def _layout(
    sources: dict[str, torch.Tensor],
    cuts: dict[str, tuple[int, Sequence[int]]] | None = None,
) -> GlobalLayout:
    """One rank per shard: ``cuts[key] = (dim, sizes)`` cuts that key into bands of those sizes."""
    ranks: list[list] = []
    for key, t in sources.items():
        dim, sizes = (cuts or {}).get(key, (0, [t.shape[0]]))
        at = 0
        for r, size in enumerate(sizes):
            while len(ranks) <= r:
                ranks.append([])
            off, shape = [0] * t.dim(), list(t.shape)
            off[dim], shape[dim] = at, size
            ranks[r].append((key, tuple(t.shape), dtype_name(t.dtype), Box(tuple(off), tuple(shape))))
            at += size
    return GlobalLayout.merge(ranks)


def _run(program, sources, cuts=None, **kw) -> dict[str, torch.Tensor]:
    return {t.name: assemble(t, sources) for t in resolve(program, _layout(sources, cuts), **kw)}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# fused_ffn, PyTorch [out, in] layout: W is 2 TP blocks of [GATE_r | UP_r] along dim 0, 3 rows each.
W_FFN = arange_tensor((12, 5))
GATE = torch.cat([W_FFN[0:3], W_FFN[6:9]])
UP = torch.cat([W_FFN[3:6], W_FFN[9:12]])
# fused_qkv_old, GQA H=4, G=2, head size 2, axis 0: per TP block [Q 2 heads | K 1 | V 1] = 8 rows.
QKV_ATTRS = "num_heads=4, num_key_value_groups=2, axis=0"
W_QKV = arange_tensor((16, 3), start=1000)
Q = torch.cat([W_QKV[0:4], W_QKV[8:12]])
K = torch.cat([W_QKV[4:6], W_QKV[12:14]])
V = torch.cat([W_QKV[6:8], W_QKV[14:16]])

# The same fused tensor as TP=2 shards (block count from the layout), and with tp=2 as one full tensor
# (full_tensor(), a DCP load), as TP=4 shards and as a DCP chunking that follows no TP boundary.
# (shard sizes of W_FFN, of W_QKV, the tp attribute)
CHUNKINGS = [
    ([6, 6], [8, 8], ""),
    ([12], [16], ", tp=2"),
    ([3, 3, 3, 3], [4, 4, 4, 4], ", tp=2"),
    ([5, 7], [7, 9], ", tp=2"),
]


@pytest.mark.parametrize("ffn_sizes, qkv_sizes, tp", CHUNKINGS)
def test_fused_ffn_split_is_the_same_however_the_source_is_chunked(ffn_sizes, qkv_sizes, tp) -> None:
    out = _run([f"w -> gate, up, fused_ffn, axis=0{tp}"], {"w": W_FFN}, {"w": (0, ffn_sizes)})
    _same(out, {"gate": GATE, "up": UP})


@pytest.mark.parametrize("ffn_sizes, qkv_sizes, tp", CHUNKINGS)
def test_fused_qkv_old_gqa_split_is_the_same_however_the_source_is_chunked(ffn_sizes, qkv_sizes, tp) -> None:
    out = _run([f"w -> q, k, v, fused_qkv_old, {QKV_ATTRS}{tp}"], {"w": W_QKV}, {"w": (0, qkv_sizes)})
    _same(out, {"k": K, "q": Q, "v": V})


@pytest.mark.parametrize("ffn_sizes, qkv_sizes, tp", CHUNKINGS)
def test_reverse_mode_reads_the_fused_model_tensor_the_same_way(ffn_sizes, qkv_sizes, tp) -> None:
    # Load programs (checkpoint -> model) run backwards to export the model's fused tensors.
    load = [f"hf.gate, hf.up -> w, fused_ffn, axis=0{tp}", f"hf.q, hf.k, hf.v -> wqkv, fused_qkv_old, {QKV_ATTRS}{tp}"]
    out = _run(load, {"w": W_FFN, "wqkv": W_QKV}, {"w": (0, ffn_sizes), "wqkv": (0, qkv_sizes)}, reverse=True)
    _same(out, {"hf.gate": GATE, "hf.k": K, "hf.q": Q, "hf.up": UP, "hf.v": V})


def test_tp_sets_the_block_count_of_a_fused_tensor_being_built() -> None:
    # Without a destination layout a built tensor has one block; tp=2 builds the TP=2 layout.
    parts = {"gate": GATE, "up": UP, "q": Q, "k": K, "v": V}
    out = _run(["gate, up -> w, fused_ffn, axis=0, tp=2", f"q, k, v -> wqkv, fused_qkv_old, {QKV_ATTRS}, tp=2"], parts)
    _same(out, {"w": W_FFN, "wqkv": W_QKV})
    out = _run(["gate, up -> w, fused_ffn, axis=0"], {"gate": GATE, "up": UP})
    assert torch.equal(out["w"], torch.cat([GATE, UP]))


def _err(program, sources, cuts=None, **kw) -> MappingError:
    with pytest.raises(MappingError) as info:
        resolve(program, _layout(sources, cuts), **kw)
    assert len(info.value.diagnostics) == 1, str(info.value)
    return info.value


def test_unequal_shards_without_tp_are_an_error_naming_key_sizes_and_tp() -> None:
    err = _err(["w -> gate, up, fused_ffn, axis=0"], {"w": W_FFN}, {"w": (0, [5, 7])})
    assert "'w' is cut along dim 0 into shards of sizes [5, 7]" in str(err)
    assert "tp=<tensor-parallel size" in str(err) and err.diagnostics[0].name == "w"
    err = _err(
        ["w -> wr, dtype='float64'", f"wr -> q, k, v, fused_qkv_old, {QKV_ATTRS}"], {"w": W_QKV}, {"w": (0, [4, 4, 8])}
    )
    assert "'wr' (source 'w') is cut along dim 0 into shards of sizes [4, 4, 8]" in str(err)
    assert err.diagnostics[0].index == 1
    # ... and in reverse mode, where the fused tensor is on the right of the load statement
    err = _err(["hf.gate, hf.up -> w, fused_ffn, axis=0"], {"w": W_FFN}, {"w": (0, [4, 8])}, reverse=True)
    assert "shards of sizes [4, 8]" in str(err)


def test_unequal_destination_shards_without_tp_are_an_error() -> None:
    dest = _layout({"w": W_FFN}, {"w": (0, [4, 8])})
    err = _err(["gate, up -> w, fused_ffn, axis=0"], {"gate": GATE, "up": UP}, dest=dest)
    assert "destination 'w' is cut along dim 0 into shards of sizes [4, 8]" in str(err)


def test_tp_that_does_not_fit_is_an_error_at_tp() -> None:
    stmt = "w -> gate, up, fused_ffn, axis=0, tp=4"
    err = _err([stmt], {"w": W_FFN})
    d = err.diagnostics[0]
    assert "dim 0 of 'w' has size 12, not divisible into 4 blocks (tp=4) of 2 equal parts" in d.message
    assert (d.col, d.name) == (stmt.index("tp=4"), "tp")
    err = _err(["gate, up -> w, fused_ffn, axis=0, tp=4"], {"gate": GATE, "up": UP})
    assert "dim 0 of 'gate' has size 6, not divisible into 4 blocks (tp=4)" in str(err)
    err = _err([f"w -> q, k, v, fused_qkv_old, {QKV_ATTRS}, tp=4"], {"w": W_QKV})
    assert "read in 4 blocks (tp=4), which must divide num_heads=4 and num_key_value_groups=2" in str(err)
    err = _err([f"q, k, v -> w, fused_qkv_old, {QKV_ATTRS}, tp=3"], {"q": Q, "k": K, "v": V})
    assert "read in 3 blocks (tp=3), which must divide" in str(err)


@pytest.mark.parametrize(
    "tp, message",
    [
        ("0", "tp=0 must be a positive integer"),
        ("-2", "tp=-2 must be a positive integer"),
        ("'2'", "tp='2' must be a positive integer"),
    ],
)
def test_tp_must_be_a_positive_integer(tp: str, message: str) -> None:
    err = _err([f"w -> gate, up, fused_ffn, tp={tp}"], {"w": W_FFN})
    assert message in str(err) and err.diagnostics[0].name == "tp"


def test_tp_is_refused_where_it_means_nothing_or_is_ambiguous() -> None:
    err = _err(["w -> q, k, v, fused_qkv, num_heads=4, num_key_value_groups=2, tp=2"], {"w": W_QKV})
    assert "fused_qkv does not take tp (it takes axis=, num_heads=, num_key_value_groups=)" in str(err)
    err = _err(["w -> w2, fused_ffn, axis=0, tp=2"], {"w": W_FFN})
    assert "tp= fixes the block count of one fused tensor; re-blocking `w -> w2` has two" in str(err)
    err = _err(["w -> a, b, axis=0, tp=2"], {"w": W_FFN})
    assert "takes only axis=" in str(err)


def test_a_registered_fused_form_is_parsed_checked_and_dispatched(monkeypatch) -> None:
    # One table entry plus its function: the parser's keyword, the attribute check and the dispatch
    # all come from FUSED_FORMS.
    def halves_swapped(st, ins, dim, count):
        lo, hi = split(ins[0], dim, [ins[0].shape[dim] // 2] * 2)
        return [concat([hi, lo], dim)]

    monkeypatch.setitem(
        FUSED_FORMS,
        "fused_swap",
        FusedForm(frozenset({"axis"}), frozenset({(1, 1)}), "`W -> W2, fused_swap`", halves_swapped),
    )
    out = _run(["w -> s, fused_swap, axis=0"], {"w": W_FFN})
    assert torch.equal(out["s"], torch.cat([W_FFN[6:], W_FFN[:6]]))
    err = _err(["w -> s, fused_swap, tp=2"], {"w": W_FFN})
    assert "fused_swap does not take tp (it takes axis=)" in str(err)
