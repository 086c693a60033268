"""Write streamed ``(name, tensor)`` pairs as HuggingFace-style safetensors: sharded files plus
``model.safetensors.index.json``, committed crash-safely (see :mod:`shardsync.io.commit`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

from ..errors import FormatError
from ..layout.dtypes import dtype_name
from ..sizes import parse_size  # exported here too: shardsync.io.parse_size
from .commit import CheckpointNames, commit, new_tag, output_dir, prepare_directory, remove_uncommitted
from .rank_files import FileWriter, in_flight
from .safetensors_file import TensorSpec, header

__all__ = [
    "SafetensorsWriter",
    "WriteResult",
    "save_safetensors",
    "parse_size",
    "starts_new_shard",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriteResult:
    """What was written: final file paths (in order), the index path (None for one file), totals."""

    files: tuple[Path, ...]
    index: Path | None
    num_tensors: int
    total_bytes: int


def starts_new_shard(pending_bytes: int, nbytes: int, limit: int) -> bool:
    """HuggingFace's packing rule: a tensor that would overflow a non-empty shard starts the next one
    (so a tensor larger than the limit gets a shard of its own).

    Example:
        >>> starts_new_shard(0, 900, 100), starts_new_shard(60, 50, 100)
        (False, True)
    """
    return pending_bytes > 0 and pending_bytes + nbytes > limit


class SafetensorsWriter:
    """Collect tensors into shards of at most ``max_shard_bytes`` and write them as they fill.

    A full shard is handed to a writer thread (:mod:`shardsync.io.rank_files`), which writes it while
    the caller adds the next tensors.

    Call sequence: ``add(name, tensor)`` for each tensor, then ``close()``, which commits the files
    crash-safely (see :mod:`shardsync.io.commit`); used as a context manager, an exception removes
    every file written so far. A tensor larger than the limit gets a shard of its own. One shard is
    written as ``<prefix>.safetensors`` with no index, as HuggingFace does. Other files in the
    directory (``model_ema.safetensors``, ``config.json``) are never touched.

    Args:
        directory: where the files go (created if missing).
        max_shard_bytes: shard size limit, int or ``"5GB"``-style string.
        prefix: file name stem (``model`` -> ``model-00001-of-00003.safetensors``).
        metadata: extra string metadata for every file's header (``format: pt`` is always set).
        overwrite: replace an existing checkpoint with this prefix (its files are removed after the
            new ones are committed); otherwise an existing one is an error.

    Raises:
        FormatError: the directory holds a checkpoint and ``overwrite`` is False.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d, SafetensorsWriter(d) as w:
        ...     w.add("a", torch.zeros(2))
        ...     w.close().num_tensors
        1
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_shard_bytes: int | str = "5GB",
        prefix: str = "model",
        metadata: dict[str, str] | None = None,
        overwrite: bool = False,
    ) -> None:
        self.dir = output_dir(directory, "directory")
        self.limit = parse_size(max_shard_bytes)
        self.names = CheckpointNames(prefix)
        self.metadata = {"format": "pt", **(metadata or {})}
        self._old = prepare_directory(self.dir, self.names, overwrite)  # leftovers go at the commit
        self._tag = new_tag(self._old.committed + self._old.leftovers)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._temps: list[Path] = []
        self._writer = FileWriter(in_flight(self.limit))  # with the shard held: at most about two shards
        self._weight_map: dict[str, int] = {}
        self._total = 0
        self._closed = False

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor; writes a shard when the next tensor would overflow it."""
        if name in self._weight_map or name in self._pending:
            raise FormatError(f"tensor {name!r} added twice")
        nbytes = tensor.numel() * tensor.element_size()
        header([TensorSpec(name, dtype_name(tensor.dtype), tuple(tensor.shape))], self.metadata)  # writable?
        if starts_new_shard(self._pending_bytes, nbytes, self.limit):
            self._flush()
        self._pending[name] = tensor.detach().cpu()  # a device tensor is released at once
        self._pending_bytes += nbytes
        self._total += nbytes

    def _flush(self) -> None:
        tmp = self.dir / self.names.temp(self._tag, f"{len(self._temps) + 1:05d}")
        self._temps.append(tmp)
        f = len(self._temps) - 1
        specs = [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in self._pending.items()]
        self._writer.open(f, tmp, specs, self.metadata)
        for name, tensor in self._pending.items():
            self._writer.write(f, name, tensor)
            self._weight_map[name] = f
        self._writer.close(f)
        log.debug("wrote shard %s (%d tensors, %d bytes)", tmp.name, len(self._pending), self._pending_bytes)
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> WriteResult:
        """Write the last shard and commit: rename shards to their final names, then the index."""
        if self._closed:
            raise FormatError("writer already closed")
        try:
            if self._pending or not self._temps:
                self._flush()
            self._writer.finish()
        except BaseException:
            self.abort()
            raise
        try:
            files, index = commit(
                self.dir, self.names, self._temps, self._weight_map, self._total, self._old, self._tag
            )
        except BaseException:
            remove_uncommitted(self.dir, self.names)
            raise
        self._temps = []
        self._closed = True
        return WriteResult(files, index, len(self._weight_map), self._total)

    def abort(self) -> None:
        """Remove the temp files written so far; the directory keeps its old checkpoint."""
        self._writer.abort()
        self._temps, self._pending, self._closed = [], {}, True

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.close()


def save_safetensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    directory: str | os.PathLike,
    *,
    max_shard_bytes: int | str = "5GB",
    prefix: str = "model",
    metadata: dict[str, str] | None = None,
    overwrite: bool = False,
) -> WriteResult:
    """Write a stream of ``(name, tensor)`` as HF safetensors (see :class:`SafetensorsWriter`).

    Returns:
        the files written and totals. If the stream raises, nothing is left behind.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_safetensors([("w", torch.ones(3))], d).files[0].name
        'model.safetensors'
    """
    with SafetensorsWriter(
        directory, max_shard_bytes=max_shard_bytes, prefix=prefix, metadata=metadata, overwrite=overwrite
    ) as writer:
        for name, tensor in tensors:
            writer.add(name, tensor)
        return writer.close()
