"""Planning and streaming work grows linearly with the number of tensors (issue 19: 25k tiny tensors
planned in 11 s, 100k in 108 s). Work is counted as Python function calls (cProfile), not time:
deterministic, and a loop over every tensor for each tensor shows up as a quadratic count.

A quadratic step inside one C call (``list.count`` in a loop over the targets: the bug of issue 19)
is not seen by that count; names that count their comparisons see it. ``bench/bench_plan.py`` (case
``tensors``) times the whole range.
"""

from __future__ import annotations

import cProfile
import pstats
from collections.abc import Callable

import pytest
import torch

import shardsync
from shardsync.layout import Box, GlobalLayout
from shardsync.mapping import Piece, TargetSpec
from shardsync.planning.validate import target_problems

MAPPING = ["layers.$LAYER_ID.w -> model.layers.$LAYER_ID.weight"]


def _state(n: int) -> dict[str, torch.Tensor]:
    return {f"layers.{i}.w": torch.full((3,), float(i)) for i in range(n)}


def _calls(fn: Callable[[], object]) -> int:
    profile = cProfile.Profile()
    profile.enable()
    try:
        fn()
    finally:
        profile.disable()
    return pstats.Stats(profile).total_calls  # type: ignore[attr-defined, no-any-return]


def _stream(state: dict[str, torch.Tensor]) -> int:
    return sum(1 for _ in shardsync.full_params(state, MAPPING))


@pytest.mark.parametrize("verb", ["plan", "full_params"])
def test_work_is_linear_in_the_number_of_tensors(verb: str) -> None:
    run: Callable[[dict[str, torch.Tensor]], object] = (
        (lambda s: shardsync.plan(s, MAPPING)) if verb == "plan" else _stream
    )
    run(_state(50))  # warm up: imports and caches
    counts = {n: _calls(lambda n=n: run(_state(n))) for n in (150, 300, 600)}  # type: ignore[misc]
    first, second = counts[300] - counts[150], counts[600] - counts[300]
    # linear: each doubling adds twice the work of the one before (quadratic: four times)
    assert first > 0 and second <= 2.05 * first, counts


def test_streamed_values_at_scale() -> None:
    state = _state(600)
    got = dict(shardsync.full_params(state, MAPPING))
    assert len(got) == 600
    assert all(torch.equal(got[f"model.layers.{i}.weight"], torch.full((3,), float(i))) for i in range(600))


class _Name(str):
    """A target name that counts how often it is compared for equality."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        _Name.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_target_names_are_compared_a_linear_number_of_times() -> None:
    n = 2000
    keys = [f"w{i}" for i in range(n)]
    layout = GlobalLayout.merge([[(k, (3,), "float32", Box.full((3,))) for k in keys]])
    targets = [TargetSpec(_Name(k), (3,), "float32", (Piece(k, Box.full((3,)), Box.full((3,))),)) for k in keys]
    _Name.compared = 0
    assert target_problems(targets, layout) == []
    assert _Name.compared <= 2 * n, _Name.compared  # a list.count per name: n * n = 4,000,000
    twice = targets + targets[:1]
    assert target_problems(twice, layout) == ["target 'w0' is produced twice"]
