"""Layer 5: writers only (the safetensors writer, the crash-safe commit, the checkpoint savers).

The orchestrators that write whole checkpoints from a stream live in :mod:`shardsync.io.save_hf`
(HuggingFace safetensors) and :mod:`shardsync.io.dcp_writer` (torch DCP); they are exported from
:mod:`shardsync` as ``save_hf`` and ``save``. Readers live in :mod:`shardsync.sources`
(``read_layout``, ``read_tensors`` and ``checkpoint_files`` are in
:mod:`shardsync.sources.safetensors_reader`).
"""

from __future__ import annotations

from .safetensors_writer import SafetensorsWriter, WriteResult, parse_size, save_safetensors

__all__ = ["SafetensorsWriter", "WriteResult", "parse_size", "save_safetensors"]
