"""The public acceptance cases at the end of the mapping spec, exactly."""

from __future__ import annotations

import torch

from reference import arange_tensor, assemble
from shardsync.layout import Box, GlobalLayout, dtype_name
from shardsync.mapping import resolve


def _run(statements: list[str], sources: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    layout = GlobalLayout.merge(
        [[(k, tuple(v.shape), dtype_name(v.dtype), Box.full(v.shape)) for k, v in sources.items()]]
    )
    return {t.name: assemble(t, sources) for t in resolve(statements, layout)}


def test_case1_concat_then_split() -> None:
    s0, s1 = arange_tensor((2, 2)), arange_tensor((2, 2), start=100)
    out = _run(["s0, s1 -> s, axis=1", "s -> d0, d1, axis=0"], {"s0": s0, "s1": s1})
    assert list(out) == ["d0", "d1"]
    assert out["d0"].shape == (1, 4) and out["d1"].shape == (1, 4)
    assert torch.equal(out["d0"][0, 0:2], s0[0]) and torch.equal(out["d1"][0, 0:2], s0[1])
    assert torch.equal(out["d1"][0, 2:4], s1[1]) and torch.equal(out["d0"][0, 2:4], s1[0])


def test_case2_cast() -> None:
    s0 = arange_tensor((2, 2), torch.int32)
    out = _run(['s0 -> d0, dtype="float32"'], {"s0": s0})
    assert out["d0"].dtype == torch.float32 and torch.equal(out["d0"], s0.float())


def test_case3_transpose_then_split() -> None:
    s0, s1 = arange_tensor((2, 2)), arange_tensor((2, 2), start=100)
    prog = ["s0, s1 -> s, axis=1", "s^T -> d", "d -> d0, d1, axis=1"]
    out = _run(prog, {"s0": s0, "s1": s1})
    assert out["d0"].shape == (4, 1)
    assert torch.equal(out["d0"][:, 0], torch.cat([s0[0], s1[0]]))
    assert torch.equal(out["d1"][:, 0], torch.cat([s0[1], s1[1]]))
    out64 = _run(prog[:1] + ["s -> s, dtype='float64'"] + prog[1:], {"s0": s0, "s1": s1})
    assert out64["d0"].dtype == out64["d1"].dtype == torch.float64
    assert torch.equal(out64["d1"][:, 0], torch.cat([s0[1], s1[1]]).double())


def test_case4_fan_out() -> None:
    s0 = arange_tensor((3, 4))
    out = _run(
        ["s0 -> a1, a2, a3, a4, axis=1", "a2^T -> b2", "a3^T -> b3", "b2, b3 -> d0, axis=1", "a3, a4 -> d1, axis=0"],
        {"s0": s0},
    )
    assert sorted(out) == ["a1", "d0", "d1"]  # a1 is never consumed: an output of its own
    assert torch.equal(out["d0"], torch.cat([s0[:, 1], s0[:, 2]]).reshape(1, 6))
    assert torch.equal(out["d1"], torch.cat([s0[:, 2], s0[:, 3]]).reshape(6, 1))


def test_case5_cast_permute_split_chain() -> None:
    s0, s1 = arange_tensor((4, 1, 3)), arange_tensor((4, 1, 3), start=50)
    out = _run(
        [
            "s0, s1 -> s, axis=1",
            "s -> s, dtype='bfloat16'",
            "s -> a, permute='[2, 0, 1]'",
            "a -> b1, b2, b3, axis=0",
            "b1 -> b1, permute='[0, 2, 1]'",
            "b2 -> b2, permute='[0, 2, 1]'",
            "b1, b2 -> d0, axis=1",
            "b3 -> d1",
            "d1 -> d1, dtype='float32'",
        ],
        {"s0": s0, "s1": s1},
    )
    s = torch.cat([s0, s1], dim=1).to(torch.bfloat16)
    a = s.permute(2, 0, 1)
    assert out["d0"].dtype == torch.bfloat16 and out["d0"].shape == (1, 4, 4)
    assert torch.equal(out["d0"], torch.cat([a[0:1].permute(0, 2, 1), a[1:2].permute(0, 2, 1)], 1))
    assert out["d1"].dtype == torch.float32 and out["d1"].shape == (1, 4, 2)
    assert torch.equal(out["d1"], s[:, :, 2].unsqueeze(0).float())


def test_case6_fused_qkv_is_interleaved_split() -> None:
    qkv = arange_tensor((3, 24))  # H=8, G=2: d = 24 / 12 = 2
    out = _run(["qkv -> q, k, v, fused_qkv, num_heads=8, num_key_value_groups=2"], {"qkv": qkv})
    heads = qkv.reshape(3, 12, 2)  # order: Q0..Q3, K0, V0, Q4..Q7, K1, V1
    q = torch.cat([heads[:, 0:4], heads[:, 6:10]], 1).reshape(3, 16)
    assert torch.equal(out["q"], q)
    assert torch.equal(out["k"], torch.cat([heads[:, 4], heads[:, 10]], 1))
    assert torch.equal(out["v"], torch.cat([heads[:, 5], heads[:, 11]], 1))


def test_case7_star_expands_sorted_numerically() -> None:
    w = {f"layers.2.experts.{e}.weight": arange_tensor((2, 3), start=10 * e) for e in (0, 1)}
    out = _run(["layers.2.experts.*.weight -> fused_experts, axis=1"], w)
    assert list(out) == ["fused_experts"]
    assert torch.equal(
        out["fused_experts"], torch.cat([w["layers.2.experts.0.weight"], w["layers.2.experts.1.weight"]], 1)
    )


def test_case8_layer_id_offset() -> None:
    src = {f"layers.{i}.experts.0.weight": arange_tensor((2,), start=i) for i in (1, 2)}
    out = _run(["layers.$LAYER_ID_OFFSET.experts.0.weight -> layers.$LAYER_ID_OFFSET.experts.0.weight"], src)
    assert list(out) == ["layers.0.experts.0.weight", "layers.1.experts.0.weight"]
    assert torch.equal(out["layers.0.experts.0.weight"], src["layers.1.experts.0.weight"])
    assert torch.equal(out["layers.1.experts.0.weight"], src["layers.2.experts.0.weight"])
