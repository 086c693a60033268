"""Mappings that used to give wrong data without a word (issue 19): two statements producing one
target, nested permutations, lossy casts, an unchecked ``src_dtype``. Each is a ``MappingError``
naming the statement, before anything is read; what stays allowed gives exact values."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import shardsync
from reference import arange_tensor, assemble
from shardsync.cli import main
from shardsync.errors import MappingError
from shardsync.layout import Box, GlobalLayout
from shardsync.mapping import resolve
from shardsync.mapping.statements import cast_loss

SHAPES = {
    "a": ((3, 17), "float32"),
    "b": ((3, 17), "float32"),
    "c": ((5,), "complex64"),
    "i": ((5,), "int64"),
    "u": ((5,), "uint8"),
    "h": ((5,), "float16"),
}
LAYOUT = GlobalLayout.merge([[(k, s, d, Box.full(s)) for k, (s, d) in SHAPES.items()]])


def _rest(statements: list[str]) -> list[str]:
    """Drops of the sources no statement reads, so that no case passes sources through."""
    read = {n.strip() for s in statements for n in s.split("->")[0].split(",")}
    return [f"{k} -> _" for k in SHAPES if k not in read]


def _error(statements: list[str], **kw: object) -> MappingError:
    with pytest.raises(MappingError) as info:
        resolve(statements + _rest(statements), LAYOUT, **kw)  # type: ignore[arg-type]
    return info.value


def _only(statements: list[str]) -> dict[str, shardsync.TargetSpec]:
    return {t.name: t for t in resolve(statements + _rest(statements), LAYOUT)}


# ---- two statements producing the same target ----------------------------------------------------


def test_two_statements_producing_one_target_name_both() -> None:
    err = _error(["a -> x", "b -> x"])
    assert len(err.diagnostics) == 1
    d = err.diagnostics[0]
    assert (d.index, d.col, d.name) == (1, 5, "x")
    assert "'x' is already produced by statement 0 `a -> x`" in str(err)
    assert "statement 1 `b -> x`" in str(err)


def test_produced_twice_is_an_error_also_when_strict_and_in_a_split() -> None:
    err = _error(["a -> p, q, axis=0, sizes='[1, 2]'", "b -> q"], strict=True)
    assert "'q' is already produced by statement 0 `a -> p, q, axis=0, sizes='[1, 2]'`" in str(err)


def test_produced_twice_through_placeholders() -> None:
    lay = GlobalLayout.merge([[(k, (2,), "float32", Box.full((2,))) for k in ("l.0.w", "l.1.w", "l.0.b", "l.1.b")]])
    with pytest.raises(MappingError, match=r"'o\.1' is already produced by statement 0 `l\.\$LAYER_ID\.w"):
        resolve(["l.$LAYER_ID.w -> o.$LAYER_ID", "l.1.b -> o.1"], lay)


def test_rebinding_what_was_read_stays_allowed() -> None:
    # `x` is read by statement 1 before statement 2 binds it again: one producer of each target
    t = _only(["a -> x", "x -> y, permute='[1, 0]'", "b -> x", "h -> h, dtype='float32'"])
    assert sorted(t) == ["h", "x", "y"]
    assert t["x"].pieces[0].source == "b" and t["y"].pieces[0].source == "a"
    assert t["y"].shape == (17, 3) and t["h"].dtype == "float32"


def test_explain_and_the_cli_refuse_a_target_produced_twice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = {"a": arange_tensor((3, 17)), "b": arange_tensor((3, 17), start=100)}
    with pytest.raises(MappingError, match="already produced by statement 0"):
        shardsync.explain(state, ["a -> x", "b -> x"])
    shardsync.save_hf(state, tmp_path / "ck")
    for cmd in (["diff", str(tmp_path / "ck"), str(tmp_path / "ck")], ["explain", str(tmp_path / "ck")]):
        assert main([*cmd, "-m", "a -> x\nb -> x", "--strict"]) == 2
        err = capsys.readouterr().err
        assert "'x' is already produced by statement 0 `a -> x`" in err and "statement 1" in err, err


# ---- permutations ---------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["[[[0, 1]]]", "[[1, 0]]", "[[1], 0]", "[1, 0", "1, 0]"])
def test_nested_or_unbalanced_permutation_is_refused(spec: str) -> None:
    err = _error([f"a -> x, permute='{spec}'"])
    assert f"permute= must be a list of integers like '[2, 0, 1]': '{spec}' is nested" in str(err)
    assert err.diagnostics[0].col == 8


@pytest.mark.parametrize("spec", ["[[1, 0]]", "[[[0, 1]]]"])
def test_nested_permutation_is_refused_in_reverse_too(spec: str) -> None:
    lay = GlobalLayout.merge([[("x", (3, 17), "float32", Box.full((3, 17)))]])
    with pytest.raises(MappingError, match=f"'{re.escape(spec)}' is nested or unbalanced"):
        resolve([f"a -> x, permute='{spec}'"], lay, reverse=True)
    (t,) = resolve(["a -> x, permute='[1, 0]'"], lay, reverse=True)
    assert (t.name, t.shape, t.pieces[0].perm) == ("a", (17, 3), (1, 0))


def test_flat_permutations_and_the_empty_one() -> None:
    full = arange_tensor((3, 17))
    for spec in ("[1, 0]", "1, 0", "[]", "[-1, 0]"):
        (piece,) = _only([f"a -> x, permute='{spec}'"])["x"].pieces
        assert piece.perm == (1, 0)
        assert torch.equal(full[piece.source_box.slices()].permute(piece.perm), full.T)


# ---- casts ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "src,dst,why",
    [
        ("complex64", "float32", "drops the imaginary part"),
        ("float32", "int32", "cuts fractions and turns NaN and inf into arbitrary integers"),
        ("bfloat16", "uint8", "cuts fractions and turns NaN and inf into arbitrary integers"),
        ("float32", "bool", "turns every nonzero float32 value into True"),
        ("int64", "int32", "wraps int64 values outside the range of int32"),
        ("uint8", "int8", "wraps uint8 values outside the range of int8"),
        ("int8", "uint8", "wraps int8 values outside the range of uint8"),
    ],
)
def test_lossy_casts(src: str, dst: str, why: str) -> None:
    assert cast_loss(src, dst) == why


@pytest.mark.parametrize(
    "src,dst",
    [
        ("float32", "bfloat16"),
        ("float64", "float16"),
        ("int64", "float32"),
        ("uint8", "int16"),
        ("int32", "int64"),
        ("bool", "int8"),
        ("float32", "complex64"),
        ("complex128", "complex64"),
        ("int16", "int16"),
    ],
)
def test_casts_that_only_round_are_not_lossy(src: str, dst: str) -> None:
    assert cast_loss(src, dst) is None


@pytest.mark.parametrize(
    "stmt,col",
    [
        ("c -> x, dtype='float32'", 8),
        ("a -> x, dtype='int32'", 8),
        ("i -> x, src_dtype='int64', dst_dtype='int16'", 27),
    ],
)
def test_a_lossy_cast_needs_lossy_1(stmt: str, col: int) -> None:
    err = _error([stmt])
    assert err.diagnostics[0].col == col and "add lossy=1 to the statement to cast anyway" in str(err)
    assert list(_only([stmt + ", lossy=1"])) == ["x"]


def test_lossy_1_casts_exactly_as_torch() -> None:
    full = {
        "a": arange_tensor((3, 17), start=-20, step=1.37),
        "c": torch.complex(arange_tensor((5,), step=1.5), arange_tensor((5,), start=7)),
    }
    t = _only(["a -> x, dtype='int32', lossy=1", "c -> y, dtype='float64', lossy=1"])
    assert (t["x"].dtype, t["y"].dtype) == ("int32", "float64")
    with pytest.warns(UserWarning, match="discards the imaginary part"):
        y = assemble(t["y"], full)
    assert torch.equal(assemble(t["x"], full), full["a"].to(torch.int32))
    assert y.tolist() == [0.0, 1.5, 3.0, 4.5, 6.0]


def test_lossy_flag_misuse() -> None:
    assert "lossy=2: write lossy=1" in str(_error(["a -> x, dtype='int32', lossy=2"]))
    assert "lossy=1 goes with a cast" in str(_error(["a -> x, lossy=1"]))
    assert "takes only axis=" in str(_error(["a -> x, y, axis=0, sizes='[1, 2]', lossy=1"]))


def test_src_dtype_must_be_the_tensors_dtype() -> None:
    err = _error(["a -> x, src_dtype='int8', dst_dtype='float16'"])
    assert (err.diagnostics[0].col, err.diagnostics[0].name) == (8, "src_dtype")
    assert "src_dtype='int8' but 'a' is float32" in str(err) and "write src_dtype='float32'" in str(err)
    assert _only(["a -> x, src_dtype='float32', dst_dtype='float16'"])["x"].dtype == "float16"


def test_src_dtype_checked_in_reverse_too() -> None:
    # written for loading (checkpoint bf16 -> model fp32); reversed, `x` (the model's) must be float32
    lay = GlobalLayout.merge([[("x", (4,), "float32", Box.full((4,)))]])
    (t,) = resolve(["ck -> x, src_dtype='bfloat16', dst_dtype='float32'"], lay, reverse=True)
    assert (t.name, t.dtype) == ("ck", "bfloat16")
    wrong = GlobalLayout.merge([[("x", (4,), "float16", Box.full((4,)))]])
    with pytest.raises(MappingError, match="src_dtype='float32' but 'x' is float16"):
        resolve(["ck -> x, src_dtype='bfloat16', dst_dtype='float32'"], wrong, reverse=True)
