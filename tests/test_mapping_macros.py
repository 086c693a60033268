"""Macros, input forms, reverse mode, optimizer states, fused forms and Paddle's defects done right."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from reference import arange_tensor, assemble
from shardsync.layout import Box, GlobalLayout, dtype_name
from shardsync.mapping import Mapping, resolve
from shardsync.mapping.macros import expand_macros


def _layout(sources: dict[str, torch.Tensor], shards: dict[str, tuple[int, int]] | None = None):
    """One rank per shard: ``shards[key] = (dim, count)`` cuts that key in equal bands."""
    ranks: list[list] = [[]]
    for k, v in sources.items():
        dim, count = (shards or {}).get(k, (0, 1))
        for r in range(count):
            while len(ranks) <= r:
                ranks.append([])
            off = [0] * v.dim()
            size = list(v.shape)
            off[dim], size[dim] = r * v.shape[dim] // count, v.shape[dim] // count
            ranks[r].append((k, tuple(v.shape), dtype_name(v.dtype), Box(tuple(off), tuple(size))))
    return GlobalLayout.merge(ranks)


def _run(prog, sources, shards=None, dest=None, reverse=None) -> dict[str, torch.Tensor]:
    specs = resolve(prog, _layout(sources, shards), dest=dest, reverse=reverse)
    return {t.name: assemble(t, sources) for t in specs}


def test_layer_id_expands_per_layer() -> None:
    src = {f"layers.{i}.{n}": arange_tensor((2, 3), start=10 * i + (n == "k")) for i in range(3) for n in "qk"}
    out = _run(["layers.$LAYER_ID.q, layers.$LAYER_ID.k -> model.$LAYER_ID.qk, axis=0"], src)
    assert list(out) == [f"model.{i}.qk" for i in range(3)]
    for i in range(3):
        assert torch.equal(out[f"model.{i}.qk"], torch.cat([src[f"layers.{i}.q"], src[f"layers.{i}.k"]]))


def test_expert_and_layer_ids_expand_expert_slowest() -> None:
    keys = [f"l.{layer}.e.{e}.w" for layer in (0, 1) for e in (0, 1)]
    st = Mapping.parse(["l.$LAYER_ID.e.$EXPERT_ID.w -> m.$LAYER_ID.$EXPERT_ID"]).statements
    got, diags = expand_macros(st, keys)
    assert not diags
    assert [s.render() for s in got] == [
        "l.0.e.0.w -> m.0.0",
        "l.1.e.0.w -> m.1.0",
        "l.0.e.1.w -> m.0.1",
        "l.1.e.1.w -> m.1.1",
    ]


def test_star_sorts_numerically_and_name_ranges_expand() -> None:
    src = {f"e.{i}.w": arange_tensor((1, 2), start=i) for i in (0, 2, 10, 1)}
    out = _run(["e.*.w -> all, axis=0", "all -> h[0:2], axis=1"], src)
    want = torch.cat([src[f"e.{i}.w"] for i in (0, 1, 2, 10)])
    assert list(out) == ["h_0", "h_1"]
    assert torch.equal(out["h_0"], want[:, :1]) and torch.equal(out["h_1"], want[:, 1:])


def test_input_forms(tmp_path: Path) -> None:
    src = {"a": arange_tensor((2, 2)), "b": arange_tensor((2, 2), start=4)}
    forms = [
        ["a -> x", "b -> y"],
        "a -> x\nb -> y",
        "a -> x b -> y   # two statements on one line, a comment",
        {"aoa_statements": ["a -> x", "b -> y"]},
    ]
    (tmp_path / "m.txt").write_text("# export names\na -> x\n\nb -> y\n")
    (tmp_path / "m.json").write_text(json.dumps({"aoa_statements": ["a -> x", "b -> y"]}))
    forms += [tmp_path / "m.txt", str(tmp_path / "m.json")]
    for form in forms:
        out = _run(form, src)
        assert list(out) == ["x", "y"], form
        assert torch.equal(out["y"], src["b"])


def test_reverse_mode_runs_a_load_program_backwards() -> None:
    # Written for loading: checkpoint (hf.*) -> model.
    load = [
        "hf.q, hf.k -> qk, axis=0",
        "hf.o -> o, permute='[1, 2, 0]'",
        "hf.n -> n, src_dtype='bfloat16', dst_dtype='float32'",
        "hf.e^T -> e",
    ]
    model = {
        "qk": arange_tensor((4, 3)),
        "o": arange_tensor((3, 5, 2)),
        "n": arange_tensor((5,), step=1.37),
        "e": arange_tensor((2, 7)),
    }
    for form in ({"aoa_statements": load, "aoa_config_reverse": True}, load):
        out = _run(form, model, reverse=None if isinstance(form, dict) else True)
        assert list(out) == ["hf.e", "hf.k", "hf.n", "hf.o", "hf.q"]
        assert torch.equal(out["hf.q"], model["qk"][:2]) and torch.equal(out["hf.k"], model["qk"][2:])
        assert torch.equal(out["hf.o"], model["o"].permute(2, 0, 1))
        assert out["hf.n"].dtype == torch.bfloat16
        assert torch.equal(out["hf.n"], model["n"].to(torch.bfloat16))
        assert torch.equal(out["hf.e"], model["e"].t())


def test_layer_id_offset_in_reverse() -> None:
    model = {f"layers.{i}.w": arange_tensor((2,), start=i) for i in (0, 1)}
    out = _run(["layers.$LAYER_ID_OFFSET.w -> layers.$LAYER_ID_OFFSET.w"], model, reverse=True)
    assert list(out) == ["layers.1.w", "layers.2.w"]
    assert torch.equal(out["layers.2.w"], model["layers.1.w"])


def test_optimizer_states_follow_their_parameter() -> None:
    src = {
        "w": arange_tensor((4, 3)),
        "w.moment1_0": arange_tensor((4, 3), start=100),
        "w.moment2_0": arange_tensor((4, 3), start=200),
        "w.w_0": arange_tensor((4, 3), start=300),
        "w.beta1_pow_acc_0": torch.tensor([0.9]),
        "frozen": arange_tensor((2,)),
    }
    out = _run(["w -> a, b, axis=0", "b^T -> b"], src)
    assert sorted(out) == [
        "a",
        "a.beta1_pow_acc_0",
        "a.moment1_0",
        "a.moment2_0",
        "a.w_0",
        "b",
        "b.beta1_pow_acc_0",
        "b.moment1_0",
        "b.moment2_0",
        "b.w_0",
        "frozen",
    ]
    assert torch.equal(out["b.moment1_0"], src["w.moment1_0"][2:].t())
    assert torch.equal(out["a.w_0"], src["w.w_0"][:2])
    assert torch.equal(out["b.beta1_pow_acc_0"], torch.tensor([0.9]))


def test_fused_qkv_one_head_per_group_names_q_k_v() -> None:  # Paddle defect: q0/k0/v0
    src = {"qkv": arange_tensor((2, 12))}  # H = G = 2, d = 2
    out = _run(["qkv -> q, k, v, fused_qkv, num_heads=2, num_key_value_groups=2"], src)
    assert list(out) == ["k", "q", "v"]
    h = src["qkv"].reshape(2, 2, 3, 2)  # [rows, group, (q, k, v), d]
    assert torch.equal(out["q"], h[:, :, 0].reshape(2, 4)) and torch.equal(out["v"], h[:, :, 2].reshape(2, 4))


def test_fused_ffn_names_and_no_collision_between_statements() -> None:  # Paddle defect
    src = {"l0.w": arange_tensor((3, 8)), "l1.w": arange_tensor((3, 8), start=100)}
    out = _run(
        ["l0.w -> l0.gate, l0.up, fused_ffn", "l1.w -> l1.gate, l1.up, fused_ffn"],
        src,
        shards={"l0.w": (1, 2), "l1.w": (1, 2)},
    )
    assert list(out) == ["l0.gate", "l0.up", "l1.gate", "l1.up"]
    w = src["l1.w"]  # two TP shards of [GATE_r | UP_r], 2 columns each
    assert torch.equal(out["l1.gate"], torch.cat([w[:, 0:2], w[:, 4:6]], 1))
    assert torch.equal(out["l1.up"], torch.cat([w[:, 2:4], w[:, 6:8]], 1))


def test_drop_and_declare_are_not_outputs() -> None:  # Paddle defect: `x -> _` still listed
    src = {"x": arange_tensor((2,)), "y": arange_tensor((2,))}
    out = _run(["x -> _", "_ -> z"], src)
    assert list(out) == ["y"]


def test_tied_weights_feed_both_statements() -> None:
    src = {"emb": arange_tensor((5, 3))}
    out = _run(["emb -> embed_tokens", "emb -> lm_head"], src)
    assert list(out) == ["embed_tokens", "lm_head"]
    assert torch.equal(out["lm_head"], src["emb"]) and torch.equal(out["embed_tokens"], src["emb"])


def test_fused_qkv_old_counts_source_shards_and_reblocks_for_a_destination() -> None:
    h, g = 4, 2  # two TP shards, head size 1: [Q0 Q1 K0 V0 | Q2 Q3 K1 V1]
    w = arange_tensor((8, 3))
    src = {"w": w}
    attrs = f"num_heads={h}, num_key_value_groups={g}, axis=0"
    out = _run([f"w -> q, k, v, fused_qkv_old, {attrs}"], src, shards={"w": (0, 2)})
    assert torch.equal(out["q"], w[[0, 1, 4, 5]]) and torch.equal(out["k"], w[[2, 6]])
    assert torch.equal(out["v"], w[[3, 7]])
    # Re-block from 2 source shards to 1 destination block (no destination layout): [Q | K | V]
    out = _run([f"w -> w1, fused_qkv_old, {attrs}"], src, shards={"w": (0, 2)})
    assert torch.equal(out["w1"], w[[0, 1, 4, 5, 2, 6, 3, 7]])
    # ... and for a destination cut in 2 along dim 0: back to the source order
    dest = _layout({"w2": w}, {"w2": (0, 2)})
    out = _run([f"w -> w2, fused_qkv_old, {attrs}"], src, shards={"w": (0, 2)}, dest=dest)
    assert torch.equal(out["w2"], w)


def test_star_on_the_destination_side_uses_the_destination_layout() -> None:
    src = {"all": arange_tensor((3, 2))}
    dest = _layout({f"out.{i}": torch.zeros(1, 2) for i in range(3)})
    out = _run(["all -> out.*, axis=0"], src, dest=dest)
    assert list(out) == ["out.0", "out.1", "out.2"]
    assert torch.equal(out["out.2"], src["all"][2:])


def test_yaml_file_and_reverse_flag(tmp_path: Path) -> None:
    (tmp_path / "m.yaml").write_text("aoa_statements:\n  - hf.a -> a\naoa_config_reverse: true\n")
    m = Mapping.parse(tmp_path / "m.yaml")
    assert m.reverse and m.text() == "hf.a -> a"
    out = _run(m, {"a": arange_tensor((2,))})
    assert list(out) == ["hf.a"]


def test_explain_lists_pieces_per_target() -> None:
    from shardsync.mapping.explain import explain

    text = explain(
        {"qkv": torch.zeros(3, 12, dtype=torch.float16)},
        ["qkv -> q, k, v, fused_qkv, num_heads=2, num_key_value_groups=1", "q^T -> qt", "qt -> qt, dtype='float32'"],
    )
    assert text.splitlines() == [
        "k  [3, 3] float16  (1 piece from qkv)",
        "    qkv[0:3, 6:9] -> [0:3, 0:3]",
        "qt  [6, 3] float32  (1 piece from qkv)",
        "    qkv[0:3, 0:6] -> [0:6, 0:3]  permute [1, 0]  cast float32",
        "v  [3, 3] float16  (1 piece from qkv)",
        "    qkv[0:3, 9:12] -> [0:3, 0:3]",
        "3 targets, 0.00 MiB",
    ]
