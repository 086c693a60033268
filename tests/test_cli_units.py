"""The command line's helpers: human units, folded tables, flags in library messages, unconsumed
sources."""

from __future__ import annotations

import pytest

from shardsync.cli.common import unconsumed_sources
from shardsync.cli.messages import one_line
from shardsync.cli.table import Row, fold, render_ints
from shardsync.cli.units import human_bytes, human_rate, human_seconds
from shardsync.errors import FormatError, MappingError, PlanError
from shardsync.mapping import Mapping


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (7, "7 B"),
        (999, "999 B"),
        (1000, "1.00 KB"),
        (1234, "1.23 KB"),
        (99_940, "99.9 KB"),
        (99_960, "100 KB"),
        (350_000, "350 KB"),
        (999_400, "999 KB"),
        (999_600, "1.00 MB"),
        (1_234_567_890, "1.23 GB"),
        (5 * 10**15, "5.00 PB"),
        (2 * 10**18, "2000 PB"),
    ],
)
def test_human_bytes(n: int, text: str) -> None:
    assert human_bytes(n) == text


def test_rates_and_seconds() -> None:
    assert human_rate(350_000, 1.0) == "350 KB/s"
    assert (human_seconds(0.004), human_seconds(59.99), human_seconds(60), human_seconds(3725)) == (
        "0.00 s",
        "59.99 s",
        "1 min 0 s",
        "62 min 5 s",
    )


def _names(rows: list[Row]) -> list[tuple[str, ...]]:
    return [names for names, _ in fold(rows)]


def test_fold_layers_and_grids() -> None:
    rows = [Row((f"layers.{i}.experts.{e}.w",), ("bf16",), nbytes=2) for i in range(32) for e in range(8)]
    rows += [Row(("layers.5.experts.8.w",), ("bf16",))]  # an extra expert in one layer only
    folded = fold(rows)
    assert [(names, row.count, row.nbytes) for names, row in folded] == [
        (("layers.{0..31}.experts.{0..7}.w",), 256, 512),
        (("layers.5.experts.8.w",), 1, 0),
    ]


def test_fold_keeps_rows_that_differ_apart() -> None:
    rows = [Row((f"l.{i}.w",), ((4,) if i != 2 else (5,),)) for i in range(5)]
    assert _names(rows) == [("l.{0,1,3,4}.w",), ("l.2.w",)]
    assert _names([Row(("l.1.w",)), Row(("l.10.w",)), Row(("l.2.w",))]) == [("l.{1,2,10}.w",)]
    # numbers inside words are not layer numbers
    assert _names([Row(("fc1.w",)), Row(("fc2.w",))]) == [("fc1.w",), ("fc2.w",)]


def test_fold_moves_linked_numbers_together() -> None:
    # a target and its source keep their numbers in step, even offset (pipeline stage renumbering)
    rows = [Row((f"model.layers.{i + 8}.q", f"stage1.layers.{i}.qkv")) for i in range(8)]
    assert _names(rows) == [("model.layers.{8..15}.q", "stage1.layers.{0..7}.qkv")]
    # two numbers of one name never link: a diagonal is not a grid
    assert _names([Row(("a.0.b.0",)), Row(("a.1.b.1",))]) == [("a.0.b.0",), ("a.1.b.1",)]


def test_fold_gathers_sets() -> None:
    rows = [Row((f"l.{i}.w",), sets=(frozenset({i % 2}),)) for i in range(4)]
    ((names, row),) = fold(rows)
    assert names == ("l.{0..3}.w",) and row.sets == (frozenset({0, 1}),)


def test_render_ints() -> None:
    assert [render_ints(v) for v in ([3], [0, 1], [0, 1, 2], [0, 2, 3, 4, 9])] == ["3", "{0,1}", "{0..2}", "{0,2..4,9}"]


@pytest.mark.parametrize(
    "exc, line",
    [
        (
            FormatError("out already holds a checkpoint (x); pass overwrite=True to replace it"),
            "out already holds a checkpoint (x) (pass --overwrite to replace it)",
        ),
        (
            PlanError("memory_budget=1000 B cannot be met; raise memory_budget to 123456 B or more"),
            "--memory-budget 1.00 KB cannot be met (raise --memory-budget to 123 KB or more)",
        ),
        (FormatError("cannot read size '5x'; write e.g. '5GB'"), "cannot read size '5x' (write e.g. '5GB')"),
        (
            FormatError("config_from='d' holds no config.json"),
            "--config-from 'd' holds no config.json (check the checkpoint path)",
        ),
        (
            PlanError("invalid stream options:\n  a\n  b"),
            "invalid stream options: a; b (check --memory-budget and --nproc)",
        ),
        (
            MappingError("mapping file 'm.txt' does not exist (inline statements need '->')"),
            "mapping file 'm.txt' does not exist (inline statements need '->') (fix the mapping)",
        ),
    ],
)
def test_library_messages_name_flags(exc: Exception, line: str) -> None:
    assert one_line("convert", exc) == (f"shardsync convert: {line}", 2)


def test_several_mapping_problems_show_the_first() -> None:
    with pytest.raises(MappingError) as err:
        Mapping.parse(["a -> ", "-> c"])
    line, status = one_line("explain", err.value)
    assert status == 2 and "\n" not in line
    assert line.startswith("shardsync explain: statement 0 `a ->`, column")
    assert line.endswith("; 1 more problem after this one)")


def test_unconsumed_sources() -> None:
    keys = ["layers.0.qkv", "layers.1.qkv", "layers.0.qkv.moment1_0", "norm", "head"]
    m = Mapping.parse(["layers.$LAYER_ID.qkv -> l.$LAYER_ID.q, l.$LAYER_ID.k, axis=0", "head -> _"])
    assert unconsumed_sources(m, keys) == ["norm"]
    assert unconsumed_sources(None, keys) == [] and unconsumed_sources(Mapping.parse([]), keys) == []
    back = Mapping.parse(["x -> norm2"], reverse=True)  # reversed: `norm2 -> x` consumes norm2
    assert unconsumed_sources(back, ["norm2", "other"]) == ["other"]
