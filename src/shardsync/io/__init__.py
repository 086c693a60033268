"""Layer 5: sinks and sources (safetensors writer and reader, the crash-safe commit).

The orchestrators that write whole checkpoints from a stream live in :mod:`shardsync.io.save_hf`
(HuggingFace safetensors) and :mod:`shardsync.io.dcp_writer` (torch DCP); they are exported from
:mod:`shardsync` as ``save_hf`` and ``save``.
"""

from __future__ import annotations

from .safetensors_reader import checkpoint_files, read_layout, read_tensors
from .safetensors_writer import SafetensorsWriter, WriteResult, parse_size, save_safetensors

__all__ = ["SafetensorsWriter", "WriteResult", "parse_size", "save_safetensors", "checkpoint_files",
           "read_layout", "read_tensors"]
