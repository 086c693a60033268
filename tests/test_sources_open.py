"""open_source: format detection and its errors; spreading a shared source; reading each box once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import shardsync
from reference import arange_tensor
from shardsync.cli import main
from shardsync.errors import FormatError, LayoutError
from shardsync.layout.box import Box
from shardsync.layout.meta import LayoutEntry
from shardsync.sources import DcpSource, LocalSource, SafetensorsSource, Source, assign_boxes, open_source, spread

# dcp.save(no_dist=True) warns that it runs in one process, which is what these tests want
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_detects_each_format(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    dcp.save({"w": torch.zeros(2)}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    assert isinstance(open_source(tmp_path), SafetensorsSource)
    assert isinstance(open_source(str(tmp_path / "model.safetensors")), SafetensorsSource)
    assert isinstance(open_source(tmp_path / "dcp"), DcpSource)
    assert isinstance(open_source({"w": torch.zeros(2)}), LocalSource)
    src = SafetensorsSource(tmp_path)
    assert open_source(src) is src and isinstance(src, Source)


def test_what_is_not_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dcp.save({"w": torch.zeros(2)}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    cases = {
        tmp_path / "dcp" / ".metadata": "is the metadata file of a DCP checkpoint; pass its directory "
        f"{tmp_path / 'dcp'}",
        tmp_path / "config.json": "is not a checkpoint file; pass a .safetensors file, a "
        "*.safetensors.index.json, a directory of safetensors files, a "
        "torch DCP checkpoint directory (one holding .metadata), or a Megatron "
        "dist_checkpointing directory (metadata.json, common.pt)",
        tmp_path / "empty": "is not a checkpoint: it holds no *.safetensors file and no .metadata",
        tmp_path / "nope": "does not exist",
    }
    for path, message in cases.items():
        with pytest.raises(FormatError) as err:
            open_source(path)
        assert str(err.value).startswith(f"{path} {message}"), err.value
        assert main(["export", str(path), str(tmp_path / "out"), "-q"]) == 2
        one_line = message.replace("; ", " (", 1)  # the command line puts the fix in parentheses
        assert f"shardsync export: {path} {one_line}" in capsys.readouterr().err
    assert main(["explain", str(tmp_path / "config.json")]) == 2
    assert f"{tmp_path / 'config.json'} is not a layout JSON" in capsys.readouterr().err
    with pytest.raises(LayoutError, match="cannot read weights from a int; pass a state dict, a Source"):
        open_source(3)  # type: ignore[arg-type]


class CountingSource:
    """A LocalSource that counts reads of each (key, box), and is shared like a file source."""

    shared = True

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.inner = LocalSource(state)
        self.calls: dict[tuple[str, Box], int] = {}

    def entries(self) -> list[LayoutEntry]:
        return self.inner.entries()

    def read(self, key: str, box: Box) -> torch.Tensor:
        self.calls[(key, box)] = self.calls.get((key, box), 0) + 1
        return self.inner.read(key, box).clone()

    def device(self) -> torch.device:
        return self.inner.device()


def test_executor_reads_each_planned_box_once() -> None:
    full = {"qkv": arange_tensor((12, 5)), "w": arange_tensor((7, 3), start=100)}
    src = CountingSource(full)
    mapping = [
        "qkv -> q, k, v, fused_qkv, num_heads=2, num_key_value_groups=1, axis=0",
        "qkv^T -> qkv_t",
        "qkv -> qkv_copy",
        "w -> w",
        "w -> w16, dtype='float16'",
    ]
    for copy in (True, False):
        src.calls.clear()
        stream = shardsync.full_params(src, mapping, copy=copy)
        got = dict(stream)
        assert torch.equal(got["k"], full["qkv"][6:9]) and torch.equal(got["qkv_t"], full["qkv"].T)
        assert torch.equal(got["w16"], full["w"].half()) and torch.equal(got["qkv_copy"], full["qkv"])
        assert src.calls == {("qkv", Box((0, 0), (12, 5))): 1, ("w", Box((0, 0), (7, 3))): 1}
        assert stream.stats.bytes_read == (60 + 21) * 4


def test_assign_boxes_balances_bytes_deterministically() -> None:
    sizes = [("a", 40), ("b", 30), ("c", 20), ("d", 20), ("e", 10), ("f", 1)]
    entries = [LayoutEntry(k, (n,), "float32", Box((0,), (n,))) for k, n in sizes]
    # largest first to the least-loaded rank: a->0, b->1, c->1 (30<40), d->0, e->1, f->0 (60=60: lowest)
    assert assign_boxes(entries, 2) == [0, 1, 1, 0, 1, 0]
    assert assign_boxes(entries, 4) == [0, 1, 2, 3, 2, 3]  # e: 2 and 3 tie at 20; f: 3 has 20
    assert assign_boxes(entries, 1) == [0] * 6


def test_spread_narrows_only_shared_sources_of_several_ranks() -> None:
    state = {"a": torch.zeros(40), "b": torch.zeros(30), "c": torch.zeros(20)}
    shared = CountingSource(state)
    assert spread(shared, 0, 1) is shared
    assert [e.key for e in spread(shared, 0, 2).entries()] == ["a"]
    assert [e.key for e in spread(shared, 1, 2).entries()] == ["b", "c"]
    local = LocalSource(state)
    assert spread(local, 1, 2) is local  # in-memory state: each rank holds what it holds
