"""Every error form of the mapping language: the message names the statement, the column, the name."""

from __future__ import annotations

import pytest

from shardsync.errors import MappingError
from shardsync.layout import Box, GlobalLayout
from shardsync.mapping import Mapping, resolve

SHAPES = {
    "s0": ((2, 3), "float32"),
    "s1": ((2, 5), "float32"),
    "i0": ((2, 3), "int32"),
    "qkv": ((4, 26), "float32"),
    "layers.0.w": ((2,), "float32"),
    "layers.1.w": ((2,), "float32"),
    "layers.1.b": ((2,), "float32"),
}
LAYOUT = GlobalLayout.merge([[(k, s, d, Box.full(s)) for k, (s, d) in SHAPES.items()]])


def _err(statements: list[str] | str) -> MappingError:
    with pytest.raises(MappingError) as info:
        resolve(statements, LAYOUT)
    return info.value


def _one(statements: list[str] | str, index: int, col: int, *fragments: str, name: str | None = None):
    err = _err(statements)
    assert len(err.diagnostics) == 1, str(err)
    d = err.diagnostics[0]
    assert (d.index, d.col) == (index, col), str(err)
    if name is not None:
        assert d.name == name, str(err)
    for f in fragments:
        assert f in str(err), (f, str(err))
    return d


def test_mapping_error_is_a_value_error() -> None:
    assert issubclass(MappingError, ValueError)


def test_unknown_name_with_suggestion() -> None:
    d = _one(["s0 -> a", "s2 -> b"], 1, 0, "unknown name 's2'", "did you mean", name="s2")
    assert d.text == "s2 -> b"


def test_unknown_name_in_second_position_points_at_it() -> None:
    _one(["s0, sx -> c, axis=1"], 0, 4, "unknown name 'sx'", name="sx")


def test_assign_to_transpose() -> None:
    _one(["s0 -> a^T"], 0, 6, "cannot assign to a transpose", "`a^T -> a`", name="a^T")


def test_many_to_many() -> None:
    _one(["s0, s1 -> a, b, axis=0"], 0, 0, "more than one name on both sides")


def test_split_not_divisible() -> None:
    _one(["s1 -> a, b, axis=1"], 0, 0, "size 5, not divisible into 2 equal parts", "sizes=", name="s1")


def test_bad_sizes() -> None:
    _one(["s1 -> a, b, axis=1, sizes='[2, 2]'"], 0, 20, "sizes=[2, 2] must give 2", "summing to 5")


def test_concat_dtype_mismatch() -> None:
    _one(["s0, i0 -> c, axis=0"], 0, 4, "'i0' is int32 but 's0' is float32", "dtype='float32'", name="i0")


def test_concat_other_dims_differ_is_an_error_not_a_truncation() -> None:  # Paddle defect
    _one(["s0, s1 -> c, axis=0"], 0, 4, "'s1' has shape [2, 5]", "all dims but 0 must match")


def test_permute_wrong_length_is_an_error_not_index_error() -> None:  # Paddle defect
    _one(["s0 -> a, permute='[2, 0, 1]'"], 0, 9, "has 3 entries but the tensor has 2 dims")


def test_permute_not_a_permutation() -> None:
    _one(["s0 -> a, permute='[0, 0]'"], 0, 9, "not a permutation")


def test_unknown_attribute_with_suggestion() -> None:
    _one(["s0 -> a, b, axes=1"], 0, 12, "unknown attribute 'axes'", "did you mean 'axis'")


def test_one_to_one_takes_one_transform() -> None:
    _one(["s0 -> a, dtype='float16', permute='[]'"], 0, 26, "at most one of permute/dtype/axis")


def test_split_takes_only_axis() -> None:
    _one(["s0 -> a, b, axis=0, dtype='float16'"], 0, 20, "takes only axis=")


def test_axis_out_of_range_and_missing() -> None:
    _one(["s0 -> a, b, axis=2"], 0, 12, "axis=2 is out of range for a 2-dim tensor")
    _one(["s0 -> a, b"], 0, 0, "needs axis=<dim>")


def test_negative_axis_is_accepted() -> None:
    got = resolve(["s0 -> a, b, c, axis=-1"], LAYOUT)
    assert [t.shape for t in got if t.name in "abc"] == [(2, 1)] * 3


def test_unknown_dtype() -> None:
    _one(["s0 -> a, dtype='float17'"], 0, 9, "unknown dtype 'float17'")


def test_src_and_dst_dtype_go_together() -> None:
    _one(["s0 -> a, src_dtype='float16'"], 0, 0, "src_dtype and dst_dtype go together")
    _one(["s0 -> a, src_dtype='float16', dst_dtype='float8'"], 0, 30, "unknown dtype 'float8'")


def test_duplicate_output() -> None:
    _one(["s0 -> a, a, axis=0"], 0, 6, "'a' is assigned twice")


def test_lexical_and_syntax_errors_all_reported() -> None:
    err = _err("s0 -> a\ns0 -> @b\ns0 -> , c\ns1 -> 'open\nx[3:1] -> y, axis=0\ns0 -> a, b, axis=")
    got = [(d.index, d.col, d.message) for d in err.diagnostics]
    assert len(got) == 5, str(err)
    assert got[0][:2] == (1, 6) and "unexpected character '@'" in got[0][2]
    assert got[1][:2] == (2, 6) and "expected a name, found ','" in got[1][2]
    assert got[2][:2] == (3, 6) and "unterminated string" in got[2][2]
    assert got[3][:2] == (4, 4) and "empty range x[3:1]" in got[3][2]
    assert got[4][:2] == (5, 17) and "needs an integer or a quoted string" in got[4][2]


def test_several_semantic_errors_reported_together_without_cascades() -> None:
    err = _err(["s9 -> a", "a -> b, c, axis=0", "s1 -> d, e, axis=1", "s0 -> f^T"])
    assert [d.index for d in err.diagnostics] == [0, 2, 3]  # statement 1 reads a: no second report
    assert "3 mapping errors" in str(err)


def test_macro_errors() -> None:
    _one(["layers.$LAYER_ID.x -> y.$LAYER_ID"], 0, 0, "'layers.$LAYER_ID.x' matches no source key")
    _one(["layers.$LAYER_ID.w, layers.$LAYER_ID.b -> c.$LAYER_ID, axis=0"], 0, 20, "matches other $LAYER_ID values")
    _one(["nope.*.w -> c, axis=0"], 0, 0, "'nope.*.w' matches no source key")
    _one(["layers.$LAYER_ID_OFFSET.w -> plain"], 0, 29, "'plain' lacks $LAYER_ID_OFFSET")
    _one(["s0 -> out.*"], 0, 6, "needs a destination layout")


def test_fused_errors() -> None:
    _one(
        ["qkv -> q, k, v, fused_qkv, num_heads=6, num_key_value_groups=4"],
        0,
        0,
        "num_heads=6 is not divisible by num_key_value_groups=4",
    )
    _one(
        ["qkv -> q, k, v, fused_qkv, num_heads=4, num_key_value_groups=2"],
        0,
        0,
        "size 26, not divisible by num_heads + 2 * num_key_value_groups = 8",
    )
    _one(["qkv -> q, k, fused_qkv, num_heads=4, num_key_value_groups=2"], 0, 0, "fused_qkv has the forms")
    _one(["qkv -> q, k, v, fused_qkv, num_heads=4"], 0, 0, "num_key_value_groups")
    _one(
        ["s0 -> a, b, fused_ffn, num_heads=2"],
        0,
        23,
        "fused_ffn does not take num_heads (it takes axis=, tp=)",
        name="num_heads",
    )


def test_bad_input_forms() -> None:
    with pytest.raises(MappingError, match="aoa_statements"):
        Mapping.parse({"statements": []})
    with pytest.raises(MappingError, match="cannot read a mapping from int"):
        Mapping.parse(3)  # type: ignore[arg-type]
