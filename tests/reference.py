"""Slow, obviously-correct references for tests.

``dense_run`` applies already-expanded statements literally to full tensors (torch.cat, torch.split,
permute, .to, torch.stack, torch.unbind, .reshape), with the fused macros written as reshapes - a
different route from the resolver's box arithmetic. ``assemble`` builds targets from resolved pieces
by plain slicing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from shardsync.layout.dtypes import to_torch_dtype
from shardsync.mapping.pieces import TargetSpec
from shardsync.mapping.syntax import Statement

__all__ = ["dense_run", "assemble", "arange_tensor"]


def arange_tensor(
    shape: Sequence[int], dtype: torch.dtype = torch.float32, start: int = 0, step: float = 1.0
) -> torch.Tensor:
    """``start, start + step, ...`` in ``shape``; a fractional step makes every lossy cast visible."""
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64) * step + start).reshape(tuple(shape)).to(dtype)


def assemble(spec: TargetSpec, full: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Build a target from its pieces by slicing the full sources."""
    out = torch.full(spec.shape, -7, dtype=to_torch_dtype(spec.dtype))
    covered = torch.zeros(spec.shape, dtype=torch.int32)
    for p in spec.pieces:
        x = full[p.source][p.source_box.slices()]
        if p.perm is not None:  # -1: a new unit dim; source dims left out have size 1
            kept = [d for d in p.perm if d >= 0]
            x = x.permute(kept + [d for d in range(x.dim()) if d not in kept]).reshape(p.target_box.sizes)
        for c in p.casts:
            x = x.to(to_torch_dtype(c))
        out[p.target_box.slices()] = x.to(out.dtype)
        covered[p.target_box.slices()] += 1
    assert bool((covered == 1).all()), f"{spec.name}: pieces do not tile the target exactly"
    return out


def _axis(st: Statement, x: torch.Tensor, default: int | None = None) -> int:
    a = st.attr("axis", default)
    assert isinstance(a, int)
    return a % x.dim()


def _fused(st: Statement, kind: str, ins: list[torch.Tensor], shards: Mapping[str, int]) -> list[torch.Tensor]:
    h, g = st.attr("num_heads"), st.attr("num_key_value_groups")
    ax = _axis(st, ins[0], 1)

    def split_heads(w: torch.Tensor, blocks: int, per: list[int]) -> list[torch.Tensor]:
        # move axis last, view as [..., blocks, sum(per)*d], cut each block by `per` head counts
        x = w.movedim(ax, -1)
        d = x.shape[-1] // (blocks * sum(per))
        x = x.reshape(*x.shape[:-1], blocks, sum(per) * d)
        outs, at = [], 0
        for p in per:
            part = x[..., at * d : (at + p) * d]
            outs.append(part.reshape(*x.shape[:-2], blocks * p * d).movedim(-1, ax))
            at += p
        return outs

    def join_heads(parts: list[torch.Tensor], blocks: int) -> torch.Tensor:
        xs = [p.movedim(ax, -1) for p in parts]
        xs = [x.reshape(*x.shape[:-1], blocks, x.shape[-1] // blocks) for x in xs]
        y = torch.cat(xs, dim=-1)
        return y.reshape(*y.shape[:-2], -1).movedim(-1, ax)

    if kind == "fused_qkv":
        if len(ins) == 1:
            return split_heads(ins[0], g, [h // g, 1, 1])
        return [join_heads(ins, g)]

    def blocks(name: str) -> int:  # tp= when given, else the tensor's shard count (1: not sharded)
        tp = st.attr("tp")
        return tp if isinstance(tp, int) else shards.get(name, 1)

    if kind == "fused_qkv_old":
        if len(ins) == 3:
            return [join_heads(ins, blocks(st.right[0].text))]
        t = blocks(st.left[0].text)
        qkv = split_heads(ins[0], t, [h // t, g // t, g // t])
        return qkv if len(st.right) == 3 else [join_heads(qkv, blocks(st.right[0].text))]
    if len(ins) == 2:
        return [join_heads(ins, blocks(st.right[0].text))]
    t = blocks(st.left[0].text)
    gu = split_heads(ins[0], t, [1, 1])
    return gu if len(st.right) == 2 else [join_heads(gu, blocks(st.right[0].text))]


def _ints(st: Statement, key: str) -> list[int]:
    return [int(p) for p in str(st.attr(key)).strip("[]").split(",") if p.strip()]


def _apply(st: Statement, ins: list[torch.Tensor], shards: Mapping[str, int]) -> list[torch.Tensor]:
    fused = [a.key for a in st.attrs if a.value is None]
    if fused == ["stack"]:
        return [torch.stack(ins, dim=int(st.attr("axis", 0) or 0))]
    if fused == ["unstack"]:
        return list(torch.unbind(ins[0], dim=int(st.attr("axis", 0) or 0)))
    if fused:
        return _fused(st, fused[0], ins, shards)
    if st.has("shape") or st.has("dst_shape"):
        if st.has("src_shape"):
            assert ins[0].shape == ins[0].reshape(_ints(st, "src_shape")).shape
        return [ins[0].reshape(_ints(st, "shape" if st.has("shape") else "dst_shape"))]
    if len(ins) == 1 and len(st.right) == 1:
        x = ins[0]
        if st.has("src_dtype"):
            x = x.to(to_torch_dtype(str(st.attr("dst_dtype"))))
        if st.has("permute"):
            perm = [int(p) for p in str(st.attr("permute")).strip("[]").split(",") if p.strip()]
            x = x.permute(perm or list(range(x.dim()))[::-1])
        if st.has("dtype"):
            x = x.to(to_torch_dtype(str(st.attr("dtype"))))
        return [x]
    if len(ins) == 1:
        ax = _axis(st, ins[0])
        sizes = st.attr("sizes")
        if sizes is not None:
            sz = [int(s) for s in str(sizes).strip("[]").split(",")]
            return list(torch.split(ins[0], sz, dim=ax))
        return list(torch.chunk(ins[0], len(st.right), dim=ax))
    return [torch.cat(ins, dim=_axis(st, ins[0]))]


def dense_run(
    statements: Sequence[Statement], sources: Mapping[str, torch.Tensor], shards: Mapping[str, int] | None = None
) -> dict[str, torch.Tensor]:
    """Apply expanded statements to full tensors; return the outputs (unconsumed, not dropped)."""
    bound: dict[str, torch.Tensor] = {}
    live = dict.fromkeys(sources)
    for st in statements:
        if [n.text for n in st.left] == ["_"]:
            continue
        ins = []
        for n in st.left:
            if n.text in bound or n.text in sources:  # also `s^T` bound by an expanded statement
                ins.append(bound[n.text] if n.text in bound else sources[n.text])
                live.pop(n.text, None)
                continue
            base = n.text.removesuffix("^T")
            x = bound[base] if base in bound else sources[base]
            ins.append(x.permute(*range(x.dim() - 1, -1, -1)))
            live.pop(base, None)
        outs = _apply(st, ins, shards or {})
        for n, v in zip(st.right, outs):
            if n.text != "_":
                bound[n.text] = v
                live[n.text] = None
    merged = {**sources, **bound}
    return {k: merged[k] for k in sorted(live)}
