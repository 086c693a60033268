"""A safetensors checkpoint that changes while a stream reads it: replaced (a new file renamed over
it) or rewritten in place. The stream yields the old values only, then raises a FormatError naming
the file; never a mix of old and new tensors, and never a SIGBUS from a mapping cut short.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import shardsync.sources.safetensors as st_source
from shardsync import full_params
from shardsync.errors import FormatError
from shardsync.files import FileStamp, check_unchanged
from shardsync.sources import SafetensorsSource

KEYS = [f"layers.{i}.w" for i in range(7)]


def _state(sign: float) -> dict[str, torch.Tensor]:
    return {k: sign * (torch.arange(127.0) + 1000 * i) for i, k in enumerate(KEYS)}


def _stream_with_change(path: Path, change: Callable[[], None]) -> tuple[dict[str, torch.Tensor], FormatError | None]:
    """Stream ``path`` target by target; ``change`` runs once the first target was yielded."""
    got: dict[str, torch.Tensor] = {}
    try:
        for name, tensor in full_params(str(path), bucket_bytes=127 * 4):
            got[name] = tensor.clone()
            if len(got) == 1:
                change()
    except FormatError as exc:
        return got, exc
    return got, None


@pytest.fixture(autouse=True)
def reopen_every_read(monkeypatch: pytest.MonkeyPatch) -> None:
    # the reader reopens a file after REMAP_BYTES; a small checkpoint reaches that only if it is small
    monkeypatch.setattr(st_source, "REMAP_BYTES", 1)


def test_file_replaced_mid_stream_gives_old_values_then_an_error(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file(_state(1.0), str(path))
    save_file(_state(-1.0), str(tmp_path / "new.safetensors"))
    got, err = _stream_with_change(path, lambda: os.replace(tmp_path / "new.safetensors", path))
    old = _state(1.0)
    assert got and all(torch.equal(t, old[k]) for k, t in got.items())  # never a new value
    assert len(got) < len(KEYS) and err is not None
    assert str(err) == (
        f"{path} was replaced by another file while it was read (the tensors already read "
        "come from the old file); do not write a checkpoint while a stream reads it, and "
        "read it again once it is complete"
    )


def test_file_rewritten_in_place_mid_stream_raises(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file(_state(1.0), str(path))
    save_file(_state(-1.0), str(tmp_path / "new.safetensors"))
    new_bytes = (tmp_path / "new.safetensors").read_bytes()

    def rewrite() -> None:
        time.sleep(0.05)  # past the file system's timestamp granularity, as any real writer is
        with open(path, "r+b") as fh:
            fh.write(new_bytes)

    got, err = _stream_with_change(path, rewrite)
    old = _state(1.0)
    assert got and all(torch.equal(t, old[k]) for k, t in got.items())
    assert err is not None and str(err).startswith(f"{path} was rewritten in place while it was read")


def test_file_cut_short_between_reads_is_a_format_error(tmp_path: Path) -> None:
    # in a child process: touching a mapping past the file's new end can kill it (SIGBUS)
    path = tmp_path / "model.safetensors"
    save_file(_state(1.0), str(path))
    code = textwrap.dedent(f"""
        import os, time
        import shardsync.sources.safetensors as s
        from shardsync.errors import FormatError
        from shardsync.sources import SafetensorsSource
        from shardsync.layout import Box
        s.REMAP_BYTES = 1 << 40  # keep one mapping open, as a large file would
        src = SafetensorsSource({str(path)!r})
        src.read("layers.0.w", Box((0,), (127,)))
        time.sleep(0.05)
        os.truncate({str(path)!r}, 200)
        try:
            src.read("layers.6.w", Box((0,), (127,)))
        except FormatError as exc:
            print("FormatError:", exc)
        """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout.startswith(f"FormatError: {path} was rewritten in place while it was read")


def test_unchanged_file_streams_whole(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file(_state(1.0), str(path))
    got, err = _stream_with_change(path, lambda: None)
    assert err is None and got.keys() == set(KEYS)
    assert all(torch.equal(t, _state(1.0)[k]) for k, t in got.items())


def test_check_unchanged_tells_replaced_from_rewritten_and_gone(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 17)
    stamp = FileStamp.of(os.stat(path))
    check_unchanged(path, stamp)
    os.utime(path, ns=(stamp.mtime_ns + 10**9, stamp.mtime_ns + 10**9))
    with pytest.raises(FormatError, match="rewritten in place"):
        check_unchanged(path, stamp)
    (tmp_path / "g").write_bytes(b"x" * 17)
    os.replace(tmp_path / "g", path)
    with pytest.raises(FormatError, match="replaced by another file"):
        check_unchanged(path, stamp)
    path.unlink()
    with pytest.raises(FormatError, match="changed while it was read \\(it is gone"):
        check_unchanged(path, stamp)


def test_source_remembers_the_file_its_headers_came_from(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file(_state(1.0), str(path))
    src = SafetensorsSource(path)
    assert {info.stamp for info in src.tensors.values()} == {FileStamp.of(os.stat(path))}
