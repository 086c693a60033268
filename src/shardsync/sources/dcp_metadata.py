"""Read a DCP ``.metadata`` file without running code from it.

DCP metadata is a pickle, and a plain ``pickle.load`` calls whatever the file names (a crafted one
runs a shell command). :func:`read_metadata` unpickles with an allow-list instead, as
``torch.load(weights_only=True)`` does for tensor data: only the classes DCP metadata is made of
(the dataclasses of ``torch.distributed.checkpoint.metadata``, DCP's storage info, ``torch.Size``,
dtypes and layouts, paths, and the save plans Megatron's dist_checkpointing stores there); any other
name is a :class:`FormatError` before it is looked up.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from ..errors import FormatError

__all__ = ["read_metadata", "storage_problems", "ALLOWED"]

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


class _Unpickler(pickle.Unpickler):
    def __init__(self, fh: Any, path: Path) -> None:
        super().__init__(fh)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        allowed = ALLOWED.get(module, frozenset())
        if name in allowed or ("*" in allowed and not name.startswith("__")):
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


def read_metadata(path: Path) -> Any:
    """The ``Metadata`` in DCP metadata file ``path``, unpickled with the allow-list.

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
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    try:
        with open(path, "rb") as fh:
            metadata = _Unpickler(fh, path).load()
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
    if not isinstance(metadata, Metadata):
        raise FormatError(f"{path}: holds a {type(metadata).__name__}, not DCP Metadata")
    if getattr(metadata, "storage_meta", None) is None:  # as torch's FileSystemReader.read_metadata
        metadata.storage_meta = StorageMeta()
    return metadata


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
    from torch.distributed.checkpoint.metadata import MetadataIndex

    storage = metadata.storage_data or {}
    sizes: dict[str, int] = {}
    problems = []
    for fqn in fqns:
        for chunk in metadata.state_dict_metadata[fqn].chunks:
            info = storage.get(MetadataIndex(fqn, chunk.offsets))
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
