"""Layer 5: sinks and sources (safetensors writer and reader)."""

from __future__ import annotations

from .safetensors_reader import checkpoint_files, read_layout, read_tensors
from .safetensors_writer import SafetensorsWriter, WriteResult, parse_size, save_safetensors

__all__ = ["SafetensorsWriter", "WriteResult", "parse_size", "save_safetensors", "checkpoint_files",
           "read_layout", "read_tensors"]
