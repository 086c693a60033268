"""HF safetensors -> shardsync.load into a transformers Llama tensor-parallelised by torch's
``parallelize_module`` (TP=2, DTensor parameters, uneven vocab): parameters equal the reference
model's exactly, written in place, each rank reading only its shards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardsync
from dest_helpers import LAYERS, SliceSource, hf_state
from llama_helpers import llama_config, llama_tp_plan
from multiproc import run_ranks

transformers = pytest.importorskip("transformers")


def _worker(rank: int, world: int, path: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(rank)
    model = transformers.LlamaForCausalLM(llama_config())
    parallelize_module(model, init_device_mesh("cpu", (world,)), llama_tp_plan())
    params = dict(model.named_parameters())
    before = {k: (p.to_local() if isinstance(p, DTensor) else p).data_ptr() for k, p in params.items()}
    source = SliceSource(path)
    result = shardsync.load(model, source)
    local = {k: (p.to_local() if isinstance(p, DTensor) else p) for k, p in params.items()}
    ref = transformers.LlamaForCausalLM(llama_config())
    ref.load_state_dict(shardsync.read_tensors(path))
    full = {k: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for k, p in params.items()}
    return {
        "bad": [k for k, p in ref.named_parameters() if not torch.equal(full[k], p.detach())],
        "in place": all(local[k].data_ptr() == before[k] for k in params),
        "dtensors": sum(isinstance(p, DTensor) for p in params.values()),
        "read": source.bytes_read,
        "mine": sum(t.numel() * 4 for t in local.values()),
        "received": result.stats.bytes_received,
        "names": sorted(params),
    }


def test_hf_checkpoint_into_parallelize_module_tp2_llama(tmp_path: Path) -> None:
    hf = hf_state()
    shardsync.save_safetensors(hf.items(), tmp_path)
    records = run_ranks(_worker, 2, str(tmp_path), timeout=300)
    for rank, r in enumerate(records):
        assert r["names"] == sorted(hf), rank
        assert r["bad"] == [], (rank, r["bad"])
        assert r["in place"] and r["dtensors"] == 2 + 7 * LAYERS
        assert r["read"] == r["mine"] and r["received"] == 0
    assert records[0]["mine"] > records[1]["mine"]  # the vocab (17) splits 9 / 8
