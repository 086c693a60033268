"""Find and check the files of a safetensors checkpoint, and read their headers.

Everything here runs before any tensor data is read: which files make up the checkpoint (one file, an
index and the files it names, or a directory of files), whether they agree with each other, and each
file's header (keys, shapes, dtypes). Every problem is a :class:`FormatError` naming the file.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from pathlib import Path, PurePosixPath
from typing import NamedTuple

from safetensors import SafetensorError, safe_open

from ..errors import FormatError
from ..files import FileStamp, check_unchanged, file_kind, open_regular, read_bounded
from ..layout.dtypes import SAFETENSORS_DTYPES

__all__ = ["TensorInfo", "checkpoint_files", "scan_checkpoint", "read_header"]

log = logging.getLogger(__name__)

#: Largest header the safetensors library accepts (its own limit); larger lengths are corruption.
MAX_HEADER_BYTES = 100_000_000
#: Largest index file read (a 100k-tensor index is about 10 MB); larger is not an index.
MAX_INDEX_BYTES = 256 << 20
_SET_MEMBER = re.compile(r"(?P<stem>.+)-(?P<i>\d+)-of-(?P<n>\d+)\.safetensors")


class TensorInfo(NamedTuple):
    """Where a tensor of a checkpoint lives, its global shape and dtype name, and which version of
    its file the header was read from."""

    file: Path
    shape: tuple[int, ...]
    dtype: str
    #: the version of ``file`` the header was read from; reads check that it is still the one
    stamp: FileStamp


def read_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{key: (shape, dtype name)}`` of one safetensors file, from its header alone.

    The 8-byte header length is checked against the file size before anything parses the header;
    the header itself is parsed and validated (offsets, shapes, dtypes) by the safetensors library.

    Raises:
        FormatError: the file is not a regular file, is short, truncated, corrupt, changed while
            its header was read, or holds a dtype torch cannot cut.

    Example:
        >>> import tempfile, torch; from safetensors.torch import save_file
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_file({"w": torch.zeros(2, 3, dtype=torch.uint16)}, f"{d}/m.safetensors")
        ...     read_header(Path(d) / "m.safetensors")
        {'w': ((2, 3), 'uint16')}
    """
    return _stamped_header(path)[0]


def _stamped_header(path: Path) -> tuple[dict[str, tuple[tuple[int, ...], str]], FileStamp]:
    """The header of ``path`` and the stamp of the file it was read from."""
    fh, stamp = open_regular(path)
    try:
        with fh:
            raw = fh.read(8)
    except OSError as exc:
        raise FormatError(f"{path}: cannot read: {exc}") from exc
    size = stamp.size
    if size < 8:
        raise FormatError(
            f"{path}: {size} bytes is too short for a safetensors file (it starts with an "
            "8-byte header length); the file is truncated or not safetensors"
        )
    (n,) = struct.unpack("<Q", raw)
    if n > size - 8 or n > MAX_HEADER_BYTES:
        raise FormatError(
            f"{path}: header length {n} B runs past the end of the file ({size} B) or "
            f"beyond {MAX_HEADER_BYTES} B; the file is truncated or not safetensors"
        )
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    try:
        with safe_open(str(path), framework="pt") as fh:
            for key in fh.keys():
                piece = fh.get_slice(key)
                out[key] = (tuple(int(s) for s in piece.get_shape()), _dtype(path, key, piece.get_dtype()))
    except SafetensorError as exc:
        raise FormatError(f"{path}: corrupt safetensors header: {exc}") from exc
    check_unchanged(path, stamp)  # safetensors reopened it by name: the header is of the same file
    return out, stamp


def _dtype(path: Path, key: str, code: str) -> str:
    if code not in SAFETENSORS_DTYPES:
        raise FormatError(f"{path}: tensor {key!r} has dtype {code}, unknown to shardsync")
    name = SAFETENSORS_DTYPES[code]
    if name is None:
        raise FormatError(
            f"{path}: tensor {key!r} has sub-byte dtype {code}, which has no torch dtype "
            "with one element per value, so boxes of it cannot be cut; convert it first"
        )
    return name


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint (the file, the files its index names, or every
    ``*.safetensors`` of a directory), sorted; a ``-of-N`` set must be complete. Reads no header.

    Raises:
        FormatError: see :func:`scan_checkpoint`.

    Example:
        >>> import tempfile, torch; from safetensors.torch import save_file
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_file({"w": torch.zeros(1)}, f"{d}/model.safetensors")
        ...     [p.name for p in checkpoint_files(d)]
        ['model.safetensors']
    """
    files, _ = _files(Path(path))
    _check_sets(files)
    return files


def scan_checkpoint(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Every tensor of a checkpoint: its file, shape and dtype, from the headers alone.

    ``path`` is a ``.safetensors`` file, a ``*.safetensors.index.json``, or a directory holding
    ``model.safetensors`` (then only that file counts, as for HF's ``from_pretrained``), one index (the
    files it names) or, without either, ``*.safetensors`` files.

    Raises:
        FormatError: nothing to read; several indexes; an index that names a file outside its
            directory or a missing file, or disagrees with the files' headers; a ``-of-N`` set with a
            member missing; a key in two files; a corrupt header.

    Example:
        >>> import tempfile, torch; from safetensors.torch import save_file
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_file({"w": torch.zeros(3)}, f"{d}/model.safetensors")
        ...     scan_checkpoint(d)["w"].shape
        (3,)
    """
    files, index = _files(Path(path))
    _check_sets(files)
    found: dict[str, TensorInfo] = {}
    for f in files:
        header, stamp = _stamped_header(f)
        for key, (shape, dtype) in header.items():
            if key in found:
                raise FormatError(
                    f"tensor {key!r} is in both {found[key].file} and {f}; a checkpoint holds each tensor once"
                )
            found[key] = TensorInfo(f, shape, dtype, stamp)
    if index is not None:
        _check_index(index[0], index[1], found)
    log.debug("%s: %d tensors in %d files", path, len(found), len(files))
    return dict(sorted(found.items()))


def _files(p: Path) -> tuple[list[Path], tuple[Path, dict[str, Path]] | None]:
    """The files to read, and ``(index path, weight map)`` when an index says which."""
    if p.is_file():
        if p.name.endswith(".index.json"):
            weight_map = _weight_map(p)
            return sorted(set(weight_map.values())), (p, weight_map)
        return [p], None
    if not p.is_dir():
        problem = _not_regular(p)
        raise FormatError(f"{problem}; pass a .safetensors file, an index or a checkpoint directory")
    if (p / "model.safetensors").is_file():
        # the HF rule, which the writer's commit relies on: a single-file checkpoint wins (an index
        # beside it belongs to a save that had not committed yet)
        return [p / "model.safetensors"], None
    indexes = sorted(p.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise FormatError(f"{p} holds several indexes ({', '.join(i.name for i in indexes)}); pass the one to read")
    if indexes:
        return _files(indexes[0])
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FormatError(f"{p} holds no *.safetensors file")
    odd = [_not_regular(f) for f in files if not f.is_file()]
    if odd:
        raise FormatError(
            f"{p} holds *.safetensors names that are not regular files: {'; '.join(odd)} "
            "(remove them, or pass the checkpoint's files by an index)"
        )
    return files, None


def _not_regular(p: Path) -> str:
    """Why ``p``, which is not a regular file, cannot be read, in words."""
    try:
        return f"{p} is {file_kind(os.stat(p))}, not a regular file"
    except FileNotFoundError:
        return f"{p} does not exist" if not p.is_symlink() else f"{p} is a link to a missing file"
    except OSError as exc:
        return f"{p}: cannot stat: {exc.strerror or exc}"


def _weight_map(index: Path) -> dict[str, Path]:
    text = read_bounded(index, MAX_INDEX_BYTES)
    try:
        doc = json.loads(text)
        weight_map = doc["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ValueError("'weight_map' must map tensor names to file names")
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise FormatError(
            f"{index}: not a safetensors index (a JSON object with a 'weight_map' of tensor name -> file name): {exc}"
        ) from exc
    outside = sorted({v for v in weight_map.values() if _escapes(v)})
    if outside:
        raise FormatError(
            f"{index} names files outside its directory: {', '.join(outside)}; an index may name only files next to it"
        )
    out = {k: index.parent / v for k, v in weight_map.items()}
    absent = sorted({f for f in out.values() if not f.is_file()})
    missing = [f.name for f in absent if not os.path.lexists(f)]
    if missing:
        raise FormatError(f"{index} names missing files: {', '.join(missing)}")
    if absent:
        raise FormatError(f"{index} names files that cannot be read: {'; '.join(_not_regular(f) for f in absent)}")
    return out


def _escapes(name: str) -> bool:
    # Lexical: symlinks inside the directory are followed (the Hugging Face cache links to blobs).
    parts = PurePosixPath(name.replace("\\", "/")).parts
    return not parts or parts[0] == "/" or ":" in parts[0] or ".." in parts


def _check_sets(files: list[Path]) -> None:
    """Every ``<stem>-<i>-of-<n>.safetensors`` set among ``files`` has all n members on disk."""
    problems = []
    seen = set()
    for f in files:
        m = _SET_MEMBER.fullmatch(f.name)
        if m is None or (f.parent, m["stem"], m["n"]) in seen:
            continue
        seen.add((f.parent, m["stem"], m["n"]))
        width, n = len(m["i"]), int(m["n"])
        names = [f"{m['stem']}-{i:0{width}d}-of-{m['n']}.safetensors" for i in range(1, n + 1)]
        missing = [nm for nm in names if not (f.parent / nm).is_file()]
        if missing:
            problems.append(f"{f.parent}: {', '.join(missing)} missing from a set of {n}")
    if problems:
        raise FormatError("incomplete checkpoint (still being written, or copied in part):\n  " + "\n  ".join(problems))


def _check_index(index: Path, weight_map: dict[str, Path], found: dict[str, TensorInfo]) -> None:
    problems = []
    for key, file in sorted(weight_map.items()):
        if key not in found or found[key].file != file:
            where = f"it is in {found[key].file.name}" if key in found else "no file it names holds it"
            problems.append(f"{key!r} is mapped to {file.name} but {where}")
    problems += [
        f"{key!r} is in {info.file.name} but the index does not name it"
        for key, info in found.items()
        if key not in weight_map
    ]
    if problems:
        shown = problems[:10] + ([f"... and {len(problems) - 10} more"] if len(problems) > 10 else [])
        raise FormatError(
            f"{index} disagrees with the files it names (a stale or hand-edited index?):\n  " + "\n  ".join(shown)
        )
