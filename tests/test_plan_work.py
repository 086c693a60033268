"""Planning and streaming work grows linearly with the number of tensors (issue 19: 25k tiny tensors
planned in 11 s, 100k in 108 s). Work is counted as Python function calls (cProfile), not time:
deterministic, and a loop over every tensor for each tensor shows up as a quadratic count.

A quadratic step inside one C call (``list.count`` in a loop, the bug fixed with this test) is not
seen by the count; ``bench/bench_plan.py`` (case ``tensors``) times the whole range.
"""

from __future__ import annotations

import cProfile
import pstats
from collections.abc import Callable

import pytest
import torch

import shardsync

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
        (lambda s: shardsync.plan(s, MAPPING)) if verb == "plan" else _stream)
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
