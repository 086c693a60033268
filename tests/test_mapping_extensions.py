"""The language forms shipped mappings need: optional statements (``name?``), ``keep=``, ``{parameters}``
and ``prefix``; each exact on arange tensors through :func:`resolve` and a plain slicing reference."""

from __future__ import annotations

import pytest
import torch

from reference import arange_tensor, assemble
from shardsync.errors import MappingError
from shardsync.layout import Box, GlobalLayout
from shardsync.mapping import Mapping, resolve, unconsumed
from shardsync.mapping.lexer import parameter_names, tokenize

FULL = {
    "w": arange_tensor((5, 3)),
    "b": arange_tensor((5,), start=100),
    "layers.0.x": arange_tensor((4,), start=200),
    "layers.1.x": arange_tensor((4,), start=300),
}
LAYOUT = GlobalLayout.merge([[(k, tuple(v.shape), "float32", Box.full(v.shape)) for k, v in FULL.items()]])


def outputs(
    mapping: Mapping | list[str] | str, full: dict[str, torch.Tensor] = FULL, **kw: object
) -> dict[str, torch.Tensor]:
    layout = GlobalLayout.merge([[(k, tuple(v.shape), "float32", Box.full(v.shape)) for k, v in full.items()]])
    return {t.name: assemble(t, full) for t in resolve(mapping, layout, **kw)}  # type: ignore[arg-type]


def error(mapping: Mapping | list[str], **kw: object) -> str:
    with pytest.raises(MappingError) as info:
        resolve(mapping, LAYOUT, **kw)  # type: ignore[arg-type]
    return str(info.value)


# -- optional statements ----------------------------------------------------------------------------


def test_an_optional_statement_runs_when_its_source_is_there_and_is_skipped_when_not() -> None:
    got = outputs(
        [
            "w? -> weight",
            "absent? -> gone",
            "layers.$LAYER_ID.nope? -> y.$LAYER_ID",
            "experts.*.w? -> fused, axis=0",
            "b -> bias",
        ]
    )
    assert sorted(got) == ["bias", "layers.0.x", "layers.1.x", "weight"]
    assert torch.equal(got["weight"], FULL["w"]) and torch.equal(got["bias"], FULL["b"])
    got = outputs(["layers.$LAYER_ID.x? -> y.$LAYER_ID", "w -> _", "b -> _"])
    assert sorted(got) == ["y.0", "y.1"] and torch.equal(got["y.1"], FULL["layers.1.x"])


def test_optional_is_kept_in_canonical_text_and_reverse_mode() -> None:
    m = Mapping.parse("out? -> lm_head\nw -> weight")
    assert m.text() == "out? -> lm_head\nw -> weight" and m.statements[0].optional
    assert sorted(outputs(m.text(), {"weight": FULL["w"]}, reverse=True)) == ["w"]  # no lm_head: skipped
    got = outputs(m.text(), {"weight": FULL["w"], "lm_head": FULL["b"]}, reverse=True)
    assert sorted(got) == ["out", "w"] and torch.equal(got["out"], FULL["b"])


def test_optional_forms_that_stay_errors() -> None:
    assert (
        "statement 0 `w -> v?`, column 6: 'v?': '?' marks an optional statement and goes after a name "
        "on the left of '->'" in error(["w -> v?"])
    )
    # partly present: the missing one is reported; a reader of a skipped statement's output too
    assert "unknown name 'absent'" in error(["w?, absent -> c, axis=0"])
    assert "unknown name 'gone'" in error(["absent? -> gone", "gone -> kept"])
    assert "unexpected character '?'" in error(["w ? -> v"])


# -- keep= ------------------------------------------------------------------------------------------


def test_keep_takes_the_first_entries_along_a_dim() -> None:
    got = outputs(["w -> rows, axis=0, keep=2", "b -> head, axis=-1, keep=5"])
    assert got["rows"].tolist() == [[0.0, 1, 2], [3, 4, 5]]
    assert torch.equal(got["head"], FULL["b"])  # keep= the whole size is a rename
    got = outputs(["w -> cols, axis=1, keep=1"])
    assert got["cols"].tolist() == [[0.0], [3], [6], [9], [12]]


def test_keep_in_reverse_passes_the_rows_it_has() -> None:
    got = outputs(["emb -> embed_tokens, axis=0, keep=3"], {"embed_tokens": FULL["w"][:3]}, reverse=True)
    assert list(got) == ["emb"] and torch.equal(got["emb"], FULL["w"][:3])


@pytest.mark.parametrize(
    "statement, message",
    [
        ("w -> v, keep=2", "keep= needs axis=<dim>"),
        ("w -> v, axis=0, keep=0", "keep=0 must be a positive integer at most 5, the size of dim 0 of 'w'"),
        (
            "w -> v, axis=1, keep=4",
            "keep=4 must be a positive integer at most 3, the size of dim 1 of 'w' (shape [5, 3])",
        ),
        ("w -> v, axis=0, keep='2'", "keep='2' must be a positive integer"),
        ("w -> v, c, axis=0, keep=2", "a split or concat takes only axis= (and sizes= for a split), not keep"),
        ("w -> v, dtype='float16', keep=2", "keep= needs axis=<dim>"),
    ],
)
def test_keep_errors(statement: str, message: str) -> None:
    assert message in error([statement])


# -- {parameters} -----------------------------------------------------------------------------------


def test_parameters_fill_attribute_values_as_integers_or_strings() -> None:
    text = "w -> v, axis={dim}, keep={n}  # {ignored} in a comment\nb -> c, dtype={dt}"
    assert parameter_names(text) == ["dim", "n", "dt"]
    m = Mapping.parse(text, params={"dim": 0, "n": "2", "dt": "float16"})
    assert m.text() == "w -> v, axis=0, keep=2\nb -> c, dtype='float16'"
    assert m.statements[0].text == "w -> v, axis={dim}, keep={n}"  # as written, for errors
    got = outputs(m)
    assert got["v"].tolist() == [[0.0, 1, 2], [3, 4, 5]] and got["c"].dtype == torch.float16


def test_parameter_syntax_errors_point_at_the_parameter() -> None:
    assert [t.kind for t in tokenize("a -> b, axis={x}")][-2:] == ["PARAM", "EOF"]
    for text, col, message in [
        (
            "a -> b, axis={1x}",
            13,
            "a parameter is written {name} (a letter or '_', then letters, digits or '_'), not '{1x}'",
        ),
        ("a -> b, axis={x", 13, "not '{x'"),
        ("a -> {x}", 5, "expected a name, found 'x'"),
    ]:
        with pytest.raises(MappingError) as info:
            Mapping.parse(text, params={"x": 1} if "{x}" in text else None)
        (d,) = info.value.diagnostics
        assert d.col == col and message in d.message, str(info.value)


# -- prefix -----------------------------------------------------------------------------------------


def test_a_prefix_is_stripped_from_sources_and_added_to_reverse_targets() -> None:
    wrapped = {"module.module." + k: v for k, v in FULL.items()}
    got = outputs(Mapping.parse(["w -> weight", "layers.$LAYER_ID.x -> h.$LAYER_ID"], prefix="module.module."), wrapped)
    assert sorted(got) == ["b", "h.0", "h.1", "weight"]  # the unconsumed `b` passes without the prefix
    assert torch.equal(got["h.1"], FULL["layers.1.x"])
    back = outputs(Mapping.parse(["w -> weight"], prefix="module.", reverse=True), {"weight": FULL["w"]})
    assert list(back) == ["module.w"] and torch.equal(back["module.w"], FULL["w"])


def test_a_prefix_that_makes_two_keys_one_is_refused() -> None:
    both = {"w": FULL["w"], "m.w": FULL["w"]}
    with pytest.raises(MappingError, match="source keys 'm.w' and 'w' both read as 'w' with prefix='m.'; drop one"):
        outputs(Mapping.parse(["w -> v"], prefix="m."), both)


def test_flags_of_a_parsed_mapping_can_be_changed() -> None:
    m = Mapping.parse(["w -> v"])
    assert (m.prefix, m.strict, m.reverse) == ("", False, False)
    m2 = Mapping.parse(m, prefix="module.", strict=True)
    assert (m2.prefix, m2.strict, m2.reverse, m2.statements) == ("module.", True, False, m.statements)


# -- unconsumed -------------------------------------------------------------------------------------


def test_unconsumed_lists_only_sources_no_statement_reads() -> None:
    # read (renamed, split, rebound, dropped or read twice) is consumed; the layer keys are not read
    program = ["w -> a, c, axis=0, sizes='[2, 3]'", "b -> b, dtype='float16'", "a -> _"]
    assert unconsumed(program, LAYOUT) == ["layers.0.x", "layers.1.x"]
    assert unconsumed(["absent? -> y", "w -> _", "b -> _", "layers.$LAYER_ID.x -> _"], LAYOUT) == []
    assert "leaves 2 sources unconsumed: 'layers.0.x', 'layers.1.x'" in error(program, strict=True)
