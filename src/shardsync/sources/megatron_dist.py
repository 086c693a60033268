"""A Megatron ``dist_checkpointing`` checkpoint (torch_dist format) as a source, per layer.

``megatron.core.dist_checkpointing.save`` writes a torch DCP directory (``.metadata``, ``__*.distcp``)
plus ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``) and ``common.pt`` (the state that
is not sharded). The model's tensors are not stored as the live model names them:

* the decoder layers are stacked: ``decoder.layers.self_attention.linear_qkv.weight`` is
  ``[num_layers, ...]``, layer ``i`` at index ``i`` of dim 0 (global layer numbers, whatever the
  pipeline split); with ``non_homogeneous_layers`` they are saved per layer
  (``decoder.layers.3.self_attention...``) instead;
* MoE experts are stacked again: ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` is
  ``[num_layers, num_experts, ...]`` (global expert ids), or saved per expert
  (``...experts.experts.5.linear_fc1.weight``), for ``SequentialMLP`` and ``GroupedMLP`` alike;
* the layer norms have Transformer Engine names whichever layer spec saved them
  (``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``);
* each tensor is global: a SwiGLU ``linear_fc1`` is ``[gate; up]``, as ``from_megatron`` gives it.

:class:`MegatronDistSource` presents every layer (and expert) as its own tensor under the name a live
model has: ``decoder.layers.{i}.<rest>`` and ``decoder.layers.{i}.mlp.experts.local_experts.{e}.<rest>``,
so the shipped ``megatron-llama-te`` mapping (or ``megatron-llama`` with ``norms="local"``) reads a
checkpoint as it reads ``from_megatron(model)``. A read of one layer asks the DCP source for that
layer's box of the stacked tensor: only the chunks that overlap it are loaded. Optimizer state
(``optimizer.*``) and non-tensor entries (``_extra_state``) are left out.

Megatron is not needed: the format is torch DCP, read through :class:`~shardsync.sources.DcpSource`.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Literal

import torch

from ..errors import FormatError, LayoutError
from ..layout.box import Box
from ..layout.meta import LayoutEntry
from .dcp import METADATA_FILE, DcpSource
from .megatron_config import checkpoint_config, load_common

__all__ = ["MegatronDistSource", "is_megatron_dist", "MEGATRON_METADATA_FILE", "COMMON_FILE"]

log = logging.getLogger(__name__)

#: The file ``dist_checkpointing.save`` writes to say which backend holds the sharded tensors.
MEGATRON_METADATA_FILE = "metadata.json"
#: The file holding the state that is not sharded (``torch.save`` of a dict).
COMMON_FILE = "common.pt"

_LAYERS = "decoder.layers."
_STACKED_EXPERTS = re.compile(r"^(?P<head>.*?\bexperts\.)experts\.(?P<tail>\D.*)$")
_ONE_EXPERT = re.compile(r"^(?P<head>.*?\bexperts\.)experts\.(?P<id>\d+)\.(?P<tail>.*)$")
#: Transformer Engine norm names -> the local layer spec's (``norms="local"``).
_LOCAL_NORMS = {
    "self_attention.linear_qkv.layer_norm_": "input_layernorm.",
    "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm.",
}


def is_megatron_dist(path: Path) -> bool:
    """Whether ``path`` is a directory written by ``megatron.core.dist_checkpointing.save``.

    Example:
        >>> is_megatron_dist(Path("/nonexistent"))
        False
    """
    return (path / MEGATRON_METADATA_FILE).is_file() and (path / COMMON_FILE).is_file()


def _check_backend(path: Path) -> None:
    """FormatError unless metadata.json names the torch_dist backend and the DCP metadata is there."""
    meta = path / MEGATRON_METADATA_FILE
    try:
        backend = json.loads(meta.read_text()).get("sharded_backend")
    except (OSError, ValueError, AttributeError, RecursionError) as exc:
        raise FormatError(
            f"{meta}: not the metadata.json of a Megatron dist_checkpointing checkpoint ({type(exc).__name__}: {exc})"
        ) from exc
    if backend != "torch_dist":
        raise FormatError(
            f"{path}: a Megatron dist_checkpointing checkpoint with sharded_backend "
            f"{backend!r}; only 'torch_dist' (the default since megatron-core 0.7) is read: "
            "convert it with Megatron first (dist_checkpointing.load, then save)"
        )
    if not (path / METADATA_FILE).is_file():
        raise FormatError(
            f"{path}: metadata.json says torch_dist but there is no {METADATA_FILE}; the "
            "checkpoint is incomplete (was the save interrupted?)"
        )


def _split(key: str) -> tuple[str, int]:
    """A checkpoint key as the live name with ``{}`` for each stacked index, and how many there are."""
    key = key.replace("{", "{{").replace("}", "}}")  # the result is a format string
    if not key.startswith(_LAYERS):
        return key, 0
    rest, stacked = key[len(_LAYERS) :], 0
    if not rest[:1].isdigit():
        rest, stacked = "{}." + rest, 1
    if m := _STACKED_EXPERTS.match(rest):
        rest, stacked = f"{m['head']}local_experts.{{}}.{m['tail']}", stacked + 1
    elif m := _ONE_EXPERT.match(rest):
        rest = f"{m['head']}local_experts.{m['id']}.{m['tail']}"
    return _LAYERS + rest, stacked


class MegatronDistSource:
    """A Megatron ``dist_checkpointing`` checkpoint (torch_dist) read per layer under live names.

    Only trusted checkpoints may be read: the DCP metadata is unpickled (see :mod:`.dcp`).

    Args:
        path: the checkpoint directory (holding ``metadata.json``, ``common.pt``, ``.metadata``).
        norms: ``"te"`` keeps the Transformer Engine norm names the checkpoint holds (for the
            ``megatron-llama-te`` mapping); ``"local"`` renames them as the local layer spec has them
            (``input_layernorm.weight``, ``pre_mlp_layernorm.weight``; for ``megatron-llama``).

    Raises:
        FormatError: not a torch_dist checkpoint, or a stacked tensor without the dims its name says.
        LayoutError: ``norms`` is neither ``"te"`` nor ``"local"``.

    Example:
        >>> MegatronDistSource("/nonexistent")
        Traceback (most recent call last):
        ...
        shardsync.errors.FormatError: /nonexistent is not a Megatron dist_checkpointing checkpoint: ...
    """

    #: every rank sees the same data at the same path
    shared = True

    def close(self) -> None:
        """Nothing to release: torch's reader opens each data file for the reads that need it."""

    def __init__(self, path: str | os.PathLike, *, norms: Literal["te", "local"] = "te") -> None:
        if norms not in ("te", "local"):
            raise LayoutError(
                f"norms={norms!r}: use 'te' (the checkpoint's Transformer Engine names) or "
                "'local' (the local layer spec's)"
            )
        self.path = Path(path)
        if not is_megatron_dist(self.path):
            raise FormatError(
                f"{self.path} is not a Megatron dist_checkpointing checkpoint: it needs "
                f"{MEGATRON_METADATA_FILE} and {COMMON_FILE}"
            )
        _check_backend(self.path)
        self.dcp = DcpSource(self.path)
        #: live key -> (checkpoint key, stacked indices)
        self.where: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._entries: list[LayoutEntry] = []
        for e in self.dcp.entries():
            if e.key.startswith("optimizer."):
                continue
            self._add(e, norms)
        self._entries.sort(key=lambda e: (e.key, e.box.offsets))

    def _add(self, e: LayoutEntry, norms: str) -> None:
        pattern, stacked = _split(e.key)
        if norms == "local":
            for te, local in _LOCAL_NORMS.items():
                pattern = pattern.replace(te, local)
        if len(e.shape) <= stacked:
            raise FormatError(
                f"{self.path}: {e.key!r} is {list(e.shape)}, but its name says {stacked} "
                "stacked dims (layers, experts) before the tensor's own"
            )
        ranges = [range(o, o + s) for o, s in zip(e.box.offsets[:stacked], e.box.sizes[:stacked])]
        box = Box(e.box.offsets[stacked:], e.box.sizes[stacked:])
        for index in itertools.product(*ranges):
            key = pattern.format(*index)
            self.where[key] = (e.key, index)
            self._entries.append(LayoutEntry(key, e.shape[stacked:], e.dtype, box))

    def entries(self) -> list[LayoutEntry]:
        """One entry per saved chunk of each layer (and expert), sorted by key then offsets."""
        return list(self._entries)

    def read(self, key: str, box: Box) -> torch.Tensor:
        """The data of ``box`` of one layer's tensor: its box of the stacked tensor, through DCP.

        Raises:
            LayoutError: no such tensor, or the box is outside it.
        """
        if key not in self.where:
            raise LayoutError(f"{key!r}: not in the Megatron checkpoint {self.path}")
        stacked_key, index = self.where[key]
        outer = Box(index + box.offsets, (1,) * len(index) + box.sizes)
        return self.dcp.read(stacked_key, outer).reshape(box.sizes)

    def device(self) -> torch.device:
        """Reads land in CPU memory."""
        return torch.device("cpu")

    def common(self) -> dict[str, Any]:
        """The checkpoint's ``common.pt`` (state that is not sharded), read without running its code
        (:func:`~shardsync.sources.megatron_config.load_common`): containers, namespaces, tensors
        and dtypes are rebuilt; an object of any other class the file names (Megatron's enums and
        dataclasses, or anything a crafted file asks for) is an inert
        :class:`~shardsync.sources.megatron_config.Opaque` with its name and arguments.

        Raises:
            FormatError: ``common.pt`` is not a torch.save file of a dict.
        """
        path = self.path / COMMON_FILE
        common = load_common(path)
        if not isinstance(common, dict):
            raise FormatError(f"{path}: holds a {type(common).__name__}, not the dict Megatron saves")
        return common

    def config(self) -> dict[str, Any] | None:
        """The model settings the checkpoint keeps (Megatron's saved ``args``), for
        ``Mapping.parse(..., config=source.config())``; None when ``common.pt`` holds none. Read
        without running code from the file (see :mod:`.megatron_config`).

        Raises:
            FormatError: ``common.pt`` is not a torch.save file.
        """
        return checkpoint_config(self.path)

    def __repr__(self) -> str:
        return f"MegatronDistSource({str(self.path)!r}, {len(self.where)} tensors)"
