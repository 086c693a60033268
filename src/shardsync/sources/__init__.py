"""Where weights come from: the :class:`Source` protocol and its implementations.

In-memory state (:class:`LocalSource`), Hugging Face safetensors checkpoints
(:class:`SafetensorsSource`), torch Distributed Checkpoints (:class:`DcpSource`), Megatron
``dist_checkpointing`` checkpoints (:class:`MegatronDistSource`, per layer), and block-FP8 weights
read as values (:class:`Fp8Source`);
:func:`open_source` picks one for a state dict, a Source or a path. Whole-checkpoint reads of small
safetensors checkpoints: :func:`read_layout`, :func:`read_tensors` and :func:`checkpoint_files`
(:mod:`shardsync.sources.safetensors_reader`). Writers live in :mod:`shardsync.io`.
"""

from __future__ import annotations

from .base import FileSource, Source
from .dcp import DcpSource
from .fp8 import Fp8Source, dequantized
from .fp8_quantized import QuantizedSource
from .local import LocalSource
from .megatron import from_megatron
from .megatron_dist import MegatronDistSource
from .open import SourceLike, assign_boxes, open_path, open_source, spread
from .safetensors import SafetensorsSource
from .safetensors_reader import checkpoint_files, read_layout, read_tensors

__all__ = [
    "Source",
    "FileSource",
    "open_path",
    "LocalSource",
    "SafetensorsSource",
    "DcpSource",
    "MegatronDistSource",
    "SourceLike",
    "open_source",
    "assign_boxes",
    "spread",
    "from_megatron",
    "Fp8Source",
    "dequantized",
    "QuantizedSource",
    "checkpoint_files",
    "read_layout",
    "read_tensors",
]
