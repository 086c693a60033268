"""Layer 4: running plans (local copies, transports) on each rank."""

from __future__ import annotations

from .assemble import cast_into, copy_piece
from .executor import STREAM_PHASE, execute
from .mesh import MeshTransport, local_mesh_info, mesh_groups
from .multicast import MulticastTransport
from .stats import Stats
from .transport import BroadcastTransport, LocalTransport, P2PTransport, PacketIO, Pending, Transport

__all__ = ["cast_into", "copy_piece", "execute", "STREAM_PHASE", "Stats", "Transport",
           "BroadcastTransport", "P2PTransport", "LocalTransport", "MeshTransport",
           "MulticastTransport", "mesh_groups",
           "PacketIO", "Pending", "local_mesh_info"]
