"""Layer 5: sinks and sources (safetensors writer)."""

from __future__ import annotations

from .safetensors_writer import SafetensorsWriter, WriteResult, parse_size, save_safetensors

__all__ = ["SafetensorsWriter", "WriteResult", "parse_size", "save_safetensors"]
