"""transformers' fused expert tensors (``mlp.experts.gate_up_proj [E, 2f, h]``,
``mlp.experts.down_proj [E, h, f]``, transformers 5) and per-expert checkpoints, both ways, with a
real tiny Mixtral: the per-expert checkpoint shardsync writes loads with ``from_pretrained`` into
identical parameters (and logits), and a per-expert checkpoint maps back to the fused tensors exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardsync

transformers = pytest.importorskip("transformers")
MixtralConfig, MixtralForCausalLM = transformers.MixtralConfig, transformers.MixtralForCausalLM

E = 3  # experts
# live transformers-5 Mixtral (fused experts) -> the per-expert names of Mixtral checkpoints on the Hub
FUSED_TO_PER_EXPERT = [
    "model.layers.$LAYER_ID.mlp.experts.gate_up_proj -> gate_up.$LAYER_ID.*, unstack",
    "gate_up.$LAYER_ID.$EXPERT_ID -> model.layers.$LAYER_ID.block_sparse_moe.experts.$EXPERT_ID.w1.weight, "
    "model.layers.$LAYER_ID.block_sparse_moe.experts.$EXPERT_ID.w3.weight, axis=0",
    "model.layers.$LAYER_ID.mlp.experts.down_proj -> model.layers.$LAYER_ID.block_sparse_moe.experts.*.w2.weight, "
    "unstack",
    "model.layers.$LAYER_ID.mlp.gate.weight -> model.layers.$LAYER_ID.block_sparse_moe.gate.weight",
]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    # intermediate_size a multiple of 4: the grouped expert matmul wants 16-byte strides
    config = MixtralConfig(
        vocab_size=61,
        hidden_size=16,
        intermediate_size=12,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=E,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    m = MixtralForCausalLM(config).eval()
    assert tuple(m.state_dict()["model.layers.0.mlp.experts.gate_up_proj"].shape) == (E, 24, 16)
    return m


def test_fused_experts_written_per_expert_load_back_identically(model: torch.nn.Module, tmp_path: Path) -> None:
    model.config.save_pretrained(tmp_path / "config")
    shardsync.save_hf(model.state_dict(), tmp_path / "ckpt", FUSED_TO_PER_EXPERT, config_from=tmp_path / "config")
    written = load_file(tmp_path / "ckpt" / "model.safetensors")
    gate_up = model.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(written["model.layers.1.block_sparse_moe.experts.2.w1.weight"], gate_up[2, :12])
    assert torch.equal(written["model.layers.1.block_sparse_moe.experts.2.w3.weight"], gate_up[2, 12:])
    assert not any("gate_up_proj" in k or "mlp.experts" in k for k in written)
    loaded = MixtralForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    want, got = model.state_dict(), loaded.state_dict()
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    ids = torch.arange(12).reshape(2, 6) % 61
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_per_expert_tensors_to_fused_experts_exact(model: torch.nn.Module) -> None:
    per_expert = dict(shardsync.full_params(model.state_dict(), FUSED_TO_PER_EXPERT))
    assert "model.layers.0.block_sparse_moe.experts.2.w2.weight" in per_expert
    fused = dict(shardsync.full_params(per_expert, shardsync.Mapping.parse(FUSED_TO_PER_EXPERT, reverse=True)))
    want = model.state_dict()
    assert sorted(fused) == sorted(want)
    assert [k for k in want if not torch.equal(fused[k], want[k])] == []
