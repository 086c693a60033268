"""Layer 4: running plans (local copies, transports) on each rank."""

from __future__ import annotations

from .assemble import cast_into, copy_piece
from .executor import STREAM_PHASE, execute
from .mesh import MeshGroups, MeshLike, MeshPlace, MeshTransport, local_mesh_info, mesh_groups
from .multicast import MulticastTransport
from .registry import TRANSPORTS, Chosen, choose_transport, run_device, transport_for
from .stats import Stats
from .transport import BroadcastTransport, LocalTransport, P2PTransport, PacketIO, Pending, Received, Transport

__all__ = [
    "cast_into",
    "copy_piece",
    "execute",
    "STREAM_PHASE",
    "Stats",
    "Transport",
    "BroadcastTransport",
    "P2PTransport",
    "LocalTransport",
    "MeshTransport",
    "mesh_groups",
    "MeshGroups",
    "MeshLike",
    "MeshPlace",
    "PacketIO",
    "Pending",
    "Received",
    "local_mesh_info",
    "TRANSPORTS",
    "transport_for",
    "Chosen",
    "choose_transport",
    "run_device",
    "MulticastTransport",
]
