"""Digests in one process: the element hash against a pure-Python reference, layout independence,
the mapping's transforms, collision properties, files, and ``verify`` (tier 1)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardsync
from dest_helpers import MAPPING, hf_state, megatron_shards
from reference import arange_tensor
from shardsync import VerifyReport, digest, verify
from shardsync.errors import LayoutError, MappingError
from shardsync.exec import box_hash
from shardsync.exec.box_hash import box_sum, finish, tensor_digest
from shardsync.layout import LocalShard, shard_dim
from shardsync.layout.dtypes import dtype_name

M64 = (1 << 64) - 1
SEED_A, SEED_B = 0x243F6A8885A308D3, 0x13198A2E03707344  # the seeds of the row and column weights


def _mix(z: int) -> int:
    # splitmix64's finaliser, on Python ints (the reference the numpy code is checked against)
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & M64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def weight(q: int, c: int, group: int = 1) -> int:
    """The weight of the element at row ``q``, column (word) ``c`` of a target whose elements are packed
    ``group`` to a 32-bit word: ``A(q) * B(c // group) * 2^((32 // group) * (c % group))`` mod 2^64."""
    return (_mix(q ^ SEED_A) | 1) * (_mix(c // group ^ SEED_B) | 1) << (32 // group) * (c % group) & M64


def columns(shape: tuple[int, ...]) -> int:
    """The target's columns: its last dim, times the dims before it while fewer than 64 (and at most 2^16)."""
    cols, dims = (shape[-1] if shape else 1), list(shape[:-1])
    while dims and cols < 64 and cols * dims[-1] <= 1 << 16:
        cols *= dims.pop()
    return cols


def ref_sum(t: torch.Tensor, shape: tuple[int, ...] | None = None, base: int = 0) -> int:
    """Sum of ``weight(q, c) * bits`` over ``t`` (row-major), read from its raw little-endian bytes; the
    target has ``shape`` (default ``t``'s) and ``t`` starts at its flat element index ``base``."""
    shape = tuple(t.shape) if shape is None else shape
    t = t.contiguous().reshape(-1)
    size = t.element_size()
    step, words = min(size, 8), max(1, size // 8)
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    values = [int.from_bytes(raw[i : i + step], "little") for i in range(0, len(raw), step)]
    if step == 8:  # 8-byte words are xor-shifted: a sign flip changes a low bit too
        values = [b ^ (b >> 32) for b in values]
    width = columns(shape) * words
    group = 4 // size if size < 4 else 1
    return sum(weight(*divmod(base * words + k, width), group) * b for k, b in enumerate(values)) & M64


def _bumped(t: torch.Tensor, index: tuple[int, ...]) -> torch.Tensor:
    """``t`` with the element at ``index`` one ulp up (its bit pattern plus one: values are >= 0)."""
    out = t.clone()
    out.view({2: torch.int16, 4: torch.int32}[t.element_size()])[index] += 1
    assert (out != t).sum() == 1 and out[index] > t[index]
    return out


@pytest.mark.parametrize(
    "tensor",
    [
        arange_tensor((17, 5), step=0.37),
        arange_tensor((127,), step=0.1).to(torch.bfloat16),
        arange_tensor((3, 7, 2), step=-1.5).double(),
        (torch.arange(17) - 8).to(torch.int8),
        torch.arange(13) % 3 == 0,
        arange_tensor((11,), step=0.5).to(torch.float8_e4m3fn),
        torch.complex(arange_tensor((5, 3)).double(), arange_tensor((5, 3), start=7).double()),
        torch.tensor(3.25),
        torch.zeros(0, 4),
        arange_tensor((5, 4, 3, 3), step=0.5),
        arange_tensor((19, 1)),
        arange_tensor((3, 40, 7), step=0.3).to(torch.bfloat16),
        arange_tensor((2, 300, 300), step=0.01),
    ],
    ids=lambda t: f"{dtype_name(t.dtype)}{list(t.shape)}",
)
def test_box_sum_matches_the_reference(tensor: torch.Tensor) -> None:
    assert box_sum(tensor, tuple(tensor.shape), (0,) * tensor.dim()) == ref_sum(tensor)


def test_rows_and_columns_of_a_large_or_wide_target() -> None:
    # a row index past 2^32 (a box deep in a huge target), and a 1-d target wider than the cached
    # column weights (its slice is computed per run)
    values = arange_tensor((2, 3), step=0.3)
    assert box_sum(values, (1 << 33, 3), (1 << 32, 0)) == ref_sum(values, (1 << 33, 3), 3 << 32)
    row = arange_tensor((7,), step=0.3)
    old = box_hash.CACHED_WIDTH
    box_hash.CACHED_WIDTH = 4
    try:
        assert box_sum(row, (12,), (5,)) == ref_sum(row, (12,), 5)
    finally:
        box_hash.CACHED_WIDTH = old
    assert box_sum(row, (12,), (5,)) == ref_sum(row, (12,), 5)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 16),
    st.integers(1, 12),
    st.integers(1, 9),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float8_e4m3fn]),
)
def test_disjoint_boxes_add_up_to_the_whole(cut0: int, cut1: int, chunk: int, dtype: torch.dtype) -> None:
    # 2- and 1-byte elements are summed as 32-bit words where whole words fit: every cut of a word
    full = arange_tensor((17, 13), step=0.77).to(dtype)
    whole = ref_sum(full)
    old = box_hash.CHUNK_ELEMENTS
    box_hash.CHUNK_ELEMENTS = chunk  # runs of a few elements: every cut of the chunking is exercised
    try:
        parts = [
            box_sum(full[r0:r1, c0:c1], (17, 13), (r0, c0))
            for r0, r1 in ((0, cut0), (cut0, 17))
            for c0, c1 in ((0, cut1), (cut1, 13))
        ]
    finally:
        box_hash.CHUNK_ELEMENTS = old
    assert sum(parts) & M64 == whole


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 2), st.integers(1, 40))
def test_boxes_of_a_folded_target_add_up_to_the_whole(cut0: int, cut1: int, cut2: int, chunk: int) -> None:
    # a [7, 5, 3] target: its columns are the 15 of the last two dims; boxes cut any dim, runs are small
    full = arange_tensor((7, 5, 3), step=0.41)
    old = box_hash.CHUNK_ELEMENTS
    box_hash.CHUNK_ELEMENTS = chunk
    try:
        parts = [
            box_sum(full[a0:a1, b0:b1, c0:c1], (7, 5, 3), (a0, b0, c0))
            for a0, a1 in ((0, cut0), (cut0, 7))
            for b0, b1 in ((0, cut1), (cut1, 5))
            for c0, c1 in ((0, cut2), (cut2, 3))
        ]
    finally:
        box_hash.CHUNK_ELEMENTS = old
    assert sum(parts) & M64 == ref_sum(full)


@pytest.mark.parametrize(
    "tensor",
    [
        arange_tensor((17, 13), step=0.77),
        arange_tensor((9, 11), step=0.1).to(torch.bfloat16),
        arange_tensor((6, 5, 3), step=0.3),
        arange_tensor((5, 7), step=-1.5).double(),
        (torch.arange(33) - 8).to(torch.int16).reshape(3, 11),
        torch.arange(24).reshape(4, 6) % 3 == 0,
        arange_tensor((6, 4), step=0.5).to(torch.float8_e4m3fn),
        torch.complex(arange_tensor((3, 5)).double(), arange_tensor((3, 5), start=7).double()),
    ],
    ids=lambda t: dtype_name(t.dtype),
)
def test_the_device_path_gives_the_host_sums(monkeypatch: pytest.MonkeyPatch, tensor: torch.Tensor) -> None:
    # the torch code that hashes boxes on an accelerator, run on the CPU: runs of 5 elements, a
    # column cut (strided) at an offset, a cast, and rows deep in a huge target
    shape, before, deep = tuple(tensor.shape), tensor.clone(), (1 << 31,) + (0,) * (tensor.dim() - 1)
    want = [box_sum(tensor[:, 2:], shape, (0, 2, 0)[: tensor.dim()]), box_sum(tensor, (1 << 33, *shape[1:]), deep)]
    if tensor.is_floating_point():
        want.append(box_sum(tensor[1:], shape, (1, 0, 0)[: tensor.dim()], casts=("float16",)))
    monkeypatch.setattr(box_hash, "HOST_DEVICES", ())
    monkeypatch.setattr(box_hash, "DEVICE_CHUNK_ELEMENTS", 5)
    got = [box_sum(tensor[:, 2:], shape, (0, 2, 0)[: tensor.dim()]), box_sum(tensor, (1 << 33, *shape[1:]), deep)]
    if tensor.is_floating_point():
        got.append(box_sum(tensor[1:], shape, (1, 0, 0)[: tensor.dim()], casts=("float16",)))
    assert got == want and torch.equal(tensor, before)  # the bits of 8-byte values are views: never written


def test_a_permuted_box_hashes_its_target_values() -> None:
    src = arange_tensor((4, 6, 5), step=0.5)
    target = src.permute(2, 0, 1)
    assert box_sum(src, tuple(target.shape), (0, 0, 0), perm=(2, 0, 1)) == ref_sum(target)
    part = src[1:3, 2:6, :]  # lands at [0:5, 1:3, 2:6] of the target
    inner = target[:, 1:3, 2:6]
    mine = box_sum(part, tuple(target.shape), (0, 1, 2), perm=(2, 0, 1))
    rest = (
        box_sum(target, tuple(target.shape), (0, 0, 0)) - box_sum(inner.contiguous(), tuple(target.shape), (0, 1, 2))
    ) & M64
    assert (mine + rest) & M64 == ref_sum(target)


def test_lazy_conj_and_neg_views_hash_their_values() -> None:
    re = arange_tensor((5, 7), step=0.5)
    z = torch.complex(re, re + 1)
    assert tensor_digest(z.conj()) == tensor_digest(torch.complex(re, -re - 1))
    assert tensor_digest(torch._neg_view(re)) == tensor_digest(-re)


def test_finish_adds_a_hash_of_shape_and_dtype() -> None:
    head = hashlib.blake2b(b"float32[2, 3]", digest_size=8).digest()
    assert finish(5, (2, 3), torch.float32) == f"{(5 + int.from_bytes(head, 'little')) & M64:016x}"


def test_digest_is_the_same_for_every_layout() -> None:
    full = arange_tensor((17, 6), step=0.37)
    want = {"w": tensor_digest(full)}
    layouts = {
        "whole": {"w": full},
        "rows 5 + 12": {"w": [LocalShard(full[:5], (17, 6), (0, 0)), LocalShard(full[5:], (17, 6), (5, 0))]},
        "columns": {"w": [shard_dim(full, 1, r, 3) for r in range(3)]},
        "grid": {
            "w": [
                LocalShard(full[r0:r1, c0:c1], (17, 6), (r0, c0))
                for r0, r1 in ((0, 9), (9, 17))
                for c0, c1 in ((0, 1), (1, 6))
            ]
        },
    }
    assert {name: digest(state) for name, state in layouts.items()} == {name: want for name in layouts}


def test_digest_under_a_mapping_is_the_digest_of_the_dense_targets() -> None:
    # Megatron TP=2 shards (fused QKV, blocked gate/up, transposes) -> HF names; reference: the HF state
    hf = hf_state()
    per_rank = [megatron_shards(hf, r, 2) for r in range(2)]
    state = {
        k: [per_rank[0][k], per_rank[1][k]] if isinstance(per_rank[0][k], LocalShard) else per_rank[0][k]
        for k in per_rank[0]
    }
    assert digest(state, MAPPING) == {k: tensor_digest(v) for k, v in sorted(hf.items())}


def test_concat_split_transpose_and_cast_digest_the_targets() -> None:
    a, b = arange_tensor((5, 3), step=0.3), arange_tensor((5, 4), start=100, step=0.3)
    state = {"a": a, "b": [shard_dim(b, 0, r, 2) for r in range(2)]}
    mapping = ["a, b -> ab, axis=1", "ab -> x, y, axis=0, sizes='[2, 3]'", "x^T -> x_t", "y -> y16, dtype='bfloat16'"]
    ab = torch.cat([a, b], 1)
    want = {"x_t": tensor_digest(ab[:2].T), "y16": tensor_digest(ab[2:].to(torch.bfloat16))}
    assert digest(state, mapping) == want
    assert want == {n: tensor_digest(t) for n, t in shardsync.full_params(state, mapping)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index", [(0, 0), (8, 2), (16, 4)])
def test_one_ulp_in_one_element_changes_exactly_that_digest(dtype: torch.dtype, index: tuple[int, int]) -> None:
    state = {
        "a": arange_tensor((17, 5), step=0.37).to(dtype),
        "b": arange_tensor((7,), start=3).to(dtype),
        "c": arange_tensor((3, 3), start=-4).to(dtype),
    }
    before = digest(state)
    after = digest({**state, "a": _bumped(state["a"], index)})
    assert [n for n in before if before[n] != after[n]] == ["a"]


def test_swapping_two_elements_changes_the_digest() -> None:
    w = arange_tensor((17, 3), step=0.5)
    swapped = w.clone()
    swapped[[2, 11]] = w[[11, 2]]
    column = w.clone()
    column[:, [0, 2]] = w[:, [2, 0]]
    assert len({tensor_digest(w), tensor_digest(swapped), tensor_digest(column), tensor_digest(w.T.contiguous())}) == 4


def _flip_signs(t: torch.Tensor, index: tuple[list[int], list[int]] | None = None) -> torch.Tensor:
    """``t`` with the sign bit of every element (or of those at ``index``) flipped."""
    out = t.clone()
    bits = out.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    sign = -(1 << (8 * t.element_size() - 1))  # the top bit, as a signed integer
    if index is None:
        bits ^= sign
    else:
        bits[index] ^= sign
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float8_e4m3fn])
def test_sign_flips_change_the_digest(dtype: torch.dtype) -> None:
    # changes by multiples of the sign bit: a negated tensor, two negated elements. For 8-byte words
    # (changes of 2^63, an even number of them) the xor-shift of the bits is what makes them visible
    w = arange_tensor((9, 70), start=1, step=0.37).to(dtype)
    variants = [w, _flip_signs(w), _flip_signs(w, ([3, 7], [5, 66]))]
    assert len({tensor_digest(v) for v in variants}) == 3


def test_the_weights_are_odd_and_distinct() -> None:
    # every element has its own odd weight A(q) * B(c): one changed element always moves the sum, and
    # two elements swapped move it by (w_i - w_j) * (b_j - b_i)
    rows = box_hash.weights(np.arange(64, dtype=np.uint64), box_hash.SEED_A)
    w = np.multiply.outer(rows, box_hash.column_weights(64, 0, 64))
    assert (w & np.uint64(1)).all() and len(set(w.ravel().tolist())) == 64 * 64
    assert [int(x) for x in w[5, 9:11]] == [weight(5, 9), weight(5, 10)]


def test_all_zero_tensors_have_digests_that_depend_on_shape_and_dtype() -> None:
    # the sum of an all-zero tensor is 0 (every term is a weight times 0): the digest is finish's hash
    zeros = [
        torch.zeros(2, 3),
        torch.zeros(3, 2),
        torch.zeros(6),
        torch.zeros(2, 3, dtype=torch.bfloat16),
        torch.zeros(2, 3, dtype=torch.int32),
        torch.zeros(7),
    ]
    found = [tensor_digest(z) for z in zeros]
    assert len(set(found)) == len(zeros)
    assert all(box_sum(z, tuple(z.shape), (0,) * z.dim()) == 0 for z in zeros)
    assert found == [finish(0, tuple(z.shape), z.dtype) for z in zeros] and "0" * 16 not in found


def test_bit_patterns_not_values_are_hashed() -> None:
    assert tensor_digest(torch.tensor([0.0])) != tensor_digest(torch.tensor([-0.0]))
    nan = torch.tensor([float("nan")])
    other = nan.view(torch.int32).add(1).view(torch.float32)  # another NaN payload
    assert other.isnan().all() and tensor_digest(nan) != tensor_digest(other)


def test_files_of_any_split_and_dcp_have_the_live_digests(tmp_path: Path) -> None:
    state = {
        "a": arange_tensor((17, 5), step=0.37),
        "b": arange_tensor((127,), start=9).to(torch.bfloat16),
        "c": torch.arange(11, dtype=torch.int64) * 7,
    }
    shardsync.save_safetensors(state.items(), tmp_path / "one")
    shardsync.save_safetensors(state.items(), tmp_path / "many", max_shard_bytes=300)
    shardsync.save(state, tmp_path / "dcp")
    assert len(list((tmp_path / "many").glob("*.safetensors"))) > 1
    want = digest(state)
    assert [digest(tmp_path / d) for d in ("one", "many", "dcp")] == [want] * 3


def test_verify_reports_equal_different_and_missing() -> None:
    w = arange_tensor((17, 3), step=0.25)
    report = verify(
        {"w": w, "b": torch.ones(3), "gone": torch.zeros(2)},
        {"w_t": w.T.contiguous(), "b": torch.ones(4), "new": torch.zeros(2)},
        ["w^T -> w_t"],
    )
    assert (report.equal, report.different, report.only_a, report.only_b) == (("w_t",), ("b",), ("gone",), ("new",))
    assert not report.ok and [report.status(n) for n in ("w_t", "b", "gone", "new")] == [
        "equal",
        "different",
        "missing in b",
        "missing in a",
    ]
    assert verify({"w": w}, {"w_t": w.T.contiguous()}, ["w^T -> w_t"]).ok
    assert VerifyReport({"x": "1"}, {"x": "1"}).to_json() == (
        '{\n "ok": true,\n "tensors": {\n  "x": {\n   "status": "equal",\n   "a": "1",\n   "b": "1"\n  }\n }\n}'
    )


def test_bad_arguments_are_named() -> None:
    with pytest.raises(LayoutError, match="got a module .*pass model.state_dict"):
        digest(torch.nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="got int"):
        digest(3)  # type: ignore[arg-type]
    with pytest.raises(MappingError, match="nope"):
        digest({"w": torch.zeros(2)}, ["nope -> x"])


def test_fp8_codes_cast_under_a_mapping_are_refused_not_hashed() -> None:
    # the codes of a block-FP8 weight are not its values: digesting them cast to bf16 would prove nothing
    codes = torch.arange(6, dtype=torch.float32).reshape(2, 3).to(torch.float8_e4m3fn)
    with pytest.raises(LayoutError, match="FP8 codes cast to another dtype without their scales: 'w'"):
        digest({"w": codes}, ['w -> w, dtype="bfloat16"'])
    assert set(digest({"w": codes})) == {"w"}  # as they are, they are hashed
