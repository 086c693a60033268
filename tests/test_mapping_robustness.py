"""Inputs that used to hang, give wrong data or escape as raw exceptions: each is a MappingError
(a ShardsyncError) naming the statement or file and the position, raised at once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reference import arange_tensor, assemble
from shardsync.errors import MappingError, ShardsyncError
from shardsync.layout import Box, GlobalLayout
from shardsync.mapping import Mapping, resolve
from shardsync.mapping.parser import MAX_RANGE_NAMES


def _layout(shapes: dict[str, tuple[int, ...]]) -> GlobalLayout:
    return GlobalLayout.merge([[(k, s, "float32", Box.full(s)) for k, s in shapes.items()]])


LAYOUT = _layout({"w": (4, 6), "layers.1.w": (2,), "layers.12.w": (2,)})


def _diag(program, *fragments: str, layout: GlobalLayout = LAYOUT, col: int | None = None, name: str | None = None):
    """The single diagnostic of resolving ``program``; its message holds every fragment."""
    with pytest.raises(MappingError) as info:
        resolve(program, layout)
    err = info.value
    assert isinstance(err, ShardsyncError) and isinstance(err, ValueError)
    assert len(err.diagnostics) == 1, str(err)
    d = err.diagnostics[0]
    for f in fragments:
        assert f in str(err), (f, str(err))
    if col is not None:
        assert d.col == col, str(err)
    if name is not None:
        assert d.name == name, str(err)
    return d


def _error(source, *fragments: str) -> MappingError:
    """The error of parsing ``source`` (a file or an input form without statement diagnostics)."""
    with pytest.raises(MappingError) as info:
        Mapping.parse(source)
    for f in fragments:
        assert f in str(info.value), (f, str(info.value))
    return info.value


# -- hangs -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hi", [1_000_000_000, 10**12, MAX_RANGE_NAMES + 1])
def test_huge_name_range_is_refused_with_the_cap(hi: int) -> None:
    _diag(
        [f"w[0:{hi}] -> y, axis=0"],
        f"w[0:{hi}] would expand to {hi} names",
        f"at most {MAX_RANGE_NAMES}",
        "'*' or $NAME placeholder",
        col=0,
        name="w",
    )


def test_name_range_at_the_cap_expands() -> None:
    m = Mapping.parse([f"x -> w[5:{5 + MAX_RANGE_NAMES}], axis=0"])
    names = m.statements[0].right
    assert len(names) == MAX_RANGE_NAMES and (names[0].text, names[-1].text) == ("w_5", "w_10004")


def test_adjacent_placeholders_are_refused_not_backtracked() -> None:
    # Ten adjacent placeholders against a 40-digit key took 24 s per key before; now refused at once.
    layout = _layout({"x" + "1" * 40 + "y": (2,), "x12": (2,)})
    name = "x" + "".join(f"$P{i}" for i in range(10))
    _diag(
        [f"{name} -> o{name}"], "'$P0' is directly followed by '$'", "cut only one way", layout=layout, col=0, name=name
    )
    _diag(["layers.$L* -> y.$L, axis=0"], "'$L' is directly followed by '*'", name="layers.$L*")
    _diag(["layers.*1.w -> y, axis=0"], "'*' is directly followed by '1'")
    _diag(["x.*$A -> y.$A, axis=0"], "'*' is directly followed by '$'")


def test_placeholders_match_digit_runs_whole() -> None:
    src = {
        "l.1.x.1": arange_tensor((2,)),
        "l.1.x.2": arange_tensor((2,), start=10),
        "l.2.x.2": arange_tensor((2,), start=20),
        "l.3" + "9" * 30 + ".x.3": arange_tensor((2,)),
    }
    layout = _layout({k: tuple(v.shape) for k, v in src.items()})
    # a repeated placeholder means the same digits; a 31-digit run (too long for a layer id) matches
    # nothing, rather than escaping as a ValueError from int()
    specs = resolve(["l.$A.x.$A -> m.$A"], layout)
    got = {t.name: assemble(t, src) for t in specs}
    assert sorted(got) == ["l.1.x.2", "l.3" + "9" * 30 + ".x.3", "m.1", "m.2"]
    assert torch.equal(got["m.2"], src["l.2.x.2"])


# -- wrong data --------------------------------------------------------------------------------------


@pytest.mark.parametrize("perm", ["[0, 0]", "[1, 1]", "[5, 0]", "[0, 1, 2]"])
def test_bad_permutation_is_refused_in_reverse_as_forward(perm: str) -> None:
    msg = "has 3 entries" if perm == "[0, 1, 2]" else f"permute={perm} is not a permutation of dims 0..1"
    _diag([f"w -> a, permute='{perm}'"], msg, col=8, name="permute")
    d = _diag({"aoa_statements": [f"a -> w, permute='{perm}'"], "aoa_config_reverse": True}, msg, col=8, name="permute")
    assert d.text == f"a -> w, permute='{perm}'"


def test_non_integer_permutation_in_reverse_is_a_mapping_error() -> None:
    _diag(
        {"aoa_statements": ["a -> w, permute='[x, 1]'"], "aoa_config_reverse": True},
        "permute= must be a list of integers",
        "'x' is not an integer",
        col=8,
    )


def test_valid_permutation_still_inverts_in_reverse() -> None:
    src = {"w": arange_tensor((2, 3, 5))}
    layout = GlobalLayout.merge([[("w", (2, 3, 5), "float32", Box.full((2, 3, 5)))]])
    (t,) = resolve(["a -> w, permute='[2, -3, 1]'"], layout, reverse=True)
    assert torch.equal(assemble(t, src), src["w"].permute(1, 2, 0))  # a = w permuted back


def test_duplicated_attribute_is_an_error_with_position() -> None:
    _diag(["w -> a, b, axis=0, axis=1"], "attribute 'axis' is given twice", col=19, name="axis")
    _diag(["w -> a, b, fused_ffn, fused_ffn"], "attribute 'fused_ffn' is given twice", col=22)


def test_two_keywords_or_a_keyword_with_a_value_are_errors() -> None:
    _diag(
        ["w -> a, b, fused_ffn, fused_qkv_old"],
        "one macro keyword, got fused_ffn and fused_qkv_old",
        col=22,
        name="fused_qkv_old",
    )
    _diag(["w -> a, b, fused_ffn=1"], "fused_ffn is a bare keyword and takes no value", col=11)


def test_one_to_one_refuses_attributes_it_would_ignore() -> None:
    _diag(["w -> a, sizes='[4]'"], "a 1 -> 1 statement takes", "not sizes", col=8, name="sizes")
    _diag(["w -> a, num_heads=2"], "not num_heads", col=8)


# -- escapes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["²", "٣", "１"])
def test_unicode_digits_are_not_integers(value: str) -> None:
    _diag([f"w -> a, b, axis={value}"], f"unexpected character {value!r}", col=16)
    _diag(
        [f"w -> a, b, axis=0, sizes='[{value}, 3]'"], "sizes= must be a list of integers", "is not an integer", col=19
    )


@pytest.mark.parametrize("digits", [20, 5000])
def test_huge_integers_are_mapping_errors(digits: int) -> None:
    big = "9" * digits
    for stmt, col in (
        (f"w -> a, b, axis={big}", 16),
        (f"w -> q, k, v, fused_qkv, num_heads={big}, num_key_value_groups=1", 35),
        (f"w[0:{big}] -> x", 4),
    ):
        _diag([stmt], "is too large (at most 2**63 - 1)", col=col)
    _diag([f"w -> a, b, axis=0, sizes='[{big}, 1]'"], "sizes= must be a list of integers", "too large", col=19)
    _diag([f"w -> a, permute='[{big}, 0]'"], "too large", col=8)


def test_bad_json_file_names_file_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text('{"aoa_statements": [\n  "w -> a",\n  "w -> b"\n')
    _error(path, str(path), "line 4, column 1", "invalid JSON")
    path.write_text('{"aoa_statements": ["w -> a"], "aoa_config_reverse": "false"}')
    _error(str(path), str(path), "'aoa_config_reverse' must be true or false, not 'false'")
    path.write_text('{"aoa_statements": ["w -> a", 3]}')
    _error(path, "'aoa_statements' must be a list of statement strings (item 1 is int)")
    path.write_text('"w -> a"')
    _error(path, "expected a list of statements or a dict with 'aoa_statements', found str")


def test_bad_yaml_file_names_file_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text("aoa_statements:\n  - w -> a\n  - [w -> b\n")
    _error(path, str(path), "line 4, column 1", "invalid YAML")
    path.write_text("aoa_statements: {w: a}\n")
    _error(str(path), "'aoa_statements' must be a list of statement strings (dict)")


def test_parse_errors_in_a_file_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "m.txt"
    path.write_text("w -> a\nw -> @b\n")
    err = _error(path, f"{path}: statement 1 `w -> @b`, column 6: unexpected character '@'")
    assert err.diagnostics[0].file == str(path)


def test_unreadable_mapping_files(tmp_path: Path) -> None:
    _error(tmp_path, f"mapping path {str(tmp_path)!r} is a directory")
    (tmp_path / "d.yaml").mkdir()
    _error(str(tmp_path / "d.yaml"), "is a directory")
    (tmp_path / "latin1.txt").write_bytes(b"w -> caf\xe9\n")
    _error(tmp_path / "latin1.txt", "cannot read mapping file", "latin1.txt")


@pytest.mark.parametrize(
    "name", ["missing.txt", "missing.json", "missing.yaml", "missing.yml", "conf/missing", "conf/missing.aoa"]
)
def test_missing_path_is_named_not_parsed_as_statements(tmp_path: Path, name: str) -> None:
    path = str(tmp_path / name)
    _error(path, f"mapping file {path!r} does not exist")
    _error(name, f"mapping file {name!r} does not exist")
    _error(Path(path), "does not exist")


def test_strings_that_are_programs_still_parse() -> None:
    assert len(Mapping.parse("")) == 0 and len(Mapping.parse("# exported as is")) == 0
    _diag("w ->", "expected a name")
    # a bare word is a shipped mapping's name: not one, so an error naming what it is not
    with pytest.raises(
        MappingError,
        match=r"'w' is not a shipped mapping, a mapping file or a statement "
        r"\(a statement has '->'\)\nshipped mappings:\n  megatron-llama: ",
    ):
        resolve("w", LAYOUT)


def test_a_text_file_of_any_suffix_is_a_program(tmp_path: Path) -> None:
    (tmp_path / "export.aoa").write_text("w -> a\n")
    assert Mapping.parse(str(tmp_path / "export.aoa")).text() == "w -> a"
