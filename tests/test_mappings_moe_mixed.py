"""Models whose layers are not all MoE (Megatron's ``moe_layer_freq``, HF Qwen2-MoE's ``mlp_only_layers``,
DeepSeek's dense first layers): the shipped qwen2-moe mappings on arange states where layer 0 is a
dense MLP, against a conversion written out plainly, both ways, local and Transformer Engine specs."""

from __future__ import annotations

import pytest
import torch
from reference import arange_tensor
from test_mappings_moe import HID, PARAMS, VOCAB, assert_same, hf_moe, megatron_moe

import shardsync
from shardsync.mapping import Mapping

DENSE_FFN = 9  # odd, and other than the experts' 5


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
    mg |= {m + ("mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"): norm,
           m + "mlp.linear_fc1.weight": fc1, m + "mlp.linear_fc2.weight": fc2}
    hf |= {h + "mlp.gate_proj.weight": fc1[:DENSE_FFN], h + "mlp.up_proj.weight": fc1[DENSE_FFN:],
           h + "mlp.down_proj.weight": fc2}
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
