"""SafetensorsSource: layout from headers, lazy boxes, every dtype, and every index/header error."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import shardsync
from reference import arange_tensor
from shardsync.errors import FormatError, LayoutError
from shardsync.io import save_safetensors
from shardsync.layout.box import Box
from shardsync.sources import SafetensorsSource, open_source, read_layout


def _write_raw(path: Path, header: object, data: bytes = b"") -> Path:
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)
    return path


@pytest.fixture()
def sharded(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Three files and an index: 17x3 f32 (204 B), 127 bf16 (254 B), 5x7 i32 (140 B)."""
    tensors = {
        "a": arange_tensor((17, 3)),
        "b": arange_tensor((127,), torch.bfloat16, step=0.37),
        "c": (torch.arange(35, dtype=torch.int32) - 17).reshape(5, 7),
    }
    save_safetensors(tensors.items(), tmp_path / "ck", max_shard_bytes=210)
    return tmp_path / "ck", tensors


# -- layout and reads -------------------------------------------------------------------------------


def test_layout_from_headers_and_boxes_read_lazily(sharded: tuple[Path, dict]) -> None:
    path, tensors = sharded
    src = SafetensorsSource(path)
    assert [(e.key, e.shape, e.dtype, e.box) for e in src.entries()] == [
        ("a", (17, 3), "float32", Box((0, 0), (17, 3))),
        ("b", (127,), "bfloat16", Box((0,), (127,))),
        ("c", (5, 7), "int32", Box((0, 0), (5, 7))),
    ]
    assert [src.tensors[k].file.name for k in "abc"] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert torch.equal(src.read("a", Box((3, 1), (9, 2))), tensors["a"][3:12, 1:3])
    assert torch.equal(src.read("b", Box((100,), (27,))), tensors["b"][100:])
    assert torch.equal(src.read("c", Box((0, 0), (5, 7))), tensors["c"])
    with pytest.raises(LayoutError, match=r"'a'\[0:18, 0:3\]: not in"):
        src.read("a", Box((0, 0), (18, 3)))
    # the same checkpoint through the index file, one file, and a directory without the index
    assert SafetensorsSource(path / "model.safetensors.index.json").entries() == src.entries()
    one = SafetensorsSource(path / "model-00003-of-00003.safetensors")
    assert [e.key for e in one.entries()] == ["c"]
    (path / "model.safetensors.index.json").unlink()
    assert SafetensorsSource(path).entries() == src.entries()


@pytest.mark.parametrize(
    "dtype",
    [
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.complex64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
        torch.float8_e8m0fnu,
        torch.bool,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int64,
        torch.float64,
        torch.float16,
    ],
)
def test_every_dtype_safetensors_holds(tmp_path: Path, dtype: torch.dtype) -> None:
    raw = torch.arange(3 * 17, dtype=torch.int64).reshape(17, 3) % 7
    full = raw.to(torch.float32).to(dtype) if dtype.is_floating_point else raw.to(dtype)
    save_file({"x": full}, tmp_path / "m.safetensors")
    src = SafetensorsSource(tmp_path / "m.safetensors")
    assert src.entries()[0].dtype == str(dtype).removeprefix("torch.")
    got = src.read("x", Box((5, 1), (7, 2)))
    want = full[5:12, 1:3].contiguous()
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    ((name, tensor),) = shardsync.full_params(tmp_path / "m.safetensors")
    assert name == "x" and torch.equal(tensor.view(torch.uint8), full.view(torch.uint8))


def test_full_params_reads_each_box_once(tmp_path: Path) -> None:
    qkv = arange_tensor((12, 3))
    save_safetensors([("qkv", qkv), ("norm", arange_tensor((3,), torch.bfloat16))], tmp_path)
    mapping = [
        "qkv -> q, k, v, fused_qkv, num_heads=2, num_key_value_groups=1, axis=0",
        "qkv^T -> qkv_t",
        "norm -> norm",
    ]
    stream = shardsync.full_params(tmp_path, mapping)
    got = dict(stream)
    assert torch.equal(got["q"], qkv[0:6]) and torch.equal(got["k"], qkv[6:9])
    assert torch.equal(got["v"], qkv[9:12]) and torch.equal(got["qkv_t"], qkv.T)
    assert stream.stats.bytes_read == 12 * 3 * 4 + 3 * 2  # qkv feeds four targets: read once
    assert shardsync.plan(tmp_path, mapping).order == stream.plan.order == ("k", "norm", "q", "qkv_t", "v")
    # a budget cuts reads into pieces; still every byte is read exactly once
    small = shardsync.full_params(tmp_path, mapping, memory_budget=200)
    assert {k: v.tolist() for k, v in small} == {k: v.tolist() for k, v in got.items()}
    assert small.stats.bytes_read == 12 * 3 * 4 + 3 * 2


def test_read_helpers_and_explain_on_a_path(sharded: tuple[Path, dict]) -> None:
    path, tensors = sharded
    assert read_layout(path)["c"].shape == (5, 7)
    back = shardsync.read_tensors(path)
    assert all(torch.equal(back[k], t) for k, t in tensors.items())
    text = shardsync.explain(path, ["a^T -> at"])
    assert text.splitlines()[:2] == [
        "at  [3, 17] float32  (1 piece from a)",
        "    a[0:17, 0:3] -> [0:3, 0:17]  permute [1, 0]",
    ]


# -- the index checked against the files ----------------------------------------------------------


def _edit_index(path: Path, edit) -> None:
    index = path / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    edit(doc["weight_map"])
    index.write_text(json.dumps(doc))


def test_index_names_a_key_its_file_lacks(sharded: tuple[Path, dict]) -> None:
    path, _ = sharded
    _edit_index(path, lambda wm: wm.update(ghost="model-00001-of-00003.safetensors"))
    with pytest.raises(
        FormatError,
        match=r"model.safetensors.index.json disagrees with the files it "
        r"names.*\n  'ghost' is mapped to model-00001-of-00003.safetensors but no file "
        r"it names holds it",
    ):
        SafetensorsSource(path)


def test_index_maps_keys_to_the_wrong_files(sharded: tuple[Path, dict]) -> None:
    path, _ = sharded
    _edit_index(path, lambda wm: wm.update(a="model-00002-of-00003.safetensors", b="model-00001-of-00003.safetensors"))
    with pytest.raises(FormatError) as err:
        SafetensorsSource(path)
    assert str(err.value).splitlines()[1:] == [
        "  'a' is mapped to model-00002-of-00003.safetensors but it is in model-00001-of-00003.safetensors",
        "  'b' is mapped to model-00001-of-00003.safetensors but it is in model-00002-of-00003.safetensors",
    ]


def test_index_omits_a_key_of_a_file_it_names(tmp_path: Path) -> None:
    save_safetensors(
        [("x", torch.zeros(2)), ("y", torch.ones(2)), ("z", torch.zeros(100))], tmp_path, max_shard_bytes=20
    )
    _edit_index(tmp_path, lambda wm: wm.pop("y"))
    with pytest.raises(
        FormatError, match="\n  'y' is in model-00001-of-00002.safetensors but the index does not name it$"
    ):
        SafetensorsSource(tmp_path)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors"])
def test_index_naming_a_file_outside_the_directory(sharded: tuple[Path, dict], name: str) -> None:
    path, _ = sharded
    save_file({"z": torch.zeros(1)}, path.parent / "outside.safetensors")
    _edit_index(path, lambda wm: wm.update(z=name))
    with pytest.raises(
        FormatError, match=f"names files outside its directory: {name}; an index may name only files next to it"
    ):
        SafetensorsSource(path)


def test_index_naming_a_missing_file_and_bad_index(sharded: tuple[Path, dict]) -> None:
    path, _ = sharded
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FormatError, match="names missing files: model-00002-of-00003.safetensors"):
        SafetensorsSource(path)
    (path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(FormatError, match="not a safetensors index .*'weight_map'"):
        SafetensorsSource(path)
    (path / "model.safetensors.index.json").write_text('{"weight_map": {"a": 3}}')
    with pytest.raises(FormatError, match="'weight_map' must map tensor names to file names"):
        SafetensorsSource(path)


def test_incomplete_set_without_index_is_refused(sharded: tuple[Path, dict]) -> None:
    # A half-written checkpoint: the writer commits the index last, so it is not there yet.
    path, _ = sharded
    (path / "model.safetensors.index.json").unlink()
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(
        FormatError,
        match=r"incomplete checkpoint \(still being written, or copied in "
        r"part\):\n  .*ck: model-00002-of-00003.safetensors missing from a set of 3",
    ):
        open_source(path)


def test_several_indexes_and_a_key_in_two_files(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(2)}, tmp_path / "a.safetensors")
    save_file({"w": torch.ones(2)}, tmp_path / "b.safetensors")
    with pytest.raises(FormatError, match=r"tensor 'w' is in both .*a.safetensors and .*b.safetensors"):
        SafetensorsSource(tmp_path)
    for stem in ("a", "b"):
        (tmp_path / f"{stem}.safetensors.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(
        FormatError,
        match=r"holds several indexes \(a.safetensors.index.json, "
        r"b.safetensors.index.json\); pass the one to read",
    ):
        SafetensorsSource(tmp_path)


# -- corrupt headers: a FormatError naming the file, never a crash ---------------------------------

CORRUPT = {
    "short": (lambda p: p.write_bytes(b"abc"), "3 bytes is too short for a safetensors file"),
    "huge length": (
        lambda p: p.write_bytes(struct.pack("<Q", 2**62) + b"{}"),
        r"header length 4611686018427387904 B runs past the end of the file \(10 B\)",
    ),
    "bad json": (
        lambda p: p.write_bytes(struct.pack("<Q", 5) + b"{abc}"),
        "corrupt safetensors header: .*invalid JSON in header",
    ),
    "negative shape": (
        lambda p: _write_raw(p, {"x": {"dtype": "F32", "shape": [-1, 3], "data_offsets": [0, 12]}}, bytes(12)),
        "corrupt safetensors header: .*invalid value: integer `-1`",
    ),
    "offsets past the end": (
        lambda p: _write_raw(p, {"x": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}, bytes(12)),
        "corrupt safetensors header: .*incomplete metadata, file not fully covered",
    ),
    "size mismatch": (
        lambda p: _write_raw(p, {"x": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}, bytes(20)),
        "corrupt safetensors header: .*invalid shape, data type, or offset for tensor",
    ),
    "unknown dtype": (
        lambda p: _write_raw(p, {"x": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 2]}}, bytes(2)),
        "corrupt safetensors header: .*unknown variant `Q7`",
    ),
    "not an object": (lambda p: _write_raw(p, [1, 2]), "corrupt safetensors header: .*invalid type"),
    "sub-byte dtype": (
        lambda p: _write_raw(p, {"x": {"dtype": "F4", "shape": [2, 4], "data_offsets": [0, 4]}}, bytes(4)),
        "tensor 'x' has sub-byte dtype F4, which has no torch dtype",
    ),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_header_is_a_format_error_naming_the_file(tmp_path: Path, case: str) -> None:
    make, message = CORRUPT[case]
    path = tmp_path / "model.safetensors"
    make(path)
    with pytest.raises(FormatError, match=f"^{path}: {message}"):
        SafetensorsSource(path)


def test_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"w": arange_tensor((17, 3))}, path)
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(FormatError, match=f"^{path}: corrupt safetensors header: .*incomplete metadata"):
        list(shardsync.full_params(path))  # opened when iteration starts


def test_single_file_wins_over_an_uncommitted_index(tmp_path: Path) -> None:
    # the writer's commit rule (docs/checkpoints.md): while model.safetensors exists it is the
    # checkpoint; the index and shards of a save that had not yet removed it are not read
    old = {"w": arange_tensor((5, 3))}
    save_file(old, str(tmp_path / "model.safetensors"))
    save_file({"w": arange_tensor((5, 3)) + 100}, str(tmp_path / "model-00001-of-00001-x.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"w": "model-00001-of-00001-x.safetensors"}})
    )
    src = SafetensorsSource(tmp_path)
    assert torch.equal(src.read("w", Box((0, 0), (5, 3))), old["w"])
