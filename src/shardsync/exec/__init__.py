"""Layer 4: running plans (local copies, collectives) and cross-rank phases."""

from __future__ import annotations

from .assemble import LocalSource, cast_into, copy_piece
from .executor import STREAM_PHASE, Stats, execute
from .mesh import MeshTransport, local_mesh_info, mesh_groups
from .phases import agree, data_phase, group_rank, group_size, is_distributed
from .transport import (BroadcastTransport, GroupRanks, LocalTransport, P2PTransport, PacketIO, Pending,
                        Transport)

__all__ = ["agree", "data_phase", "group_rank", "group_size", "is_distributed", "LocalSource",
           "cast_into", "copy_piece", "execute", "STREAM_PHASE", "Stats", "Transport", "GroupRanks",
           "BroadcastTransport", "P2PTransport", "LocalTransport", "MeshTransport", "mesh_groups",
           "PacketIO", "Pending", "local_mesh_info"]
