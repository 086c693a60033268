"""One safetensors file written in place: the header first, then each tensor at its final offset as it
arrives, in any order (:class:`SafetensorsFile`).

Everything the header says (names, dtypes, shapes, offsets) is known from the plan before any data
moves, so the file needs no buffer of its own: each tensor's bytes go to disk with ``os.pwrite`` as
soon as the tensor is complete, and the tensor can be released. The bytes are the ones
``safetensors.torch.save_file`` writes for the same tensors (checked by the tests): the tensors sorted
by dtype (the order the library sorts by, asked of the library itself), then by name; the header
compact JSON, ``__metadata__`` first, padded with spaces to a multiple of 8 bytes.

One difference: with several metadata keys, ``save_file`` writes them in an order that changes from
process to process (a Rust ``HashMap``); this file writes them in the order given, so its output is
the same on every run.
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ..errors import FormatError
from ..layout.dtypes import DTYPES, SAFETENSORS_DTYPES

__all__ = ["TensorSpec", "SafetensorsFile", "header", "KICK_BYTES"]

#: Written bytes after which the kernel is asked to start writing the file's dirty pages back (so that
#: the fsync before the commit finds most of them on disk already).
KICK_BYTES = 16 << 20
_MAX_PWRITE = 1 << 30  # Linux writes at most about 2 GiB in one call


class TensorSpec(NamedTuple):
    """One tensor of a file, as the plan knows it before its data exists."""

    name: str
    dtype: str  # a dtype name of :data:`shardsync.layout.dtypes.DTYPES`
    shape: tuple[int, ...]


@functools.cache
def _dtype_order() -> dict[str, tuple[str, int]]:
    """Dtype name -> (safetensors code, rank in the library's data order) for every dtype the
    installed safetensors writes; asked of the library, so that a new version's order is followed."""
    from safetensors.torch import save

    codes = {}
    for code, name in SAFETENSORS_DTYPES.items():
        if name is None or name not in DTYPES:
            continue
        try:
            save({"x": torch.zeros(1, dtype=DTYPES[name])})
        except (ValueError, TypeError, KeyError, AttributeError):  # a dtype this version cannot write
            continue
        codes[name] = code
    blob = save({name: torch.zeros(1, dtype=DTYPES[name]) for name in codes})
    (n,) = struct.unpack("<Q", blob[:8])
    written = [key for key in json.loads(blob[8 : 8 + n]) if key != "__metadata__"]
    return {name: (codes[name], rank) for rank, name in enumerate(written)}


def header(
    tensors: Sequence[TensorSpec], metadata: Mapping[str, str] | None
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The file's first bytes (length, header, padding) and each tensor's data range in the file.

    Raises:
        FormatError: a dtype the installed safetensors cannot write, a name given twice, metadata that
            is not text, or a big-endian machine (the format is little-endian).

    Example:
        >>> head, where = header([TensorSpec("w", "float32", (2,))], {"format": "pt"})
        >>> head[8:].decode()
        '{"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}  '
        >>> where
        {'w': (96, 104)}
    """
    if sys.byteorder != "little":
        raise FormatError(
            "safetensors files are little-endian and this machine is big-endian; write the "
            "checkpoint on a little-endian machine (x86-64, arm64)"
        )
    order = _dtype_order()
    unknown = sorted({t.dtype for t in tensors if t.dtype not in order})
    if unknown:
        raise FormatError(
            f"the installed safetensors cannot write dtype {', '.join(unknown)}; cast those "
            "tensors (dtype=...) or upgrade safetensors"
        )
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise FormatError(f"tensors named twice in one file: {sorted({n for n in names if names.count(n) > 1})}")
    doc: dict[str, object] = {}
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise FormatError(f"safetensors metadata must map text to text, not {dict(metadata)!r}")
        doc["__metadata__"] = dict(metadata)
    ranges: dict[str, tuple[int, int]] = {}
    end = 0
    for t in sorted(tensors, key=lambda t: (order[t.dtype][1], t.name.encode("utf-8", "surrogatepass"))):
        start, end = end, end + math.prod(t.shape) * DTYPES[t.dtype].itemsize
        doc[t.name] = {"dtype": order[t.dtype][0], "shape": list(t.shape), "data_offsets": [start, end]}
        ranges[t.name] = (start, end)
    try:
        text = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError as exc:
        raise FormatError(f"a tensor name or metadata text is not valid Unicode: {exc}") from exc
    text += b" " * (-len(text) % 8)
    base = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, {k: (base + a, base + b) for k, (a, b) in ranges.items()}


class SafetensorsFile:
    """A safetensors file at ``path`` (created; it must not exist), written tensor by tensor.

    ``write(name, tensor)`` puts each tensor's bytes at its offset (any order, from one thread);
    ``close()`` checks every tensor was written, fsyncs and closes. Each :data:`KICK_BYTES` written,
    the kernel is asked to start writing back what it holds (``posix_fadvise(DONTNEED)``).

    Raises:
        FormatError: see :func:`header`; ``write`` of a tensor not in the file, twice, or of another
            dtype or shape than planned; ``close`` with tensors never written.
        OSError: the file cannot be created or written (a full disk).

    Example:
        >>> import tempfile; from safetensors.torch import load_file
        >>> with tempfile.TemporaryDirectory() as d:
        ...     f = SafetensorsFile(Path(d, "m.safetensors"), [TensorSpec("w", "int64", (3,))], None)
        ...     f.write("w", torch.arange(3))
        ...     f.close()
        ...     load_file(f"{d}/m.safetensors")["w"].tolist()
        [0, 1, 2]
    """

    def __init__(self, path: Path, tensors: Sequence[TensorSpec], metadata: Mapping[str, str] | None) -> None:
        self.path = path
        head, self.ranges = header(tensors, metadata)
        self.specs = {t.name: t for t in tensors}
        self.size = max((b for _, b in self.ranges.values()), default=len(head))
        self.fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        self.missing = set(self.specs)
        self.unkicked = 0
        try:
            self._pwrite(memoryview(head), 0)
            os.ftruncate(self.fd, self.size)
        except BaseException:
            self.discard()
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (CPU) as tensor ``name`` of the file."""
        spec = self.specs.get(name)
        if spec is None or name not in self.missing:
            what = "is not one of its tensors" if spec is None else "was written already"
            raise FormatError(f"{self.path.name}: {name!r} {what}")
        if DTYPES[spec.dtype] != tensor.dtype or tuple(tensor.shape) != spec.shape:
            raise FormatError(
                f"{self.path.name}: {name!r} arrived as {tensor.dtype} {list(tensor.shape)}, planned as "
                f"{spec.dtype} {list(spec.shape)}"
            )
        start, end = self.ranges[name]
        if end > start:
            flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            self._pwrite(np.from_dlpack(flat).data, start)  # numpy() would pin the caller's storage's size
        self.missing.discard(name)
        self.unkicked += end - start
        if self.unkicked >= KICK_BYTES:
            self._kick()

    def _pwrite(self, data: memoryview, offset: int) -> None:
        assert self.fd is not None
        done = 0
        try:
            while done < len(data):
                done += os.pwrite(self.fd, data[done : done + _MAX_PWRITE], offset + done)
        except OSError as exc:
            raise self._named(exc) from exc

    def _named(self, exc: OSError) -> OSError:
        """``exc`` naming this file (a failed write or fsync names none)."""
        if exc.filename is not None or exc.errno is None:
            return exc
        return OSError(exc.errno, exc.strerror, str(self.path))

    def _kick(self) -> None:
        """Start writeback of the dirty pages; their cache is dropped once they are clean."""
        assert self.fd is not None
        self.unkicked = 0
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Check that every tensor was written, fsync and close the file."""
        if self.missing:
            raise FormatError(f"{self.path.name}: tensors {sorted(self.missing)} were never written")
        assert self.fd is not None
        try:
            os.fsync(self.fd)
        except OSError as exc:
            raise self._named(exc) from exc
        os.close(self.fd)
        self.fd = None

    def discard(self) -> None:
        """Close (if open) and remove the file: a failed write leaves nothing."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.path.unlink(missing_ok=True)
