"""The small transformers Llama of the DTensor tests and its tensor-parallel plan (imported by
spawned ranks too): the sizes of :mod:`dest_helpers` (vocab 17, ffn 20: uneven splits)."""

from __future__ import annotations

from typing import Any

from dest_helpers import FFN, HIDDEN, LAYERS, VOCAB, G, H

__all__ = ["llama_config", "llama_tp_plan"]


def llama_config() -> Any:
    """The Llama config of :mod:`dest_helpers`' sizes, untied embeddings."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=H,
        num_key_value_heads=G,
        tie_word_embeddings=False,
    )


def llama_tp_plan(layers: int = LAYERS) -> dict[str, Any]:
    """``parallelize_module``'s plan for a transformers Llama: embedding row-wise (replicated input),
    q/k/v, gate and up column-wise, o and down row-wise, ``lm_head`` column-wise."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(),
    }
    for i in range(layers):
        p = f"model.layers.{i}"
        plan |= {f"{p}.self_attn.{x}_proj": ColwiseParallel() for x in "qkv"}
        plan |= {f"{p}.mlp.{x}_proj": ColwiseParallel() for x in ("gate", "up")}
        plan |= {f"{p}.self_attn.o_proj": RowwiseParallel(), f"{p}.mlp.down_proj": RowwiseParallel()}
    return plan
