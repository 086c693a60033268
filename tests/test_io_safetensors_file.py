"""SafetensorsFile writes the bytes safetensors.torch.save_file writes, whatever order the tensors come
in; FileWriter's thread bounds the bytes in flight and hands its failures to the caller."""

from __future__ import annotations

import json
import random
import struct
import sys
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from shardsync.errors import FormatError
from shardsync.io import safetensors_file
from shardsync.io.rank_files import FileWriter
from shardsync.io.safetensors_file import SafetensorsFile, TensorSpec, header
from shardsync.layout.dtypes import DTYPES, dtype_name

#: every dtype the installed safetensors writes
WRITABLE = sorted(safetensors_file._dtype_order())


def random_tensor(shape: tuple[int, ...], dtype: str, seed: int) -> torch.Tensor:
    """Random bytes of every pattern (NaNs, subnormals) viewed as ``dtype``."""
    numel = 1
    for n in shape:
        numel *= n
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * DTYPES[dtype].itemsize,), dtype=torch.uint8, generator=g)
    if dtype == "bool":
        raw = raw % 2
    return raw.view(DTYPES[dtype]).reshape(shape)


def written(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None, seed: int = 0) -> bytes:
    specs = [TensorSpec(k, dtype_name(v.dtype), tuple(v.shape)) for k, v in tensors.items()]
    f = SafetensorsFile(path, specs, metadata)
    order = list(tensors)
    random.Random(seed).shuffle(order)  # any arrival order
    for k in order:
        f.write(k, tensors[k])
    f.close()
    data = path.read_bytes()
    path.unlink()
    return data


def reference(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> bytes:
    save_file(tensors, str(path), metadata=metadata)
    data = path.read_bytes()
    path.unlink()
    return data


CASES = {
    "every dtype, two of each": {f"{d}.{i}": random_tensor((3, i + 2), d, 7 * i) for d in WRITABLE for i in range(2)},
    "odd shapes, 0-size, scalars": {
        "a": random_tensor((17, 3, 5), "float32", 1),
        "empty": random_tensor((0, 4), "int8", 2),
        "empty bf16": random_tensor((3, 0), "bfloat16", 3),
        "scalar": random_tensor((), "float64", 4),
        "one": random_tensor((1,), "float8_e4m3fn", 5),
        "b": random_tensor((7,), "bfloat16", 6),
        "ids": random_tensor((129,), "int64", 7),
    },
    "names that need escaping": {
        'q"uote\\back': random_tensor((2,), "int16", 8),
        "new\nline\ttab\x01\x7f": random_tensor((3,), "uint8", 9),
        "é ü 中文 \u2028": random_tensor((2, 2), "float16", 10),
        "Z": random_tensor((1,), "float16", 11),
        "a": random_tensor((1,), "float16", 12),
    },
    "no tensors": {},
}


METADATA = [None, {}, {"format": "pt"}, {"k\n\u00e9": 'v"\\\x02'}]


@pytest.mark.parametrize(
    ("case", "metadata"),
    # no tensors and {}: save_file's header is not JSON (test_no_tensors_and_empty_metadata)
    [(c, m) for c in sorted(CASES) for m in METADATA if CASES[c] or m != {}],
)
def test_bytes_are_save_files(tmp_path: Path, case: str, metadata: dict[str, str] | None) -> None:
    tensors = CASES[case]
    assert written(tmp_path / "m", tensors, metadata) == reference(tmp_path / "r", tensors, metadata)


def test_no_tensors_and_empty_metadata(tmp_path: Path) -> None:
    """The one case not written as save_file writes it: safetensors 0.8 writes the header
    ``{},"__metadata__":{}}``, which is not JSON; this file's header is."""
    data = written(tmp_path / "m", {}, {})
    assert data == struct.pack("<Q", 24) + b'{"__metadata__":{}}     '
    (tmp_path / "m").write_bytes(data)
    assert load_file(tmp_path / "m") == {}


def split(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def test_several_metadata_keys(tmp_path: Path) -> None:
    """save_file writes several metadata keys in an order that changes between processes (a Rust
    HashMap); SafetensorsFile writes them as given. The same header otherwise, byte for byte."""
    tensors = CASES["odd shapes, 0-size, scalars"]
    metadata = {"format": "pt", "b": "2", "a": "1", "long key": "x" * 100}
    mine, theirs = written(tmp_path / "m", tensors, metadata), reference(tmp_path / "r", tensors, metadata)
    assert len(mine) == len(theirs) and split(mine) == split(theirs)
    assert list(split(mine)[0]["__metadata__"]) == list(metadata)  # as given: the same file on every run
    no_metadata = {k: v for k, v in split(mine)[0].items() if k != "__metadata__"}
    assert mine.endswith(theirs[-sum(t.numel() * t.element_size() for t in tensors.values()) :])
    assert no_metadata == {k: v for k, v in split(theirs)[0].items() if k != "__metadata__"}


names = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=12)
specs = st.dictionaries(
    names, st.tuples(st.sampled_from(WRITABLE), st.lists(st.integers(0, 5), max_size=3).map(tuple)), max_size=8
)
one_key = st.none() | st.dictionaries(names, st.text(st.characters(exclude_categories=("Cs",))), max_size=1)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=specs, metadata=one_key, seed=st.integers(0, 2**16))
def test_bytes_are_save_files_property(tmp_path: Path, specs: dict, metadata: dict[str, str] | None, seed: int) -> None:
    tensors = {k: random_tensor(shape, d, seed + i) for i, (k, (d, shape)) in enumerate(specs.items())}
    if not tensors and metadata == {}:
        return  # test_no_tensors_and_empty_metadata
    assert written(tmp_path / "m", tensors, metadata, seed) == reference(tmp_path / "r", tensors, metadata)


def test_refuses_what_it_cannot_write_identically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FormatError, match="cannot write dtype complex128; cast those tensors"):
        header([TensorSpec("c", "complex128", (2,))], None)
    with pytest.raises(FormatError, match=r"named twice in one file: \['w'\]"):
        header([TensorSpec("w", "float32", (2,)), TensorSpec("w", "int8", (1,))], None)
    with pytest.raises(FormatError, match="metadata must map text to text"):
        header([], {"n": 1})  # type: ignore[dict-item]
    monkeypatch.setattr(sys, "byteorder", "big")
    with pytest.raises(FormatError, match="this machine is big-endian; write the checkpoint on a little-endian"):
        SafetensorsFile(tmp_path / "m", [TensorSpec("w", "float32", (2,))], None)
    assert not (tmp_path / "m").exists()  # refused before the file is made


def test_write_checks(tmp_path: Path) -> None:
    f = SafetensorsFile(tmp_path / "m", [TensorSpec("w", "float32", (2,)), TensorSpec("v", "int8", (3,))], None)
    with pytest.raises(FormatError, match=r"'w' arrived as torch.float64 \[2\], planned as float32 \[2\]"):
        f.write("w", torch.zeros(2, dtype=torch.float64))
    with pytest.raises(FormatError, match=r"'w' arrived as torch.float32 \[1, 2\], planned as float32 \[2\]"):
        f.write("w", torch.zeros(1, 2))
    with pytest.raises(FormatError, match="'x' is not one of its tensors"):
        f.write("x", torch.zeros(2))
    f.write("w", torch.zeros(4)[::2])  # not contiguous: written as its values
    with pytest.raises(FormatError, match="'w' was written already"):
        f.write("w", torch.zeros(2))
    with pytest.raises(FormatError, match=r"tensors \['v'\] were never written"):
        f.close()
    f.discard()
    assert not (tmp_path / "m").exists()
    (tmp_path / "taken").write_bytes(b"someone's")
    with pytest.raises(FileExistsError):
        SafetensorsFile(tmp_path / "taken", [], None)
    assert (tmp_path / "taken").read_bytes() == b"someone's"


def test_writer_thread_failure_reaches_the_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(self: SafetensorsFile, name: str, tensor: torch.Tensor) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(SafetensorsFile, "write", full)
    w = FileWriter()
    w.open(0, tmp_path / "a", [TensorSpec("w", "float32", (2,)), TensorSpec("v", "float32", (2,))], None)
    w.write(0, "w", torch.zeros(2))
    with pytest.raises(OSError, match="No space left"):
        w.finish()
    with pytest.raises(OSError, match="No space left"):  # and every later call
        w.write(0, "v", torch.zeros(2))
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_bytes_in_flight_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    original = SafetensorsFile.write
    in_flight: list[int] = []

    def slow(self: SafetensorsFile, name: str, tensor: torch.Tensor) -> None:
        release.wait()
        original(self, name, tensor)

    monkeypatch.setattr(SafetensorsFile, "write", slow)
    w = FileWriter(in_flight=250)  # two 100-byte tensors, not three
    w.open(0, tmp_path / "a", [TensorSpec(f"t{i}", "float32", (25,)) for i in range(4)], None)

    def produce() -> None:
        for i in range(4):
            w.write(0, f"t{i}", torch.full((25,), float(i)))
            in_flight.append(w._bytes)
        w.close(0)

    producer = threading.Thread(target=produce)
    producer.start()
    producer.join(0.5)
    assert producer.is_alive() and in_flight == [100, 200]  # the third waits for the thread
    release.set()
    producer.join()
    w.finish()
    assert max(in_flight) <= 250
    assert [t.tolist()[0] for t in load_file(tmp_path / "a").values()] == [0.0, 1.0, 2.0, 3.0]


def test_a_memory_budget_or_a_shard_size_bounds_the_writer_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """save_hf's writer thread holds at most ``memory_budget`` bytes not yet written, and
    save_safetensors' at most one shard (it holds another until it is full); 256 MiB otherwise."""
    import shardsync
    from shardsync.io import rank_files, safetensors_writer, save_hf

    limits: list[int] = []

    class Recording(rank_files.FileWriter):
        def __init__(self, in_flight: int = rank_files.IN_FLIGHT) -> None:
            limits.append(in_flight)
            super().__init__(in_flight)

    monkeypatch.setattr(save_hf, "FileWriter", Recording)
    monkeypatch.setattr(safetensors_writer, "FileWriter", Recording)
    state = {f"w{i}": torch.arange(i * 1000, i * 1000 + 999, dtype=torch.float32) for i in range(3)}
    shardsync.save_hf(state, tmp_path / "budget", memory_budget="8KiB")
    shardsync.save_hf(state, tmp_path / "none")
    shardsync.save_safetensors(state.items(), tmp_path / "shards", max_shard_bytes="5000")
    assert limits == [8192, rank_files.IN_FLIGHT, 5000]
    for d in ("budget", "none", "shards"):
        got = {}
        for f in sorted((tmp_path / d).glob("*.safetensors")):
            got.update(load_file(f))
        assert set(got) == set(state) and all(torch.equal(got[k], v) for k, v in state.items()), d
