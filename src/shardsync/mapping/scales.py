"""Block-FP8 weights kept as codes (no dtype asked for): each weight and its scales are one tensor.

A source ``W`` of FP8 codes with a ``W_scale_inv`` companion is one name to the mapping: the program
sees ``W`` only (wildcards do not match the scales, and they are never reported unconsumed), and every
target built from ``W`` gets a companion target ``<target>_scale_inv`` whose pieces follow ``W``'s:
a rename carries the scales whole; a split, a slice or a concatenation along rows or columns at
block boundaries cuts the scale grid at the same block rows and columns. A piece that cuts through
a block, or that transposes the blocks, would need values the scales do not describe: that is an
error asking for a dtype (which dequantises; docs/fp8.md). A program that names ``W_scale_inv``
itself maps it as it says.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from ..errors import MappingError
from ..layout.box import Box
from ..layout.meta import GlobalLayout
from ..quant.fp8 import CODE_DTYPES, DEFAULT_BLOCK, Block, scale_box, scale_key, scale_shape
from .pieces import Piece, TargetSpec

__all__ = ["fp8_pairs", "scale_targets"]


def fp8_pairs(layout: GlobalLayout, named: Collection[str]) -> dict[str, str]:
    """``{weight key: scale key}`` of the block-FP8 weights of ``layout`` whose scales the program
    does not name (``named``: every name the program uses).

    Example:
        >>> lay = GlobalLayout.merge([[("w", (3, 2), "float8_e4m3fn", Box((0, 0), (3, 2))),
        ...                            ("w_scale_inv", (1, 1), "float32", Box((0, 0), (1, 1)))]])
        >>> fp8_pairs(lay, []), fp8_pairs(lay, ["w_scale_inv"])
        ({'w': 'w_scale_inv'}, {})
    """
    keys = set(layout.keys())
    return {
        k: scale_key(k)
        for k in layout.keys()
        if layout[k].dtype in CODE_DTYPES
        and len(layout[k].shape) >= 2
        and scale_key(k) in keys
        and scale_key(k) not in named
    }


def scale_targets(
    targets: Iterable[TargetSpec], layout: GlobalLayout, pairs: dict[str, str], block: Block = DEFAULT_BLOCK
) -> list[TargetSpec]:
    """The scale target of every target that reads block-FP8 weights, its pieces following theirs.

    Args:
        targets: the resolved targets.
        layout: the sources' layout.
        pairs: :func:`fp8_pairs` of it.
        block: rows x columns of a block (needed only where a piece is not a whole weight).

    Raises:
        MappingError: naming each target whose pieces cut blocks, transpose them, cast the codes to
            another FP8 dtype, mix FP8 weights with other tensors, or whose scale target name is
            taken; the fix is a dtype (dequantise) or block-aligned cuts.

    Example:
        >>> lay = GlobalLayout.merge([[("w", (300, 17), "float8_e4m3fn", Box((0, 0), (300, 17))),
        ...                            ("w_scale_inv", (3, 1), "float32", Box((0, 0), (3, 1)))]])
        >>> top = TargetSpec("top", (256, 17), "float8_e4m3fn",
        ...                  (Piece("w", Box((0, 0), (256, 17)), Box((0, 0), (256, 17))),))
        >>> [(t.name, t.shape, t.pieces[0].source_box) for t in scale_targets([top], lay, {"w": "w_scale_inv"})]
        [('top_scale_inv', (2, 1), Box(offsets=(0, 0), sizes=(2, 1)))]
    """
    targets = list(targets)
    taken = {t.name for t in targets}
    out, problems = [], []
    for t in targets:
        fp8 = [p for p in t.pieces if p.source in pairs]
        if not fp8 or t.dtype not in CODE_DTYPES:
            continue  # no FP8 weight, or cast to values: refused when planned (check_fp8_casts)
        spec = _target_problem(t, fp8, taken) or _scale_target(t, layout, pairs, block)
        if isinstance(spec, str):
            problems.append(f"{t.name!r}: {spec}")
        else:
            out.append(spec)
    if problems:
        raise MappingError(
            "block-FP8 weights (codes with *_scale_inv scales) are mapped without a dtype, so "
            "their scales must follow them:\n  "
            + "\n  ".join(problems)
            + "\nask for a dtype to dequantise them (dtype=..., --dtype bf16), or cut on block "
            "boundaries"
        )
    return out


def _target_problem(t: TargetSpec, fp8: Sequence[Piece], taken: Collection[str]) -> str:
    if len(fp8) != len(t.pieces):
        others = sorted({p.source for p in t.pieces} - {p.source for p in fp8})
        return f"joins block-FP8 weights with tensors that have no scales ({', '.join(map(repr, others))})"
    if scale_key(t.name) in taken:
        return f"its scales would be target {scale_key(t.name)!r}, which the mapping makes too"
    return ""


def _scale_target(t: TargetSpec, layout: GlobalLayout, pairs: dict[str, str], block: Block) -> TargetSpec | str:
    """The scale target of ``t``, or what is wrong."""
    if len(t.pieces) == 1 and _whole(t.pieces[0], layout, t.shape):
        p = t.pieces[0]
        meta = layout[pairs[p.source]]
        box = Box.full(meta.shape)
        return TargetSpec(scale_key(t.name), meta.shape, meta.dtype, (Piece(pairs[p.source], box, box),))
    pieces, dtypes = [], set()
    for p in t.pieces:
        weight, scales = layout[p.source], layout[pairs[p.source]]
        if scales.shape != scale_shape(weight.shape, block):
            return (
                f"its scales {pairs[p.source]!r} of shape {list(scales.shape)} do not fit weight "
                f"{p.source!r} of shape {list(weight.shape)} in blocks of {list(block)}, so the cut "
                f"{p.source}{p.source_box} cannot be followed"
            )
        why = _piece_problem(p, weight.shape, t.shape, block)
        if why:
            return why
        pieces.append(Piece(pairs[p.source], scale_box(p.source_box, block), scale_box(p.target_box, block), p.perm))
        dtypes.add(scales.dtype)
    if len(dtypes) > 1:
        return f"its weights' scales have different dtypes ({', '.join(sorted(dtypes))})"
    return TargetSpec(scale_key(t.name), scale_shape(t.shape, block), dtypes.pop(), tuple(pieces))


def _whole(p: Piece, layout: GlobalLayout, shape: tuple[int, ...]) -> bool:
    """Whether ``p`` copies a whole weight onto a whole target of its shape, as it is."""
    source = layout[p.source].shape
    return (
        p.perm is None
        and not p.casts
        and source == shape
        and p.source_box == Box.full(source)
        and p.target_box == Box.full(shape)
    )


def _piece_problem(p: Piece, source: Sequence[int], target: Sequence[int], block: Block) -> str:
    """Why the scales cannot follow piece ``p`` (empty: they can)."""
    ns, nt = len(source), len(target)
    if p.casts:
        return f"casts the codes of {p.source!r} to {p.casts[-1]}, which their scales do not describe"
    if nt < 2 or (p.perm is not None and tuple(p.perm[-2:]) != (ns - 2, ns - 1)):
        return f"moves the rows and columns of {p.source!r} (a transpose or a reshape of its blocks)"
    for ds, dt, b in zip((ns - 2, ns - 1), (nt - 2, nt - 1), block):
        s0, t0, size = p.source_box.offsets[ds], p.target_box.offsets[dt], p.source_box.sizes[ds]
        aligned = s0 % b == 0 and t0 % b == 0
        ends = size % b == 0 or (s0 + size == source[ds] and t0 + size == target[dt])
        if not (aligned and ends):
            what = "rows" if ds == ns - 2 else "columns"
            return (
                f"{p.source}{p.source_box} -> {p.target_box} cuts blocks of {list(block)} ({what} "
                f"{s0}..{s0 + size} land at {t0}..{t0 + size})"
            )
    return ""
