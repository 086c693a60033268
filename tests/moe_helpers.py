"""Test helpers: tiny megatron-core MoE GPTModels (SequentialMLP) on gloo ranks, the CPU shims their
forward needs, and the Megatron -> HF conversion of their weights written out by hand.

The shims patch megatron-core for a CPU-only machine (CUDA device queries, the CUDA RNG tracker,
Transformer Engine's GEMM); they belong to the tests, never to the package.
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "MoeSpec",
    "MIXTRAL",
    "QWEN2_MOE",
    "TOKENS",
    "init_parallel",
    "cpu_shims",
    "build_moe_gpt",
    "fill",
    "gathered",
    "hf_by_hand",
    "hf_config",
    "megatron_logits",
]


@dataclass(frozen=True)
class MoeSpec:
    """A tiny MoE model: 2 layers, 4 experts, top-2 routing; ``shared`` adds a gated shared expert and
    q/k/v biases (Qwen2-MoE); ``dense_layers`` are plain MLPs of ``shared_ffn`` (Megatron's
    ``moe_layer_freq`` 0 there, HF Qwen2-MoE's ``mlp_only_layers``)."""

    shared: bool
    layers: int = 2
    hidden: int = 32
    heads: int = 4
    groups: int = 2
    ffn: int = 24  # per expert
    shared_ffn: int = 40
    experts: int = 4
    top_k: int = 2
    vocab: int = 100  # the tokenizer's; the GPTModel pads it
    padded_vocab: int = 128
    dense_layers: tuple[int, ...] = ()

    @property
    def mapping(self) -> str:
        return "megatron-qwen2-moe" if self.shared else "megatron-mixtral"


MIXTRAL = MoeSpec(shared=False)
QWEN2_MOE = MoeSpec(shared=True, layers=3, dense_layers=(0,))  # a dense first layer, as DeepSeek's
#: The prompt of the logits comparisons.
TOKENS = torch.tensor([[3, 17, 42, 99, 0, 64, 7, 23, 88, 5, 51]])


def init_parallel(tp: int, ep: int, pp: int = 1) -> None:
    """Megatron's parallel state for TP x EP (x PP) over the joined gloo group."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
    )


def cpu_shims() -> None:
    """What a megatron-core forward needs on CPU (see the module docstring)."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.moe import moe_utils

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda *a, **k: contextlib.nullcontext()  # type: ignore[method-assign]
    if getattr(moe_utils, "te_general_gemm", None) is None:
        moe_utils.te_general_gemm = None


def build_moe_gpt(spec: MoeSpec) -> torch.nn.Module:
    """The GPTModel of ``spec`` for the initialised parallel state, every tensor seeded random:
    rank-dependent where the rank holds its own part (TP shards, its experts), equal elsewhere."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = ps.get_tensor_model_parallel_world_size()
    config = TransformerConfig(
        num_layers=spec.layers,
        hidden_size=spec.hidden,
        num_attention_heads=spec.heads,
        num_query_groups=spec.groups,
        ffn_hidden_size=spec.shared_ffn if spec.dense_layers else spec.ffn,
        moe_ffn_hidden_size=spec.ffn,
        moe_layer_freq=[int(i not in spec.dense_layers) for i in range(spec.layers)] if spec.dense_layers else 1,
        num_moe_experts=spec.experts,
        moe_router_topk=spec.top_k,
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        moe_shared_expert_intermediate_size=spec.shared_ffn if spec.shared else None,
        moe_shared_expert_gate=spec.shared,
        add_qkv_bias=spec.shared,
        moe_router_pre_softmax=spec.shared,  # Qwen2-MoE: softmax over all experts, no renormalising
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        sequence_parallel=False,
    )
    layer: Any = get_gpt_layer_local_spec(num_experts=spec.experts, moe_grouped_gemm=False, normalization="RMSNorm")
    if spec.dense_layers:  # one spec per layer, dense where moe_layer_freq says 0
        layer = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer,
        vocab_size=spec.padded_vocab,
        max_sequence_length=32,
        position_embedding_type="rope",
        rotary_base=10000,
        share_embeddings_and_output_weights=False,
        parallel_output=False,
    )
    _seed(model)
    return model


def fill(model: torch.nn.Module, value: float) -> None:
    """Every parameter set to ``value`` (a destination whose untouched rows are visible)."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def _seed(model: torch.nn.Module) -> None:
    from megatron.core import parallel_state as ps

    tp_rank, ep_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            own = 1000 * tp_rank if getattr(p, "tensor_model_parallel", False) else 0
            own += 100_000 * ep_rank if ".local_experts." in name else 0
            seed = zlib.crc32(name.encode()) + own
            p.copy_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))


def gathered(model: torch.nn.Module) -> dict[str, Any]:
    """Every parameter under its Megatron name, by plain torch collectives: TP shards concatenated
    along ``partition_dim`` (the expert ones over the expert TP group), local experts of every EP
    rank under ``ep_rank * per_rank + local``."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out = {}
    for name, p in model.named_parameters():
        expert = ".local_experts." in name
        local = p.detach().contiguous()
        if getattr(p, "tensor_model_parallel", False):
            group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, local, group=group)
            local = torch.cat(parts, p.partition_dim)
        if not expert:
            out[name] = local
            continue
        group = ps.get_expert_model_parallel_group()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local, group=group)
        head, tail = name.split(".local_experts.")
        i, rest = tail.split(".", 1)
        per = model.config.num_moe_experts // dist.get_world_size(group)
        for ep, part in enumerate(parts):
            out[f"{head}.local_experts.{ep * per + int(i)}.{rest}"] = part
    return out


def hf_by_hand(mg: dict[str, torch.Tensor], spec: MoeSpec, tp: int) -> dict[str, torch.Tensor]:
    """Megatron -> HF hub names (Mixtral or Qwen2-MoE), written out plainly from :func:`gathered`:
    linear_qkv is [q heads | k | v] per query group; every linear_fc1 is [gate_r; up_r] per TP rank
    r; the vocabulary is cut to the tokenizer's."""
    d, per = spec.hidden // spec.heads, spec.heads // spec.groups
    hf = {
        "model.embed_tokens.weight": mg["embedding.word_embeddings.weight"][: spec.vocab],
        "model.norm.weight": mg["decoder.final_layernorm.weight"],
        "lm_head.weight": mg["output_layer.weight"][: spec.vocab],
    }

    def gate_up(fc1: torch.Tensor, ffn: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = fc1.reshape(tp, 2, ffn // tp, spec.hidden)
        return blocks[:, 0].reshape(ffn, spec.hidden), blocks[:, 1].reshape(ffn, spec.hidden)

    for i in range(spec.layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        hf |= {
            h + "input_layernorm.weight": mg[m + "input_layernorm.weight"],
            h + "post_attention_layernorm.weight": mg[m + "pre_mlp_layernorm.weight"],
            h + "self_attn.o_proj.weight": mg[m + "self_attention.linear_proj.weight"],
        }
        for kind in ("weight", "bias") if spec.shared else ("weight",):
            qkv = mg[m + f"self_attention.linear_qkv.{kind}"]
            groups = qkv.reshape(spec.groups, (per + 2) * d, *qkv.shape[1:])
            hf |= {
                h + f"self_attn.q_proj.{kind}": groups[:, : per * d].reshape(spec.heads * d, *qkv.shape[1:]),
                h + f"self_attn.k_proj.{kind}": groups[:, per * d : (per + 1) * d].reshape(
                    spec.groups * d, *qkv.shape[1:]
                ),
                h + f"self_attn.v_proj.{kind}": groups[:, (per + 1) * d :].reshape(spec.groups * d, *qkv.shape[1:]),
            }
        moe = h + ("mlp." if spec.shared else "block_sparse_moe.")
        names = ("gate_proj", "up_proj", "down_proj") if spec.shared else ("w1", "w3", "w2")
        if i in spec.dense_layers:
            gate, up = gate_up(mg[m + "mlp.linear_fc1.weight"], spec.shared_ffn)
            hf |= {
                h + "mlp.gate_proj.weight": gate,
                h + "mlp.up_proj.weight": up,
                h + "mlp.down_proj.weight": mg[m + "mlp.linear_fc2.weight"],
            }
            continue
        hf[moe + "gate.weight"] = mg[m + "mlp.router.weight"]
        for e in range(spec.experts):
            x = f"{m}mlp.experts.local_experts.{e}."
            gate, up = gate_up(mg[x + "linear_fc1.weight"], spec.ffn)
            hf |= {
                f"{moe}experts.{e}.{names[0]}.weight": gate,
                f"{moe}experts.{e}.{names[1]}.weight": up,
                f"{moe}experts.{e}.{names[2]}.weight": mg[x + "linear_fc2.weight"],
            }
        if spec.shared:
            gate, up = gate_up(mg[m + "mlp.shared_experts.linear_fc1.weight"], spec.shared_ffn)
            hf |= {
                moe + "shared_expert.gate_proj.weight": gate,
                moe + "shared_expert.up_proj.weight": up,
                moe + "shared_expert.down_proj.weight": mg[m + "mlp.shared_experts.linear_fc2.weight"],
                moe + "shared_expert_gate.weight": mg[m + "mlp.shared_experts.gate_weight"],
            }
    return hf


def hf_config(spec: MoeSpec) -> Any:
    """The transformers config of the same model (eager attention, for exact logits)."""
    import transformers

    common = dict(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.groups,
        num_experts_per_tok=spec.top_k,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    if spec.shared:
        return transformers.Qwen2MoeConfig(
            **common,
            intermediate_size=spec.shared_ffn,
            moe_intermediate_size=spec.ffn,
            num_experts=spec.experts,
            shared_expert_intermediate_size=spec.shared_ffn,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            router_aux_loss_coef=0.0,
            mlp_only_layers=list(spec.dense_layers),
        )
    return transformers.MixtralConfig(
        **common,
        intermediate_size=spec.ffn,
        num_local_experts=spec.experts,
        router_jitter_noise=0.0,
        router_aux_loss_coef=0.0,
    )


def megatron_logits(model: torch.nn.Module, spec: MoeSpec) -> torch.Tensor:
    """The model's logits for :data:`TOKENS` (every rank runs the forward), real vocabulary only."""
    cpu_shims()
    n = TOKENS.shape[1]
    positions = torch.arange(n).unsqueeze(0)
    causal = torch.triu(torch.ones(1, 1, n, n), diagonal=1).bool()  # True: masked (Megatron's default is on CUDA)
    model.eval()
    with torch.no_grad():
        logits = model(TOKENS, positions, attention_mask=causal)
    return logits[..., : spec.vocab]
