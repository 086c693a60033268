"""from_megatron: Megatron/Paddle tensor-parallel attributes become shards; a real megatron-core GPTModel
(TP=2, then PP=2, untied and tied, on 2 gloo ranks) exports through the shipped mapping to HF names,
bit-exact."""

from __future__ import annotations

import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import shardsync
from multiproc import run_ranks
from reference import arange_tensor
from shardsync.errors import LayoutError
from shardsync.layout import Box, LocalShard
from shardsync.sources.megatron import from_megatron, partition_of, tp_shards

DOC = Path(__file__).parent.parent / "docs" / "megatron.md"
LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB = 2, 64, 4, 2, 96, 128


def mark(t: torch.Tensor, dim: int, stride: int = 1) -> torch.Tensor:
    """Set Megatron's attributes, as set_tensor_model_parallel_attributes does."""
    t.tensor_model_parallel = True  # type: ignore[attr-defined]
    t.partition_dim, t.partition_stride = dim, stride  # type: ignore[attr-defined]
    return t


# -- tp_shards and partition_of ---------------------------------------------------------------------


def test_tp_shards_place_stride_blocks_like_megatron_splits_them() -> None:
    full = arange_tensor((18, 5))
    for stride in (1, 2, 3):
        chunks = full.chunk(3 * stride, 0)  # Megatron: rank r holds chunks r, r + tp, r + 2 tp...
        for rank in range(3):
            local = torch.cat(chunks[rank::3])
            shards = tp_shards(local, 0, rank, 3, stride)
            assert len(shards) == stride
            for s in shards:
                assert s.global_shape == (18, 5) and s.local.untyped_storage().data_ptr() == local.data_ptr()
                assert torch.equal(s.local, full[s.box.slices()])


def test_tp_shards_along_a_later_dim_and_bad_input() -> None:
    w = arange_tensor((3, 7))
    (s,) = tp_shards(w, -1, 1, 2)
    assert s.box == Box((0, 7), (3, 7)) and s.global_shape == (3, 14)
    with pytest.raises(LayoutError, match=r"'w': partition dim 2 is outside a tensor of shape \[3, 7\]"):
        tp_shards(w, 2, 0, 2, key="w")
    with pytest.raises(
        LayoutError,
        match="'w': partition_stride 2 must be a positive integer that divides the local size 7 along dim 1",
    ):
        tp_shards(w, 1, 0, 2, 2, key="w")
    with pytest.raises(LayoutError, match="partition_stride 0"):
        tp_shards(w, 0, 0, 2, 0)


def test_partition_of_reads_megatron_and_paddle_marks() -> None:
    assert partition_of("w", mark(torch.zeros(2, 2), 1, 2)) == (1, 2)
    paddle = torch.zeros(2, 2)
    paddle.is_distributed, paddle.split_axis = True, 0  # type: ignore[attr-defined]
    assert partition_of("p", paddle) == (0, 1)
    assert partition_of("plain", torch.zeros(2)) is None  # torch's is_distributed() method is no mark
    off = torch.zeros(2)
    off.tensor_model_parallel, off.partition_dim = False, -1  # type: ignore[attr-defined]
    assert partition_of("off", off) is None  # Megatron's defaults for a replica
    broken = torch.zeros(2, 2)
    broken.is_distributed = True  # type: ignore[attr-defined]
    with pytest.raises(LayoutError, match="'b' is marked tensor-parallel but its split_axis is None"):
        partition_of("b", broken)


# -- from_megatron on hand-built modules (one process: the TP group is this rank alone) -----------


class Extra(torch.nn.Module):
    """A layer with Megatron's _extra_state, a buffer and a replicated norm."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.Parameter(arange_tensor((3,)))
        self.register_buffer("table", arange_tensor((2, 3)))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def get_extra_state(self) -> Any:
        return {"fp8": None}

    def set_extra_state(self, state: Any) -> None:
        pass


def test_from_megatron_one_process_keeps_keys_views_and_skips_extra_state() -> None:
    model = torch.nn.Module()
    model.attn = Extra()
    model.proj = torch.nn.Linear(4, 6)
    mark(model.proj.weight, 1)
    model.proj.bias.is_distributed, model.proj.bias.split_axis = True, 0  # Paddle-style mark
    state = from_megatron(model)
    assert list(state) == ["attn.norm", "attn.table", "proj.weight", "proj.bias"]
    assert isinstance(state["proj.weight"], LocalShard) and state["proj.weight"].global_shape == (6, 4)
    assert state["proj.weight"].local.data_ptr() == model.proj.weight.data_ptr()
    assert isinstance(state["attn.norm"], torch.Tensor) and not state["attn.norm"].requires_grad
    got = dict(shardsync.full_params(state))
    assert torch.equal(got["attn.table"], arange_tensor((2, 3)))
    assert torch.equal(got["proj.weight"], model.proj.weight.detach())


class Config:
    gated_linear_unit = True


class GatedMLP(torch.nn.Module):
    """Megatron's MLP shape: config.gated_linear_unit and a column-parallel linear_fc1."""

    def __init__(self, stride: int) -> None:
        super().__init__()
        self.config = Config()
        self.linear_fc1 = torch.nn.Linear(3, 8, bias=False)
        mark(self.linear_fc1.weight, 0, stride)


def test_gated_fc1_reads_as_gate_then_up_whatever_its_stride_attribute() -> None:
    for stride in (1, 2):  # megatron-core before / after it marked fc1 with partition_stride=2
        mlp = GatedMLP(stride)
        (first, second) = from_megatron(mlp)["linear_fc1.weight"]  # type: ignore[misc]
        assert (first.box, second.box) == (Box((0, 0), (4, 3)), Box((4, 0), (4, 3)))
    plain = torch.nn.Module()
    plain.linear_fc1 = torch.nn.Linear(3, 8, bias=False)  # not gated: stride 1 stays one shard
    mark(plain.linear_fc1.weight, 0)
    assert isinstance(from_megatron(plain)["linear_fc1.weight"], LocalShard)


class Layer(torch.nn.Module):
    def __init__(self, number: int) -> None:
        super().__init__()
        self.layer_number = number  # Megatron: global and 1-based
        self.w = torch.nn.Parameter(torch.full((2,), float(number)))


def stage(first: int, count: int) -> torch.nn.Module:
    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList(Layer(first + i) for i in range(count))
    return model


def test_pipeline_stages_and_virtual_chunks_get_global_layer_numbers() -> None:
    assert list(from_megatron(stage(1, 2))) == ["decoder.layers.0.w", "decoder.layers.1.w"]
    state = from_megatron([stage(3, 2), stage(7, 1)])  # chunks of a virtual pipeline
    assert list(state) == ["decoder.layers.2.w", "decoder.layers.3.w", "decoder.layers.6.w"]
    assert state["decoder.layers.6.w"].tolist() == [7.0, 7.0]  # type: ignore[union-attr]
    with pytest.raises(LayoutError, match=r"model chunks hold the same keys \['decoder.layers.0.w'\]"):
        from_megatron([stage(1, 1), stage(1, 1)])


# -- a real megatron-core GPTModel on 2 gloo ranks ----------------------------------------------------


def init_parallel(tp: int, pp: int) -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def build_gpt(tied: bool = False) -> torch.nn.Module:
    """A tiny Llama-style GPTModel (RMSNorm, SwiGLU, GQA, RoPE, untied output) for the initialised
    TP x PP, with every tensor set to seeded random values: rank-dependent for TP shards, equal on all
    ranks for replicas."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        ffn_hidden_size=FFN,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        normalization="RMSNorm",
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=32,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=tied,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            parallel = getattr(p, "tensor_model_parallel", False)
            seed = zlib.crc32(name.encode()) + (1000 * dist.get_rank() if parallel else 0)
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    return model


def gathered_by_hand(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as torch.cat of its TP shards along partition_dim (TP=2)."""
    import torch.distributed as dist

    mg = {}
    for name, p in model.named_parameters():
        local = p.detach().contiguous()
        if getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(local) for _ in range(2)]
            dist.all_gather(parts, local)
            local = torch.cat(parts, p.partition_dim)
        mg[name] = local
    return mg


def hf_by_hand(mg: dict[str, torch.Tensor], tp: int) -> dict[str, torch.Tensor]:
    """Megatron -> HF, written out plainly. ``mg`` holds every tensor as torch.cat of its TP shards
    along the partition dim: linear_qkv is [q heads | k | v] per query group; linear_fc1 is
    [gate_r; up_r] for each TP rank r."""
    d, per = HIDDEN // HEADS, HEADS // GROUPS
    hf = {
        "model.embed_tokens.weight": mg["embedding.word_embeddings.weight"],
        "model.norm.weight": mg["decoder.final_layernorm.weight"],
        "lm_head.weight": mg["output_layer.weight"],
    }
    for i in range(LAYERS):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        groups = mg[m + "self_attention.linear_qkv.weight"].reshape(GROUPS, (per + 2) * d, HIDDEN)
        fc1 = mg[m + "mlp.linear_fc1.weight"].reshape(tp, 2, FFN // tp, HIDDEN)
        hf |= {
            h + "input_layernorm.weight": mg[m + "input_layernorm.weight"],
            h + "post_attention_layernorm.weight": mg[m + "pre_mlp_layernorm.weight"],
            h + "self_attn.q_proj.weight": groups[:, : per * d].reshape(HEADS * d, HIDDEN),
            h + "self_attn.k_proj.weight": groups[:, per * d : (per + 1) * d].reshape(GROUPS * d, HIDDEN),
            h + "self_attn.v_proj.weight": groups[:, (per + 1) * d :].reshape(GROUPS * d, HIDDEN),
            h + "self_attn.o_proj.weight": mg[m + "self_attention.linear_proj.weight"],
            h + "mlp.gate_proj.weight": fc1[:, 0].reshape(FFN, HIDDEN),
            h + "mlp.up_proj.weight": fc1[:, 1].reshape(FFN, HIDDEN),
            h + "mlp.down_proj.weight": mg[m + "mlp.linear_fc2.weight"],
        }
    return hf


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {
        "missing": sorted(set(want) - set(got)),
        "extra": sorted(set(got) - set(want)),
        "different": sorted(
            k for k in want if k in got and not (got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]))
        ),
    }


def tp_case(mapping: shardsync.Mapping) -> dict[str, Any]:
    init_parallel(tp=2, pp=1)
    model = build_gpt()
    want = hf_by_hand(gathered_by_hand(model), tp=2)
    report = compare(dict(shardsync.full_params(from_megatron(model), mapping)), want)
    plain = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    try:  # per-rank shards passed as they are: taken for replicas, and caught
        dict(shardsync.full_params(plain, mapping))
        report["plain"] = None
    except LayoutError as exc:
        report["plain"] = str(exc)
    return report


def pp_case(mapping: shardsync.Mapping) -> dict[str, Any]:
    import torch.distributed as dist

    init_parallel(tp=1, pp=2)
    model = build_gpt()
    stages: list[Any] = [None, None]
    dist.all_gather_object(stages, {k: v.detach() for k, v in model.named_parameters()})
    mg = {}
    for rank, params in enumerate(stages):  # one layer per stage, numbered from 0 on each stage
        mg |= {k.replace("decoder.layers.0.", f"decoder.layers.{rank}."): v for k, v in params.items()}
    return compare(dict(shardsync.full_params(from_megatron(model), mapping)), hf_by_hand(mg, tp=1))


def tied_pp_case(mapping: shardsync.Mapping) -> dict[str, Any]:
    """Tied embeddings at PP=2: the last stage's output_layer.weight (a copy of the embeddings it
    keeps for the logits) is left out, so the export has no lm_head.weight of its own."""
    import torch.distributed as dist

    init_parallel(tp=1, pp=2)
    cuda = torch.Tensor.cuda  # megatron moves the copy to CUDA to sync it with the embeddings: a CPU shim
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    try:
        model = build_gpt(tied=True)
    finally:
        torch.Tensor.cuda = cuda  # type: ignore[method-assign]
    stages: list[Any] = [None, None]
    dist.all_gather_object(stages, {k: v.detach() for k, v in model.named_parameters()})
    mg = {}
    for rank, params in enumerate(stages):
        mg |= {k.replace("decoder.layers.0.", f"decoder.layers.{rank}."): v for k, v in params.items()}
    want = hf_by_hand(mg | {"output_layer.weight": mg["embedding.word_embeddings.weight"]}, tp=1)
    del want["lm_head.weight"]
    return {
        "held": "output_layer.weight" in mg,
        **compare(dict(shardsync.full_params(from_megatron(model), mapping)), want),
    }


def doc_block(marker: str) -> str:
    """The first python code block after ``marker`` in docs/megatron.md."""
    text = DOC.read_text()
    return text[text.index(marker) :].split("```python\n", 1)[1].split("```", 1)[0]


def doc_case(rank: int, out_dir: str) -> dict[str, Any] | None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    script = doc_block("<!-- executed by tests/test_megatron.py")
    join = 'dist.init_process_group("gloo")  # "nccl" on GPUs\n'
    assert join in script  # the harness has joined the group already
    namespace: dict[str, Any] = {
        "build_model": build_gpt,
        "out_dir": out_dir,
        "tokenizer": SimpleNamespace(vocab_size=VOCAB),
    }
    exec(script.replace(join, ""), namespace)
    want = hf_by_hand(gathered_by_hand(namespace["model"]), tp=2)
    if rank != 0:
        return None
    from safetensors.torch import load_file

    return compare(load_file(str(Path(out_dir) / "model.safetensors")), want)


def megatron_worker(rank: int, world: int, mapping: shardsync.Mapping, out_dir: str) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    return {
        "tp": tp_case(mapping),
        "pp": pp_case(mapping),
        "tied": tied_pp_case(mapping),
        "doc": doc_case(rank, out_dir),
    }


def test_megatron_core_gpt_exports_to_hf_bit_exact(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    mapping = shardsync.Mapping.parse(
        "megatron-llama", params={"num_heads": HEADS, "num_key_value_groups": GROUPS, "vocab_size": VOCAB}
    )
    results = run_ranks(megatron_worker, 2, mapping, str(tmp_path), timeout=400)
    for rank, res in enumerate(results):
        cases = ("tp", "pp", "tied", "doc") if rank == 0 else ("tp", "pp", "tied")
        assert res["tied"]["held"], rank  # the last stage does hold the copy
        for case in cases:
            assert res[case]["missing"] == res[case]["extra"] == res[case]["different"] == [], (rank, case)
        msg = res["tp"]["plain"]
        assert msg is not None, rank
        assert (
            "'decoder.layers.0.self_attention.linear_proj.weight': ranks [0] vs ranks [1] hold box "
            "[0:64, 0:32] with different values"
        ) in msg
        assert "this looks like a per-rank shard: wrap it in LocalShard, or use shardsync.from_megatron(model)" in msg
        assert "layernorm" not in msg  # replicas agree


def test_doc_example_of_a_module_of_your_own_runs(capsys: pytest.CaptureFixture[str]) -> None:
    exec(doc_block("<!-- runs as is in tests/test_megatron.py"), {})
    text = DOC.read_text()
    printed = text[text.index("prints, in one process") :].split("```\n", 1)[1].split("```", 1)[0]
    assert capsys.readouterr().out == printed
