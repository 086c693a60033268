"""A rank's safetensors files, written by one thread while the caller keeps producing tensors
(:class:`FileWriter`).

The caller opens a file (its tensors known from the plan), hands over each tensor as it completes and
closes the file; the thread puts each tensor at its offset (:class:`~shardsync.io.safetensors_file.
SafetensorsFile`) and fsyncs each file it closes. At most ``in_flight`` bytes are handed over and not
yet written: a caller that gets ahead waits, so the memory held stays bounded while the stream and the
disk writes overlap. A failure in the thread is raised by the caller's next call, and by ``finish``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .commit import mark_stage
from .safetensors_file import SafetensorsFile, TensorSpec

__all__ = ["FileWriter", "IN_FLIGHT", "in_flight"]

#: Bytes handed to the writer thread and not yet written, at most (one tensor larger than this is
#: handed over alone), unless the caller set a smaller bound (:func:`in_flight`).
IN_FLIGHT = 256 << 20


def in_flight(bound: int | None) -> int:
    """The writer thread's bound under a caller's ``bound`` (a memory budget, a shard size): the
    smaller of the two, so that a write with a budget holds at most about twice it.

    Example:
        >>> in_flight(None) == IN_FLIGHT, in_flight(64 << 20) == 64 << 20, in_flight(1 << 40) == IN_FLIGHT
        (True, True, True)
    """
    return IN_FLIGHT if bound is None else max(1, min(IN_FLIGHT, bound))


class FileWriter:
    """One thread writing safetensors files, fed ``open`` / ``write`` / ``close`` in order.

    Example:
        >>> import tempfile; from safetensors.torch import load_file
        >>> with tempfile.TemporaryDirectory() as d:
        ...     w = FileWriter()
        ...     w.open(0, Path(d, "m.safetensors"), [TensorSpec("w", "float32", (2,))], None)
        ...     w.write(0, "w", torch.ones(2))
        ...     w.close(0)
        ...     w.finish()
        ...     load_file(f"{d}/m.safetensors")["w"].tolist()
        [1.0, 1.0]
    """

    def __init__(self, in_flight: int = IN_FLIGHT) -> None:
        self.limit = in_flight
        self.paths: list[Path] = []  # every file opened, listed before it exists (abort removes it)
        self.error: BaseException | None = None  # the thread's first failure
        self._jobs: deque[tuple[Any, ...]] = deque()
        self._bytes = 0  # handed over, not yet written
        self._cond = threading.Condition()
        self._files: dict[Hashable, SafetensorsFile] = {}
        self._thread: threading.Thread | None = None

    def open(
        self, key: Hashable, path: Path, tensors: Sequence[TensorSpec], metadata: Mapping[str, str] | None
    ) -> None:
        """Create file ``key`` at ``path`` (it must not exist) for ``tensors``."""
        self.paths.append(path)
        self._put(("open", key, path, tuple(tensors), metadata), 0)

    def write(self, key: Hashable, name: str, tensor: torch.Tensor) -> None:
        """Hand over tensor ``name`` of file ``key`` (waits while too many bytes are in flight)."""
        t = tensor.detach()
        if t.device.type != "cpu":  # copied here, on the caller's stream; the device memory is released
            t = t.cpu()
        self._put(("write", key, name, t), t.numel() * t.element_size())

    def close(self, key: Hashable) -> None:
        """File ``key`` has all its tensors: fsync and close it (in the thread)."""
        self._put(("close", key), 0)

    def finish(self) -> None:
        """Wait until every file is written and closed; raise the thread's failure, if any."""
        self._stop()
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        """Stop, and remove every file this writer created."""
        with self._cond:
            self._jobs.clear()
            self._bytes = 0
        self._stop()
        for f in self._files.values():
            f.discard()
        self._files.clear()
        for p in self.paths:
            p.unlink(missing_ok=True)

    def _put(self, job: tuple[Any, ...], nbytes: int) -> None:
        with self._cond:
            while self.error is None and self._bytes > 0 and self._bytes + nbytes > self.limit:
                self._cond.wait()
            if self.error is not None:
                raise self.error
            self._jobs.append((*job, nbytes))
            self._bytes += nbytes
            self._cond.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="shardsync-writer", daemon=True)
            self._thread.start()

    def _stop(self) -> None:
        if self._thread is None:
            return
        with self._cond:
            self._jobs.append(("stop", 0))
            self._cond.notify_all()
        self._thread.join()
        self._thread = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    self._cond.wait()
                job = self._jobs.popleft()
            if job[0] == "stop":
                return
            try:
                if self.error is None:
                    self._do(job)
            except BaseException as exc:  # the caller raises it
                with self._cond:
                    self.error = exc
            with self._cond:
                self._bytes -= job[-1]
                self._cond.notify_all()

    def _do(self, job: tuple[Any, ...]) -> None:
        kind, key = job[0], job[1]
        if kind == "open":
            self._files[key] = SafetensorsFile(job[2], job[3], job[4])
        elif kind == "write":
            self._files[key].write(job[2], job[3])
        else:
            f = self._files.pop(key)
            f.close()
            mark_stage(f"wrote {f.path.name}")
