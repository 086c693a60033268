"""Layer 4: running plans (local copies, collectives) and cross-rank phases."""

from __future__ import annotations

from .phases import agree, data_phase, group_rank, group_size, is_distributed

__all__ = ["agree", "data_phase", "group_rank", "group_size", "is_distributed"]
