"""Write streamed ``(name, tensor)`` pairs as HuggingFace-style safetensors: sharded files plus
``model.safetensors.index.json``, committed atomically (temp names, renamed when complete, index last).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch
from safetensors.torch import save_file

from ..errors import FormatError

__all__ = ["SafetensorsWriter", "WriteResult", "save_safetensors", "parse_size"]

log = logging.getLogger(__name__)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int or a string like ``"5GB"``, ``"512MiB"`` (HF's convention)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", size.upper())
    if not m:
        raise ValueError(f"cannot read size {size!r}; write e.g. '5GB' or '512MiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


@dataclass(frozen=True)
class WriteResult:
    """What was written: final file paths (in order), the index path (None for one file), totals."""

    files: tuple[Path, ...]
    index: Path | None
    num_tensors: int
    total_bytes: int


class SafetensorsWriter:
    """Collect tensors into shards of at most ``max_shard_bytes`` and write them as they fill.

    Call sequence: ``add(name, tensor)`` for each tensor, then ``close()``; used as a context manager,
    an exception removes every file written so far. A tensor larger than the limit gets a shard of its
    own. One shard is written as ``<prefix>.safetensors`` with no index, as HuggingFace does.

    Args:
        directory: where the files go (created if missing).
        max_shard_bytes: shard size limit, int or ``"5GB"``-style string.
        prefix: file name stem (``model`` -> ``model-00001-of-00003.safetensors``).
        metadata: extra string metadata for every file's header (``format: pt`` is always set).
        overwrite: replace an existing checkpoint with this prefix (stale shards are removed after the
            new files are committed); otherwise an existing one is an error.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d, SafetensorsWriter(d) as w:
        ...     w.add("a", torch.zeros(2))
        ...     w.close().num_tensors
        1
    """

    def __init__(self, directory: str | os.PathLike, *, max_shard_bytes: int | str = "5GB",
                 prefix: str = "model", metadata: dict[str, str] | None = None,
                 overwrite: bool = False) -> None:
        self.dir = Path(directory)
        self.limit = parse_size(max_shard_bytes)
        self.prefix = prefix
        self.metadata = {"format": "pt", **(metadata or {})}
        self.dir.mkdir(parents=True, exist_ok=True)
        self._old = sorted(self.dir.glob(f"{prefix}*.safetensors")) + sorted(
            self.dir.glob(f"{prefix}.safetensors.index.json"))
        if self._old and not overwrite:
            raise FormatError(f"{self.dir} already holds a checkpoint ({self._old[0].name}, ...); pass "
                              "overwrite=True or choose another directory")
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._storages: set[int] = set()
        self._temps: list[Path] = []
        self._weight_map: dict[str, int] = {}
        self._total = 0
        self._closed = False

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor; writes a shard when the next tensor would overflow it."""
        if name in self._weight_map or name in self._pending:
            raise FormatError(f"tensor {name!r} added twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.limit:
            self._flush()
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        elif t.untyped_storage().data_ptr() in self._storages:
            t = t.clone()  # safetensors refuses tensors that share memory in one file
        self._storages.add(t.untyped_storage().data_ptr())
        self._pending[name] = t
        self._pending_bytes += nbytes
        self._total += nbytes

    def _flush(self) -> None:
        tmp = self.dir / f".{self.prefix}-{len(self._temps) + 1:05d}.safetensors.tmp{os.getpid()}"
        save_file(self._pending, str(tmp), metadata=self.metadata)
        for name in self._pending:
            self._weight_map[name] = len(self._temps)
        self._temps.append(tmp)
        log.debug("wrote shard %s (%d tensors, %d bytes)", tmp.name, len(self._pending),
                  self._pending_bytes)
        self._pending, self._pending_bytes, self._storages = {}, 0, set()

    def close(self) -> WriteResult:
        """Write the last shard, rename every shard to its final name, then write the index."""
        if self._closed:
            raise FormatError("writer already closed")
        if self._pending or not self._temps:
            self._flush()
        n = len(self._temps)
        names = ([f"{self.prefix}.safetensors"] if n == 1 else
                 [f"{self.prefix}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
        finals = [self.dir / nm for nm in names]
        for tmp, final in zip(self._temps, finals):
            os.replace(tmp, final)
        self._temps = []
        index = None
        if n > 1:
            index = self.dir / f"{self.prefix}.safetensors.index.json"
            doc = {"metadata": {"total_size": self._total},
                   "weight_map": {k: names[i] for k, i in sorted(self._weight_map.items())}}
            tmp = index.with_name(index.name + f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
            os.replace(tmp, index)
        for stale in self._old:
            if stale not in finals and stale != index and stale.exists():
                stale.unlink()
        self._closed = True
        return WriteResult(tuple(finals), index, len(self._weight_map), self._total)

    def abort(self) -> None:
        """Remove the temp files written so far; nothing final is left behind."""
        for tmp in self._temps:
            tmp.unlink(missing_ok=True)
        self._temps, self._pending, self._closed = [], {}, True

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.close()


def save_safetensors(tensors: Iterable[tuple[str, torch.Tensor]], directory: str | os.PathLike, *,
                     max_shard_bytes: int | str = "5GB", prefix: str = "model",
                     metadata: dict[str, str] | None = None, overwrite: bool = False) -> WriteResult:
    """Write a stream of ``(name, tensor)`` as HF safetensors (see :class:`SafetensorsWriter`).

    Returns:
        the files written and totals. If the stream raises, nothing is left behind.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_safetensors([("w", torch.ones(3))], d).files[0].name
        'model.safetensors'
    """
    with SafetensorsWriter(directory, max_shard_bytes=max_shard_bytes, prefix=prefix,
                           metadata=metadata, overwrite=overwrite) as writer:
        for name, tensor in tensors:
            writer.add(name, tensor)
        return writer.close()
