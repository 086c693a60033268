"""A ``torch.save`` record already in memory, loaded without copying its tensors' bytes.

``torch.load`` of a file-like object copies every storage out of the record into fresh memory; for a
DCP chunk that is a second copy of every byte read (the first is the read from the file). Loading
through torch's own zip reader and unpickler with the record's memory as the *overall storage* -
what ``torch.load(mmap=True)`` does with a mapped file - makes each tensor a view of that memory.
That path uses two private functions of ``torch.serialization`` (``_open_zipfile_reader``, ``_load``);
where a torch release changes them, and for a record that is not a zip (``torch.save``'s legacy
format, or corrupt bytes), :func:`load_record` falls back to ``torch.load`` (a copy).
The unpickler is torch's ``weights_only`` one either way.
"""

from __future__ import annotations

import io
import logging
from typing import Any

import torch

__all__ = ["load_record"]

log = logging.getLogger(__name__)
_ZIP_MAGIC = b"PK\x03\x04"  # a local file header: how every zip record of torch.save starts


class _View(io.RawIOBase):
    """A read-only, seekable file over a memoryview (``io.BytesIO`` would copy it)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), len(self._view) - self._pos))
        buffer[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n


def load_record(record: torch.Tensor) -> Any:
    """What ``torch.save`` wrote into ``record`` (a 1-D uint8 CPU tensor), its tensors views of it.

    Example:
        >>> buf = io.BytesIO(); torch.save(torch.arange(6.).reshape(2, 3), buf)
        >>> record = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        >>> t = load_record(record)
        >>> t.tolist(), t.untyped_storage().data_ptr() - record.data_ptr() > 0
        ([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], True)
    """
    private = _private_loader()
    if private is None or bytes(record[:4].numpy()) != _ZIP_MAGIC:
        # another torch, or not a zip record (torch.save's legacy format, or corrupt): torch.load, a copy
        return torch.load(io.BytesIO(record.numpy().tobytes()), map_location="cpu", weights_only=True)
    opener, load = private
    with opener(_View(record.numpy().data)) as zipped:
        return load(zipped, "cpu", torch._weights_only_unpickler, overall_storage=record.untyped_storage())


def _private_loader() -> tuple[Any, Any] | None:
    """``torch.serialization``'s zip reader and loader, where this torch has them."""
    from torch import serialization

    opener, load = getattr(serialization, "_open_zipfile_reader", None), getattr(serialization, "_load", None)
    if opener is None or load is None:
        log.debug("torch.serialization has no _open_zipfile_reader/_load; torch.load copies")
        return None
    return opener, load
