"""Open only regular files, and know when a file changed since it was first read.

Every reader of shardsync (safetensors headers and indexes, DCP storage files, mapping files) opens
files through here. A FIFO, socket or device named like a checkpoint file would block ``open`` or
stream without end; a regular file that was replaced or rewritten while a stream reads it would mix
old and new bytes. Both become a :class:`~shardsync.errors.FormatError` naming the file, before any
data of it is used.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO, NamedTuple

from .errors import FormatError

__all__ = ["FileStamp", "file_kind", "open_regular", "read_bounded", "check_unchanged"]

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


class FileStamp(NamedTuple):
    """What identifies one version of a file: replacing it (a new inode) or rewriting it in place
    (a new size or modification time) changes the stamp."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileStamp:
        """The stamp of a ``stat`` result."""
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def file_kind(st: os.stat_result) -> str:
    """What a non-regular file is, in words ("a FIFO (named pipe)", "a directory"...).

    Example:
        >>> file_kind(os.stat("/"))
        'a directory'
    """
    return next((word for test, word in _KINDS if test(st.st_mode)), "not a regular file")


def open_regular(path: Path) -> tuple[BinaryIO, FileStamp]:
    """``path`` opened for reading, and its stamp, if it is a regular file (symlinks are followed).

    The file is opened without blocking, so a FIFO is refused instead of waiting for a writer, and
    checked on the open descriptor, so what was checked is what is read.

    Raises:
        FormatError: ``path`` is missing, unreadable, or not a regular file.

    Example:
        >>> fh, stamp = open_regular(Path(__file__)); fh.close(); stamp.size > 0
        True
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FormatError(f"{path} does not exist") from None
    except OSError as exc:
        raise FormatError(f"{path}: cannot open: {exc.strerror or exc}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise FormatError(f"{path} is {file_kind(st)}, not a regular file; only regular files are read")
    return os.fdopen(fd, "rb"), FileStamp.of(st)


def read_bounded(path: Path, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes.

    Raises:
        FormatError: as :func:`open_regular`, or the file holds more than ``limit`` bytes (checked
            while reading, so a file that grows cannot get past it).

    Example:
        >>> len(read_bounded(Path(__file__), 1 << 20)) == Path(__file__).stat().st_size
        True
    """
    fh, stamp = open_regular(path)
    with fh:
        if stamp.size > limit:
            raise FormatError(f"{path} holds {stamp.size} bytes, more than the {limit} a file of its kind may hold")
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise FormatError(f"{path} grew past {limit} bytes while it was read")
    return data


def check_unchanged(path: Path, stamp: FileStamp) -> None:
    """Raise unless ``path`` is still the file ``stamp`` was taken of, unmodified.

    Raises:
        FormatError: the file was replaced (renamed over, deleted) or rewritten since.

    Example:
        >>> fh, stamp = open_regular(Path(__file__)); fh.close(); check_unchanged(Path(__file__), stamp)
    """
    try:
        now = FileStamp.of(os.stat(path))
    except OSError as exc:
        raise FormatError(
            f"{path} changed while it was read (it is gone: {exc.strerror or exc}); "
            "read a checkpoint only once it is complete, and do not replace it while "
            "a stream reads it"
        ) from None
    if now != stamp:
        how = "replaced by another file" if now[:2] != stamp[:2] else "rewritten in place"
        raise FormatError(
            f"{path} was {how} while it was read (the tensors already read come from the "
            "old file); do not write a checkpoint while a stream reads it, and read it "
            "again once it is complete"
        )
