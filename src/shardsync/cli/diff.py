"""``shardsync diff``: compare two checkpoints of any formats, tensor by tensor, ``A`` through a mapping.

Names only in one of them, shapes and dtypes that differ (``--ignore-dtype``: compare the values
only, as after ``convert --dtype``), and the largest absolute difference of each common tensor (NaN
equals NaN, inf equals inf of the same sign). Memory stays bounded: ``A``'s
targets are streamed one at a time, each compared with the same tensor read from ``B``, in chunks.
Exit status 0: equal (within ``--atol``); 1: they differ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..layout.box import Box
from ..layout.dtypes import dtype_name
from ..stream import full_params
from .common import layout_of, progress_bar
from .table import SHOWN, Comparison, Row, fold, folded_list

__all__ = ["DiffConfig", "DiffReport", "TensorDiff", "compare", "max_abs_diff", "run_diff"]

#: Elements compared at once (bounds the temporaries of the comparison).
CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class DiffConfig(Comparison):
    """``shardsync diff``: the two checkpoints, the mapping applied to ``a``, the tolerance."""

    atol: float = 0.0
    ignore_dtype: bool = False
    memory_budget: int | None = None
    progress: bool = True


@dataclass(frozen=True)
class TensorDiff:
    """One tensor both checkpoints have. ``status``: ``equal``, ``values`` (differ by more than the
    tolerance), ``dtype`` or ``shape`` (then ``max_abs_diff`` is None)."""

    name: str
    status: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    dtype_a: str
    dtype_b: str
    max_abs_diff: float | None


@dataclass
class DiffReport:
    """Everything ``diff`` found."""

    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    tensors: list[TensorDiff] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not self.only_in_a and not self.only_in_b and all(t.status == "equal" for t in self.tensors)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest ``|a - b|`` over two same-shaped tensors, in chunks; NaN against NaN and equal
    infinities count as equal, NaN against a number as infinitely far.

    Example:
        >>> max_abs_diff(torch.tensor([1.0, float("nan"), 3.0]), torch.tensor([1.5, float("nan"), 3.0]))
        0.5
    """
    x, y = a.reshape(-1), b.reshape(-1)
    exact = not (x.is_floating_point() or y.is_floating_point() or x.is_complex() or y.is_complex())
    worst = 0.0
    for start in range(0, x.numel(), CHUNK_ELEMENTS):
        cx, cy = x[start : start + CHUNK_ELEMENTS], y[start : start + CHUNK_ELEMENTS]
        if exact:
            d = (cx.to(torch.int64) - cy.to(torch.int64)).abs().to(torch.float64)
        else:
            cx, cy = cx.to(torch.float64), cy.to(torch.float64)
            d = (cx - cy).abs()
            d[(cx == cy) | (cx.isnan() & cy.isnan())] = 0.0
            d = d.nan_to_num(nan=math.inf, posinf=math.inf)  # the default posinf is the largest float
        if d.numel():
            worst = max(worst, float(d.max()))
    return worst


def compare(cfg: DiffConfig) -> DiffReport:
    """Compare ``cfg.a`` (mapped) with ``cfg.b``.

    Raises:
        FormatError: either path is not a checkpoint; MappingError: the mapping does not fit ``a``.
    """
    source_a, source_b, mapping, resolved = cfg.open()
    targets = {t.name: t for t in resolved}
    layout_b = layout_of(source_b)
    report = DiffReport(sorted(set(targets) - set(layout_b.keys())), sorted(set(layout_b.keys()) - set(targets)))
    bar = progress_bar(cfg.progress, "diff", sum(t.nbytes for t in targets.values()))
    try:
        for name, tensor in full_params(source_a, mapping, copy=False, memory_budget=cfg.memory_budget):
            if name in layout_b:
                meta = layout_b[name]
                other = source_b.read(name, Box.full(meta.shape)) if meta.shape == tuple(tensor.shape) else None
                report.tensors.append(_one(name, tensor, meta.shape, meta.dtype, other, cfg))
            if bar is not None:
                bar.update(tensor.numel() * tensor.element_size())
    finally:
        if bar is not None:
            bar.close()
    return report


def _one(
    name: str, a: torch.Tensor, shape_b: tuple[int, ...], dtype_b: str, b: torch.Tensor | None, cfg: DiffConfig
) -> TensorDiff:
    dtype_a = dtype_name(a.dtype)
    if b is None:
        return TensorDiff(name, "shape", tuple(a.shape), shape_b, dtype_a, dtype_b, None)
    worst = max_abs_diff(a, b)
    if dtype_a != dtype_b and not cfg.ignore_dtype:
        status = "dtype"
    else:
        status = "values" if worst > cfg.atol else "equal"
    return TensorDiff(name, status, tuple(a.shape), shape_b, dtype_a, dtype_b, worst)


def _number(x: float | None) -> Any:
    return x if x is None or math.isfinite(x) else "inf"


def document(report: DiffReport, cfg: DiffConfig) -> dict[str, Any]:
    """The JSON document ``diff --json`` prints."""
    return {
        **cfg.header(),
        "equal": report.equal,
        "atol": cfg.atol,
        "only_in_a": report.only_in_a,
        "only_in_b": report.only_in_b,
        "tensors": {
            t.name: {
                "status": t.status,
                "shape_a": list(t.shape_a),
                "shape_b": list(t.shape_b),
                "dtype_a": t.dtype_a,
                "dtype_b": t.dtype_b,
                "max_abs_diff": _number(t.max_abs_diff),
            }
            for t in report.tensors
        },
    }


def _lines(differ: list[TensorDiff], atol: float) -> list[str]:
    """One line per kind of difference, tensors that differ alike folded (``layers.{0..3}.w``)."""
    rows = [
        Row(
            (t.name,),
            (t.status, tuple(t.shape_a), tuple(t.shape_b), t.dtype_a, t.dtype_b),
            sets=(frozenset({t.max_abs_diff or 0.0}),),
        )
        for t in differ
    ]
    out = []
    for (name,), row in fold(rows):
        status, shape_a, shape_b, dtype_a, dtype_b = row.same
        worst = max(row.sets[0])
        if status == "shape":
            out.append(f"shape differs: {name} {list(shape_a)} in A, {list(shape_b)} in B")
        elif status == "dtype":
            out.append(f"dtype differs: {name} {dtype_a} in A, {dtype_b} in B (max abs diff {worst:.6g})")
        else:
            out.append(f"values differ: {name} max abs diff {worst:.6g} > --atol {atol:g}")
    return out


def text(report: DiffReport, cfg: DiffConfig) -> str:
    """The lines ``diff`` prints."""
    lines = []
    if report.only_in_a:
        lines.append(f"only in A ({len(report.only_in_a)}): {folded_list(report.only_in_a)}")
    if report.only_in_b:
        lines.append(f"only in B ({len(report.only_in_b)}): {folded_list(report.only_in_b)}")
    differ = [t for t in report.tensors if t.status != "equal"]
    found = _lines(differ, cfg.atol)
    lines += found[:SHOWN]
    if len(found) > SHOWN:
        lines.append(f"... and {len(found) - SHOWN} more lines (--json lists every tensor)")
    worst = max((t.max_abs_diff or 0.0 for t in report.tensors), default=0.0)
    common = len(report.tensors)
    if report.equal:
        within = f" (within --atol {cfg.atol:g})" if worst > 0 else ""
        lines.append(f"equal: {common} tensors, max abs diff {worst:.6g}{within}")
    else:
        lines.append(
            f"differ: {len(differ)} of {common} common tensors, {len(report.only_in_a)} only in A, "
            f"{len(report.only_in_b)} only in B"
        )
    return "\n".join(lines)


def run_diff(cfg: DiffConfig) -> tuple[str, int]:
    """What ``shardsync diff`` prints, and its exit status (0 equal, 1 different)."""
    report = compare(cfg)
    return cfg.output(lambda: document(report, cfg), lambda: text(report, cfg)), 0 if report.equal else 1
