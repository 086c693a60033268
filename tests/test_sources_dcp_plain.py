"""DcpSource reads a DCP checkpoint without importing torch.distributed.checkpoint: the metadata as
records (the same layout torch's own classes give), each chunk loaded as torch's reader loads it.
Checkpoints written by torch.distributed.checkpoint.save: several dtypes, nested keys, non-tensor
entries, TP-sharded DTensors on 2 gloo ranks, chunks saved through a stream transform."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path
from typing import IO

import pytest
import torch

from multiproc import run_ranks
from reference import arange_tensor
from shardsync import Box
from shardsync.errors import FormatError
from shardsync.sources import DcpSource
from shardsync.sources.dcp_metadata import read_metadata, storage_index

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.uint8, torch.bool]


def nested_state() -> dict:
    tensors = {
        str(d).removeprefix("torch."): arange_tensor((5, 3), torch.float32, start=i).to(d) for i, d in enumerate(DTYPES)
    }
    tensors["float8_e4m3fn"] = arange_tensor((4, 2), torch.float32, step=0.5).to(torch.float8_e4m3fn)
    return {
        "model": {"layers": {"0": tensors}, "norm": torch.ones(7)},
        "step": 3,
        "blob": b"bytes",
        "empty": torch.zeros(0, 4),
    }


def _tp_worker(rank: int, world: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {
        "qkv": distribute_tensor(arange_tensor((17, 6)), mesh, [Shard(0)]),  # uneven: 9 + 8 rows
        "proj": distribute_tensor(arange_tensor((6, 10), torch.bfloat16), mesh, [Shard(1)]),
        "norm": distribute_tensor(arange_tensor((6,)), mesh, [Replicate()]),
        "opt": {"step": torch.tensor(5)},
    }
    dcp.save(state, checkpoint_id=path)


def tp_full() -> dict[str, torch.Tensor]:
    return {
        "qkv": arange_tensor((17, 6)),
        "proj": arange_tensor((6, 10), torch.bfloat16),
        "norm": arange_tensor((6,)),
        "opt.step": torch.tensor(5),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("dcp")
    dcp.save(nested_state(), checkpoint_id=root / "nested", no_dist=True)
    run_ranks(_tp_worker, 2, str(root / "tp2"))
    return {"nested": root / "nested", "tp2": root / "tp2"}


def _layout(metadata: object) -> dict:
    """What a reader takes from the metadata, from either kind of objects."""
    out = {}
    for fqn, md in metadata.state_dict_metadata.items():  # type: ignore[attr-defined]
        kind = type(md).__name__
        if kind == "TensorStorageMetadata":
            chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
            out[fqn] = (kind, md.properties.dtype, tuple(md.size), chunks)
        else:
            out[fqn] = (kind,)
    storage = {k: (str(v.relative_path), v.offset, v.length) for k, v in storage_index(metadata).items()}
    return {"tensors": out, "storage": storage}


@pytest.mark.parametrize("name", ["nested", "tp2"])
def test_records_give_torchs_layout(checkpoints: dict[str, Path], name: str) -> None:
    path = checkpoints[name] / ".metadata"
    plain, real = _layout(read_metadata(path, plain=True)), _layout(read_metadata(path))
    assert plain == real
    assert len(plain["tensors"]) == {"nested": 12, "tp2": 4}[name]
    if name == "tp2":  # the DTensor shards, as DCP saved them
        assert plain["tensors"]["qkv"][3] == [((0, 0), (9, 6)), ((9, 0), (8, 6))]
        assert plain["tensors"]["proj"][3] == [((0, 0), (6, 5)), ((0, 5), (6, 5))]


def _loaded_by_torch(path: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    del dcp
    dcp_to_torch_save(path, path.parent / f"{path.name}.pt")
    state = torch.load(path.parent / f"{path.name}.pt", weights_only=True)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, v: object) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}{k}.", x)
        elif isinstance(v, torch.Tensor):
            flat[prefix[:-1]] = v

    walk("", state)
    return flat


@pytest.mark.parametrize("name", ["nested", "tp2"])
def test_reads_what_torch_loads(checkpoints: dict[str, Path], name: str) -> None:
    src = DcpSource(checkpoints[name])
    want = _loaded_by_torch(checkpoints[name])
    assert sorted(src.tensors) == sorted(want)
    for key, t in want.items():
        got = src.read(key, Box.full(t.shape))
        assert got.dtype == t.dtype and torch.equal(
            got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
        ), key
    if name == "tp2":  # a box across both ranks' shards
        assert torch.equal(src.read("qkv", Box((7, 1), (4, 3))), tp_full()["qkv"][7:11, 1:4])
        assert torch.equal(src.read("proj", Box((2, 3), (3, 4))), tp_full()["proj"][2:5, 3:7])
        assert src.chunk_file("qkv", Box((9, 0), (8, 6))) == "__1_0.distcp"


def test_a_chunk_is_a_view_of_the_bytes_read(checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    import shardsync.sources.dcp as dcp
    import shardsync.sources.torch_record as torch_record

    records: list[torch.Tensor] = []
    real = dcp.load_record
    monkeypatch.setattr(dcp, "load_record", lambda record: (records.append(record), real(record))[1])

    def inside(t: torch.Tensor) -> bool:  # its bytes lie in the last record read from the file
        start = records[-1].data_ptr()
        return start <= t.data_ptr() and t.data_ptr() + t.nbytes <= start + records[-1].numel()

    chunk = Box((9, 0), (8, 6))  # rank 1's shard of qkv, a saved chunk as it is
    got = DcpSource(checkpoints["tp2"]).read("qkv", chunk)
    assert torch.equal(got, tp_full()["qkv"][9:17]) and inside(got)  # a view: not copied again
    monkeypatch.setattr(torch_record, "_private_loader", lambda: None)  # a torch without it: torch.load
    again = DcpSource(checkpoints["tp2"]).read("qkv", chunk)
    assert torch.equal(again, got) and not inside(again)


def test_torch_distributed_checkpoint_is_not_imported(checkpoints: dict[str, Path]) -> None:
    code = (
        "import sys, shardsync; from shardsync.sources import DcpSource; from shardsync import Box\n"
        f"s = DcpSource({str(checkpoints['tp2'])!r}); s.read('qkv', Box((0, 0), (17, 6)))\n"
        "print('torch.distributed.checkpoint' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "False"


class _Tagged:
    """A stream transform that leaves the bytes as they are but is named in each chunk's storage
    info, as DCP's compression extensions are."""

    @staticmethod
    def registry_name() -> str:
        return "test_tagged"

    @staticmethod
    def from_descriptor(version: str) -> _Tagged:
        return _Tagged()

    def get_descriptor(self) -> str:
        return "test_tagged/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return output

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return input


def test_chunks_saved_through_a_transform_are_read_by_torchs_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import _extension

    ext = type("Tagged", (_Tagged, _extension.StreamTransformExtension), {})
    original = _extension.ExtensionRegistry.__init__

    def with_reversed(self: _extension.ExtensionRegistry) -> None:
        original(self)
        self.register(ext)

    monkeypatch.setattr(_extension.ExtensionRegistry, "__init__", with_reversed)
    state = {"w": arange_tensor((5, 3)), "b": arange_tensor((4,), torch.bfloat16)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path, _extensions=[ext()]), no_dist=True)
    infos = read_metadata(tmp_path / ".metadata", plain=True).storage_data.values()
    assert [i.transform_descriptors for i in infos] == [["test_tagged/1"]] * 2
    src = DcpSource(tmp_path)
    assert src._torch is not None
    for k, t in state.items():
        assert torch.equal(src.read(k, Box.full(t.shape)), t)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x80\x04\x95", "cannot read DCP metadata"),
        (pickle.dumps({"state_dict_metadata": {}}), "holds a dict, not DCP Metadata"),
        (b"cos\nsystem\n(S'true'\ntR.", "names os.system, which DCP metadata is not made of"),
    ],
)
def test_a_metadata_file_it_cannot_read(tmp_path: Path, content: bytes, message: str) -> None:
    (tmp_path / ".metadata").write_bytes(content)
    with pytest.raises(FormatError, match=message):
        DcpSource(tmp_path)


def test_a_chunk_that_is_not_a_tensor_record(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    d = tmp_path / "bad"
    shutil.copytree(checkpoints["tp2"], d)
    data = d / "__1_0.distcp"
    raw = bytearray(data.read_bytes())
    info = storage_index(read_metadata(d / ".metadata", plain=True))[("qkv", (9, 0))]
    raw[info.offset : info.offset + info.length] = b"\0" * info.length
    data.write_bytes(bytes(raw))
    src = DcpSource(d)
    assert torch.equal(src.read("qkv", Box((0, 0), (9, 6))), tp_full()["qkv"][:9])  # rank 0's chunk is whole
    with pytest.raises(FormatError, match=r"cannot read 'qkv' from __1_0.distcp \(corrupt or truncated\?\)"):
        src.read("qkv", Box((8, 0), (2, 6)))


def test_a_legacy_torch_save_record_loads_through_torch_load() -> None:
    import io

    from shardsync.sources.torch_record import load_record

    buf = io.BytesIO()
    torch.save(arange_tensor((3, 5), start=2), buf, _use_new_zipfile_serialization=False)
    record = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    assert torch.equal(load_record(record), arange_tensor((3, 5), start=2))
