"""The crash-safe commit of a HuggingFace safetensors checkpoint (a set of files).

The rule a reader follows (the same as ``transformers``' ``from_pretrained``): if
``model.safetensors`` exists, it is the checkpoint; otherwise ``model.safetensors.index.json`` is,
with exactly the files its ``weight_map`` names; without either, every complete
``model-NNNNN-of-NNNNN.safetensors`` set is (shardsync's reader reads a directory of files). Other
files with the writer's names are leftovers of an interrupted save.

The writer keeps that rule true at every instant, so a crash at any point leaves either the complete
old checkpoint or the complete new one:

1. Each shard is written under a temporary name (``.model.<tag>.00001.tmp``), created by the writer
   itself (:mod:`shardsync.io.safetensors_file`), and fsynced, so that a kill leaves no byte under a
   name the writer did not choose.
2. Once every check passed and every shard is written, leftovers of earlier killed saves (files with
   the writer's names that the rule does not select) are removed; nothing is removed before.
3. Shards are renamed to final names that collide with no file of the old checkpoint (plain HF
   names ``model-00001-of-00003.safetensors`` when those are free, else with the generation tag:
   ``model-00001-of-00003-<tag>.safetensors``); the directory is fsynced. Readers still see the old
   checkpoint: no index names the new files yet. (An old checkpoint that is a set of files without an
   index is first given an index naming exactly its files, so that the new files stay unseen.)
4. The commit, one atomic step: the new index is written to a temporary name, fsynced and renamed
   over the old index (if the old checkpoint was a single ``model.safetensors``, the commit is
   removing that file once the index is in place); a single-file result is renamed over
   ``model.safetensors``. The directory is fsynced.
5. Files of the old checkpoint with the writer's names are removed.

Only the writer's own names are ever touched: ``model.safetensors``, ``model-NNNNN-of-NNNNN.safetensors``
(with or without a tag), ``model.safetensors.index.json`` and the temporary names. Two saves into one
directory at the same time are not supported.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import secrets
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import FormatError
from ..files import file_kind, read_bounded
from ..layout.dtypes import itemsize
from ..sources.safetensors_files import read_header

__all__ = [
    "CheckpointNames",
    "check_dcp_directory",
    "DirectoryState",
    "scan",
    "prepare_directory",
    "new_tag",
    "fsync_path",
    "durable_write",
    "index_text",
    "complete_sets",
    "commit",
    "remove_files",
    "remove_uncommitted",
    "stage_hook",
    "mark_stage",
    "output_dir",
]

log = logging.getLogger(__name__)

#: Called with the name of each commit stage once it is done (``"wrote .model.<tag>.00001.tmp"``,
#: ``"committed"``...). Tests set it to kill the writer at a chosen stage; None in normal use.
stage_hook: Callable[[str], None] | None = None


def mark_stage(name: str) -> None:
    """Report that commit stage ``name`` is done (logged at debug level; see :data:`stage_hook`)."""
    log.debug("commit stage: %s", name)
    if stage_hook is not None:
        stage_hook(name)


def new_tag(avoid: Sequence[str] = ()) -> str:
    """A fresh generation tag: 8 hex digits that occur in none of the names ``avoid``.

    Example:
        >>> len(new_tag(["model-00001-of-00002-0a1b2c3d.safetensors"]))
        8
    """
    while True:
        tag = secrets.token_hex(4)
        if not any(tag in name for name in avoid):
            return tag


@dataclass(frozen=True)
class CheckpointNames:
    """The file names a checkpoint with file stem ``prefix`` uses, and a test for them.

    Example:
        >>> n = CheckpointNames("model")
        >>> n.shard(1, 3), n.shard(2, 3, "0a1b2c3d")
        ('model-00001-of-00003.safetensors', 'model-00002-of-00003-0a1b2c3d.safetensors')
        >>> [n.is_own(f) for f in ("model.safetensors", "model_ema.safetensors", ".model.0a1b2c3d.index.tmp")]
        [True, False, True]
    """

    prefix: str = "model"

    @property
    def single(self) -> str:
        return f"{self.prefix}.safetensors"

    @property
    def index(self) -> str:
        return f"{self.prefix}.safetensors.index.json"

    def shard(self, i: int, n: int, tag: str | None = None) -> str:
        """Final name of shard ``i`` (1-based) of ``n``, tagged when ``tag`` is given."""
        return f"{self.prefix}-{i:05d}-of-{n:05d}{'-' + tag if tag else ''}.safetensors"

    def temp(self, tag: str, what: str) -> str:
        """Temporary name for ``what`` (a shard number, ``index``...) of generation ``tag``."""
        return f".{self.prefix}.{tag}.{what}.tmp"

    def is_own(self, name: str) -> bool:
        """Whether ``name`` is one the writer may create (and so may remove)."""
        p = re.escape(self.prefix)
        return (
            re.fullmatch(
                rf"{p}\.safetensors|{p}\.safetensors\.index\.json|{p}-\d{{5}}-of-\d{{5}}(-[0-9a-f]{{8}})?"
                rf"\.safetensors|\.{p}\.[0-9a-f]{{8}}\..+\.tmp"
                # temporary names of shardsync 0.1 (no fsync, no tag), left behind by killed saves
                rf"|\.{p}-\d{{5}}\.safetensors\.tmp\d+|{p}\.safetensors\.index\.json\.tmp\d+",
                name,
            )
            is not None
        )


@dataclass(frozen=True)
class DirectoryState:
    """What a directory holds, by the reader's rule.

    Attributes:
        committed: file names of the checkpoint a reader sees (the index first, if any); empty when
            there is none.
        leftovers: files with the writer's names that are not part of it (interrupted saves).
    """

    committed: tuple[str, ...]
    leftovers: tuple[str, ...]


def scan(directory: Path, names: CheckpointNames) -> DirectoryState:
    """Apply the reader's rule to ``directory`` (which may not exist).

    Example:
        >>> scan(Path("/nonexistent"), CheckpointNames())
        DirectoryState(committed=(), leftovers=())
    """
    present = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    committed: tuple[str, ...] = ()
    if names.single in present:
        committed = (names.single,)
    elif names.index in present:
        try:
            weight_map = json.loads(read_bounded(directory / names.index, 256 << 20))["weight_map"]
            committed = (names.index, *sorted(set(weight_map.values())))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            committed = (names.index,)  # not ours, and not readable: protect it as it is
    else:
        committed = complete_sets(present, names)
    leftovers = tuple(f for f in present if names.is_own(f) and f not in committed)
    return DirectoryState(committed, leftovers)


def complete_sets(present: Sequence[str], names: CheckpointNames) -> tuple[str, ...]:
    """The files of every complete plain ``<prefix>-NNNNN-of-NNNNN.safetensors`` set among ``present``:
    without an index, a reader reads them as the checkpoint.

    Example:
        >>> n = CheckpointNames()
        >>> complete_sets([n.shard(1, 2), n.shard(2, 2), n.shard(1, 3)], n)
        ('model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors')
    """
    found = set(present)
    sizes = {
        int(m[1])
        for f in present
        if (m := re.fullmatch(rf"{re.escape(names.prefix)}-\d{{5}}-of-(\d{{5}})\.safetensors", f))
    }
    out = [
        names.shard(i, n)
        for n in sorted(sizes)
        if all(names.shard(i, n) in found for i in range(1, n + 1))
        for i in range(1, n + 1)
    ]
    return tuple(out)


def check_dcp_directory(path: Path, overwrite: bool) -> None:
    """Refuse ``path`` for a DCP checkpoint: a file, or a checkpoint already (unless ``overwrite``).

    Raises:
        FormatError: naming the path and the fix.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     check_dcp_directory(Path(d), overwrite=False)
    """
    if path.exists() and not path.is_dir():
        raise FormatError(f"{path} is a file, not a directory; choose a directory for the checkpoint")
    if (path / ".metadata").exists() and not overwrite:
        raise FormatError(
            f"{path} already holds a DCP checkpoint (.metadata); pass overwrite=True to "
            "replace it, or choose another directory"
        )


def output_dir(path: str | os.PathLike[str], what: str = "the output directory") -> Path:
    """``path`` as a Path, refusing an empty one (an unset variable), which would mean the working
    directory.

    Raises:
        FormatError: ``path`` is empty.

    Example:
        >>> output_dir("out")
        PosixPath('out')
    """
    if not os.fspath(path):
        raise FormatError(
            f"{what} is an empty path, which would mean the working directory; give the directory to write to"
        )
    return Path(path)


def prepare_directory(directory: Path, names: CheckpointNames, overwrite: bool) -> DirectoryState:
    """Check that ``directory`` may receive a checkpoint and create it; returns its state.

    Raises:
        FormatError: it holds a checkpoint and ``overwrite`` is False, or it is not a directory.
    """
    if directory.exists() and not directory.is_dir():
        raise FormatError(f"{directory} is a file, not a directory; choose a directory for the checkpoint")
    state = scan(directory, names)
    # temporary names (a killed save's files and work directories) are removed at the commit, whatever
    # they are; a final name must be a regular file
    finals = state.committed + tuple(f for f in state.leftovers if not f.startswith("."))
    odd = sorted(f for f in finals if os.path.lexists(directory / f) and not (directory / f).is_file())
    if odd:
        what = ", ".join(f"{f} ({_kind(directory / f)})" for f in odd)
        raise FormatError(
            f"{directory} holds {what}, where the checkpoint's files go, and not as a "
            "regular file; remove it, or choose another directory"
        )
    if state.committed and not overwrite:
        raise FormatError(
            f"{directory} already holds a checkpoint ({state.committed[0]}); pass "
            "overwrite=True to replace it, or choose another directory"
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FormatError(f"cannot create {directory}: {exc.strerror}; choose a writable directory") from exc
    return state


def _kind(path: Path) -> str:
    try:
        return file_kind(os.stat(path))
    except OSError:
        return "a link to a missing file"


def fsync_path(path: Path) -> None:
    """Flush a written file's data, or a directory's entries (renames, removals), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_write(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file and fsync it."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def remove_files(directory: Path, files: Sequence[str]) -> None:
    """Remove ``files`` (names in ``directory``; missing ones are skipped), then fsync the directory.

    A name that is a directory (``.model.<tag>.00001.dir.tmp``, the work directory earlier versions
    wrote each shard in, left by a killed save) is removed with what it holds; a symbolic link is
    removed, never followed."""
    for name in files:
        path = directory / name
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            continue
        mark_stage(f"removed {name}")
    if files:
        fsync_path(directory)


def remove_uncommitted(directory: Path, names: CheckpointNames) -> None:
    """After a failed save, remove what it wrote: every file with the writer's names that the
    reader's rule does not select. Best effort: an error here would hide the failure itself."""
    with contextlib.suppress(OSError):
        remove_files(directory, scan(directory, names).leftovers)


def index_text(weight_map: Mapping[str, str], total_size: int) -> str:
    """The index document, formatted as HuggingFace writes it.

    Example:
        >>> print(index_text({"w": "a.safetensors"}, 8), end="")
        {
          "metadata": {
            "total_size": 8
          },
          "weight_map": {
            "w": "a.safetensors"
          }
        }
    """
    doc = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def _rename(tmp: Path, final: Path) -> None:
    try:
        os.replace(tmp, final)
    except FileNotFoundError as exc:
        raise FormatError(
            f"{tmp} is missing: another save into {tmp.parent} at the same time removed "
            "it (run one save per directory at a time), or a rank wrote it where this "
            "rank cannot see it (write to a file system every rank shares)"
        ) from exc


def _index_old_set(directory: Path, names: CheckpointNames, old: DirectoryState, tag: str) -> DirectoryState:
    """Give an old checkpoint that is a set of files without an index an index naming exactly its
    files (a reader sees the same tensors), so that the new files stay unseen until the commit."""
    weight_map: dict[str, str] = {}
    total = 0
    try:
        for f in old.committed:
            for key, (shape, dtype) in read_header(directory / f).items():
                weight_map[key] = f
                total += math.prod(shape) * itemsize(dtype)
    except FormatError:  # a reader cannot read the old files either: there is nothing to keep
        return old
    tmp = directory / names.temp(tag, "old-index")
    durable_write(tmp, index_text(weight_map, total).encode())
    os.replace(tmp, directory / names.index)
    fsync_path(directory)
    mark_stage("indexed the old files")
    return DirectoryState((names.index, *old.committed), ())


def commit(
    directory: Path,
    names: CheckpointNames,
    temps: Sequence[Path],
    weight_map: Mapping[str, int],
    total_size: int,
    old: DirectoryState,
    tag: str,
) -> tuple[tuple[Path, ...], Path | None]:
    """Steps 3-5 of the protocol: publish fsynced shard files ``temps`` as the new checkpoint.

    Args:
        directory: the checkpoint directory.
        names: its file names.
        temps: the written, fsynced shard files in shard order.
        weight_map: tensor name -> shard number (0-based).
        total_size: tensor bytes, for the index.
        old: the directory's state before the save; its leftovers are removed first.
        tag: this save's generation tag.

    Returns:
        the final shard paths and the index path (None for a single file).
    """
    remove_files(directory, old.leftovers)
    n = len(temps)
    if n > 1 and old.committed and names.index not in old.committed and names.single not in old.committed:
        old = _index_old_set(directory, names, old, tag)
    if n == 1:
        _rename(temps[0], directory / names.single)
        fsync_path(directory)
        mark_stage("committed")
        new: tuple[str, ...] = (names.single,)
        index = None
    else:
        plain = [names.shard(i + 1, n) for i in range(n)]
        finals = plain if not set(plain) & set(old.committed) else [names.shard(i + 1, n, tag) for i in range(n)]
        for tmp, final in zip(temps, finals):
            _rename(tmp, directory / final)
            mark_stage(f"renamed {final}")
        fsync_path(directory)
        index = directory / names.index
        tmp = directory / names.temp(tag, "index")
        durable_write(tmp, index_text({k: finals[i] for k, i in weight_map.items()}, total_size).encode())
        mark_stage(f"wrote {tmp.name}")
        os.replace(tmp, index)
        fsync_path(directory)
        if names.single in old.committed:  # model.safetensors hides the index until it is gone
            mark_stage("index in place")
            (directory / names.single).unlink()
            fsync_path(directory)
        mark_stage("committed")
        new = (names.index, *finals)
    remove_files(directory, [f for f in old.committed if names.is_own(f) and f not in new])
    return tuple(directory / f for f in new if f != names.index), index
