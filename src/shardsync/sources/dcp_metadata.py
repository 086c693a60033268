"""Read a DCP ``.metadata`` file without running code from it.

DCP metadata is a pickle, and a plain ``pickle.load`` calls whatever the file names (a crafted one
runs a shell command). :func:`read_metadata` unpickles with an allow-list instead, as
``torch.load(weights_only=True)`` does for tensor data: only the classes DCP metadata is made of
(the dataclasses of ``torch.distributed.checkpoint.metadata``, DCP's storage info, ``torch.Size``,
dtypes and layouts, paths); any other name is a :class:`FormatError` before it is looked up.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from ..errors import FormatError

__all__ = ["read_metadata", "ALLOWED"]

#: ``module -> names`` that DCP metadata may name (torch 2.x writers; ``*``: every class and enum the
#: module itself defines, which are all plain data).
ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({"*"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.distributed._shard.sharded_tensor.metadata": frozenset({"TensorProperties",
                                                                    "MEM_FORMAT_ENCODING"}),
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
        raise FormatError(f"{self.path}: names {module}.{name}, which DCP metadata is not made of; "
                          "refusing to load it (a crafted or foreign file: unpickling it could run code)")


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
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            ImportError, IndexError, KeyError, RecursionError, MemoryError) as exc:
        raise FormatError(f"{path}: cannot read DCP metadata (not written by "
                          f"torch.distributed.checkpoint.save?): {type(exc).__name__}: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise FormatError(f"{path}: holds a {type(metadata).__name__}, not DCP Metadata")
    if getattr(metadata, "storage_meta", None) is None:  # as torch's FileSystemReader.read_metadata
        metadata.storage_meta = StorageMeta()
    return metadata
