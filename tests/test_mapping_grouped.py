"""Grouped and stacked tensors: ``stack``, ``unstack`` and reshapes (``shape=``, ``src_shape=`` /
``dst_shape=``) against the dense reference, both directions, composed with the fused forms, on
sources cut into shards along any dim; and the errors of each."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardsync
from reference import arange_tensor, assemble, dense_run
from shardsync.errors import MappingError
from shardsync.layout import Box, GlobalLayout, dtype_name
from shardsync.mapping import Mapping, resolve


def _layout(sources: dict[str, torch.Tensor], cut: dict[str, tuple[int, int]] | None = None) -> GlobalLayout:
    """One rank per shard: ``cut[key] = (dim, n)`` cuts that key into ``n`` bands along ``dim`` (the
    last band takes the rest)."""
    ranks: list[list] = [[]]
    for key, t in sources.items():
        dim, n = (cut or {}).get(key, (0, 1))
        size = t.shape[dim]
        stops = [size * (r + 1) // n for r in range(n)]
        lo = 0
        for r, hi in enumerate(stops):
            while len(ranks) <= r:
                ranks.append([])
            off, shape = [0] * t.dim(), list(t.shape)
            off[dim], shape[dim] = lo, hi - lo
            ranks[r].append((key, tuple(t.shape), dtype_name(t.dtype), Box(tuple(off), tuple(shape))))
            lo = hi
    return GlobalLayout.merge(ranks)


def _run(program, sources, cut=None, **kw) -> dict[str, torch.Tensor]:
    return {t.name: assemble(t, sources) for t in resolve(program, _layout(sources, cut), **kw)}


def _check_pieces_inside_shards(program, sources, cut, **kw) -> None:
    """Every piece restricted to each shard it touches is still a valid piece (the planner's cut)."""
    layout = _layout(sources, cut)
    for t in resolve(program, layout, **kw):
        for p in t.pieces:
            for box in {s.box for s in layout[p.source].shards}:
                hit = p.source_box.intersect(box)
                if hit is not None and not hit.empty:
                    assert p.restrict(hit).target_box.within(t.shape)


# --- a random program of grouped statements equals the dense reference -------------------------------


def _factor_shape(draw: st.DrawFn, numel: int) -> tuple[int, ...]:
    """A random shape holding ``numel`` entries, unit dims included."""
    dims, left = [], numel
    for _ in range(draw(st.integers(0, 2))):
        d = draw(st.sampled_from([x for x in range(1, left + 1) if left % x == 0]))
        dims.append(d)
        left //= d
    dims.append(left)
    if draw(st.booleans()):
        dims.insert(draw(st.integers(0, len(dims))), 1)
    return tuple(draw(st.permutations(dims)))


@st.composite
def grouped_programs(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], list[str], dict[str, tuple[int, int]]]:
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    sources = {"s0": arange_tensor(shape, start=1), "s1": arange_tensor(shape, start=500)}
    cut = {k: (draw(st.integers(0, len(shape) - 1)), draw(st.integers(1, 3))) for k in sources}
    env = {k: shape for k in sources}
    stmts: list[str] = []
    fresh = iter(f"v{i}" for i in range(100))
    for _ in range(draw(st.integers(1, 5))):
        name = draw(st.sampled_from(sorted(env)))
        shp = env.pop(name)
        op = draw(st.sampled_from(["stack", "unstack", "reshape", "permute"]))
        if op == "stack":
            same = [n for n in sorted(env) if env[n] == shp]
            parts = [name] + draw(st.lists(st.sampled_from(same), max_size=2, unique=True)) if same else [name]
            for p in parts[1:]:
                env.pop(p)
            dim = draw(st.integers(-len(shp) - 1, len(shp)))
            out = next(fresh)
            stmts.append(f"{', '.join(parts)} -> {out}, stack, axis={dim}")
            d = dim % (len(shp) + 1)
            env[out] = shp[:d] + (len(parts),) + shp[d:]
        elif op == "unstack":
            if len(shp) == 1:
                env[name] = shp
                continue
            dim = draw(st.integers(0, len(shp) - 1))
            outs = [next(fresh) for _ in range(shp[dim])]
            stmts.append(f"{name} -> {', '.join(outs)}, unstack, axis={dim}")
            env.update({o: shp[:dim] + shp[dim + 1 :] for o in outs})
        elif op == "reshape":
            new = _factor_shape(draw, math.prod(shp))
            spec = list(new)
            if draw(st.booleans()):
                spec[draw(st.integers(0, len(spec) - 1))] = -1
            out = next(fresh)
            stmts.append(f"{name} -> {out}, shape='{spec}'")
            env[out] = new
        else:
            perm = list(draw(st.permutations(range(len(shp)))))
            out = next(fresh)
            stmts.append(f"{name} -> {out}, permute='{perm}'")
            env[out] = tuple(shp[p] for p in perm)
    return sources, stmts, cut


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grouped_programs())
def test_random_grouped_programs_match_dense_reference(case) -> None:
    sources, stmts, cut = case
    got = _run(stmts, sources, cut)
    want = dense_run(Mapping.parse(stmts).statements, sources)
    assert sorted(got) == sorted(want), stmts
    for k, ref in want.items():
        assert got[k].shape == ref.shape and torch.equal(got[k], ref), (k, stmts)
    _check_pieces_inside_shards(stmts, sources, cut)


@st.composite
def reversible_programs(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A load-direction program (checkpoint -> model) of reversible grouped statements, and the
    checkpoint it reads."""
    e, rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 5))
    ckpt = {f"experts.{i}.w": arange_tensor((rows, cols), start=100 * i) for i in range(e)}
    ckpt["norm"] = arange_tensor((1, cols), start=7)
    axis = draw(st.integers(0, 2))
    stacked = [(rows, cols)[:axis] + (e,) + (rows, cols)[axis:]][0]
    new = _factor_shape(draw, math.prod(stacked))
    stmts = [
        f"experts.*.w -> stacked, stack, axis={axis}",
        f"stacked -> grouped, src_shape='{list(stacked)}', dst_shape='{list(new)}'",
        "norm -> norm_vec, unstack, axis=0",
    ]
    return ckpt, stmts


@settings(max_examples=60, deadline=None)
@given(reversible_programs())
def test_a_reversed_program_undoes_stack_reshape_and_unstack(case) -> None:
    ckpt, stmts = case
    model = _run(stmts, ckpt)
    want = dense_run(_expanded(stmts, ckpt), ckpt)
    assert sorted(model) == sorted(want)
    for k in want:
        assert torch.equal(model[k], want[k]), k
    back = _run(stmts, model, reverse=True, cut={"grouped": (0, 2)})
    assert sorted(back) == sorted(ckpt)
    for k, v in ckpt.items():
        assert torch.equal(back[k], v), k


def _expanded(stmts: list[str], sources: dict[str, torch.Tensor]):
    from shardsync.mapping.macros import expand_macros

    out, diags = expand_macros(Mapping.parse(stmts).statements, list(sources))
    assert not diags
    return out


# --- the use cases, exact ------------------------------------------------------------------------------

E, F, H = 3, 5, 4  # experts, ffn size, hidden size (odd and distinct, so misplacement shows)


def test_fused_experts_to_per_expert_and_back() -> None:
    """transformers' fused experts ``gate_up_proj [E, 2f, h]`` and ``down_proj [E, h, f]`` <->
    per-expert ``experts.N.{gate,up,down}_proj.weight``, with $LAYER_ID and $EXPERT_ID over names an
    earlier statement bound."""
    fused = {f"layers.{i}.experts.gate_up_proj": arange_tensor((E, 2 * F, H), start=1000 * i) for i in (0, 1)}
    fused |= {f"layers.{i}.experts.down_proj": arange_tensor((E, H, F), start=1000 * i + 500) for i in (0, 1)}
    to_hf = [
        "layers.$LAYER_ID.experts.gate_up_proj -> gate_up.$LAYER_ID.*, unstack",
        "gate_up.$LAYER_ID.$EXPERT_ID -> layers.$LAYER_ID.experts.$EXPERT_ID.gate_proj.weight, "
        "layers.$LAYER_ID.experts.$EXPERT_ID.up_proj.weight, axis=0",
        "layers.$LAYER_ID.experts.down_proj -> layers.$LAYER_ID.experts.*.down_proj.weight, unstack",
    ]
    hf = _run(to_hf, fused)
    assert len(hf) == 2 * E * 3
    for i in (0, 1):
        for e in range(E):
            gu = fused[f"layers.{i}.experts.gate_up_proj"][e]
            assert torch.equal(hf[f"layers.{i}.experts.{e}.gate_proj.weight"], gu[:F])
            assert torch.equal(hf[f"layers.{i}.experts.{e}.up_proj.weight"], gu[F:])
            assert torch.equal(
                hf[f"layers.{i}.experts.{e}.down_proj.weight"], fused[f"layers.{i}.experts.down_proj"][e]
            )
    back = _run(to_hf, hf, reverse=True)  # the same mapping read backwards: per-expert -> fused
    assert sorted(back) == sorted(fused)
    for k, v in fused.items():
        assert torch.equal(back[k], v), k


def test_stacked_layers_to_per_layer_targets_sharded_along_the_layer_dim() -> None:
    """A ``[num_layers, ...]`` source (Megatron's torch_dist checkpoints) cut along the layer dim as
    pipeline stages hold it: each layer's target reads one shard."""
    src = {"decoder.layers.mlp.linear_fc2.weight": arange_tensor((5, H, F), start=3)}
    program = [
        "decoder.layers.mlp.linear_fc2.weight -> fc2.*, unstack, axis=0",
        "fc2.$LAYER_ID -> model.layers.$LAYER_ID.mlp.down_proj.weight",
    ]
    specs = resolve(program, _layout(src, {"decoder.layers.mlp.linear_fc2.weight": (0, 2)}))
    assert [s.name for s in specs] == [f"model.layers.{i}.mlp.down_proj.weight" for i in range(5)]
    for i, s in enumerate(specs):
        (p,) = s.pieces
        assert p.source_box == Box((i, 0, 0), (1, H, F)) and p.target_box == Box((0, 0), (H, F))
        assert torch.equal(assemble(s, src), src["decoder.layers.mlp.linear_fc2.weight"][i])


def test_stacked_layers_through_fused_qkv() -> None:
    """A stacked ``linear_qkv [L, (H + 2G) d, h]`` (GQA-interleaved per group) to per-layer q/k/v:
    unstack, then fused_qkv on each layer's intermediate; reversed, back to the stacked tensor."""
    heads, groups, d = 4, 2, 3
    stacked = {"decoder.layers.self_attention.linear_qkv.weight": arange_tensor((3, (heads + 2 * groups) * d, 5))}
    program = [
        "decoder.layers.self_attention.linear_qkv.weight -> qkv.*, unstack",
        "qkv.$LAYER_ID -> layers.$LAYER_ID.q_proj.weight, layers.$LAYER_ID.k_proj.weight, "
        f"layers.$LAYER_ID.v_proj.weight, fused_qkv, num_heads={heads}, num_key_value_groups={groups}, axis=0",
    ]
    got = _run(program, stacked)
    w = stacked["decoder.layers.self_attention.linear_qkv.weight"]
    for layer in range(3):
        per_group = w[layer].reshape(groups, (heads // groups + 2) * d, 5)
        q = per_group[:, : heads // groups * d].reshape(-1, 5)
        k = per_group[:, heads // groups * d : (heads // groups + 1) * d].reshape(-1, 5)
        v = per_group[:, (heads // groups + 1) * d :].reshape(-1, 5)
        assert torch.equal(got[f"layers.{layer}.q_proj.weight"], q)
        assert torch.equal(got[f"layers.{layer}.k_proj.weight"], k)
        assert torch.equal(got[f"layers.{layer}.v_proj.weight"], v)
    back = _run(program, got, reverse=True)
    assert list(back) == list(stacked) and torch.equal(back["decoder.layers.self_attention.linear_qkv.weight"], w)


@pytest.mark.parametrize(
    "statement", ["w -> v, unstack", "w -> v, unstack, axis=0", "w -> v, shape='[127, 17]'", "w -> v, shape='[-1, 17]'"]
)
def test_a_leading_unit_dim_removed(statement: str) -> None:
    src = {"w": arange_tensor((1, 127, 17))}
    (spec,) = resolve([statement], _layout(src))
    assert spec.shape == (127, 17) and len(spec.pieces) == 1
    assert torch.equal(assemble(spec, src), src["w"][0])
    back = _run(["v -> w, stack"], {"v": src["w"][0]})
    assert torch.equal(back["w"], src["w"])


def test_megatron_grouped_weight1_viewed_per_expert_per_tp_block() -> None:
    """GroupedMLP's ``weight1`` is ``[h, E * 2f / tp]`` on each TP rank, whose memory is viewed as
    ``[E, h, 2f / tp]``: each TP block is reshaped on its own, the blocks joined, then unstacked and
    split with fused_ffn (``[gate_r | up_r]`` per block). The program is the one
    docs/mapping-language.md shows."""
    tp, ffn = 2, 6  # 3 gate and 3 up rows per expert and TP rank
    local = [arange_tensor((H, E * 2 * ffn // tp), start=10_000 * r) for r in range(tp)]
    src = {"weight1": torch.cat(local, dim=1)}
    page = (Path(__file__).parent.parent / "docs" / "mapping-language.md").read_text()
    text = page.split("decoder.layers.0.mlp.experts.weight1 -> b0", 1)[1].split("```", 1)[0]
    program = Mapping.parse(
        "decoder.layers.0.mlp.experts.weight1 -> b0" + text, params={"hidden_size": H, "num_experts": E}
    )
    src = {"decoder.layers.0.mlp.experts.weight1": src["weight1"]}
    got = _run(program, src, {"decoder.layers.0.mlp.experts.weight1": (1, tp)})
    views = [x.view(E, H, -1) for x in local]  # what GroupedMLP computes with, per rank
    for e in range(E):
        blocks = [v[e].t() for v in views]  # [2f/tp, h] each: [gate_r | up_r]
        gate = torch.cat([b[: ffn // tp] for b in blocks])
        up = torch.cat([b[ffn // tp :] for b in blocks])
        assert torch.equal(got[f"experts.{e}.gate_proj.weight"], gate), e
        assert torch.equal(got[f"experts.{e}.up_proj.weight"], up), e
    _check_pieces_inside_shards(program, src, {"decoder.layers.0.mlp.experts.weight1": (1, tp)})


def test_parameters_fill_a_shape_list() -> None:
    program = Mapping.parse(["w -> v, shape=[{num_experts}, -1, {hidden}]"], params={"num_experts": 3, "hidden": 4})
    src = {"w": arange_tensor((4, 3 * 10))}
    assert torch.equal(_run(program, src)["v"], src["w"].reshape(3, -1, 4))


def test_full_params_streams_unstacked_experts() -> None:
    state = {"experts.down_proj": arange_tensor((E, H, F))}
    got = dict(shardsync.full_params(state, ["experts.down_proj -> experts.*.down_proj.weight, unstack"]))
    assert sorted(got) == [f"experts.{e}.down_proj.weight" for e in range(E)]
    for e in range(E):
        assert torch.equal(got[f"experts.{e}.down_proj.weight"], state["experts.down_proj"][e])


# --- '*' matches any segment ------------------------------------------------------------------------


def test_a_whole_segment_star_matches_any_segment() -> None:
    src = {f"experts.{n}.w": arange_tensor((1, 3), start=10 * i) for i, n in enumerate(["10", "2", "shared", "a"])}
    got = _run(["experts.*.w -> all, axis=0"], src)
    order = ["experts.2.w", "experts.10.w", "experts.a.w", "experts.shared.w"]  # numbers first, then text
    assert torch.equal(got["all"], torch.cat([src[k] for k in order]))


def test_a_star_inside_a_segment_still_matches_digits_only() -> None:
    src = {"layer_1.w": arange_tensor((2,)), "layer_x.w": arange_tensor((2,), start=5)}
    got = _run(["layer_*.w -> w, axis=0"], src)
    assert sorted(got) == ["layer_x.w", "w"] and torch.equal(got["w"], src["layer_1.w"])


# --- errors, each naming what is wrong and the fix -------------------------------------------------------

ERRORS = [
    (["w -> a, b, unstack"], {"w": (3, 2)}, r"3 names are needed, 2 are given"),
    (["w -> a, b, unstack, axis=2"], {"w": (2, 2)}, r"axis=2 is out of range: 'w' has 2 dims"),
    (
        ["a, b -> s, stack, axis=-4"],
        {"a": (2, 2), "b": (2, 2)},
        r"axis=-4 is out of range: the stacked tensor has 3 dims \(axis -3 to 2\)",
    ),
    (["a, b -> s, stack"], {"a": (2, 3), "b": (3, 2)}, r"'b' has shape \[3, 2\].*must have one shape"),
    (["a, b -> c, d, stack"], {"a": (2,), "b": (2,)}, r"more than one name on both sides"),
    (["w -> a, b, stack"], {"w": (2,)}, r"stack has the forms"),
    (["w -> v, shape='[4, 4]'"], {"w": (3, 5)}, r"shape='\[4, 4\]' does not fit 'w' of shape \[3, 5\]"),
    (["w -> v, shape='[-1, -1]'"], {"w": (3, 5)}, r"at most one -1"),
    (["w -> v, src_shape='[5, 3]', dst_shape='[15]'"], {"w": (3, 5)}, r"'w' has shape \[3, 5\], not src_shape"),
    (["w -> v, src_shape='[3, 5]'"], {"w": (3, 5)}, r"src_shape and dst_shape go together"),
    (["w -> v, shape='[15]', permute='[1, 0]'"], {"w": (3, 5)}, r"at most one of permute/dtype/axis/shape"),
    (["w -> v, stack, num_heads=2"], {"w": (3,)}, r"stack does not take num_heads"),
    (["y -> e.*, unstack"], {"w": (3, 2)}, r"unknown name 'y'"),
]


@pytest.mark.parametrize(("program", "shapes", "message"), ERRORS)
def test_grouped_errors_name_the_problem(program: list[str], shapes: dict, message: str) -> None:
    src = {k: arange_tensor(s) for k, s in shapes.items()}
    with pytest.raises(MappingError, match=message):
        resolve(program, _layout(src))


def test_a_one_way_shape_refuses_reverse_mode_and_says_what_to_write() -> None:
    with pytest.raises(MappingError, match=r"(?s)shape= is one-way.*src_shape="):
        resolve(["ckpt -> model, shape='[6]'"], _layout({"model": arange_tensor((6,))}), reverse=True)


def test_a_shape_parameter_that_is_not_an_integer_is_refused() -> None:
    with pytest.raises(MappingError, match=r"in a \[\.\.\.\] list it must be an integer"):
        Mapping.parse(["w -> v, shape=[{n}, -1]"], params={"n": "four"})


@pytest.mark.parametrize("copy", [False, True])
def test_a_dropped_unit_dim_is_never_yielded_as_the_source_itself(copy: bool) -> None:
    """With copy=False a target that is a whole local source is returned as a view of it; a target
    that drops a trailing unit dim reads the same bytes but must have its own shape."""
    state = {"x": arange_tensor((17, 1)), "w": arange_tensor((1, 3, 4))}
    got = dict(shardsync.full_params(state, ["x -> y, unstack, axis=1", "w -> v, unstack"], copy=copy))
    assert got["y"].shape == (17,) and torch.equal(got["y"], state["x"][:, 0])
    assert got["v"].shape == (3, 4) and torch.equal(got["v"], state["w"][0])


@pytest.mark.parametrize(
    "program", [["w -> e.*, unstack, axis=1"], ["w -> v, shape='[5, 3, 1, 4]'"], ["w -> s, stack, axis=2"]]
)
def test_pieces_cut_to_a_destination_box_read_what_lands_there(program: list[str]) -> None:
    """A destination shard (``load``/``reshard``) takes each piece cut to its box: with dropped and new
    unit dims the cut still reads the source box that lands there."""
    from shardsync.planning.destinations import restrict_target

    src = {"w": arange_tensor((5, 3, 4), start=1)}
    for spec in resolve(program, _layout(src)):
        full = assemble(spec, src)
        for dim in range(len(spec.shape)):
            n = spec.shape[dim]
            for lo, hi in ((0, (n + 1) // 2), ((n + 1) // 2, n)):
                if hi <= lo:
                    continue
                off, size = [0] * len(spec.shape), list(spec.shape)
                off[dim], size[dim] = lo, hi - lo
                box = Box(tuple(off), tuple(size))
                cut = restrict_target(spec, box, spec.name)
                assert torch.equal(assemble(cut, src), full[box.slices()]), (spec.name, box)
