"""Real megatron-core MoE GPTModels (SequentialMLP) on gloo ranks, through from_megatron and the
shipped MoE mappings: Mixtral at EP=2 (4 ranks, so expert data parallel 2), Qwen2-MoE with a gated
shared expert at TP=2 x EP=2 (4 ranks), its first layer a dense MLP. Exported files equal a
conversion written out by hand, bit for bit, and transformers' ``from_pretrained`` of them computes
the logits of the megatron forward
(to 1e-5); the export loaded back (``load``, reversed mapping) into a fresh EP-sharded model with a
padded vocabulary gives every parameter exactly, the padding rows left as they were."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsync
from moe_helpers import (
    MIXTRAL,
    QWEN2_MOE,
    TOKENS,
    MoeSpec,
    build_moe_gpt,
    fill,
    gathered,
    hf_by_hand,
    hf_config,
    init_parallel,
    megatron_logits,
)
from multiproc import run_ranks
from shardsync.errors import LayoutError

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

#: What a padding row of the fresh destination holds, before and after the load.
UNTOUCHED = -7.0


def _compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    return {
        "missing": sorted(set(want) - set(got)),
        "extra": sorted(set(got) - set(want)),
        "different": sorted(
            k for k in want if k in got and not (got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]))
        ),
    }


def _export(rank: int, spec: MoeSpec, model: torch.nn.Module, out: Path) -> dict[str, Any]:
    """save_hf through the shipped mapping; rank 0 checks the files and runs transformers."""
    mapping = shardsync.Mapping.parse(spec.mapping, config=model.config, params={"vocab_size": spec.vocab})
    want = hf_by_hand(gathered(model), spec, tp=model.config.tensor_model_parallel_size)
    shardsync.save_hf(shardsync.from_megatron(model), out, mapping)
    reference = megatron_logits(model, spec)  # every rank runs the forward
    if rank != 0:
        return {}
    hf_config(spec).save_pretrained(out)
    files = _compare(shardsync.read_tensors(out), want)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = hf_model(TOKENS).logits
    return {"files": files, "logits": (logits - reference).abs().max().item()}


def _load_back(spec: MoeSpec, model: torch.nn.Module, out: Path) -> dict[str, Any]:
    """The export loaded into a fresh model of the same layout, every parameter UNTOUCHED before."""
    from megatron.core import parallel_state as ps

    fresh = build_moe_gpt(spec)
    fill(fresh, UNTOUCHED)
    mapping = shardsync.Mapping.parse(
        spec.mapping, config=fresh.config, params={"vocab_size": spec.vocab}, reverse=True
    )
    try:
        shardsync.load(fresh, out, mapping)
        bare = ""
    except LayoutError as exc:  # a bare Megatron module: its state dict is local shards
        bare = str(exc)
    result = shardsync.load(shardsync.from_megatron(fresh), out, mapping)
    tp = fresh.config.tensor_model_parallel_size
    vocab_rows = spec.padded_vocab // tp  # this rank's rows of the padded vocabulary
    real = max(0, min(vocab_rows, spec.vocab - vocab_rows * ps.get_tensor_model_parallel_rank()))
    bad, padding = [], []
    want = dict(model.named_parameters())
    for name, p in fresh.named_parameters():
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if not torch.equal(p[:real], want[name][:real]):
                bad.append(name)
            padding.append(bool((p[real:] == UNTOUCHED).all()))
        elif not torch.equal(p, want[name]):
            bad.append(name)
    return {"bad": bad, "padding": padding, "bare": bare, "report": (result.missing, result.unexpected)}


def _worker(rank: int, world: int, spec: MoeSpec, tp: int, ep: int, out: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    init_parallel(tp=tp, ep=ep)
    model = build_moe_gpt(spec)
    return {"export": _export(rank, spec, model, Path(out)), "load": _load_back(spec, model, Path(out))}


def _check(records: list[dict[str, Any]]) -> None:
    files = records[0]["export"]["files"]
    assert files == {"missing": [], "extra": [], "different": []}, files
    assert records[0]["export"]["logits"] < 1e-5, records[0]["export"]["logits"]
    for rank, r in enumerate(records):
        assert r["load"]["bad"] == [], (rank, r["load"]["bad"])
        assert all(r["load"]["padding"]), rank
        assert r["load"]["report"] == ((), ()), rank
        assert "the destination is a Megatron module" in r["load"]["bare"], rank
        assert "pass shardsync.from_megatron(model) instead" in r["load"]["bare"], rank


def test_mixtral_at_ep2_with_expert_data_parallel_replicas(tmp_path: Path) -> None:
    # 4 ranks at EP=2: each expert is held by the 2 ranks of its expert data-parallel group
    _check(run_ranks(_worker, 4, MIXTRAL, 1, 2, str(tmp_path), timeout=900))


def test_qwen2_moe_with_shared_expert_at_tp2_ep2(tmp_path: Path) -> None:
    # QWEN2_MOE's first layer is dense (Megatron moe_layer_freq=[0, 1, 1], HF mlp_only_layers=[0]):
    # the shipped mapping's optional dense lines take it, its MoE lines the others
    _check(run_ranks(_worker, 4, QWEN2_MOE, 2, 2, str(tmp_path), timeout=900))
