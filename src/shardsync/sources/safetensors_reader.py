"""Read safetensors checkpoints whole: the layout, or every tensor (small checkpoints, tests).

Both are thin wrappers over :class:`shardsync.sources.SafetensorsSource`, which checks the files and
reads boxes lazily; stream large checkpoints with ``full_params(path)`` instead of loading them.
"""

from __future__ import annotations

import os

import torch

from ..layout.meta import GlobalLayout
from .safetensors import SafetensorsSource
from .safetensors_files import checkpoint_files

__all__ = ["checkpoint_files", "read_layout", "read_tensors"]


def read_layout(path: str | os.PathLike) -> GlobalLayout:
    """The layout of a checkpoint from its headers alone (no tensor data is read).

    Raises:
        FormatError: see :class:`~shardsync.sources.SafetensorsSource`.

    Example:
        >>> import tempfile; from safetensors.torch import save_file
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_file({"w": torch.zeros(2, 3)}, f"{d}/model.safetensors")
        ...     read_layout(d)["w"].shape
        (2, 3)
    """
    return GlobalLayout.merge([SafetensorsSource(path).entries()])


def read_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, loaded into CPU memory.

    Raises:
        FormatError: see :class:`~shardsync.sources.SafetensorsSource`.

    Example:
        >>> import tempfile; from safetensors.torch import save_file
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_file({"w": torch.ones(2)}, f"{d}/model.safetensors")
        ...     read_tensors(d)["w"].tolist()
        [1.0, 1.0]
    """
    source = SafetensorsSource(path)
    try:
        return {e.key: source.read(e.key, e.box) for e in source.entries()}
    finally:
        source.close()
