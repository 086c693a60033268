"""Read a DCP ``.metadata`` file without running code from it.

DCP metadata is a pickle, and a plain ``pickle.load`` calls whatever the file names (a crafted one
runs a shell command). :func:`read_metadata` unpickles with an allow-list instead, as
``torch.load(weights_only=True)`` does for tensor data: only the classes DCP metadata is made of
(the dataclasses of ``torch.distributed.checkpoint.metadata``, DCP's storage info, ``torch.Size``,
dtypes and layouts, paths, and the save plans Megatron's dist_checkpointing stores there); any other
name is a :class:`FormatError` before it is looked up.

``read_metadata(path, plain=True)`` builds the same objects without importing
``torch.distributed.checkpoint`` (most of a second): each allowed DCP class becomes a
:class:`Record` stand-in of the same name holding the fields the file gave it, which is all a reader
needs (``DcpSource`` reads the layout and the data this way).
"""

from __future__ import annotations

import functools
import pickle
from pathlib import Path
from typing import Any

from ..errors import FormatError

__all__ = ["read_metadata", "storage_index", "storage_problems", "ALLOWED", "Record", "record_class", "is_record"]

#: ``module -> names`` that DCP metadata may name (torch 2.x writers; ``*``: every class and enum the
#: module itself defines, which are all plain data).
ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({"*"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    # the save plans Megatron's dist_checkpointing keeps in the metadata (plain dataclasses and enums)
    "torch.distributed.checkpoint.planner": frozenset({"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"}),
    "torch.distributed._shard.sharded_tensor.metadata": frozenset({"TensorProperties", "MEM_FORMAT_ENCODING"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a layout by its name ("torch.strided")
    "torch": frozenset({"Size"}),  # and dtypes, checked by type below
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "complex"}),
}


#: The modules whose classes :func:`read_metadata` (``plain=True``) builds as records.
_DCP_MODULES = frozenset(m for m in ALLOWED if m.startswith("torch.distributed."))


class Record:
    """A stand-in for an object of a DCP metadata class: the fields the file gave it, as attributes
    (a dataclass's fields; ``TensorProperties``' ``dtype``; an enum's ``value``).

    Example:
        >>> r = record_class("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata")()
        >>> r.__setstate__({"offsets": (0,), "sizes": (2,)})
        >>> r.qualname, r.sizes
        ('torch.distributed.checkpoint.metadata.ChunkStorageMetadata', (2,))
    """

    qualname = "?"

    def __init__(self, *args: Any) -> None:
        if args:
            self.value = args[0]  # an enum member, by its value

    def __setstate__(self, state: Any) -> None:
        if self.qualname.endswith(".TensorProperties") and isinstance(state, tuple):
            self.dtype = state[0]  # TensorProperties.__getstate__: (dtype, layout, requires_grad, ...)
            return
        if isinstance(state, tuple) and len(state) == 2:  # (__dict__, __slots__ values)
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"{self.qualname}: unexpected state {type(state).__name__}")
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"<{self.qualname} {self.__dict__!r}>"


@functools.cache
def record_class(module: str, name: str) -> type[Record]:
    """The stand-in class for DCP class ``module.name`` (one per name)."""
    return type(name, (Record,), {"qualname": f"{module}.{name}"})


def is_record(obj: Any, name: str) -> bool:
    """Whether ``obj`` is a stand-in of the DCP class called ``name`` (``"TensorStorageMetadata"``)."""
    return isinstance(obj, Record) and type(obj).__name__ == name


class _Unpickler(pickle.Unpickler):
    def __init__(self, fh: Any, path: Path, plain: bool = False) -> None:
        super().__init__(fh)
        self.path, self.plain = path, plain

    def find_class(self, module: str, name: str) -> Any:
        allowed = ALLOWED.get(module, frozenset())
        if name in allowed or ("*" in allowed and not name.startswith("__")):
            if self.plain and module in _DCP_MODULES:
                return record_class(module, name)
            found = super().find_class(module, name)
            if "*" not in allowed or (isinstance(found, type) and found.__module__ == module):
                return found
        if module == "torch" and not name.startswith("_"):
            import torch

            if isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        raise FormatError(
            f"{self.path}: names {module}.{name}, which DCP metadata is not made of; "
            "refusing to load it (a crafted or foreign file: unpickling it could run code)"
        )


def read_metadata(path: Path, plain: bool = False) -> Any:
    """The ``Metadata`` in DCP metadata file ``path``, unpickled with the allow-list; with ``plain``,
    of :class:`Record` stand-ins (``torch.distributed.checkpoint`` is not imported).

    Raises:
        FormatError: the file names a class outside :data:`ALLOWED`, is not a pickle, or holds
            something other than DCP ``Metadata``.

    Example:
        >>> import tempfile; import torch, torch.distributed.checkpoint as dcp
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = dcp.save({"w": torch.zeros(2)}, checkpoint_id=d, no_dist=True)
        ...     sorted(read_metadata(Path(d) / ".metadata").state_dict_metadata)
        ['w']
    """
    try:
        with open(path, "rb") as fh:
            metadata = _Unpickler(fh, path, plain).load()
    except FormatError:
        raise
    except (
        OSError,
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        ImportError,
        IndexError,
        KeyError,
        RecursionError,
        MemoryError,
    ) as exc:
        raise FormatError(
            f"{path}: cannot read DCP metadata (not written by "
            f"torch.distributed.checkpoint.save?): {type(exc).__name__}: {exc}"
        ) from exc
    if plain:
        if not is_record(metadata, "Metadata"):
            raise FormatError(f"{path}: holds a {type(metadata).__name__}, not DCP Metadata")
        if not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
            raise FormatError(f"{path}: DCP Metadata without its state_dict_metadata; the file is corrupt")
        return metadata
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    if not isinstance(metadata, Metadata):
        raise FormatError(f"{path}: holds a {type(metadata).__name__}, not DCP Metadata")
    if getattr(metadata, "storage_meta", None) is None:  # as torch's FileSystemReader.read_metadata
        metadata.storage_meta = StorageMeta()
    return metadata


def storage_index(metadata: Any) -> dict[tuple[str, tuple[int, ...]], Any]:
    """``(fqn, chunk offsets) -> storage info`` (where each chunk's bytes are), for either kind of
    metadata :func:`read_metadata` returns."""
    storage = metadata.storage_data or {}
    return {(k.fqn, tuple(k.offset)): v for k, v in storage.items() if getattr(k, "offset", None) is not None}


def storage_problems(directory: Path, metadata: Any, fqns: Any) -> list[str]:
    """What keeps the chunks of tensors ``fqns`` from being read: a chunk the storage data does not
    place, a data file that is missing, or a chunk that runs past its file's end.

    Example:
        >>> import tempfile; import torch, torch.distributed.checkpoint as dcp
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = dcp.save({"w": torch.zeros(2)}, checkpoint_id=d, no_dist=True)
        ...     md = read_metadata(Path(d) / ".metadata")
        ...     storage_problems(Path(d), md, ["w"])
        []
    """
    storage = storage_index(metadata)
    sizes: dict[str, int] = {}
    problems = []
    for fqn in fqns:
        for chunk in metadata.state_dict_metadata[fqn].chunks:
            info = storage.get((fqn, tuple(chunk.offsets)))
            where = f"{fqn!r} chunk at {list(chunk.offsets)}"
            if info is None:
                problems.append(f"{where} is in no data file (the storage data does not place it)")
                continue
            name = str(info.relative_path)
            if name not in sizes:
                file = directory / name
                sizes[name] = file.stat().st_size if file.is_file() else -1
            if sizes[name] < 0:
                problems.append(f"{where}: its data file {name} is missing")
            elif info.offset < 0 or info.length < 0 or info.offset + info.length > sizes[name]:
                problems.append(
                    f"{where}: bytes {info.offset}..{info.offset + info.length} of {name} "
                    f"run past its end ({sizes[name]} B)"
                )
    return problems
