"""One parser of sizes: every API argument that is a size and every CLI size flag accept the same
spellings (``7``, ``"4096"``, ``"5GB"``, ``"64MiB"``) and refuse the same ones with the same words."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import shardsync.io as io
from shardsync import full_params, load, reshard, save_hf
from shardsync.cli.common import size_flag
from shardsync.cli.messages import UsageError
from shardsync.errors import FormatError, PlanError, ReplicaError
from shardsync.replicas import ReplicaSync
from shardsync.sizes import parse_size, sizes_in


@pytest.mark.parametrize(
    "text, size",
    [
        (7, 7),
        ("4096", 4096),
        ("5GB", 5 * 10**9),
        ("5 gb", 5 * 10**9),
        ("1.5KiB", 1536),
        ("64MiB", 64 << 20),
        ("0.5MB", 500_000),
        ("2TiB", 2 << 40),
        ("17B", 17),
        ("123456789012345678.5KB", 123456789012345678500),  # exact: no float rounding
    ],
)
def test_parse_size(text: int | str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(
    "text, message",
    [
        ("lots", "cannot read size 'lots' for memory_budget; write e.g. '5GB', '500MB' or '512MiB'"),
        ("-5GB", "cannot read size '-5GB' for memory_budget; write e.g. '5GB', '500MB' or '512MiB'"),
        ("0MB", "size '0MB' for memory_budget is not positive; write e.g. '5GB', '500MB' or '512MiB'"),
        (0, "size 0 for memory_budget is not positive; write e.g. '5GB', '500MB' or '512MiB'"),
        (True, "cannot read size True for memory_budget; write e.g. '5GB', '500MB' or '512MiB'"),
        (1.5, "cannot read size 1.5 for memory_budget; write e.g. '5GB', '500MB' or '512MiB'"),
    ],
)
def test_parse_size_refuses(text: object, message: str) -> None:
    with pytest.raises(FormatError) as err:
        parse_size(text, "memory_budget")  # type: ignore[arg-type]
    assert str(err.value) == message


def test_io_exports_the_same_parser() -> None:
    assert io.parse_size is parse_size


def test_sizes_in_reads_strings_and_leaves_the_rest() -> None:
    assert sizes_in({"memory_budget": "64MiB", "bucket_bytes": 17, "mesh_threshold_bytes": "1GB", "copy": "64MiB"}) == {
        "memory_budget": 64 << 20,
        "bucket_bytes": 17,
        "mesh_threshold_bytes": 10**9,
        "copy": "64MiB",
    }


def _state() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(17.0), "b": torch.arange(127.0).reshape(127, 1)}


def test_full_params_takes_size_strings() -> None:
    stream = full_params(_state(), memory_budget="64MiB", bucket_bytes="4KiB")
    got = dict(stream)
    assert all(torch.equal(got[k], v) for k, v in _state().items())
    assert stream.plan.bucket_bytes <= 4096


def test_full_params_size_errors() -> None:
    with pytest.raises(FormatError, match="cannot read size '64 apples' for memory_budget"):
        full_params(_state(), memory_budget="64 apples")
    with pytest.raises(PlanError, match="memory_budget=-1: use a positive number of bytes"):
        full_params(_state(), memory_budget=-1)


def test_load_and_reshard_take_size_strings() -> None:
    dst = {k: torch.zeros_like(v) for k, v in _state().items()}
    load(dst, _state(), memory_budget="64MiB", bucket_bytes="1KiB")
    assert all(torch.equal(dst[k], v) for k, v in _state().items())
    again = {k: torch.zeros_like(v) for k, v in _state().items()}
    reshard(_state(), again, memory_budget="1MB")
    assert all(torch.equal(again[k], v) for k, v in _state().items())
    with pytest.raises(FormatError, match="cannot read size 'much' for memory_budget"):
        load(dst, _state(), memory_budget="much")


def test_save_hf_takes_the_same_sizes(tmp_path: Path) -> None:
    save_hf(_state(), tmp_path, max_file_size="100B", memory_budget="64MiB")
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    files = [load_file(str(p)) for p in sorted(tmp_path.glob("*.safetensors"))]
    assert torch.equal(files[0]["a"], torch.arange(17.0)) and torch.equal(files[1]["b"], _state()["b"])


def test_cli_size_flags_use_the_parser() -> None:
    assert size_flag("64MiB", "--memory-budget") == 64 << 20
    with pytest.raises(UsageError, match=r"--memory-budget '64 apples' is not a size \(write e.g. 5GB"):
        size_flag("64 apples", "--memory-budget")


def test_replica_sync_takes_size_strings() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    assert ReplicaSync(model, grads="mean", bucket_bytes="1KiB").bucket_bytes == 1024
    with pytest.raises(ReplicaError, match="cannot read size '1 KiBi' for bucket_bytes"):
        ReplicaSync(model, bucket_bytes="1 KiBi")
