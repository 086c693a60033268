#!/usr/bin/env python
"""Generate tests/golden/paddle_cases.json from PaddlePaddle FlexCheckpoint's real ``full_param``.

This script is NOT part of the test suite and shardsync never imports Paddle. It only runs under a
Python that has Paddle 3.3.1 (CPU is enough), e.g. the venv at /tmp/paddle-venv:

    cd /work/main
    /tmp/paddle-venv/bin/python tests/golden/make_paddle_golden.py            # all cases
    /tmp/paddle-venv/bin/python tests/golden/make_paddle_golden.py --only fused_ffn_t2 rename

The driver runs the 1-process cases in-process (``paddle.distributed.get_world_size() == 1``, i.e.
``SingleCommGroupFullParamAssembler._run_single_card``), then launches the cases whose sources are
sharded across two ranks (``"nproc": 2``) itself, as

    /tmp/paddle-venv/bin/python -m paddle.distributed.launch --nproc_per_node 2 --log_dir <tmp> \
        tests/golden/make_paddle_golden.py --worker <tmpdir> [--only ...]

(CPU / gloo). Paddle's distributed path calls ``Tensor.cuda()`` unconditionally on CPU tensors before
broadcasting (dcp/full_param.py:527), which raises on a CPU-only build, so the worker replaces
``paddle.Tensor.cuda`` by the identity when Paddle is not compiled with CUDA; nothing else is patched.
Both ranks must yield identical results; the driver checks that.

Inputs (also stated in the JSON's "input_rule"/"shard_rule"): the full global tensor of key k is
``arange(numel) + 1000 * i`` where i is k's index in ``sorted(case inputs)``, computed in float64,
reshaped, then cast to the key's dtype (numpy ``astype``; bfloat16 via float32 then paddle cast).
A key with one shard is whole (and replicated on both ranks of a 2-process case); a key with two shards
has shard r on rank r.

Each case records: Paddle's outputs in the order full_param yielded them ("output_order"), each with
shape, dtype and flat row-major values (``null`` when Paddle left part of the tensor uninitialised:
the output's shard mappings do not cover it, "uninitialised": true), the statements after macro
expansion ("paddle_expanded"), the exception if Paddle raised ("paddle_error"), and, where Paddle
misbehaves, "paddle_defect" saying what shardsync should do instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "paddle_cases.json")


# --------------------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------------------


def inp(shape, dtype="float32", split=None):
    """Input description. split=(axis, [size0, size1]) shards the key across 2 ranks along axis."""
    shape = list(shape)
    if split is None:
        shards = [{"offset": [0] * len(shape), "shape": shape}]
    else:
        axis, sizes = split
        assert sum(sizes) == shape[axis]
        shards, off = [], 0
        for s in sizes:
            o = [0] * len(shape)
            o[axis] = off
            sh = list(shape)
            sh[axis] = s
            shards.append({"offset": o, "shape": sh})
            off += s
    return {"shape": shape, "dtype": dtype, "shards": shards}


def case(name, statements, inputs, reverse=False, defect=None, nproc=1, garbage=()):
    """garbage: outputs whose values Paddle never writes although its mappings claim to (recorded
    with values null)."""
    return {
        "name": name,
        "statements": statements,
        "reverse": reverse,
        "inputs": inputs,
        "paddle_defect": defect,
        "nproc": nproc,
        "garbage": list(garbage),
    }


QKV_D = 2  # head width used by the fused_qkv cases


def qkv_w(h, g, axis, d=QKV_D, other=3):
    n = (h + 2 * g) * d
    return [other, n] if axis == 1 else [n, other]


CASES = [
    # ---- the 8 public acceptance cases of the spec, as written there -----------------------------
    case(
        "accept1_concat_then_split",
        ["s0, s1 -> s, axis=1", "s -> d0, d1, axis=0"],
        {"s0": inp([2, 2]), "s1": inp([2, 2])},
    ),
    case("accept2_cast_int32_to_float32", ['s0 -> d0, dtype="float32"'], {"s0": inp([2, 2], "int32")}),
    case(
        "accept3_concat_transpose_split",
        ["s0, s1 -> s, axis=1", "s^T -> d", "d -> d0, d1, axis=1"],
        {"s0": inp([2, 2]), "s1": inp([2, 2])},
    ),
    case(
        "accept3_float64_variant",
        ["s0, s1 -> s, axis=1", "s -> s, dtype='float64'", "s^T -> d", "d -> d0, d1, axis=1"],
        {"s0": inp([2, 2]), "s1": inp([2, 2])},
        defect="Paddle 3.3.1 only casts to float16/float32/bfloat16 (SUPPORTED_DTYPES, "
        "aoa_engine.py:35, checked at :608): 'Unsupported cast dtype: float64'. Intended: "
        "d0, d1 as in accept3 but float64.",
    ),
    case(
        "accept4_split_transpose_fanout",
        ["s0 -> a1, a2, a3, a4, axis=1", "a2^T -> b2", "a3^T -> b3", "b2, b3 -> d0, axis=1", "a3, a4 -> d1, axis=0"],
        {"s0": inp([3, 4])},
    ),
    case(
        "accept5_cast_permute_split_3d",
        [
            "s0, s1 -> s, axis=1",
            "s -> s, dtype='bfloat16'",
            "s -> a, permute='[2, 0, 1]'",
            "a -> b1, b2, b3, axis=0",
            "b1 -> b1, permute='[0, 2, 1]'",
            "b2 -> b2, permute='[0, 2, 1]'",
            "b1, b2 -> d0, axis=1",
            "b3 -> d1",
            "d1 -> d1, dtype='float32'",
        ],
        {"s0": inp([4, 1, 3]), "s1": inp([4, 1, 3])},
    ),
    case(
        "accept6_fused_qkv_h8_g2_expanded",
        [
            "qkv -> Q0, Q1, Q2, Q3, K0, V0, Q4, Q5, Q6, Q7, K1, V1, axis=1",
            "Q0, Q1, Q2, Q3, Q4, Q5, Q6, Q7 -> Q, axis=1",
            "K0, K1 -> K, axis=1",
            "V0, V1 -> V, axis=1",
        ],
        {"qkv": inp(qkv_w(8, 2, 1))},
    ),
    case(
        "accept7_star_experts",
        ["layers.2.experts.*.weight -> fused_experts, axis=1"],
        {"layers.2.experts.0.weight": inp([2, 3]), "layers.2.experts.1.weight": inp([2, 3])},
    ),
    case(
        "accept8_layer_id_offset",
        ["layers.$LAYER_ID_OFFSET.experts.0.weight -> layers.$LAYER_ID_OFFSET.experts.0.weight"],
        {"layers.1.experts.0.weight": inp([2, 3]), "layers.2.experts.0.weight": inp([2, 3])},
    ),
    # ---- basic forms ------------------------------------------------------------------------------
    case("rename_with_passthrough", ["a -> b"], {"a": inp([3, 5]), "c": inp([2, 3])}),
    case(
        "rename_onto_existing_source",
        ["a -> b"],
        {"a": inp([2]), "b": inp([2])},
        defect="the renamed a and the untouched source b share the name b; the output scan lists "
        "unconsumed inputs first (aoa_engine.py:686-692) and skips names already listed, so "
        "b is the ORIGINAL b and a's data is lost silently. Intended: an error (two values "
        "for output b), or the statement's b.",
    ),
    case("swap_names", ["a -> t", "b -> a", "t -> b"], {"a": inp([2]), "b": inp([2])}),
    case("permute_3d", ["x -> y, permute='[2, 0, 1]'"], {"x": inp([2, 3, 5])}),
    case("permute_empty_reverses_all_dims", ["x -> y, permute='[]'"], {"x": inp([2, 3, 5])}),
    case("transpose_suffix_2d", ["x^T -> y"], {"x": inp([3, 5])}),
    case("transpose_suffix_3d", ["x^T -> y"], {"x": inp([2, 3, 5])}),
    case("transpose_suffix_inside_concat", ["a^T, b -> c, axis=0"], {"a": inp([3, 2]), "b": inp([1, 3])}),
    case("cast_float32_to_bfloat16", ["x -> y, dtype='bfloat16'"], {"a": inp([1]), "x": inp([3, 7])}),
    case("cast_int32_to_float32", ["x -> y, dtype='float32'"], {"x": inp([3, 5], "int32")}),
    case(
        "cast_chain_float32_float16_float32",
        ["x -> y, dtype='float16'", "y -> z, dtype='float32'"],
        {"a": inp([1]), "b": inp([1]), "c": inp([1]), "x": inp([3, 5])},
    ),
    case("cast_rebind_same_name", ["x -> x, dtype='bfloat16'"], {"a": inp([1]), "x": inp([3, 5])}),
    case(
        "cast_to_int_unsupported",
        ["x -> y, dtype='int64'"],
        {"x": inp([2, 3])},
        defect="Paddle only casts to float16/float32/bfloat16 (aoa_engine.py:35,608). The spec allows "
        "int targets; intended: y = int64(x).",
    ),
    case("concat_axis0_unequal", ["a, b -> c, axis=0"], {"a": inp([2, 3]), "b": inp([3, 3])}),
    case("concat_axis1_three", ["a, b, c -> d, axis=1"], {"a": inp([3, 1]), "b": inp([3, 2]), "c": inp([3, 3])}),
    case("split_axis0_three", ["x -> p, q, r, axis=0"], {"x": inp([9, 5])}),
    case("split_axis1_two", ["x -> p, q, axis=1"], {"x": inp([3, 10])}),
    case("split_not_divisible", ["x -> p, q, axis=1"], {"x": inp([3, 5])}),
    case("concat_split_3d", ["a, b -> c, axis=2", "c -> p, q, r, axis=1"], {"a": inp([2, 3, 1]), "b": inp([2, 3, 4])}),
    case(
        "permute_then_split_3d",
        ["x -> y, permute='[1, 2, 0]'", "y -> p, q, axis=1", "q -> q, permute='[2, 1, 0]'"],
        {"x": inp([3, 5, 4])},
    ),
    case(
        "one_to_one_with_axis",
        ["x -> y, axis=1"],
        {"x": inp([2, 3])},
        defect="1 -> 1 with axis binds y to x's descriptor without bumping x's out_degree "
        "(aoa_engine.py:629-636); the final output scan lists x first (inputs before "
        "intermediates, :686-695), and the identity() it applies marks the shared "
        "descriptor consumed, so y is never listed. Intended: output y (= x), not x.",
    ),
    case(
        "tied_weights_two_consumers", ["w -> a", "w -> b, permute='[]'", "w -> c, dtype='bfloat16'"], {"w": inp([2, 3])}
    ),
    case("tied_weights_concat_twice", ["w, w -> ww, axis=0"], {"w": inp([2, 3])}),
    case("glued_statements_one_string", ["s0 -> a s1 -> b"], {"s0": inp([2]), "s1": inp([2])}),
    case("multiline_string", ["s0 -> a\ns1 -> b\n\ns2 -> c"], {"s0": inp([2]), "s1": inp([2]), "s2": inp([2])}),
    case(
        "python_adjacent_literals",
        ["s0 -> as1 -> b"],
        {"s0": inp([2]), "s1": inp([2])},
        defect='Python glues "s0 -> a" "s1 -> b" into \'s0 -> as1 -> b\', which is not two '
        "statements: Paddle raises SyntaxError (parser.py:254/272). Only whitespace- or "
        "newline-separated statements in one string parse as several.",
    ),
    # ---- drops and declarations -------------------------------------------------------------------
    case("drop_input", ["x -> _"], {"x": inp([2, 3]), "z": inp([2, 2])}),
    case(
        "drop_intermediate",
        ["x -> y", "y -> _"],
        {"x": inp([2, 3]), "z": inp([2, 2])},
        defect="'_' only removes *input* keys (need_remove_input_vars, aoa_engine.py:573-574, "
        "checked only for inputs at :690). An intermediate y is still listed. Intended: "
        "y is dropped; outputs = z only.",
    ),
    case(
        "drop_input_also_renamed",
        ["x -> y", "x -> _"],
        {"x": inp([2, 3]), "z": inp([2, 2])},
        defect="y is listed but its pieces from x are skipped (find_shard_sources drops sources in "
        "need_remove_input_vars, aoa_engine.py:876-882), so y is paddle.empty garbage. "
        "Intended: y = x (or an error), never an uninitialised tensor.",
    ),
    case("drop_sharded_input_2proc", ["x -> _"], {"x": inp([2, 6], split=(1, [3, 3])), "z": inp([2, 2])}, nproc=2),
    case("declare_without_source", ["_ -> y"], {"x": inp([2, 3])}),
    # ---- reversible casts, reverse mode ---------------------------------------------------------
    case(
        "src_dst_dtype_forward",
        ["x -> y, src_dtype='float32', dst_dtype='bfloat16'"],
        {"a": inp([1]), "x": inp([3, 5])},
    ),
    case(
        "reverse_src_dst_dtype",
        ["x -> y, src_dtype='bfloat16', dst_dtype='float32'"],
        {"a": inp([1]), "y": inp([3, 5])},
        reverse=True,
    ),
    case("reverse_split", ["a, b -> c, axis=0"], {"c": inp([6, 3])}, reverse=True),
    case("reverse_concat", ["x -> p, q, axis=1"], {"p": inp([3, 2]), "q": inp([3, 2])}, reverse=True),
    case("reverse_permute", ["x -> y, permute='[2, 0, 1]'"], {"y": inp([5, 2, 3])}, reverse=True),
    case("reverse_transpose_suffix", ["x^T -> y"], {"y": inp([5, 3])}, reverse=True),
    case(
        "reverse_chain_order",
        ["x -> t, permute='[1, 0]'", "t -> a, b, axis=0", "a -> a, src_dtype='float32', dst_dtype='float16'"],
        {"a": inp([2, 3]), "b": inp([2, 3])},
        reverse=True,
    ),
    case("reverse_dtype_attr_rejected", ["x -> y, dtype='bfloat16'"], {"y": inp([2, 3])}, reverse=True, defect=None),
    # ---- fused_qkv --------------------------------------------------------------------------------
    case(
        "fused_qkv_h8_g2_axis1",
        ["qkv -> q, k, v, fused_qkv, num_heads=8, num_key_value_groups=2, axis=1"],
        {"qkv": inp(qkv_w(8, 2, 1))},
    ),
    case(
        "fused_qkv_h8_g2_default_axis",
        ["qkv -> q, k, v, fused_qkv, num_heads=8, num_key_value_groups=2"],
        {"qkv": inp(qkv_w(8, 2, 1))},
    ),
    case(
        "fused_qkv_h8_g2_axis0",
        ["qkv -> q, k, v, fused_qkv, num_heads=8, num_key_value_groups=2, axis=0"],
        {"qkv": inp(qkv_w(8, 2, 0))},
    ),
    case(
        "fused_qkv_h4_g4_axis1",
        ["qkv -> q, k, v, fused_qkv, num_heads=4, num_key_value_groups=4, axis=1"],
        {"qkv": inp(qkv_w(4, 4, 1))},
    ),
    case(
        "fused_qkv_h4_g4_axis0",
        ["qkv -> q, k, v, fused_qkv, num_heads=4, num_key_value_groups=4, axis=0"],
        {"qkv": inp(qkv_w(4, 4, 0))},
    ),
    case(
        "fused_qkv_h6_g3_axis1",
        ["qkv -> q, k, v, fused_qkv, num_heads=6, num_key_value_groups=3, axis=1"],
        {"qkv": inp(qkv_w(6, 3, 1))},
    ),
    case(
        "fused_qkv_h6_g3_axis0",
        ["qkv -> q, k, v, fused_qkv, num_heads=6, num_key_value_groups=3, axis=0"],
        {"qkv": inp(qkv_w(6, 3, 0))},
    ),
    case(
        "fused_qkv_h4_g1_axis1",
        ["qkv -> q, k, v, fused_qkv, num_heads=4, num_key_value_groups=1, axis=1"],
        {"qkv": inp(qkv_w(4, 1, 1))},
        defect="G == 1: the macro emits 'k0 -> k, axis=1' / 'v0 -> v, axis=1' (1 -> 1 with axis, "
        "aoa_engine.py:629), which does not bind k/v: outputs are q, k0, v0. Intended: q, k, v.",
    ),
    case(
        "fused_qkv_h1_g1_axis1",
        ["qkv -> q, k, v, fused_qkv, num_heads=1, num_key_value_groups=1, axis=1"],
        {"qkv": inp(qkv_w(1, 1, 1))},
        defect="H == G == 1: every concat is 1 -> 1 with axis: outputs q0, k0, v0. Intended: q, k, v.",
    ),
    case(
        "fused_qkv_reverse_form_h8_g2",
        ["q, k, v -> qkv, fused_qkv, num_heads=8, num_key_value_groups=2, axis=1"],
        {"q": inp([3, 8 * QKV_D]), "k": inp([3, 2 * QKV_D]), "v": inp([3, 2 * QKV_D])},
    ),
    case(
        "fused_qkv_reverse_form_h6_g3_axis0",
        ["q, k, v -> qkv, fused_qkv, num_heads=6, num_key_value_groups=3, axis=0"],
        {"q": inp([6 * QKV_D, 3]), "k": inp([3 * QKV_D, 3]), "v": inp([3 * QKV_D, 3])},
    ),
    case(
        "fused_qkv_reverse_mode_h8_g2",
        ["qkv -> q, k, v, fused_qkv, num_heads=8, num_key_value_groups=2, axis=1"],
        {"q": inp([3, 8 * QKV_D]), "k": inp([3, 2 * QKV_D]), "v": inp([3, 2 * QKV_D])},
        reverse=True,
    ),
    case(
        "fused_qkv_transposed_source",
        ["qkv^T -> q, k, v, fused_qkv, num_heads=4, num_key_value_groups=2, axis=0"],
        {"qkv": inp(qkv_w(4, 2, 1))},
    ),
    case(
        "fused_qkv_two_statements_layers",
        [
            "layers.$LAYER_ID.qkv -> layers.$LAYER_ID.q, layers.$LAYER_ID.k, layers.$LAYER_ID.v, "
            "fused_qkv, num_heads=4, num_key_value_groups=2, axis=1"
        ],
        {"layers.0.qkv": inp(qkv_w(4, 2, 1, d=1)), "layers.1.qkv": inp(qkv_w(4, 2, 1, d=1))},
    ),
    # ---- fused_qkv_old (blocked per TP rank) -----------------------------------------------------
    case(
        "fused_qkv_h8_g2_sharded_t2",
        ["qkv -> q, k, v, fused_qkv, num_heads=8, num_key_value_groups=2, axis=1"],
        {"qkv": inp(qkv_w(8, 2, 1), split=(1, [12, 12]))},
        nproc=2,
    ),
    case(
        "fused_qkv_old_t1",
        ["W -> q, k, v, fused_qkv_old, num_heads=4, num_key_value_groups=2"],
        {"W": inp([3, (4 + 2 + 2) * QKV_D])},
    ),
    case(
        "fused_qkv_old_t1_axis0",
        ["W -> q, k, v, fused_qkv_old, num_heads=4, num_key_value_groups=2, axis=0"],
        {"W": inp([(4 + 2 + 2) * QKV_D, 3])},
    ),
    case(
        "fused_qkv_old_t2",
        ["W -> q, k, v, fused_qkv_old, num_heads=4, num_key_value_groups=2"],
        {"W": inp([3, 16], split=(1, [8, 8]))},
        nproc=2,
    ),
    case(
        "fused_qkv_old_t2_axis0",
        ["W -> q, k, v, fused_qkv_old, num_heads=4, num_key_value_groups=2, axis=0"],
        {"W": inp([16, 3], split=(0, [8, 8]))},
        nproc=2,
    ),
    case(
        "fused_qkv_old_t2_h6_g2",
        ["W -> q, k, v, fused_qkv_old, num_heads=6, num_key_value_groups=2, axis=1"],
        {"W": inp([3, 10], split=(1, [5, 5]))},
        nproc=2,
    ),
    case(
        "fused_qkv_old_t2_sharded_on_other_axis",
        ["W -> q, k, v, fused_qkv_old, num_heads=4, num_key_value_groups=2, axis=1"],
        {"W": inp([4, 16], split=(0, [2, 2]))},
        nproc=2,
        defect="Paddle counts T as the number of distinct global offsets of the source's shards "
        "(get_src_state_shard_num, aoa_engine.py:141-184), whatever axis they are split on: "
        "here W is split by rows, so T=2 and the columns are de-blocked as if TP-sharded on "
        "axis 1. The spec counts offsets along the fused axis (T=1 here: q = W[:, 0:8]).",
    ),
    case(
        "fused_qkv_old_t2_through_rename",
        ["A -> W", "W -> q, k, v, fused_qkv_old, num_heads=4, num_key_value_groups=2"],
        {"A": inp([3, 16], split=(1, [8, 8]))},
        nproc=2,
    ),
    case(
        "fused_qkv_old_reblock_t2_to_1",
        ["W -> W2, fused_qkv_old, num_heads=4, num_key_value_groups=2"],
        {"W": inp([3, 16], split=(1, [8, 8]))},
        nproc=2,
    ),
    case(
        "fused_qkv_old_t2_g1",
        ["W -> q, k, v, fused_qkv_old, num_heads=4, num_key_value_groups=1"],
        {"W": inp([3, 16], split=(1, [8, 8]))},
        nproc=2,
        defect="G < T: gen_expr gives each rank G // T = 0 kv heads (macros.py:311-317), the expansion "
        "contains empty names ('Q_1,,,fused_qkv_old_tmp.Q_2') and parsing fails with "
        "SyntaxError. Paddle cannot express kv heads replicated across TP ranks; shardsync "
        "should reject it with a clear error (or define replication).",
    ),
    case(
        "fused_qkv_old_t1_reverse_form",
        ["q, k, v -> W, fused_qkv_old, num_heads=4, num_key_value_groups=2"],
        {"q": inp([3, 4 * QKV_D]), "k": inp([3, 2 * QKV_D]), "v": inp([3, 2 * QKV_D])},
    ),
    case(
        "fused_qkv_old_reverse_mode",
        ["W -> q, k, v, fused_qkv_old, num_heads=4, num_key_value_groups=2"],
        {"q": inp([3, 4 * QKV_D]), "k": inp([3, 2 * QKV_D]), "v": inp([3, 2 * QKV_D])},
        reverse=True,
        defect="In reverse mode the macro calls get_src_state_shard_num(None) for the q, k, v form "
        "(macros.py:281-283) and crashes with AttributeError. Intended: W = [q | k | v] "
        "(destination T = 1).",
    ),
    case(
        "fused_qkv_old_t1_h2_g1",
        ["W -> q, k, v, fused_qkv_old, num_heads=2, num_key_value_groups=1"],
        {"W": inp([3, 4 * QKV_D])},
        defect="G == 1 with T == 1: 'fused_qkv_old_tmp.K_0 -> k, axis=1' is 1 -> 1 with axis, so k/v "
        "come out as fused_qkv_old_tmp.K_0 / fused_qkv_old_tmp.V_0. Intended: q, k, v.",
    ),
    # ---- fused_ffn (gate/up blocked per TP rank) -------------------------------------------------
    case(
        "fused_ffn_t1",
        ["W -> gate, up, fused_ffn"],
        {"W": inp([3, 10])},
        defect="T == 1: the macro emits 'W -> fused_ffn_tmp.GATE_0, fused_ffn_tmp.UP_0, axis=1' then "
        "'fused_ffn_tmp.GATE_0 -> gate, axis=1' (1 -> 1 with axis, not bound), so the outputs "
        "are fused_ffn_tmp.GATE_0 / fused_ffn_tmp.UP_0. Intended: gate = W[:, :5], up = W[:, 5:].",
    ),
    case(
        "fused_ffn_t1_axis0",
        ["W -> gate, up, fused_ffn, axis=0"],
        {"W": inp([10, 3])},
        defect="same as fused_ffn_t1 (outputs named fused_ffn_tmp.GATE_0/UP_0). Intended: gate, up.",
    ),
    case(
        "fused_ffn_t1_two_statements_collide",
        ["W1 -> g1, u1, fused_ffn", "W2 -> g2, u2, fused_ffn"],
        {"W1": inp([2, 6]), "W2": inp([2, 6])},
        defect="T == 1 and the fused_ffn_tmp.* names are global: outputs are g1, u1 (from W1) and "
        "fused_ffn_tmp.GATE_0/UP_0 (from W2); g2/u2 are missing. Intended: g1, u1, g2, u2.",
    ),
    case("fused_ffn_t2", ["W -> gate, up, fused_ffn"], {"W": inp([3, 12], split=(1, [6, 6]))}, nproc=2),
    case("fused_ffn_t2_bias_axis0", ["b -> bg, bu, fused_ffn, axis=0"], {"b": inp([12], split=(0, [6, 6]))}, nproc=2),
    case(
        "fused_ffn_t2_two_statements",
        ["W1 -> g1, u1, fused_ffn", "W2 -> g2, u2, fused_ffn"],
        {"W1": inp([2, 8], split=(1, [4, 4])), "W2": inp([2, 8], split=(1, [4, 4]))},
        nproc=2,
    ),
    case("fused_ffn_reblock_t2_to_1", ["W -> W2, fused_ffn"], {"W": inp([3, 12], split=(1, [6, 6]))}, nproc=2),
    case("fused_ffn_reverse_form", ["gate, up -> W, fused_ffn"], {"gate": inp([3, 5]), "up": inp([3, 5])}),
    case(
        "fused_ffn_reverse_mode",
        ["W -> gate, up, fused_ffn"],
        {"gate": inp([3, 5]), "up": inp([3, 5])},
        reverse=True,
        defect="as fused_qkv_old_reverse_mode: get_src_state_shard_num(None) (macros.py:434-437) -> "
        "AttributeError. Intended: W = [gate | up].",
    ),
    # ---- macros: ids, offset, star, array -------------------------------------------------------
    case(
        "layer_id_several_layers",
        ["layers.$LAYER_ID.w -> model.layers.$LAYER_ID.weight"],
        {
            "layers.0.w": inp([2]),
            "layers.1.w": inp([2]),
            "layers.2.w": inp([2]),
            "layers.10.w": inp([2]),
            "layers.x.w": inp([2]),
            "other.3.w": inp([2]),
        },
    ),
    case(
        "layer_id_with_transpose_suffix",
        ["layers.$LAYER_ID.w^T -> layers.$LAYER_ID.wt"],
        {"layers.0.w": inp([2, 3]), "layers.1.w": inp([2, 3])},
    ),
    case(
        "layer_id_concat_two_names",
        ["layers.$LAYER_ID.a, layers.$LAYER_ID.b -> layers.$LAYER_ID.ab, axis=0"],
        {"layers.0.a": inp([1, 2]), "layers.0.b": inp([2, 2]), "layers.1.a": inp([1, 2]), "layers.1.b": inp([2, 2])},
    ),
    case(
        "layer_id_and_expert_id",
        ["layers.$LAYER_ID.experts.$EXPERT_ID.w -> model.layers.$LAYER_ID.mlp.experts.$EXPERT_ID.weight"],
        {
            "layers.0.experts.0.w": inp([2]),
            "layers.0.experts.1.w": inp([2]),
            "layers.1.experts.0.w": inp([2]),
            "layers.1.experts.1.w": inp([2]),
        },
    ),
    case(
        "layer_id_with_star",
        ["layers.$LAYER_ID.experts.*.w -> layers.$LAYER_ID.stacked, axis=0"],
        {
            "layers.0.experts.0.w": inp([1, 3]),
            "layers.0.experts.1.w": inp([1, 3]),
            "layers.1.experts.0.w": inp([1, 3]),
            "layers.1.experts.1.w": inp([1, 3]),
        },
        defect="the id macro runs before the star macro and re.escape()s the '*' (macros.py:720), so "
        "the pattern matches no key; the Cartesian product of an empty value set yields zero "
        "statements and the sources pass through unchanged, silently. Intended: "
        "layers.0.stacked = [layers.0.experts.0.w; layers.0.experts.1.w], same for layer 1.",
    ),
    case(
        "layer_id_no_match_expands_to_nothing",
        ["layers.$LAYER_ID.nope -> out.$LAYER_ID"],
        {"layers.0.w": inp([2])},
        defect="a placeholder pattern that matches no source key silently expands to no statement "
        "(macros.py:787-822). shardsync should report the statement (nothing matched).",
    ),
    case(
        "reverse_layer_id",
        ["layers.$LAYER_ID.w -> model.$LAYER_ID.weight"],
        {"model.0.weight": inp([2]), "model.1.weight": inp([2])},
        reverse=True,
    ),
    case(
        "reverse_layer_id_offset",
        ["layers.$LAYER_ID_OFFSET.x -> layers.$LAYER_ID_OFFSET.x"],
        {"layers.0.x": inp([2]), "layers.1.x": inp([2])},
        reverse=True,
        defect="the offset macro ignores aoa_config_reverse (macros.py:131-187): it still matches the "
        "LEFT name against source keys and writes L-1 on the right, producing "
        "'layers.0.x->layers.-1.x', which the lexer rejects ('-'). Intended (statement read "
        "backwards): sources layers.0.x, layers.1.x export as layers.1.x, layers.2.x.",
    ),
    case(
        "layer_id_and_expert_id_ragged",
        ["layers.$LAYER_ID.experts.$EXPERT_ID.w -> out.$LAYER_ID.$EXPERT_ID"],
        {"layers.0.experts.0.w": inp([2]), "layers.0.experts.1.w": inp([2]), "layers.1.experts.2.w": inp([2])},
        defect="The id macro takes the Cartesian product of each placeholder's value set "
        "(macros.py:801-809), not the combinations that exist, so it emits "
        "'layers.0.experts.2.w -> ...' and fails with 'should be assigned before'. Intended: "
        "expand only existing combinations (3 statements).",
    ),
    case(
        "layer_id_offset_concat",
        ["layers.$LAYER_ID_OFFSET.a, layers.$LAYER_ID_OFFSET.b -> layers.$LAYER_ID_OFFSET.ab, axis=1"],
        {
            "layers.1.a": inp([2, 1]),
            "layers.1.b": inp([2, 2]),
            "layers.2.a": inp([2, 1]),
            "layers.2.b": inp([2, 2]),
            "layers.3.a": inp([2, 1]),
            "layers.3.b": inp([2, 2]),
        },
    ),
    case(
        "star_numeric_sort",
        ["experts.*.w -> stacked, axis=0"],
        {
            "experts.0.w": inp([1, 3]),
            "experts.1.w": inp([1, 3]),
            "experts.2.w": inp([1, 3]),
            "experts.10.w": inp([1, 3]),
            "experts.x.w": inp([1, 3]),
            "experts.1.w2": inp([1, 3]),
        },
    ),
    case(
        "star_single_match",
        ["experts.*.w -> stacked, axis=0"],
        {"experts.0.w": inp([1, 3])},
        defect="the star expands to 'experts.0.w -> stacked, axis=0' (1 -> 1 with axis), so stacked "
        "is not bound and experts.0.w is listed instead. Intended: stacked = experts.0.w.",
    ),
    case(
        "star_on_right_without_destination",
        ["stacked -> experts.*.w, axis=0"],
        {"stacked": inp([2, 3])},
        defect="a '*' right of '->' expands against destination keys; full_param has none "
        "(destination_state_shard_info=None, full_param.py:108), so it asserts 'No keys "
        "found'. Expected to be an error in shardsync too (no destination layout).",
    ),
    case("array_macro", ["x -> p[0:3], axis=1", "p[1:3] -> pq, axis=1"], {"x": inp([2, 6])}),
    # ---- optimizer-state keys -------------------------------------------------------------------
    case(
        "optimizer_state_keys",
        ["w -> v, permute='[]'"],
        {
            "w": inp([2, 3]),
            "w.w_0": inp([2, 3]),
            "w.moment1_0": inp([2, 3]),
            "w.moment2_0": inp([2, 3]),
            "w.beta1_pow_acc_0": inp([1]),
            "w.beta2_pow_acc_0": inp([1]),
        },
    ),
    case(
        "optimizer_state_keys_without_model_key",
        ["w -> v"],
        {"w.moment1_0": inp([2, 3]), "w.beta1_pow_acc_0": inp([1])},
    ),
    # ---- ordinary statements on sources sharded across 2 ranks -----------------------------------
    case(
        "sharded_transpose_cast_2proc",
        ["x^T -> y", "y -> y, dtype='bfloat16'"],
        {"x": inp([3, 5], split=(0, [1, 2]))},
        nproc=2,
    ),
    case(
        "sharded_split_across_boundary_2proc",
        ["x -> p, q, axis=1", "p, z -> c, axis=0"],
        {"x": inp([2, 6], split=(1, [4, 2])), "z": inp([1, 3])},
        nproc=2,
    ),
    case(
        "sharded_permute_3d_2proc", ["x -> y, permute='[2, 0, 1]'"], {"x": inp([2, 3, 5], split=(2, [3, 2]))}, nproc=2
    ),
    # ---- errors and other defects -------------------------------------------------------------------
    case(
        "permute_longer_than_rank",
        ["x -> y, permute='[1, 0, 2]'"],
        {"x": inp([2, 3])},
        defect="bare IndexError: tuple index out of range (transpose_list, aoa_engine.py:913-919). "
        "Intended: an error naming the statement.",
    ),
    case(
        "permute_shorter_than_rank",
        ["x -> y, permute='[0]'"],
        {"x": inp([2, 3])},
        garbage=["y"],
        defect="no error: transpose_list keeps only the listed dims, y gets shape [2] and its values "
        "are garbage (uninitialised memory). Intended: an error naming the statement.",
    ),
    case(
        "concat_mismatched_other_dims",
        ["x, z -> c, axis=0"],
        {"x": inp([2, 2]), "z": inp([2, 3])},
        defect="silently truncates: c has x's other dims ([4, 2]) and z's third column is dropped. Intended: an error.",
    ),
    case(
        "concat_cast_and_uncast",
        ["a -> a2, dtype='bfloat16'", "a2, b -> c, axis=0"],
        {"a": inp([1, 3]), "b": inp([1, 3])},
        defect="cast() keeps the source dtype on the descriptor (aoa_engine.py:498-501), so the concat "
        "dtype check passes; the output dtype becomes bfloat16 (infer_real_dtype) and the "
        "uncast float32 piece then trips 'Direct assignment of Tensors with different types' "
        "(aoa_engine.py:833-841). Intended: a concat dtype-mismatch error naming the statement.",
    ),
    case(
        "concat_cast_and_native_bfloat16",
        ["a -> a2, dtype='bfloat16'", "a2, b -> c, axis=0"],
        {"a": inp([1, 3]), "b": inp([1, 3], "bfloat16")},
        defect="both pieces are bfloat16, but the concat dtype check compares the descriptors' "
        "dtypes, and cast() leaves a2's descriptor at the source dtype float32 "
        "(aoa_engine.py:434, :498-501), so the concat is rejected. Intended: c bfloat16 = "
        "[bf16(a); b].",
    ),
    case(
        "negative_axis",
        ["x -> p, q, axis=-1"],
        {"x": inp([2, 4])},
        defect="the lexer has no '-' token: RuntimeError \"Unexpected character '-'\". Intended "
        "(extension): axis=-1 is the last axis.",
    ),
    case("unknown_name", ["nope -> y"], {"x": inp([2])}),
    case("many_to_many_rejected", ["a, b -> c, d, axis=0"], {"a": inp([2]), "b": inp([2])}),
    case("split_with_two_attrs_rejected", ["x -> p, q, axis=0, dtype='float16'"], {"x": inp([2, 2])}),
    case("unknown_attribute_rejected", ["x -> y, foo=1"], {"x": inp([2])}),
    case("assign_to_transpose_rejected", ["x -> y^T"], {"x": inp([2, 3])}),
]

INPUT_RULE = (
    "full global tensor of key k = arange(numel) + 1000 * i, i = index of k in "
    "sorted(case['inputs']) (Python string order), computed in float64, reshaped row-major "
    "to shape, then cast to the key's dtype"
)
SHARD_RULE = (
    "one shard: the key is whole on every rank; two shards (only in 'nproc': 2 cases): rank r "
    "holds shards[r] = full[offset : offset + shape]"
)


# --------------------------------------------------------------------------------------------------
# running a case under Paddle
# --------------------------------------------------------------------------------------------------


def _np_dtype(dt):
    import numpy as np

    return {"float32": np.float32, "float64": np.float64, "float16": np.float16, "int32": np.int32, "int64": np.int64}[
        dt
    ]


def full_input(case_, key):
    import numpy as np

    i = sorted(case_["inputs"]).index(key)
    d = case_["inputs"][key]
    n = math.prod(d["shape"])
    return (np.arange(n, dtype=np.float64) + 1000 * i).reshape(d["shape"])


def local_state_dict(case_, rank):
    import numpy as np
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    sd = {}
    for key, d in sorted(case_["inputs"].items()):
        full = full_input(case_, key)
        shards = d["shards"]
        sh = shards[0] if len(shards) == 1 else shards[rank]
        idx = tuple(slice(o, o + s) for o, s in zip(sh["offset"], sh["shape"]))
        loc = np.ascontiguousarray(full[idx])
        if d["dtype"] == "bfloat16":
            t = paddle.to_tensor(loc.astype(np.float32)).astype("bfloat16")
        else:
            t = paddle.to_tensor(loc.astype(_np_dtype(d["dtype"])))
        sd[key] = ShardedWeight(
            key=key,
            local_tensor=t,
            local_shape=tuple(sh["shape"]),
            global_shape=tuple(d["shape"]),
            global_offset=tuple(sh["offset"]),
        )
    return sd


def _covered(mappings):
    return sum(math.prod(m.target_slice.local_shape) for m in mappings)


def run_case(case_, rank=0):
    from paddle.distributed.flex_checkpoint.dcp.full_param import full_param

    sd = local_state_dict(case_, rank)
    cfg = {"aoa_statements": list(case_["statements"]), "aoa_config_reverse": case_["reverse"]}
    res = {"outputs": {}, "output_order": [], "paddle_error": None, "paddle_expanded": None}
    asm = None
    try:
        asm = full_param(sd, cfg)
        for name, t in asm:
            dt = str(t.dtype).split(".")[-1]
            shape = list(t.shape)
            numel = math.prod(shape)
            mappings = asm.destination_sharded_mappings.get(name, [])
            out = {"shape": shape, "dtype": dt}
            cov = numel if asm.is_identity_mapping(mappings) else _covered(mappings)
            if cov < numel or name in case_["garbage"]:
                out["values"] = None
                out["uninitialised"] = True
            else:
                vals = t.astype("float32").numpy() if dt in ("bfloat16", "float16") else t.numpy()
                out["values"] = [v.item() if hasattr(v, "item") else v for v in vals.ravel().tolist()]
            res["outputs"][name] = out
            res["output_order"].append(name)
    except Exception as e:  # noqa: BLE001 - recording Paddle's behaviour, including crashes
        msg = str(e).strip().splitlines()
        res["paddle_error"] = f"{type(e).__name__}: {msg[0][:300] if msg else ''}"
        res["outputs"] = {}
        res["output_order"] = []
    eng = getattr(asm, "aoa_engine", None)
    if eng is not None and getattr(eng, "lexer", None) is not None:
        exprs = list(getattr(eng.lexer, "final_expressions", []) or [])
    else:
        exprs = expand_only(case_)
    res["paddle_expanded"] = None if exprs is None else [e.strip() for e in exprs]
    return res


def expand_only(case_):
    """Paddle's macro expansion alone (for cases where full_param raised); None if that raises too."""
    from paddle.distributed.flex_checkpoint.aoa.aoa_engine import AOAShardInfoContext
    from paddle.distributed.flex_checkpoint.aoa.lexer import Lexer
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeightDesc

    info = {
        k: [
            ShardedWeightDesc(k, tuple(sh["shape"]), tuple(d["shape"]), tuple(sh["offset"]), d["dtype"])
            for sh in d["shards"]
        ]
        for k, d in case_["inputs"].items()
    }
    lexer = Lexer(AOAShardInfoContext(info, None, case_["reverse"]))
    try:
        lexer.all_tokens(list(case_["statements"]))
    except Exception:  # noqa: BLE001
        return None
    return lexer.final_expressions


def finish(case_, res):
    out = {k: case_[k] for k in ("name", "statements", "reverse", "inputs")}
    out["nproc"] = case_["nproc"]
    out["outputs"] = res["outputs"]
    out["output_order"] = res["output_order"]
    out["paddle_error"] = res["paddle_error"]
    out["paddle_expanded"] = res["paddle_expanded"]
    out["paddle_defect"] = case_["paddle_defect"]
    return out


# --------------------------------------------------------------------------------------------------
# driver / worker
# --------------------------------------------------------------------------------------------------


def selected(only):
    names = {c["name"] for c in CASES}
    for n in only or []:
        if n not in names:
            raise SystemExit(f"unknown case {n!r}")
    return [c for c in CASES if not only or c["name"] in only]


def worker(tmpdir, only):
    import paddle
    import paddle.distributed as dist

    if not paddle.is_compiled_with_cuda():
        # full_param.py:527 moves CPU tensors to CUDA before broadcasting; on a CPU build keep them
        # on CPU (gloo broadcasts CPU tensors).
        paddle.Tensor.cuda = lambda self, *a, **k: self
    dist.init_parallel_env()
    rank = dist.get_rank()
    results = {}
    for c in selected(only):
        if c["nproc"] != 2:
            continue
        results[c["name"]] = run_case(c, rank)
        dist.barrier()
    with open(os.path.join(tmpdir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def driver(out_path, only):
    import paddle

    cases = selected(only)
    results = {}
    for c in cases:
        if c["nproc"] == 1:
            print(f"[1 proc] {c['name']}", file=sys.stderr, flush=True)
            results[c["name"]] = run_case(c)
    if any(c["nproc"] == 2 for c in cases):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [
                sys.executable,
                "-m",
                "paddle.distributed.launch",
                "--nproc_per_node",
                "2",
                "--log_dir",
                os.path.join(tmp, "log"),
                os.path.abspath(__file__),
                "--worker",
                tmp,
            ]
            if only:
                cmd += ["--only", *only]
            print("[2 proc] " + " ".join(cmd), file=sys.stderr, flush=True)
            # readiness order depends on set iteration order: pin the hash seed for a stable file
            env = dict(os.environ, PYTHONHASHSEED="0")
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=900, env=env)
            ranks = []
            for r in range(2):
                p = os.path.join(tmp, f"rank{r}.json")
                if not os.path.exists(p):
                    logs = os.path.join(tmp, "log")
                    for fn in sorted(os.listdir(logs)):
                        sys.stderr.write(open(os.path.join(logs, fn)).read()[-4000:])
                    raise SystemExit(f"rank {r} wrote no results")
                with open(p) as f:
                    ranks.append(json.load(f))
        for name, r0 in ranks[0].items():
            r1 = ranks[1][name]
            if r0["outputs"] != r1["outputs"] or r0["paddle_error"] != r1["paddle_error"]:
                raise SystemExit(f"{name}: ranks disagree")
            if r0["output_order"] != r1["output_order"]:
                print(f"note: {name}: ranks yielded in different orders", file=sys.stderr)
            results[name] = r0
    doc = {
        "generator": "tests/golden/make_paddle_golden.py",
        "paddle_version": paddle.__version__,
        "input_rule": INPUT_RULE,
        "shard_rule": SHARD_RULE,
        "fields": {
            "outputs": "what Paddle's full_param yielded: name -> shape, dtype, row-major values "
            "(bfloat16/float16 values widened exactly to float); values null + "
            "'uninitialised': true when Paddle never wrote (part of) the tensor",
            "output_order": "order full_param yielded the outputs: sorted by name on one process; on "
            "two, the order tensors became ready, which depends on set iteration "
            "(workers run with PYTHONHASHSEED=0); not a contract",
            "paddle_expanded": "statements after Paddle's macro expansion (Lexer.final_expressions)",
            "paddle_error": "'Type: message' when Paddle raised; outputs are then empty",
            "paddle_defect": "null, or why Paddle's result is wrong and what shardsync should do",
        },
        "cases": [finish(c, results[c["name"]]) for c in cases],
    }
    if only and os.path.exists(out_path):  # merge into the existing file
        with open(out_path) as f:
            old = json.load(f)
        by = {c["name"]: c for c in old["cases"]}
        by.update({c["name"]: c for c in doc["cases"]})
        doc["cases"] = [by[c["name"]] for c in CASES if c["name"] in by]
    text = json.dumps(doc, indent=1)
    # one line per list of numbers, to keep the file short and diffable
    text = re.sub(
        r"\[\s*([-+0-9.eE,\s]+?)\s*\]", lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text
    )
    with open(out_path, "w") as f:
        f.write(text + "\n")
    print(f"wrote {out_path} ({os.path.getsize(out_path)} bytes, {len(doc['cases'])} cases)", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--only", nargs="*", help="case names (merged into an existing --out)")
    ap.add_argument("--worker", metavar="TMPDIR", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.only)
    else:
        driver(a.out, a.only)


if __name__ == "__main__":
    main()
