"""Models whose layers are not all MoE (Megatron's ``moe_layer_freq``, HF Qwen2-MoE's ``mlp_only_layers``,
DeepSeek's dense first layers): the shipped qwen2-moe mappings on arange states where layer 0 is a
dense MLP, against a conversion written out plainly, both ways, local and Transformer Engine specs;
and a dense mapping on an MoE model, whose error names the MoE mappings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import shardsync
from reference import arange_tensor
from shardsync.cli import main
from shardsync.errors import LoadError, MappingError
from shardsync.layout import Box, GlobalLayout
from shardsync.mapping import Mapping
from test_mappings_moe import HID, PARAMS, VOCAB, assert_same, hf_moe, megatron_moe

DENSE_FFN = 9  # odd, and other than the experts' 5


def layout(state: dict[str, torch.Tensor]) -> GlobalLayout:
    return GlobalLayout.merge(
        [[(k, tuple(v.shape), "float32", Box((0,) * v.dim(), tuple(v.shape))) for k, v in state.items()]]
    )


def mixed(te: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A Qwen2-MoE-like Megatron state whose layer 0 is dense, and its HF checkpoint."""
    mg = megatron_moe(shared=True, qkv_bias=True, te=te)
    hf = hf_moe(mg, qwen=True, te=te)
    m, h = "decoder.layers.0.", "model.layers.0."
    norm = mg[m + "pre_mlp_layernorm.weight"]
    mg = {k: v for k, v in mg.items() if not k.startswith((m + "mlp.", m + "pre_mlp_layernorm."))}
    hf = {k: v for k, v in hf.items() if not k.startswith(h + "mlp.")}
    fc1, fc2 = arange_tensor((2 * DENSE_FFN, HID), start=-5000), arange_tensor((HID, DENSE_FFN), start=7000)
    # the TE spec keeps a dense layer's norm in its linear_fc1 (the MoE layers' in pre_mlp_layernorm)
    mg |= {
        m + ("mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"): norm,
        m + "mlp.linear_fc1.weight": fc1,
        m + "mlp.linear_fc2.weight": fc2,
    }
    hf |= {
        h + "mlp.gate_proj.weight": fc1[:DENSE_FFN],
        h + "mlp.up_proj.weight": fc1[DENSE_FFN:],
        h + "mlp.down_proj.weight": fc2,
    }
    return mg, hf


@pytest.mark.parametrize("name, te", [("megatron-qwen2-moe", False), ("megatron-qwen2-moe-te", True)])
def test_a_dense_layer_among_moe_layers_both_ways(name: str, te: bool) -> None:
    mg, hf = mixed(te)
    assert "model.layers.1.mlp.experts.2.down_proj.weight" in hf and "model.layers.0.mlp.gate.weight" not in hf
    assert_same(dict(shardsync.full_params(mg, Mapping.parse(name, params=PARAMS))), hf)
    dst = {k: torch.full_like(v, -1.0) for k, v in mg.items()}
    result = shardsync.load(dst, hf, Mapping.parse(name, params=PARAMS, reverse=True))
    assert (result.missing, result.unexpected, result.mismatched) == ((), (), ())
    for k, v in mg.items():
        rows = slice(0, VOCAB) if k.startswith(("embedding.", "output_layer.")) else slice(None)
        assert torch.equal(dst[k][rows], v[rows]), k


# -- a dense mapping on an MoE model names the MoE mappings ------------------------------------------


def test_a_dense_mapping_on_an_moe_model_names_the_moe_mappings() -> None:
    with pytest.raises(MappingError) as err:
        shardsync.resolve(Mapping.parse("megatron-llama", params=PARAMS), layout(megatron_moe()))
    text = str(err.value)
    assert "'decoder.layers.$LAYER_ID.mlp.linear_fc1.weight' matches no source key" in text
    assert (
        "hint: the source holds mixture-of-experts tensors (e.g. 'decoder.layers.0.mlp.router.weight') and "
        "this mapping has no expert lines: use the shipped 'megatron-mixtral' or 'megatron-qwen2-moe' (their "
        "-te variants for the Transformer Engine layer spec, -grouped for GroupedMLP experts)"
    ) in text
    assert text.count("mixture-of-experts") == 1  # once, on the first of the two mlp lines
    with pytest.raises(
        MappingError,
        match=r"use the shipped 'megatron-qwen2-moe-te' or 'megatron-mixtral-te', "
        r"which read the router",
    ):
        shardsync.resolve(Mapping.parse("megatron-llama-te", params=PARAMS), layout(megatron_moe(shared=True, te=True)))
    hf = hf_moe(megatron_moe(), qwen=False)  # loading an HF Mixtral with the reversed dense mapping
    with pytest.raises(
        MappingError,
        match=r"(?s)'model.layers.\$LAYER_ID.mlp.gate_proj.weight' matches no source key.*"
        r"the source holds mixture-of-experts tensors \(e.g. "
        r"'model.layers.0.block_sparse_moe.experts.0.w1.weight'\)",
    ):
        shardsync.load({}, hf, Mapping.parse("megatron-llama", params=PARAMS, reverse=True))


def test_a_dense_mapping_on_a_mixed_model_says_so_for_the_moe_layers_it_leaves(
    caplog: pytest.LogCaptureFixture,
) -> None:
    mg, _ = mixed(te=False)  # layer 0 dense: the dense lines match it, layer 1's experts are left over
    with pytest.raises(
        MappingError,
        match=r"unconsumed: .*'decoder.layers.1.mlp.router.weight'.*; the source "
        r"holds mixture-of-experts tensors .* use the shipped "
        r"'megatron-qwen2-moe' or 'megatron-mixtral'",
    ):
        shardsync.resolve(Mapping.parse("megatron-llama", params=PARAMS), layout(mg), strict=True)
    with caplog.at_level("WARNING"):
        shardsync.resolve(Mapping.parse("megatron-llama", params=PARAMS), layout(mg))
    assert "use the shipped 'megatron-qwen2-moe'" in caplog.text


def test_the_cli_convert_hint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "moe.safetensors"
    save_file({k: v.contiguous() for k, v in megatron_moe().items()}, str(src))
    code = main(
        [
            "convert",
            str(src),
            str(tmp_path / "out"),
            "-m",
            "megatron-llama",
            "-q",
            "--set",
            "num_heads=4",
            "--set",
            "num_key_value_groups=2",
            "--set",
            "vocab_size=11",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "out").exists()
    assert "use the shipped 'megatron-mixtral' or 'megatron-qwen2-moe'" in err, err


# -- optional lines on load: the destination decides -------------------------------------------------


def test_only_alternative_optional_outputs_the_destination_lacks_are_dropped() -> None:
    hf = {"x": arange_tensor((3,)), "y": arange_tensor((2,), start=10)}
    dst = {"b": torch.zeros(3), "c": torch.zeros(2)}
    # `a`, which the destination lacks, is dropped; `t` (an intermediate read later) is not
    mapping = ["a? -> x", "b? -> x", "c -> t", "t? -> y"]
    result = shardsync.load(dst, hf, mapping, reverse=True)
    assert result.unexpected == () and torch.equal(dst["b"], hf["x"]) and torch.equal(dst["c"], hf["y"])
    alone = ["lm_head? -> out", "emb -> embed"]  # `out` for a tied model: nothing else reads it
    with pytest.raises(LoadError, match=r"unexpected 'lm_head'"):
        shardsync.load({"emb": torch.zeros(3)}, {"out": hf["x"], "embed": hf["x"]}, alone, reverse=True)
    plain = ["a -> x", "b -> x"]  # not optional: still reported
    with pytest.raises(LoadError, match=r"unexpected 'a' \(statement 0 `a -> x`\)"):
        shardsync.load({"b": torch.zeros(3)}, {"x": hf["x"]}, plain, reverse=True)
    without_destination = dict(
        shardsync.full_params({"x": hf["x"]}, Mapping.parse(["a? -> x", "b? -> x"], reverse=True))
    )
    assert sorted(without_destination) == ["a", "b"]
