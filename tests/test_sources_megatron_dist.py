"""Megatron dist_checkpointing (torch_dist) checkpoints read per layer under live names.

A checkpoint of that format is written here with torch DCP alone (stacked layers, stacked and per-expert
MoE tensors, optimizer state, a bytes entry), and by megatron-core itself: ``dist_checkpointing.save``
of a TP=2 GPTModel on 2 gloo ranks (with the arguments Megatron's training loop saves alongside),
converted by the CLI with the shipped ``megatron-llama-te`` mapping, its parameters taken from those
arguments, and compared with the model gathered by plain ``all_gather`` (test_megatron's reference).
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import shlex
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import shardsync
from multiproc import run_ranks
from reference import arange_tensor
from shardsync.cli import main
from shardsync.cli.common import MappingFlags
from shardsync.errors import FormatError, LayoutError
from shardsync.layout import Box, GlobalLayout
from shardsync.sources import MegatronDistSource, open_source
from shardsync.sources.megatron_config import Opaque

DOC = Path(__file__).parent.parent / "docs" / "megatron.md"

QKV = "decoder.layers.self_attention.linear_qkv.weight"
NORM = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
EXPERTS = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
ONE_EXPERT = "decoder.layers.2.mlp.experts.experts.1.linear_fc2.weight"


def stacked_state() -> dict[str, Any]:
    return {
        QKV: arange_tensor((3, 17, 5)),
        NORM: arange_tensor((3, 5), start=1000),
        EXPERTS: arange_tensor((3, 4, 6, 5), start=2000),
        ONE_EXPERT: arange_tensor((5, 3), start=3000),
        "embedding.word_embeddings.weight": arange_tensor((127, 5), start=4000),
        "optimizer.state.exp_avg." + QKV: torch.zeros(3, 17, 5),
        "decoder.layers.self_attention.linear_qkv._extra_state/shard_0_1": b"te state",
    }


def write_torch_dist(path: Path, state: dict[str, Any], backend: str = "torch_dist") -> Path:
    """What dist_checkpointing.save writes: a DCP directory, metadata.json and common.pt."""
    dcp.save(state, checkpoint_id=path, no_dist=True)
    (path / "metadata.json").write_text(
        json.dumps(
            {
                "sharded_backend": backend,
                "sharded_backend_version": 1,
                "common_backend": "torch",
                "common_backend_version": 1,
            }
        )
    )
    torch.save({"iteration": 7}, path / "common.pt")
    return path


def test_stacked_layers_and_experts_read_as_live_names(tmp_path: Path) -> None:
    src = open_source(write_torch_dist(tmp_path, stacked_state()))
    assert isinstance(src, MegatronDistSource)
    want = {
        "embedding.word_embeddings.weight": stacked_state()["embedding.word_embeddings.weight"],
        "decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight": stacked_state()[ONE_EXPERT],
    }
    for i in range(3):
        want[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = stacked_state()[QKV][i]
        want[f"decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight"] = stacked_state()[NORM][i]
        for e in range(4):
            want[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight"] = stacked_state()[EXPERTS][i, e]
    assert [e.key for e in src.entries()] == sorted(want)
    for e in src.entries():
        assert e.shape == tuple(want[e.key].shape) and e.box == Box.full(e.shape), e.key
        assert torch.equal(src.read(e.key, e.box), want[e.key]), e.key
    part = src.read("decoder.layers.1.self_attention.linear_qkv.weight", Box((3, 1), (11, 4)))
    assert torch.equal(part, stacked_state()[QKV][1, 3:14, 1:5])
    assert dict(shardsync.full_params(src)).keys() == want.keys()
    assert src.common() == {"iteration": 7}


def test_local_norm_names(tmp_path: Path) -> None:
    src = MegatronDistSource(write_torch_dist(tmp_path, {NORM: arange_tensor((2, 5))}), norms="local")
    assert [e.key for e in src.entries()] == [
        "decoder.layers.0.input_layernorm.weight",
        "decoder.layers.1.input_layernorm.weight",
    ]
    assert torch.equal(src.read("decoder.layers.1.input_layernorm.weight", Box((0,), (5,))), arange_tensor((2, 5))[1])
    with pytest.raises(LayoutError, match="norms='TE': use 'te'"):
        MegatronDistSource(tmp_path, norms="TE")  # type: ignore[arg-type]


class _Boom:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, ("touch pwned",))


def test_format_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FormatError, match="sharded_backend 'zarr'; only 'torch_dist'"):
        open_source(write_torch_dist(tmp_path / "zarr", {QKV: torch.zeros(2, 3)}, backend="zarr"))
    flat = write_torch_dist(tmp_path / "flat", {"decoder.layers.mlp.linear_fc1.layer_norm_weight": torch.zeros(3)})
    with pytest.raises(FormatError, match=r"is \[3\], but its name says 1 stacked dims"):
        MegatronDistSource(flat)
    torn = write_torch_dist(tmp_path / "torn", {QKV: torch.zeros(2, 3)})
    (torn / ".metadata").unlink()
    with pytest.raises(FormatError, match="no .metadata; the checkpoint is incomplete"):
        open_source(torn)
    evil = write_torch_dist(tmp_path / "evil", {QKV: torch.zeros(2, 3)})
    torch.save({"args": _Boom()}, evil / "common.pt")
    monkeypatch.chdir(tmp_path)
    boom = MegatronDistSource(evil).common()["args"]  # os.system is named, never imported nor called
    assert isinstance(boom, Opaque) and (boom.qualname, boom.args) == (f"{os.name}.system", ("touch pwned",))
    assert not (tmp_path / "pwned").exists()
    torch.save([1, 2], evil / "common.pt")
    with pytest.raises(FormatError, match=r"common.pt: holds a list, not the dict Megatron saves"):
        MegatronDistSource(evil).common()


# -- the settings common.pt keeps, read without running code from it --------------------------------


def saved_enum(monkeypatch: pytest.MonkeyPatch) -> enum.Enum:
    """An enum value as Megatron's saved args hold one (``AttnBackend.auto``), defined in a module of
    its own that the reader cannot import."""
    module = types.ModuleType("megatron_like_enums")
    backend = enum.Enum("AttnBackend", {"auto": 5}, module=module.__name__)  # type: ignore[misc]
    module.AttnBackend = backend  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return backend.auto  # type: ignore[attr-defined,no-any-return]


def test_saved_args_give_the_config_and_nothing_else_is_built(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = argparse.Namespace(
        num_attention_heads=8,
        group_query_attention=True,
        num_query_groups=2,
        vocab_size=100,
        attention_backend=saved_enum(monkeypatch),
        params_dtype=torch.bfloat16,
    )
    ckpt = write_torch_dist(tmp_path / "c", {QKV: torch.zeros(2, 3)})
    torch.save(
        {"args": args, "iteration": 7, "rng_state": [{"random": (3, (1, 2))}], "boom": _Boom()}, ckpt / "common.pt"
    )
    monkeypatch.delitem(sys.modules, "megatron_like_enums")
    monkeypatch.chdir(tmp_path)  # _Boom would touch 'pwned' here
    config = MegatronDistSource(ckpt).config()
    assert config is not None and not (tmp_path / "pwned").exists()
    assert {k: config[k] for k in ("num_attention_heads", "num_query_groups", "vocab_size", "params_dtype")} == {
        "num_attention_heads": 8,
        "num_query_groups": 2,
        "vocab_size": 100,
        "params_dtype": torch.bfloat16,
    }
    backend = config["attention_backend"]
    assert isinstance(backend, Opaque) and (backend.qualname, backend.args) == ("megatron_like_enums.AttnBackend", (5,))
    common = MegatronDistSource(ckpt).common()  # the same reader: Megatron's enum is a stand-in too
    assert common["iteration"] == 7 and common["args"].num_attention_heads == 8
    assert isinstance(common["args"].attention_backend, Opaque) and isinstance(common["boom"], Opaque)
    assert not (tmp_path / "pwned").exists()
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(FormatError, match="TORCH_FORCE_WEIGHTS_ONLY_LOAD is set.*unset the variable"):
        MegatronDistSource(ckpt).config()
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    mapping = shardsync.Mapping.parse("megatron-llama-te", config=config)
    assert mapping.statements[0].render().endswith("keep=100")
    torch.save(
        {"args": argparse.Namespace(num_attention_heads=8, num_query_groups=1, group_query_attention=False)},
        ckpt / "common.pt",
    )
    assert MegatronDistSource(ckpt).config() == {"num_attention_heads": 8, "group_query_attention": False}
    torch.save({"iteration": 7}, ckpt / "common.pt")
    assert MegatronDistSource(ckpt).config() is None
    (ckpt / "common.pt").write_bytes(b"not a torch file")
    with pytest.raises(FormatError, match="common.pt: cannot read it as a torch.save file"):
        MegatronDistSource(ckpt).config()


def test_cli_without_saved_args_asks_for_the_parameters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = write_torch_dist(tmp_path / "c", {QKV: torch.zeros(2, 3)})  # common.pt: no args
    assert main(["convert", str(ckpt), str(tmp_path / "out"), "-m", "megatron-llama-te", "-q"]) == 2
    assert "needs the parameters vocab_size, num_heads, num_key_value_groups" in capsys.readouterr().err


# -- megatron-core's own dist_checkpointing.save, TP=2, converted by the CLI --------------------------


def doc_block(marker: str, lang: str) -> str:
    """The first ``lang`` code block after ``marker`` in docs/megatron.md."""
    text = DOC.read_text()
    return text[text.index(marker) :].split(f"```{lang}\n", 1)[1].split("```", 1)[0]


SAVE = "<!-- executed by tests/test_sources_megatron_dist.py"
CONVERT = "<!-- run by tests/test_sources_megatron_dist.py"


def save_worker(rank: int, world: int, out: str) -> dict[str, Any] | None:
    import multiprocessing
    import warnings

    from test_megatron import build_gpt, gathered_by_hand, hf_by_hand, init_parallel

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    torch.cuda.synchronize = lambda *a, **k: None  # CPU shims (real-clients.md), tests only
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    # the harness's ranks are daemon processes; Megatron's writer forks one process per file
    multiprocessing.current_process()._config["daemon"] = False  # type: ignore[attr-defined]
    init_parallel(tp=2, pp=1)
    model = build_gpt()
    exec(doc_block(SAVE, "python"), {"model": model, "ckpt_dir": out})  # dist_checkpointing.save
    want = hf_by_hand(gathered_by_hand(model), tp=2)
    live = sorted(k for k, _ in shardsync.full_params(shardsync.from_megatron(model)))
    return {"hf": want, "live": live} if rank == 0 else None


def test_megatron_core_checkpoint_converts_by_cli_to_the_gathered_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("megatron.core")
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    ckpt.mkdir()
    ref = run_ranks(save_worker, 2, str(ckpt), timeout=600)[0]
    assert ref is not None
    monkeypatch.chdir(tmp_path)
    command = shlex.split(doc_block(CONVERT, "sh").strip())
    assert command[:2] == ["shardsync", "convert"]
    assert main(command[1:]) == 0
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(ref["hf"])
    assert [k for k in ref["hf"] if not torch.equal(got[k], ref["hf"][k])] == []
    # the mapping's parameters came from the args Megatron's save kept in common.pt; --set wins
    assert {k: MegatronDistSource(ckpt).config()[k] for k in ("num_attention_heads", "num_query_groups")} == {
        "num_attention_heads": 4,
        "num_query_groups": 2,
    }
    flags = MappingFlags(mapping="megatron-llama-te", sets=(("vocab_size", "100"),))
    _, targets = flags.resolve(GlobalLayout.merge([MegatronDistSource(ckpt).entries()]), ckpt)
    assert {t.name: t.shape for t in targets}["lm_head.weight"] == (100, 64)
    local = MegatronDistSource(ckpt, norms="local")
    assert sorted({e.key for e in local.entries()}) == ref["live"]
    mapping = shardsync.Mapping.parse(
        "megatron-llama", params={"num_heads": 4, "num_key_value_groups": 2, "vocab_size": 128}
    )
    streamed = dict(shardsync.full_params(local, mapping))
    assert [k for k in ref["hf"] if not torch.equal(streamed[k], ref["hf"][k])] == []
