"""DcpSource: torch DCP checkpoints, from a tensor-parallel Llama to Hugging Face safetensors.

A tiny ``LlamaForCausalLM`` is tensor-parallelised on 2 gloo ranks (``parallelize_module``) and saved
with ``torch.distributed.checkpoint.save``; shardsync exports it (API on 2 ranks, CLI in one process)
and ``from_pretrained`` on the export gives the reference logits bit for bit. The same checkpoint read
by 1, 2 and 4 processes gives the same targets, each rank reading only its share of the bytes.
"""

from __future__ import annotations

import logging
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import shardsync
from multiproc import run_ranks
from reference import arange_tensor
from shardsync.cli import main
from shardsync.errors import FormatError
from shardsync.layout.box import Box
from shardsync.layout.dtypes import itemsize
from shardsync.sources import DcpSource, SafetensorsSource, assign_boxes

# dcp.save(no_dist=True) warns that it runs in one process, which is what these tests want
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TOKENS = torch.tensor([[3, 17, 5, 66, 0, 12, 9, 41, 28, 7, 60]])


# -- one process ---------------------------------------------------------------------------------


def test_layout_reads_and_non_tensor_entries(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = {
        "w": arange_tensor((17, 3)),
        "h": arange_tensor((127,), torch.bfloat16, step=0.37),
        "ids": torch.arange(7, dtype=torch.int64) * 3,
        "step": 1000,
        "blob": b"abc",
        "extra": {"lr": 0.5},
    }
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    with caplog.at_level(logging.DEBUG, logger="shardsync.sources.dcp"):
        src = DcpSource(tmp_path)
    assert [(e.key, e.shape, e.dtype) for e in src.entries()] == [
        ("h", (127,), "bfloat16"),
        ("ids", (7,), "int64"),
        ("w", (17, 3), "float32"),
    ]
    assert sorted(r.getMessage().split(": ")[1] for r in caplog.records if r.name == "shardsync.sources.dcp") == [
        "skipping non-tensor entry 'blob' (BytesStorageMetadata)",
        "skipping non-tensor entry 'extra.lr' (BytesStorageMetadata)",
        "skipping non-tensor entry 'step' (BytesStorageMetadata)",
    ]
    assert torch.equal(src.read("w", Box((5, 1), (9, 2))), state["w"][5:14, 1:3])
    assert torch.equal(src.read("h", Box((0,), (127,))), state["h"])
    stream = shardsync.full_params(tmp_path, ["w^T -> wt", "ids -> ids"])
    got = dict(stream)
    assert sorted(got) == ["h", "ids", "wt"]  # keys no statement names pass through
    assert torch.equal(got["wt"], state["w"].T) and torch.equal(got["ids"], state["ids"])
    assert torch.equal(got["h"], state["h"]) and stream.stats.bytes_read == 17 * 3 * 4 + 7 * 8 + 127 * 2


def test_prefix_selects_one_nested_state(tmp_path: Path) -> None:
    w = arange_tensor((5, 3))
    dcp.save(
        {"model": {"w": w, "norm": torch.ones(3)}, "optim": {"w.exp_avg": torch.zeros(5, 3)}},
        checkpoint_id=tmp_path,
        no_dist=True,
    )
    assert [e.key for e in DcpSource(tmp_path).entries()] == ["model.norm", "model.w", "optim.w.exp_avg"]
    src = DcpSource(tmp_path, prefix="model.")
    assert [e.key for e in src.entries()] == ["norm", "w"]
    assert torch.equal(dict(shardsync.full_params(src))["w"], w)
    with pytest.raises(FormatError, match=f"^{tmp_path}: no tensor under prefix 'mdl.' in this DCP checkpoint$"):
        DcpSource(tmp_path, prefix="mdl.")


def test_metadata_errors(tmp_path: Path) -> None:
    meta = tmp_path / ".metadata"
    with pytest.raises(
        FormatError,
        match=f"^{tmp_path} is not a torch DCP checkpoint: it has no "
        r"\.metadata file$",
    ):
        DcpSource(tmp_path)
    meta.write_bytes(b"\x00garbage")
    cannot = rf"^{meta}: cannot read DCP metadata \(not written by torch.distributed.checkpoint.save\?\): "
    with pytest.raises(FormatError, match=cannot + "UnpicklingError"):
        shardsync.explain(tmp_path)
    meta.write_bytes(pickle.dumps({"w": 1}))
    with pytest.raises(FormatError, match=f"^{meta}: holds a dict, not DCP Metadata$"):
        DcpSource(tmp_path)
    meta.write_bytes(pickle.dumps(SimpleNamespace(w=1)))  # a class DCP metadata is not made of
    with pytest.raises(
        FormatError,
        match=f"^{meta}: names types.SimpleNamespace, which DCP metadata is not made of; refusing to load it",
    ):
        DcpSource(tmp_path)


# -- a tensor-parallel Llama ------------------------------------------------------------------------


def _llama(path: Path) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=67,
        hidden_size=32,
        intermediate_size=47,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def save_tp_and_export(rank: int, world: int, root: str) -> tuple[int, int]:
    """TP-shard the reference model on ``world`` ranks, save it with DCP, then export the checkpoint
    with shardsync: every rank reads its share, rank 0 writes HF safetensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig.from_pretrained(f"{root}/ref"))
    model.load_state_dict(load_file(f"{root}/ref/model.safetensors"))
    plan: dict[str, Any] = {}
    for i in range(model.config.num_hidden_layers):
        p = f"model.layers.{i}"
        plan |= {f"{p}.self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
        plan |= {f"{p}.mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")}
        plan |= {f"{p}.self_attn.o_proj": RowwiseParallel(), f"{p}.mlp.down_proj": RowwiseParallel()}
    parallelize_module(model, init_device_mesh("cpu", (world,)), plan)
    dcp.save(model.state_dict(), checkpoint_id=f"{root}/dcp")
    stream = shardsync.full_params(f"{root}/dcp", consumers=0)
    if rank == 0:
        shardsync.save_safetensors(stream, f"{root}/hf")
    else:
        for _ in stream:  # this rank only reads its share and sends it
            pass
    return stream.stats.bytes_read, stream.stats.bytes_sent


def read_everywhere(rank: int, world: int, root: str) -> dict[str, tuple[int, list[str], int]]:
    """Stream the DCP checkpoint and its safetensors export on every rank; compare with the reference."""
    ref = load_file(f"{root}/ref/model.safetensors")
    out = {}
    for ckpt in ("dcp", "hf"):
        stream = shardsync.full_params(f"{root}/{ckpt}")
        names = []
        bad = []
        for name, tensor in stream:
            names.append(name)
            if not torch.equal(tensor, ref[name]):
                bad.append(name)
        out[ckpt] = (len(names) if sorted(names) == sorted(ref) else -1, bad, stream.stats.bytes_read)
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("llama")
    model = _llama(root / "ref")
    per_rank = run_ranks(save_tp_and_export, 2, str(root), timeout=300)
    ref = load_file(root / "ref/model.safetensors")
    return {"root": root, "model": model, "export": per_rank, "ref": ref}


def _shares(source: Any, world: int) -> list[int]:
    entries = source.entries()
    out = [0] * world
    for e, r in zip(entries, assign_boxes(entries, world)):
        out[r] += e.box.numel * itemsize(e.dtype)
    return out


def test_tp_checkpoint_exports_to_hf_with_identical_logits(llama: dict[str, Any]) -> None:
    from transformers import LlamaForCausalLM

    root = llama["root"]
    src = DcpSource(root / "dcp")
    q_boxes = [e.box for e in src.entries() if e.key == "model.layers.0.self_attn.q_proj.weight"]
    down = [e.box for e in src.entries() if e.key == "model.layers.1.mlp.down_proj.weight"]
    assert q_boxes == [Box((0, 0), (16, 32)), Box((16, 0), (16, 32))]  # saved as TP shards
    assert down == [Box((0, 0), (32, 24)), Box((0, 24), (32, 23))]  # 47 columns: uneven
    total = sum(t.numel() * t.element_size() for t in llama["ref"].values())
    (read0, sent0), (read1, sent1) = llama["export"]
    assert [read0, read1] == _shares(src, 2) and read0 + read1 == total and min(read0, read1) > 0
    assert (sent0, sent1) == (0, read1)  # rank 1 sends what it read to the writer, nothing more
    reference = _logits(llama["model"])
    shutil.copy(root / "ref/config.json", root / "hf/config.json")
    exported = LlamaForCausalLM.from_pretrained(root / "hf").eval()
    assert torch.equal(_logits(exported), reference)
    # the command line, in one process
    assert main(["export", str(root / "dcp"), str(root / "hf_cli"), "-q", "--memory-budget", "12KiB"]) == 0
    shutil.copy(root / "ref/config.json", root / "hf_cli/config.json")
    assert torch.equal(_logits(LlamaForCausalLM.from_pretrained(root / "hf_cli").eval()), reference)


def test_one_two_and_four_readers_get_the_same_targets(llama: dict[str, Any]) -> None:
    root, ref = llama["root"], llama["ref"]
    total = sum(t.numel() * t.element_size() for t in ref.values())
    stream = shardsync.full_params(root / "dcp")
    got = dict(stream)
    assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    assert stream.stats.bytes_read == total
    per_rank = run_ranks(read_everywhere, 4, str(root), timeout=300)
    for ckpt, source in (("dcp", DcpSource(root / "dcp")), ("hf", SafetensorsSource(root / "hf"))):
        assert [r[ckpt][:2] for r in per_rank] == [(len(ref), [])] * 4, ckpt
        reads = [r[ckpt][2] for r in per_rank]
        assert reads == _shares(source, 4) and sum(reads) == total and min(reads) > 0, (ckpt, reads)
