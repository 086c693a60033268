"""MoE without megatron-core: the shipped megatron-mixtral / megatron-qwen2-moe mappings (and their TE
variants) on arange states against a conversion written out plainly, both ways; from_megatron's global
expert ids and expert TP groups on hand-built modules; a padded vocabulary loaded; a bare Megatron
module where a placed state is needed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import shardsync
from reference import arange_tensor
from shardsync.errors import LayoutError, LoadError
from shardsync.layout import Box, LocalShard
from shardsync.mapping import Mapping, shipped_parameters

H, G, D, HID, FFN, SHARED, EXPERTS, VOCAB, ROWS, LAYERS = 4, 2, 2, 6, 5, 7, 3, 11, 16, 2
PER = H // G
PARAMS = {"num_heads": H, "num_key_value_groups": G, "vocab_size": VOCAB}


def megatron_moe(
    *,
    shared: bool = False,
    qkv_bias: bool = False,
    qk_norm: bool = False,
    te: bool = False,
) -> dict[str, torch.Tensor]:
    """A Megatron MoE GPT state under global names (ROWS padded vocabulary rows); tensor i is arange
    from 1000 * i."""
    shapes = {
        "embedding.word_embeddings.weight": (ROWS, HID),
        "decoder.final_layernorm.weight": (HID,),
        "output_layer.weight": (ROWS, HID),
    }
    for i in range(LAYERS):
        p = f"decoder.layers.{i}."
        norm = "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
        shapes |= {
            p + norm: (HID,),
            p + "pre_mlp_layernorm.weight": (HID,),
            p + "self_attention.linear_qkv.weight": ((H + 2 * G) * D, HID),
            p + "self_attention.linear_proj.weight": (HID, H * D),
            p + "mlp.router.weight": (EXPERTS, HID),
        }
        shapes |= {
            p + f"mlp.experts.local_experts.{e}.linear_fc{n}.weight": s
            for e in range(EXPERTS)
            for n, s in ((1, (2 * FFN, HID)), (2, (HID, FFN)))
        }
        if qkv_bias:
            shapes[p + "self_attention.linear_qkv.bias"] = ((H + 2 * G) * D,)
        if qk_norm:
            shapes |= {p + "self_attention.q_layernorm.weight": (D,), p + "self_attention.k_layernorm.weight": (D,)}
        if shared:
            shapes |= {
                p + "mlp.shared_experts.linear_fc1.weight": (2 * SHARED, HID),
                p + "mlp.shared_experts.linear_fc2.weight": (HID, SHARED),
                p + "mlp.shared_experts.gate_weight": (1, HID),
            }
    return {k: arange_tensor(s, start=1000 * i) for i, (k, s) in enumerate(shapes.items())}


def hf_moe(mg: dict[str, torch.Tensor], *, qwen: bool, te: bool = False) -> dict[str, torch.Tensor]:
    """Megatron -> HF hub names, written out plainly: reshape per query group, halve every fc1."""
    out = {
        "model.embed_tokens.weight": mg["embedding.word_embeddings.weight"][:VOCAB],
        "model.norm.weight": mg["decoder.final_layernorm.weight"],
        "lm_head.weight": mg["output_layer.weight"][:VOCAB],
    }
    moe, (w1, w3, w2) = (
        ("mlp.", ("gate_proj", "up_proj", "down_proj")) if qwen else ("block_sparse_moe.", ("w1", "w3", "w2"))
    )
    for i in range(LAYERS):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        norm = "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
        out |= {
            h + "input_layernorm.weight": mg[m + norm],
            h + "post_attention_layernorm.weight": mg[m + "pre_mlp_layernorm.weight"],
            h + "self_attn.o_proj.weight": mg[m + "self_attention.linear_proj.weight"],
            h + moe + "gate.weight": mg[m + "mlp.router.weight"],
        }
        for kind in ("weight", "bias"):
            if m + f"self_attention.linear_qkv.{kind}" in mg:
                w = mg[m + f"self_attention.linear_qkv.{kind}"]
                groups = w.reshape(G, (PER + 2) * D, -1)
                out |= {
                    h + f"self_attn.q_proj.{kind}": groups[:, : PER * D].reshape(H * D, -1).squeeze(-1),
                    h + f"self_attn.k_proj.{kind}": groups[:, PER * D : (PER + 1) * D].reshape(G * D, -1).squeeze(-1),
                    h + f"self_attn.v_proj.{kind}": groups[:, (PER + 1) * D :].reshape(G * D, -1).squeeze(-1),
                }
        for x, y in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
            if m + f"self_attention.{x}.weight" in mg:
                out[h + f"self_attn.{y}.weight"] = mg[m + f"self_attention.{x}.weight"]
        for e in range(EXPERTS):
            fc1 = mg[m + f"mlp.experts.local_experts.{e}.linear_fc1.weight"]
            out |= {
                h + moe + f"experts.{e}.{w1}.weight": fc1[:FFN],
                h + moe + f"experts.{e}.{w3}.weight": fc1[FFN:],
                h + moe + f"experts.{e}.{w2}.weight": mg[m + f"mlp.experts.local_experts.{e}.linear_fc2.weight"],
            }
        if m + "mlp.shared_experts.gate_weight" in mg:
            fc1 = mg[m + "mlp.shared_experts.linear_fc1.weight"]
            out |= {
                h + "mlp.shared_expert.gate_proj.weight": fc1[:SHARED],
                h + "mlp.shared_expert.up_proj.weight": fc1[SHARED:],
                h + "mlp.shared_expert.down_proj.weight": mg[m + "mlp.shared_experts.linear_fc2.weight"],
                h + "mlp.shared_expert_gate.weight": mg[m + "mlp.shared_experts.gate_weight"],
            }
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].shape == v.shape and torch.equal(got[k], v), k


@pytest.mark.parametrize("te", [False, True], ids=["local", "te"])
def test_megatron_mixtral_exports_router_and_every_expert(te: bool) -> None:
    mg = megatron_moe(te=te)
    name = "megatron-mixtral-te" if te else "megatron-mixtral"
    assert shipped_parameters(name) == ["vocab_size", "num_heads", "num_key_value_groups"]
    assert_same(dict(shardsync.full_params(mg, Mapping.parse(name, params=PARAMS))), hf_moe(mg, qwen=False, te=te))


@pytest.mark.parametrize("te", [False, True], ids=["local", "te"])
def test_megatron_qwen2_moe_exports_the_shared_expert_and_its_gate(te: bool) -> None:
    mg = megatron_moe(shared=True, qkv_bias=True, te=te)
    name = "megatron-qwen2-moe-te" if te else "megatron-qwen2-moe"
    want = hf_moe(mg, qwen=True, te=te)
    assert "model.layers.1.mlp.shared_expert_gate.weight" in want and "model.layers.0.self_attn.v_proj.bias" in want
    assert_same(dict(shardsync.full_params(mg, Mapping.parse(name, params=PARAMS))), want)


def test_qwen3_moe_names_need_no_copy_of_the_mapping() -> None:
    mg = megatron_moe(qk_norm=True)  # Qwen3-MoE: q/k norms, no biases, no shared expert
    want = hf_moe(mg, qwen=True)
    assert "model.layers.0.self_attn.q_norm.weight" in want
    assert_same(dict(shardsync.full_params(mg, Mapping.parse("megatron-qwen2-moe", params=PARAMS))), want)


def test_an_experts_expert_bias_is_dropped() -> None:
    mg = megatron_moe() | {f"decoder.layers.{i}.mlp.router.expert_bias": torch.ones(EXPERTS) for i in range(LAYERS)}
    got = dict(shardsync.full_params(mg, Mapping.parse("megatron-mixtral", params=PARAMS)))
    assert_same(got, hf_moe(megatron_moe(), qwen=False))


@pytest.mark.parametrize("name, shared", [("megatron-mixtral", False), ("megatron-qwen2-moe", True)])
def test_reversed_moe_mapping_loads_hf_into_megatron_names_with_padded_rows(name: str, shared: bool) -> None:
    mg = megatron_moe(shared=shared, qkv_bias=shared)
    hf = hf_moe(mg, qwen=shared)
    dst = {k: torch.full_like(v, -1.0) for k, v in mg.items()}
    result = shardsync.load(dst, hf, Mapping.parse(name, params=PARAMS, reverse=True))
    assert (result.missing, result.unexpected, result.mismatched) == ((), (), ())
    for k, v in mg.items():
        if k in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert torch.equal(dst[k][:VOCAB], v[:VOCAB]) and bool((dst[k][VOCAB:] == -1.0).all()), k
        else:
            assert torch.equal(dst[k], v), k


# -- a padded vocabulary as destination --------------------------------------------------------------

EMB = ["embedding.word_embeddings.weight -> model.embed_tokens.weight, axis=0, keep=11"]


def test_padded_rows_of_each_tp_shard_are_left_as_they_are() -> None:
    hf = {"model.embed_tokens.weight": arange_tensor((VOCAB, 3), start=1)}
    full = torch.full((ROWS, 3), -1.0)
    shards = [LocalShard(full[:8], (ROWS, 3), (0, 0)), LocalShard(full[8:], (ROWS, 3), (8, 0))]
    result = shardsync.load({"embedding.word_embeddings.weight": shards}, hf, EMB, reverse=True)
    assert torch.equal(full[:VOCAB], hf["model.embed_tokens.weight"]) and bool((full[VOCAB:] == -1).all())
    assert sorted(t.name for t in result.plan.targets) == [
        "embedding.word_embeddings.weight[0:8, 0:3]",
        "embedding.word_embeddings.weight[8:11, 0:3]",
    ]
    only_padding = {"embedding.word_embeddings.weight": LocalShard(torch.zeros(4, 3), (ROWS, 3), (12, 0))}
    shardsync.load(only_padding, hf, EMB, reverse=True)  # a rank holding only padding rows receives nothing


def test_a_destination_padded_elsewhere_or_shorter_is_still_a_shape_error() -> None:
    hf = {"model.embed_tokens.weight": arange_tensor((VOCAB, 3))}
    for shape in ((ROWS, 4), (VOCAB - 1, 3)):
        with pytest.raises(
            LoadError,
            match=r"shape of 'embedding.word_embeddings.weight': statement 0 .* gives "
            rf"\[11, 3\], the destination is \[{shape[0]}, {shape[1]}\]",
        ):
            shardsync.load({"embedding.word_embeddings.weight": torch.zeros(shape)}, hf, EMB, reverse=True)
    plain = ["model.embed_tokens.weight -> embedding.word_embeddings.weight"]  # no keep=: no padding
    with pytest.raises(LoadError, match=r"gives \[11, 3\], the destination is \[16, 3\]"):
        shardsync.load({"embedding.word_embeddings.weight": torch.zeros(ROWS, 3)}, hf, plain)


# -- from_megatron on hand-built MoE modules (one process) -------------------------------------------


class Expert(torch.nn.Module):
    def __init__(self, tag: float) -> None:
        super().__init__()
        self.linear_fc2 = torch.nn.Linear(4, 2, bias=False)
        with torch.no_grad():
            self.linear_fc2.weight.fill_(tag)
        self.linear_fc2.weight.tensor_model_parallel, self.linear_fc2.weight.partition_dim = True, 1


class Experts(torch.nn.Module):
    def __init__(self, count: int, tp_group: object) -> None:
        super().__init__()
        self.local_experts = torch.nn.ModuleList(Expert(float(i)) for i in range(count))
        self.tp_group = tp_group


class MoELayer(torch.nn.Module):
    """Megatron's MoELayer as from_megatron sees it: EP rank 1 of 2 holds experts 2 and 3."""

    def __init__(self, tp_group: object = None) -> None:
        super().__init__()
        self.local_expert_indices = [2, 3]
        self.router = torch.nn.Linear(4, 4, bias=False)
        self.experts = Experts(2, tp_group)


def test_local_experts_get_their_global_ids() -> None:
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.decoder.layers[0].layer_number = 3  # a pipeline stage holding layer 2: both renumberings
    model.decoder.layers[0].mlp = MoELayer()
    state = shardsync.from_megatron(model)
    assert list(state) == [
        "decoder.layers.2.mlp.router.weight",
        "decoder.layers.2.mlp.experts.local_experts.2.linear_fc2.weight",
        "decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight",
    ]
    e3 = state["decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight"]
    assert isinstance(e3, LocalShard) and bool((e3.local == 1.0).all())  # local expert 1


def test_experts_are_placed_by_their_own_tp_group() -> None:
    class Group:  # an expert TP group of 2 where this process is rank 1 (dense TP: one process)
        pass

    import shardsync.sources.megatron as megatron

    layer = MoELayer(tp_group=Group())
    real_rank, real_size = megatron.group_rank, megatron.group_size
    try:
        megatron.group_rank = lambda g=None: 1 if isinstance(g, Group) else real_rank(g)  # type: ignore[assignment]
        megatron.group_size = lambda g=None: 2 if isinstance(g, Group) else real_size(g)  # type: ignore[assignment]
        state = shardsync.from_megatron(layer)
    finally:
        megatron.group_rank, megatron.group_size = real_rank, real_size  # type: ignore[assignment]
    expert = state["experts.local_experts.2.linear_fc2.weight"]
    assert isinstance(expert, LocalShard) and expert.box == Box((0, 4), (2, 4)) and expert.global_shape == (2, 8)


def test_the_last_stage_copy_of_tied_embeddings_is_left_out() -> None:
    last = torch.nn.Module()  # GPTModel's attributes on the last pipeline stage of a tied model
    last.share_embeddings_and_output_weights, last.pre_process = True, False
    last.output_layer = torch.nn.Linear(3, 5, bias=False)
    last.final_norm = torch.nn.Parameter(torch.ones(3))
    assert list(shardsync.from_megatron(last)) == ["final_norm"]
    last.share_embeddings_and_output_weights = False  # untied: the output layer is a weight of its own
    assert list(shardsync.from_megatron(last)) == ["final_norm", "output_layer.weight"]


# -- a bare Megatron module where a placed state is needed -------------------------------------------


def marked() -> torch.nn.Module:
    lin = torch.nn.Linear(3, 4, bias=False)
    lin.weight.tensor_model_parallel, lin.weight.partition_dim = True, 0  # type: ignore[attr-defined]
    return lin


def test_a_bare_megatron_module_as_destination_or_source_says_to_use_from_megatron() -> None:
    hint = (
        "is a Megatron module (tensor-parallel marks on its parameters, e.g. 'weight'): its state dict "
        "holds this rank's shards with local shapes, layer and expert numbers; pass "
        "shardsync.from_megatron(model) instead"
    )
    with pytest.raises(LayoutError, match=re.escape("the destination " + hint)):
        shardsync.load(marked(), {"weight": torch.zeros(4, 3)})
    with pytest.raises(LayoutError, match=re.escape("the source " + hint)):
        shardsync.reshard(marked(), {"weight": torch.zeros(4, 3)})
    out = {"weight": torch.zeros(4, 3)}
    shardsync.load(shardsync.from_megatron(marked()), out)  # placed: fine (a TP group of one)


def test_save_of_a_module_says_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(LayoutError, match=r"the state is a Megatron module .* pass shardsync.from_megatron"):
        shardsync.save(marked(), tmp_path)  # type: ignore[arg-type]
    with pytest.raises(
        LayoutError,
        match=r"save takes a state dict, not a torch.nn.Module: pass "
        r"model.state_dict\(\)",
    ):
        shardsync.save(torch.nn.Linear(2, 2), tmp_path)  # type: ignore[arg-type]
    assert not any(tmp_path.iterdir())
