"""Mistakes that used to end in a misleading message or a half-done result (issue "Robustness",
"Unclear messages"): each now gets one clear error naming the cause, before anything is written."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import shardsync.io.commit as commit
from shardsync import load, save_hf
from shardsync.cli import main
from shardsync.cli.diff import max_abs_diff
from shardsync.cli.inspect import describe_checkpoint
from shardsync.destinations.state import self_overlapping
from shardsync.errors import FormatError, LayoutError
from shardsync.sources import DcpSource


def test_inspect_index_naming_files_in_a_subdirectory(tmp_path: Path) -> None:
    (tmp_path / "weights").mkdir()
    save_file({"a": torch.arange(17.0)}, str(tmp_path / "weights/part-1.safetensors"))
    save_file({"b": torch.arange(127, dtype=torch.int32)}, str(tmp_path / "weights/part-2.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "weights/part-1.safetensors", "b": "weights/part-2.safetensors"}})
    )
    doc = describe_checkpoint(tmp_path)
    sizes = {n: (tmp_path / n).stat().st_size for n in ("weights/part-1.safetensors", "weights/part-2.safetensors")}
    assert doc["files"] == [{"name": n, "bytes": b} for n, b in sizes.items()]
    assert doc["tensors"]["b"]["shards"] == [{"offsets": [0], "sizes": [127], "file": "weights/part-2.safetensors"}]
    assert doc["total_bytes"] == 17 * 4 + 127 * 4


def test_diff_of_opposite_infinities_is_infinite() -> None:
    inf = math.inf
    a = torch.tensor([1.0, inf, -inf, 3.0])
    assert max_abs_diff(a, torch.tensor([1.0, -inf, -inf, 3.0])) == inf
    assert max_abs_diff(a, torch.tensor([1.0, inf, -inf, 3.5])) == 0.5  # equal infinities are equal
    assert max_abs_diff(a, torch.tensor([1.0, 7.0, -inf, 3.0])) == inf


def test_cli_diff_reports_inf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_file({"w": torch.tensor([0.0, math.inf])}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.tensor([0.0, -math.inf])}, str(tmp_path / "b.safetensors"))
    assert main(["diff", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]) == 1
    assert "values differ: w max abs diff inf > --atol 0" in capsys.readouterr().out


def _dcp_with_size(tmp_path: Path, size: list[int]) -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(17.0)}, checkpoint_id=str(tmp_path), no_dist=True)
    meta_file = tmp_path / ".metadata"
    metadata = pickle.loads(meta_file.read_bytes())
    metadata.state_dict_metadata["w"].size = torch.Size(size)
    meta_file.write_bytes(pickle.dumps(metadata))
    return tmp_path


def test_dcp_negative_size_is_a_format_error(tmp_path: Path) -> None:
    path = _dcp_with_size(tmp_path, [-17])
    with pytest.raises(FormatError) as err:
        DcpSource(path)
    assert str(err.value) == (
        f"{path}/.metadata: tensor 'w' has size [-17], with a negative dim; the metadata is corrupt"
    )


def test_dcp_chunk_outside_its_tensor_is_a_format_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _dcp_with_size(tmp_path, [7])
    with pytest.raises(
        FormatError,
        match=r"tensor 'w': a chunk at offsets \[0\] with sizes \[17\] is not "
        r"inside its size \[7\]; the metadata is corrupt",
    ):
        DcpSource(path)
    assert main(["inspect", str(path)]) == 2
    assert "is not inside its size [7]" in capsys.readouterr().err


def test_output_model_safetensors_that_is_a_directory(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").mkdir()
    with pytest.raises(FormatError) as err:
        save_hf({"w": torch.arange(17.0)}, tmp_path, overwrite=True)
    assert str(err.value) == (
        f"{tmp_path} holds model.safetensors (a directory), where the checkpoint's "
        "files go, and not as a regular file; remove it, or choose another "
        "directory"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]  # nothing written


def test_two_writers_at_once_the_loser_names_the_other_save(tmp_path: Path) -> None:
    def second_save(stage: str) -> None:
        if stage.startswith("wrote .model."):
            commit.stage_hook = None
            save_hf({"w": -torch.arange(17.0)}, tmp_path, overwrite=True)  # removes the first one's temp

    commit.stage_hook = second_save
    try:
        with pytest.raises(FormatError) as err:
            save_hf({"w": torch.arange(17.0)}, tmp_path)
    finally:
        commit.stage_hook = None
    assert "is missing: another save into" in str(err.value)
    assert str(err.value).endswith(
        "at the same time removed it (run one save per directory at a time), "
        "or a rank wrote it where this rank cannot see it (write to a file "
        "system every rank shares)"
    )


def test_expanded_destination_is_refused_before_any_write() -> None:
    keep = torch.full((5,), -1.0)
    dst = {"a": keep, "b": torch.zeros(1, 17).expand(3, 17)}
    with pytest.raises(LayoutError) as err:
        load(dst, {"a": torch.arange(5.0), "b": torch.arange(51.0).reshape(3, 17)})
    assert str(err.value) == (
        "destination tensors ['b'] have elements that share memory (made by "
        "expand() or a stride-0 view), so they cannot be written in place; pass "
        "tensors that own their memory, e.g. t.expand(...).clone()"
    )
    assert torch.equal(keep, torch.full((5,), -1.0))  # nothing written


@pytest.mark.parametrize(
    "make, overlaps",
    [
        (lambda: torch.zeros(5, 7), False),
        (lambda: torch.zeros(5, 7).T, False),
        (lambda: torch.zeros(5, 7, 3).permute(2, 0, 1)[:, ::2, 1:], False),
        (lambda: torch.zeros(17).flip(0), False),
        (lambda: torch.zeros(0, 4).expand(0, 4), False),
        (lambda: torch.zeros(1, 4).expand(3, 4), True),
        (lambda: torch.zeros(4).as_strided((2, 3), (1, 1)), True),
        (lambda: torch.zeros(1).expand(1), False),
    ],
)
def test_self_overlapping(make, overlaps: bool) -> None:
    assert self_overlapping(make()) is overlaps


def test_failed_convert_leaves_no_directory_it_created(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(127.0)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    (data,) = (tmp_path / "ck").glob("*.distcp")
    data.write_bytes(data.read_bytes()[:100])  # the data is cut short: reading it fails mid-convert
    (tmp_path / "kept").mkdir()
    assert main(["convert", str(tmp_path / "ck"), str(tmp_path / "kept/new/out")]) != 0
    capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "kept"]
    assert list((tmp_path / "kept").iterdir()) == []
