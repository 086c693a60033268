"""Property tests: random programs resolved to pieces equal a dense run of the same statements."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from reference import arange_tensor, assemble, dense_run
from shardsync.layout import Box, GlobalLayout, dtype_name
from shardsync.mapping import Mapping, resolve

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32]
DTYPE_NAMES = ["float32", "bfloat16", "float16", "float64", "int32", "int64"]


@st.composite
def programs(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], list[str]]:
    sources: dict[str, torch.Tensor] = {}
    env: dict[str, tuple[tuple[int, ...], str]] = {}
    for i in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
        dt = draw(st.sampled_from(DTYPES))
        sources[f"s{i}"] = arange_tensor(shape, dt, start=100 * i, step=1.37)
        env[f"s{i}"] = (shape, dtype_name(dt))
    stmts: list[str] = []
    fresh = iter(f"v{i}" for i in range(100))
    for _ in range(draw(st.integers(1, 6))):
        name = draw(st.sampled_from(sorted(env)))
        shape, dt = env[name]
        op = draw(st.sampled_from(["rename", "permute", "transpose", "cast", "rebind", "split", "concat", "drop"]))
        out = next(fresh)
        if op == "rename":
            stmts.append(f"{name} -> {out}")
        elif op == "permute":
            perm = draw(st.permutations(range(len(shape))))
            use_empty = draw(st.booleans())
            perm = list(range(len(shape)))[::-1] if use_empty else list(perm)
            spec = "[]" if use_empty else str(perm)
            stmts.append(f"{name} -> {out}, permute='{spec}'")
            shape = tuple(shape[p] for p in perm)
        elif op == "transpose":
            stmts.append(f"{name}^T -> {out}")
            shape = shape[::-1]
        elif op in ("cast", "rebind"):
            dt = draw(st.sampled_from(DTYPE_NAMES))
            if op == "rebind":
                out = name
            stmts.append(
                f"{out if op == 'cast' else name} -> {out}, dtype='{dt}', lossy=1"
                if op == "rebind"
                else f"{name} -> {out}, dtype='{dt}', lossy=1"
            )
        elif op == "split":
            dim = draw(st.integers(0, len(shape) - 1))
            n = shape[dim]
            sizes = draw(st.lists(st.integers(0, n), min_size=2, max_size=3).filter(lambda s: True))
            sizes = sizes[:-1] + [n - sum(sizes[:-1])] if sum(sizes[:-1]) <= n else [n, 0]
            outs = [out] + [next(fresh) for _ in sizes[1:]]
            neg = draw(st.booleans())
            axis = dim - len(shape) if neg else dim
            stmts.append(f"{name} -> {', '.join(outs)}, axis={axis}, sizes='{sizes}'")
            for o, s in zip(outs, sizes):
                env[o] = (shape[:dim] + (s,) + shape[dim + 1 :], dt)
            continue
        elif op == "concat":
            dim = draw(st.integers(0, len(shape) - 1))
            stmts.append(f"{name}, {name} -> {out}, axis={dim}")
            shape = shape[:dim] + (2 * shape[dim],) + shape[dim + 1 :]
        else:
            stmts.append(f"{name} -> _")
            continue
        env[out] = (shape, dt)
    return sources, stmts


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
@example(
    (
        {"s0": arange_tensor((3, 5), torch.float32, step=1.37)},
        [
            "s0 -> v0, dtype='bfloat16'",
            "v0 -> v1, dtype='float32'",
            "s0 -> s0, dtype='float64'",
            "s0 -> s0, dtype='float16'",
            "s0 -> s0, dtype='float32'",
        ],
    )
)
def test_random_programs_match_dense_reference(case: tuple[dict[str, torch.Tensor], list[str]]) -> None:
    sources, stmts = case
    layout = GlobalLayout.merge(
        [[(k, tuple(v.shape), dtype_name(v.dtype), Box.full(v.shape)) for k, v in sources.items()]]
    )
    got = {t.name: (t, assemble(t, sources)) for t in resolve(stmts, layout)}
    want = dense_run(Mapping.parse(stmts).statements, sources)
    assert sorted(got) == sorted(want), stmts
    for name, ref in want.items():
        spec, value = got[name]
        assert spec.dtype == dtype_name(ref.dtype), (name, stmts)
        assert spec.shape == tuple(ref.shape), (name, stmts)
        assert torch.equal(value, ref), (name, stmts)


@st.composite
def fused_cases(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], list[str], dict[str, int]]:
    g = draw(st.integers(1, 3))
    h = g * draw(st.integers(1, 3))
    d = draw(st.integers(1, 3))
    rows = draw(st.integers(1, 3))
    axis = draw(st.integers(0, 1))
    kind = draw(st.sampled_from(["fused_qkv", "fused_qkv_old", "fused_ffn"]))
    t = draw(st.sampled_from([x for x in (1, 2, 3) if h % x == 0 and g % x == 0]))
    width = (h + 2 * g) * d if kind != "fused_ffn" else 2 * t * d
    shape = (width, rows) if axis == 0 else (rows, width)
    src = {"w": arange_tensor(shape, torch.float32, start=1)}
    attrs = f"num_heads={h}, num_key_value_groups={g}, axis={axis}" if kind != "fused_ffn" else f"axis={axis}"
    outs = "q, k, v" if kind != "fused_ffn" else "gate, up"
    tp = kind != "fused_qkv" and draw(st.booleans())
    if tp:  # the block count as an attribute: the source is one full tensor, and w2 is built in t blocks
        attrs += f", tp={t}"
    stmts = [f"w -> {outs}, {kind}, {attrs}"]
    if draw(st.booleans()):  # and back again: the reverse form must restore w (T=1 blocks without tp)
        stmts.append(f"{outs} -> w2, {kind}, {attrs}")
    return src, stmts, {"w": t if kind != "fused_qkv" and not tp else 1}


@settings(max_examples=80, deadline=None)
@given(fused_cases())
def test_fused_macros_match_reshape_reference(case: tuple[dict, list[str], dict[str, int]]) -> None:
    sources, stmts, shards = case
    t = shards["w"]
    axis = int(stmts[0].split("axis=", 1)[1].split(",")[0])
    w = sources["w"]
    n = w.shape[axis]
    layout = GlobalLayout.merge([[("w", tuple(w.shape), "float32", _band(w.shape, axis, n, t, r))] for r in range(t)])
    got = {s.name: assemble(s, sources) for s in resolve(stmts, layout)}
    want = dense_run(Mapping.parse(stmts).statements, sources, shards)
    if ", tp=" in stmts[-1] and len(stmts) == 2:
        assert torch.equal(got["w2"], sources["w"])  # split and joined in the same tp blocks
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), (k, stmts)


def _band(shape: torch.Size, axis: int, n: int, t: int, r: int) -> Box:
    off = [0, 0]
    size = list(shape)
    off[axis], size[axis] = r * n // t, n // t
    return Box(tuple(off), tuple(size))
