"""Safetensors writer: exact headers and index (golden), atomic commit, round trips."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reference import arange_tensor
from shardsync.errors import FormatError
from shardsync.io import SafetensorsWriter, parse_size, save_safetensors


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


def test_single_file_header_is_exact(tmp_path: Path) -> None:
    a = arange_tensor((3, 5), torch.float32)
    b = arange_tensor((7,), torch.bfloat16)
    res = save_safetensors([("b.weight", b), ("a.weight", a)], tmp_path)
    assert res.files == (tmp_path / "model.safetensors",) and res.index is None
    assert (res.num_tensors, res.total_bytes) == (2, 60 + 14)
    assert _header(res.files[0]) == {
        "__metadata__": {"format": "pt"},
        "a.weight": {"dtype": "F32", "shape": [3, 5], "data_offsets": [0, 60]},
        "b.weight": {"dtype": "BF16", "shape": [7], "data_offsets": [60, 74]},
    }
    back = load_file(res.files[0])
    assert torch.equal(back["a.weight"], a) and torch.equal(back["b.weight"], b)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_sharded_files_and_index_are_exact(tmp_path: Path) -> None:
    tensors = [(f"layers.{i}.w", arange_tensor((17,), torch.float32, start=i)) for i in range(5)]
    res = save_safetensors(tensors, tmp_path, max_shard_bytes=150)  # 68 bytes each: 2 per shard
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [p.name for p in res.files] == names
    assert json.loads((tmp_path / "model.safetensors.index.json").read_text()) == {
        "metadata": {"total_size": 5 * 68},
        "weight_map": {
            "layers.0.w": names[0],
            "layers.1.w": names[0],
            "layers.2.w": names[1],
            "layers.3.w": names[1],
            "layers.4.w": names[2],
        },
    }
    for name, t in tensors:
        file = tmp_path / json.loads(res.index.read_text())["weight_map"][name]  # type: ignore[union-attr]
        assert torch.equal(load_file(file)[name], t)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names + ["model.safetensors.index.json"])


def test_failure_mid_stream_leaves_nothing(tmp_path: Path) -> None:
    def stream():
        for i in range(4):
            yield f"t{i}", torch.zeros(10)
        raise RuntimeError("producer died")

    with pytest.raises(RuntimeError, match="producer died"):
        save_safetensors(stream(), tmp_path, max_shard_bytes=50)
    assert list(tmp_path.iterdir()) == []


def test_existing_checkpoint_needs_overwrite_and_stale_shards_go(tmp_path: Path) -> None:
    save_safetensors([(f"t{i}", torch.zeros(10)) for i in range(3)], tmp_path, max_shard_bytes=40)
    with pytest.raises(FormatError, match="overwrite=True"):
        save_safetensors([("x", torch.zeros(1))], tmp_path)
    save_safetensors([("x", torch.ones(1))], tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert torch.equal(load_file(tmp_path / "model.safetensors")["x"], torch.ones(1))


def test_views_of_one_storage_and_non_contiguous_tensors(tmp_path: Path) -> None:
    base = arange_tensor((4, 6))
    tensors = [("q", base[:2]), ("k", base[2:]), ("t", base.t()), ("tied", base)]
    save_safetensors(tensors, tmp_path)
    back = load_file(tmp_path / "model.safetensors")
    assert torch.equal(back["q"], base[:2]) and torch.equal(back["t"], base.t())
    assert torch.equal(back["tied"], base) and torch.equal(back["k"], base[2:])


def test_duplicate_name_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="'a' added twice"):
        save_safetensors([("a", torch.zeros(1)), ("a", torch.zeros(1))], tmp_path)


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("512MiB") == 512 * 2**20 and parse_size(7) == 7
    with pytest.raises(ValueError, match="cannot read size"):
        parse_size("lots")


def test_writer_closed_twice(tmp_path: Path) -> None:
    w = SafetensorsWriter(tmp_path)
    w.add("a", torch.zeros(1))
    w.close()
    with pytest.raises(FormatError, match="already closed"):
        w.close()


def test_reader_layout_from_headers_and_tensors(tmp_path: Path) -> None:
    from shardsync.sources import checkpoint_files, read_layout, read_tensors

    tensors = [(f"w{i}", arange_tensor((3, i + 1), torch.bfloat16)) for i in range(4)]
    save_safetensors(tensors, tmp_path, max_shard_bytes=20)
    assert len(checkpoint_files(tmp_path)) == 3  # 6+12 | 18 | 24 bytes
    assert checkpoint_files(tmp_path / "model.safetensors.index.json") == checkpoint_files(tmp_path)
    lay = read_layout(tmp_path)
    assert lay.keys() == ["w0", "w1", "w2", "w3"] and lay["w3"].shape == (3, 4)
    assert lay["w3"].dtype == "bfloat16"
    back = read_tensors(tmp_path)
    assert all(torch.equal(back[k], t) for k, t in tensors)
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FormatError, match="names missing files: model-00002-of-00003.safetensors"):
        read_layout(tmp_path)
    with pytest.raises(FormatError, match="does not exist"):
        read_layout(tmp_path / "nope")
