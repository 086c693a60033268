"""A Hugging Face safetensors checkpoint as a source: layout from the headers, boxes read lazily."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..errors import FormatError, LayoutError
from ..files import check_unchanged
from ..layout.box import Box
from ..layout.dtypes import itemsize
from ..layout.meta import LayoutEntry
from .safetensors_files import TensorInfo, scan_checkpoint

__all__ = ["SafetensorsSource"]

log = logging.getLogger(__name__)

#: A file handle is reopened after serving this many bytes: safetensors maps files into memory, and
#: the pages a read touched count as this process's resident memory until the mapping is dropped.
REMAP_BYTES = 16 << 20


class SafetensorsSource:
    """A safetensors checkpoint on disk: one file, a directory with an index, or a directory of files.

    The layout comes from the headers alone (every key is one box, the whole tensor), after the files
    are checked against each other (see :func:`~shardsync.sources.safetensors_files.scan_checkpoint`).
    :meth:`read` returns only the requested box, sliced out of the file by the safetensors library;
    nothing else is loaded. Every rank of a group sees the same files (``shared``), so under a process
    group the streamers spread the boxes across ranks (see :func:`~shardsync.sources.spread`).

    Args:
        path: a ``.safetensors`` file, a ``*.safetensors.index.json``, or a checkpoint directory.

    Raises:
        FormatError: the checkpoint is incomplete, inconsistent or corrupt (names the file).

    Example:
        >>> import tempfile; from safetensors.torch import save_file
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_file({"w": torch.arange(6.).reshape(2, 3)}, f"{d}/model.safetensors")
        ...     src = SafetensorsSource(d)
        ...     src.entries()[0].shape, src.read("w", Box((0, 1), (2, 1))).flatten().tolist()
        ((2, 3), [1.0, 4.0])
    """

    #: every rank sees the same data at the same path
    shared = True

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.tensors: dict[str, TensorInfo] = scan_checkpoint(self.path)
        self._open: tuple[Path, Any] | None = None
        self._served = 0

    def entries(self) -> list[LayoutEntry]:
        """One entry per tensor (its whole box), sorted by key."""
        return [LayoutEntry(key, info.shape, info.dtype, Box.full(info.shape)) for key, info in self.tensors.items()]

    def read(self, key: str, box: Box) -> torch.Tensor:
        """The data of ``box`` of ``key``, read from its file (a fresh CPU tensor).

        The file is checked before and after each read: one replaced or rewritten since its header
        was read raises instead of mixing old and new tensors (see :func:`~shardsync.files.check_unchanged`).

        Raises:
            LayoutError: no such key, or the box is outside the tensor.
            FormatError: the file changed or is damaged since the headers were read.
        """
        info = self.tensors.get(key)
        if info is None or not box.within(info.shape):
            raise LayoutError(f"{key!r}{box}: not in {self.path} (keys come from its headers)")
        check_unchanged(info.file, info.stamp)  # before: a file cut short would fault the mapping
        handle = self._handle(info, box.numel * itemsize(info.dtype))
        try:
            if box == Box.full(info.shape):
                out = handle.get_tensor(key)
            else:
                out = handle.get_slice(key)[box.slices()]
        except SafetensorError as exc:
            raise FormatError(f"{info.file}: cannot read {key!r}{box}: {exc}") from exc
        check_unchanged(info.file, info.stamp)  # after: a write during the copy changed the stamp
        return out

    def device(self) -> torch.device:
        """Reads land in CPU memory."""
        return torch.device("cpu")

    def close(self) -> None:
        """Drop the open file handle (reads reopen it)."""
        if self._open is not None:
            self._open[1].__exit__(None, None, None)
            self._open = None

    def _handle(self, info: TensorInfo, nbytes: int) -> Any:
        # One file open at a time, reopened after REMAP_BYTES so that mapped pages never pile up.
        file = info.file
        if self._open is not None and (self._open[0] != file or self._served >= REMAP_BYTES):
            self.close()
        if self._open is None:
            try:
                self._open = (file, safe_open(str(file), framework="pt").__enter__())
            except (SafetensorError, OSError) as exc:
                raise FormatError(f"{file}: cannot open: {exc}") from exc
            self._served = 0
            check_unchanged(file, info.stamp)  # safetensors opens by name: the file mapped is the one read
        self._served += nbytes
        return self._open[1]

    def __repr__(self) -> str:
        return f"SafetensorsSource({str(self.path)!r}, {len(self.tensors)} tensors)"
