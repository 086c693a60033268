"""A torch Distributed Checkpoint (DCP) directory as a source.

The layout comes from the checkpoint's metadata: every saved chunk of a tensor is one box, so a
checkpoint saved under any sharding (FSDP, TP, a torchtitan run, a single process) reads as it is.
:meth:`DcpSource.read` loads just the chunks that overlap the box wanted, as torch's
``FileSystemReader`` does (each chunk is a ``torch.save`` record at an offset of a ``.distcp`` file),
without importing ``torch.distributed.checkpoint`` (most of a second). A checkpoint whose chunks were
saved through stream transforms (DCP's compression extensions) is read through torch's own reader.

Trust: DCP metadata is a pickle (``.metadata``); it is read with an allow-list of the classes DCP
metadata is made of (:mod:`shardsync.sources.dcp_metadata`), so opening a checkpoint never runs code
from it. The tensor data is loaded with torch's ``weights_only`` unpickler, each chunk a view of the
bytes read from its file (:mod:`shardsync.sources.torch_record`: not copied a second time).
"""

from __future__ import annotations

import functools
import io
import logging
import os
import pickle
import re
import threading
from pathlib import Path
from typing import Any

import torch

from ..errors import FormatError, LayoutError
from ..files import file_kind
from ..layout.box import Box
from ..layout.dtypes import dtype_name
from ..layout.meta import LayoutEntry
from .dcp_metadata import is_record, read_metadata, storage_index, storage_problems
from .torch_record import load_record

__all__ = ["DcpSource", "METADATA_FILE"]

log = logging.getLogger(__name__)

#: The file that marks a directory as a DCP checkpoint.
METADATA_FILE = ".metadata"


@functools.cache
def _box_planner() -> type:
    """DCP's default load planner with every read item landing in one box-sized tensor (made on
    first use: importing torch's DCP package costs most of a second)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class BoxPlanner(DefaultLoadPlanner):
        def __init__(self, out: torch.Tensor) -> None:
            super().__init__()
            self.out = out

        def lookup_tensor(self, index: Any) -> torch.Tensor:
            return self.out  # the default transform_tensor narrows it to each item's dest offsets

    return BoxPlanner


class DcpSource:
    """A DCP checkpoint directory (as written by ``torch.distributed.checkpoint.save``).

    The metadata is unpickled with an allow-list (see the module docstring). Non-tensor entries
    (bytes, objects) are skipped with a debug log.

    Args:
        path: the checkpoint directory (the one holding ``.metadata``).
        prefix: read only the tensors whose key starts with it, named without it; e.g. ``"model."``
            for a checkpoint saved as ``{"model": model.state_dict(), "optim": ...}`` (DCP joins
            nested keys with dots).

    Raises:
        FormatError: no ``.metadata``, a metadata file that is not DCP's (or names a class DCP
            metadata is not made of), a chunk no data file holds whole, or a dtype shardsync does
            not know. :meth:`read` raises it for a data file that is corrupt.

    Example:
        >>> import tempfile; import torch.distributed.checkpoint as dcp
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = dcp.save({"w": torch.arange(6.).reshape(2, 3)}, checkpoint_id=d, no_dist=True)
        ...     src = DcpSource(d)
        ...     src.entries()[0].shape, src.read("w", Box((1, 1), (1, 2))).tolist()
        ((2, 3), [[4.0, 5.0]])
    """

    #: every rank sees the same data at the same path
    shared = True
    _files: dict[str, io.FileIO]  # data files, opened on first read, read with pread
    _lock: threading.Lock

    def close(self) -> None:
        """Close the data files opened so far (a later read opens them again)."""
        with self._lock:
            files, self._files = self._files, {}
        for fh in files.values():
            fh.close()

    def __del__(self) -> None:  # a source nobody closed: its files go with it, quietly
        if hasattr(self, "_files"):
            self.close()

    def __init__(self, path: str | os.PathLike, *, prefix: str = "") -> None:
        self.path = Path(path)
        meta_file = self.path / METADATA_FILE
        if not meta_file.is_file():
            kind = (
                f"its {METADATA_FILE} is not a regular file"
                if meta_file.exists()
                else f"it has no {METADATA_FILE} file"
            )
            raise FormatError(f"{self.path} is not a torch DCP checkpoint: {kind}")
        metadata = read_metadata(meta_file, plain=True)  # torch's reader would unpickle it without an allow-list
        _check_storage(self.path, metadata)
        self.storage = storage_index(metadata)
        self.tensors: dict[str, Any] = {}  # key (prefix removed) -> TensorStorageMetadata (a record)
        self._dtypes: dict[str, str] = {}
        self._fqns: dict[str, str] = {}  # key -> the checkpoint's own name
        for fqn, md in sorted(metadata.state_dict_metadata.items()):
            if not is_record(md, "TensorStorageMetadata"):
                log.debug("%s: skipping non-tensor entry %r (%s)", self.path, fqn, type(md).__name__)
                continue
            if not fqn.startswith(prefix):
                continue
            key = fqn[len(prefix) :]
            if not all(hasattr(md, a) for a in ("size", "chunks", "properties")):
                raise FormatError(
                    f"{meta_file}: tensor {fqn!r} lacks its size, chunks or properties; the metadata is corrupt"
                )
            _check_boxes(meta_file, fqn, md)
            dtype = getattr(md.properties, "dtype", None)
            if not isinstance(dtype, torch.dtype):
                raise FormatError(f"{meta_file}: tensor {fqn!r} has no dtype ({dtype!r}); the metadata is corrupt")
            try:
                self._dtypes[key] = dtype_name(dtype)
            except ValueError as exc:
                raise FormatError(f"{meta_file}: tensor {fqn!r}: {exc}") from exc
            self.tensors[key], self._fqns[key] = md, fqn
        problems = storage_problems(self.path, metadata, self._fqns.values())
        if problems:
            shown = problems[:5] + ([f"... and {len(problems) - 5} more"] if len(problems) > 5 else [])
            raise FormatError(f"{self.path}: incomplete or corrupt DCP checkpoint: " + "; ".join(shown))
        if not self.tensors:
            raise FormatError(
                f"{self.path}: no tensor{f' under prefix {prefix!r}' if prefix else ''} in this DCP checkpoint"
            )
        transformed = any(
            getattr(self.storage[(f, tuple(c.offsets))], "transform_descriptors", None)
            for f, md in zip(self._fqns.values(), self.tensors.values())
            for c in md.chunks
        )
        self._torch = _TorchReader(self.path) if transformed else None
        self._files = {}
        self._lock = threading.Lock()

    def entries(self) -> list[LayoutEntry]:
        """One entry per saved chunk (duplicates dropped), sorted by key then offsets."""
        out = []
        for key, md in self.tensors.items():
            shape = tuple(md.size)
            boxes = {Box(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks}
            out += [LayoutEntry(key, shape, self._dtypes[key], b) for b in sorted(boxes, key=lambda b: b.offsets)]
        return out

    def read(self, key: str, box: Box) -> torch.Tensor:
        """The data of ``box`` of ``key``: the chunks that overlap it are loaded.

        Raises:
            LayoutError: no such tensor, or the box is outside it.
            FormatError: a data file that is corrupt or truncated.
        """
        md = self.tensors.get(key)
        if md is None or not box.within(tuple(md.size)):
            raise LayoutError(f"{key!r}{box}: not in the DCP checkpoint {self.path}")
        fqn = self._fqns[key]
        if self._torch is not None:
            return self._torch.read(fqn, box, torch.empty(box.sizes, dtype=md.properties.dtype))
        if any(Box(tuple(c.offsets), tuple(c.sizes)) == box for c in md.chunks):
            return self._chunk(key, box)  # a saved chunk as it is: loaded, not copied
        out = torch.empty(box.sizes, dtype=md.properties.dtype)
        for c in md.chunks:
            chunk = Box(tuple(c.offsets), tuple(c.sizes))
            part = chunk.intersect(box)
            if part is None or part.empty:
                continue
            data = self._chunk(key, chunk)
            out[part.slices_in(box)] = part.cut(data, chunk)
        return out

    def chunk_file(self, key: str, chunk: Box) -> str:
        """The data file that holds saved chunk ``chunk`` of ``key`` (a box of :meth:`entries`)."""
        return str(self.storage[(self._fqns[key], chunk.offsets)].relative_path)

    def _file(self, name: str) -> io.FileIO:
        with self._lock:
            if name not in self._files:
                self._files[name] = io.FileIO(self.path / name, "r")
            return self._files[name]

    def _chunk(self, key: str, chunk: Box) -> torch.Tensor:
        """One saved chunk, loaded whole (as torch's reader does)."""
        info = self.storage[(self._fqns[key], chunk.offsets)]
        name = self.chunk_file(key, chunk)
        try:
            record = torch.empty(info.length, dtype=torch.uint8)
            got = os.preadv(self._file(name).fileno(), [record.numpy().data], info.offset)  # safe from any thread
            if got != info.length:
                raise EOFError(f"{got} of its {info.length} bytes are there")
            tensor = load_record(record)  # a view of the record: its bytes are not copied again
        except (OSError, RuntimeError, EOFError, ValueError, KeyError, pickle.UnpicklingError) as exc:
            raise _unreadable(self.path, key, [name], exc) from exc
        md = self.tensors[key]
        if (
            not isinstance(tensor, torch.Tensor)
            or tuple(tensor.shape) != chunk.sizes
            or tensor.dtype != md.properties.dtype
        ):
            what = f"{getattr(tensor, 'dtype', type(tensor).__name__)} {list(getattr(tensor, 'shape', []))}"
            raise FormatError(
                f"{self.path}: {name} holds a {what} where the metadata places {key!r}'s chunk "
                f"({md.properties.dtype} {list(chunk.sizes)}); the checkpoint is corrupt"
            )
        return tensor

    def device(self) -> torch.device:
        """Reads land in CPU memory."""
        return torch.device("cpu")

    def __repr__(self) -> str:
        return f"DcpSource({str(self.path)!r}, {len(self.tensors)} tensors)"


class _TorchReader:
    """torch's own ``FileSystemReader``, for chunks saved through stream transforms."""

    def __init__(self, path: Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self.path = path
        self.reader = FileSystemReader(path)
        self.metadata = read_metadata(path / METADATA_FILE)
        self.metadata.storage_meta.load_id = self.reader.load_id
        self.reader.set_up_storage_reader(self.metadata, is_coordinator=True)

    def read(self, fqn: str, box: Box, out: torch.Tensor) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        md = self.metadata.state_dict_metadata[fqn]
        wanted = ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))
        items = create_read_items_for_chunk_list(fqn, md, [wanted])
        try:
            self.reader.read_data(LoadPlan(items), _box_planner()(out)).wait()
        except (RuntimeError, EOFError, ValueError, KeyError, pickle.UnpicklingError) as exc:
            files = sorted({str(self.reader.storage_data[i.storage_index].relative_path) for i in items})
            raise _unreadable(self.path, fqn, files, exc) from exc
        return out


def _unreadable(path: Path, key: str, files: list[str], exc: BaseException) -> FormatError:
    """The error for data files that do not hold what the metadata says: the first sentence of why."""
    first = re.split(r"(?<=\.)\s", (str(exc).strip().splitlines() or [""])[0])[0]
    return FormatError(
        f"{path}: cannot read {key!r} from {', '.join(files)} (corrupt or truncated?): {type(exc).__name__}: {first}"
    )


def _check_storage(path: Path, metadata: Any) -> None:
    """Every file the metadata says holds data is a regular file (torch would block on a FIFO)."""
    names = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
    bad = [
        f"{n} ({file_kind(os.stat(path / n))})" for n in names if os.path.exists(path / n) and not (path / n).is_file()
    ]
    if bad:
        raise FormatError(
            f"{path}: the DCP metadata names data files that are not regular files: "
            f"{', '.join(bad)}; only regular files are read"
        )


def _check_boxes(meta_file: Path, fqn: str, md: Any) -> None:
    """The tensor's size and every chunk's box are non-negative and inside the tensor."""
    shape = tuple(int(n) for n in md.size)
    if any(n < 0 for n in shape):
        raise FormatError(
            f"{meta_file}: tensor {fqn!r} has size {list(shape)}, with a negative dim; the metadata is corrupt"
        )
    for c in md.chunks:
        offsets, sizes = tuple(int(o) for o in c.offsets), tuple(int(n) for n in c.sizes)
        if (
            len(offsets) != len(shape)
            or len(sizes) != len(shape)
            or min(offsets + sizes, default=0) < 0
            or not Box(offsets, sizes).within(shape)
        ):
            raise FormatError(
                f"{meta_file}: tensor {fqn!r}: a chunk at offsets {list(offsets)} with "
                f"sizes {list(sizes)} is not inside its size {list(shape)}; the metadata "
                "is corrupt"
            )
