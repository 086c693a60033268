"""save_hf: golden index and header, parallel writers (world 2 and 4) byte-identical to one writer,
failures raised on every rank with the old checkpoint intact, dtype casts, extra files, errors."""

from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file

import shardsync
from multiproc import run_ranks
from reference import arange_tensor
from shardsync import shard_dim
from shardsync.errors import FormatError
from shardsync.io.file_plan import file_owners
from shardsync.io.safetensors_file import SafetensorsFile
from test_io_commit import load_checkpoint, same

MAPPING = ["layers.$LAYER_ID.w^T -> model.layers.$LAYER_ID.weight"]
LIMIT = 220  # bytes: five files, some straddling two ranks' parts (at world 2 and 4)


def full_state() -> dict[str, torch.Tensor]:
    state = {f"layers.{i}.w": arange_tensor((17, 3), torch.float32, start=100 * i, step=0.25) for i in range(7)}
    state |= {f"layers.{i}.b": arange_tensor((5,), torch.float32, start=-50 * i) for i in range(7)}
    return state | {"norm": arange_tensor((7,), torch.bfloat16), "ids": torch.arange(11) * 3}


def expected() -> dict[str, torch.Tensor]:
    """The mapping and the bf16 cast applied by hand to the full tensors."""
    out = {}
    for k, v in full_state().items():
        if k.endswith(".w"):
            k, v = k.replace("layers.", "model.layers.").replace(".w", ".weight"), v.t()
        out[k] = v.to(torch.bfloat16) if v.is_floating_point() else v
    return out


def rank_state(rank: int, world: int) -> dict:
    """Weights and biases cut along dim 0 (17 rows, 5 entries: uneven); norm and ids replicated."""
    return {k: shard_dim(v, 0, rank, world) if k.startswith("layers.") else v for k, v in full_state().items()}


def _save_worker(rank: int, world: int, out: str, old: str) -> dict:
    state = rank_state(rank, world)
    plan = shardsync.plan(state, MAPPING)
    writers = sorted({rank for (rank,) in file_owners(plan.targets, LIMIT, torch.bfloat16, None, world)})
    res = shardsync.save_hf(state, out, MAPPING, max_file_size=LIMIT, dtype="bf16")
    # a second save over ``old`` in which rank 2 (or 1) cannot write its files
    failing = min(2, world - 1)
    error = None
    full_disk = OSError(28, "No space left on device")
    with (
        mock.patch.object(SafetensorsFile, "write", side_effect=full_disk)
        if rank == failing
        else contextlib.nullcontext()
    ):
        try:
            shardsync.save_hf(state, old, MAPPING, max_file_size=LIMIT, dtype="bf16", overwrite=True)
        except shardsync.DistributedError as exc:
            error = (exc.phase, sorted(exc.failures), str(exc))
    return {"writers": writers, "files": [p.name for p in res.files], "error": error}


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_writers_write_what_one_writer_writes(tmp_path: Path, world: int) -> None:
    one = tmp_path / "one"
    res = shardsync.save_hf(rank_state(0, 1), one, MAPPING, max_file_size=LIMIT, dtype="bf16")
    assert same(load_checkpoint(one), expected()) and len(res.files) == 5
    old = tmp_path / "old"
    shardsync.save_safetensors([("old", torch.ones(3))], old)
    (old / "config.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in old.iterdir()}

    results = run_ranks(_save_worker, world, str(tmp_path / "many"), str(old))
    assert len(results[0]["writers"]) > 1  # the files are shared out among the ranks
    assert all(r["files"] == [p.name for p in res.files] for r in results)
    assert sorted(p.name for p in (tmp_path / "many").iterdir()) == sorted(p.name for p in one.iterdir())
    for f in one.iterdir():
        assert (tmp_path / "many" / f.name).read_bytes() == f.read_bytes(), f.name
    failing = min(2, world - 1)
    for r in results:
        phase, ranks, text = r["error"]
        assert (phase, ranks) == ("save_hf: write files", [failing]) and "No space left on device" in text
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before


def test_index_and_header_are_exact(tmp_path: Path) -> None:
    state = {
        "b.weight": arange_tensor((7,), torch.bfloat16),
        "a.weight": arange_tensor((3, 5)),
        "c.ids": torch.arange(4, dtype=torch.int32),
        "d.big": arange_tensor((40,)),
    }
    res = shardsync.save_hf(state, tmp_path, max_file_size="80B")  # 60+14 | 16 | 160 bytes
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [p.name for p in res.files] == names and (res.num_tensors, res.total_bytes) == (4, 250)
    assert res.index is not None and res.index.read_text() == (
        '{\n  "metadata": {\n    "total_size": 250\n  },\n  "weight_map": {\n'
        f'    "a.weight": "{names[0]}",\n    "b.weight": "{names[0]}",\n'
        f'    "c.ids": "{names[1]}",\n    "d.big": "{names[2]}"\n  }}\n}}\n'
    )
    raw = (tmp_path / names[0]).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert raw[8 : 8 + n] == (
        b'{"__metadata__":{"format":"pt"},"a.weight":{"dtype":"F32","shape":[3,5],'
        b'"data_offsets":[0,60]},"b.weight":{"dtype":"BF16","shape":[7],'
        b'"data_offsets":[60,74]}}'
    ).ljust(n)
    assert len(raw) == 8 + n + 74 and n % 8 == 0
    assert same(load_file(tmp_path / names[0]), {k: state[k] for k in ("a.weight", "b.weight")})


def test_dtype_casts_floating_targets_only(tmp_path: Path) -> None:
    state = {"w": arange_tensor((127,), torch.float32, step=0.3), "i": torch.arange(5)}
    shardsync.save_hf(state, tmp_path, dtype=torch.float16)
    back = load_file(tmp_path / "model.safetensors")
    assert back["w"].dtype == torch.float16 and torch.equal(back["w"], state["w"].half())
    assert torch.equal(back["i"], state["i"]) and back["i"].dtype == torch.int64
    with pytest.raises(shardsync.PlanError, match="not a floating dtype"):
        shardsync.save_hf(state, tmp_path / "x", dtype="int32")
    with pytest.raises(FormatError, match="cannot read size 'big'"):
        shardsync.save_hf(state, tmp_path / "x", max_file_size="big")
    assert not (tmp_path / "x").exists()  # checked before anything is written


def test_config_and_extra_files_are_copied(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    files = {
        "config.json": '{"model_type": "llama"}',
        "tokenizer.json": "{}",
        "generation_config.json": "{}",
        "README.md": "not copied",
    }
    for name, text in files.items():
        (model / name).write_text(text)
    (tmp_path / "notes.txt").write_text("extra")
    out = tmp_path / "out"
    shardsync.save_hf({"w": torch.ones(2)}, out, config_from=model, extra_files=[tmp_path / "notes.txt"])
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "notes.txt",
        "tokenizer.json",
    ]
    assert (out / "config.json").read_text() == files["config.json"]
    (model / "config.json").write_text('{"model_type": "qwen2", "torch_dtype": "float32"}')
    shardsync.save_hf({"w": torch.ones(2)}, out, config_from=model, overwrite=True, dtype="bf16")
    assert json.loads((out / "config.json").read_text()) == {"model_type": "qwen2", "torch_dtype": "bfloat16"}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"config_from": "{tmp}/nowhere"}, "holds no config.json"),
        ({"extra_files": ["{tmp}/missing.json"]}, "missing.json is not a file"),
        ({"extra_files": ["{tmp}/a/model.safetensors"]}, "model.safetensors is a name the weights use"),
        ({"extra_files": ["{tmp}/a/x.json", "{tmp}/b/x.json"]}, "have the same name"),
        ({"extra_files": ["{tmp}/a/config.json"]}, "config.json is not a JSON object"),
    ],
)
def test_bad_extra_files(tmp_path: Path, kwargs: dict, message: str) -> None:
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "x.json").write_text("{}")
        (tmp_path / sub / "model.safetensors").write_text("{}")
        (tmp_path / sub / "config.json").write_text("{not json")
    kwargs = {
        k: (v.format(tmp=tmp_path) if isinstance(v, str) else [p.format(tmp=tmp_path) for p in v])
        for k, v in kwargs.items()
    }
    with pytest.raises(FormatError, match=message):
        shardsync.save_hf({"w": torch.ones(2)}, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_existing_checkpoint_needs_overwrite(tmp_path: Path) -> None:
    shardsync.save_hf({"w": torch.ones(2)}, tmp_path)
    with pytest.raises(FormatError, match="already holds a checkpoint"):
        shardsync.save_hf({"w": torch.zeros(2)}, tmp_path)
    assert torch.equal(load_file(tmp_path / "model.safetensors")["w"], torch.ones(2))


def test_progress_bar_in_bytes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    shardsync.save_hf({"w": torch.ones(1000)}, tmp_path, progress=True)
    err = capsys.readouterr().err
    assert "save_hf: 100%" in err and "4.00k/4.00k" in err and "B/s" in err


def test_from_pretrained_loads_the_result(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=67,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    config.save_pretrained(tmp_path / "config")
    shardsync.save_hf(model.state_dict(), tmp_path / "out", config_from=tmp_path / "config", max_file_size="10kB")
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.arange(9).reshape(1, 9) * 7 % 67
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
