"""The 2-D mesh transport (Paddle's H/V path) and discovery of this rank's place in the mesh."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Union

import torch
import torch.distributed as dist

from ..dist import GroupRanks, transport_errors, wait_for
from ..errors import PlanError
from ..planning.mesh import Topology
from ..planning.model import Step
from .stats import Stats
from .transport import PacketIO, Pending, Plain, Posted, Received, landing

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MeshGroups", "MeshLike", "MeshPlace", "mesh_groups", "local_mesh_info", "MeshTransport"]


class MeshGroups(NamedTuple):
    """The groups of a 2-D mesh this rank belongs to.

    Example:
        >>> MeshGroups(None, None).vertical is None
        True
    """

    horizontal: ProcessGroup
    vertical: ProcessGroup | None  # None: a single row


class MeshPlace(NamedTuple):
    """This rank's horizontal and vertical groups, as ranks of the stream's group (group-rank order).

    Example:
        >>> MeshPlace(horizontal=(2, 3), vertical=(1, 3)).horizontal.index(3)   # rank 3's column
        1
    """

    horizontal: tuple[int, ...]
    vertical: tuple[int, ...]


#: What ``mesh=`` accepts: a 2-D DeviceMesh, or (horizontal group, vertical group or None).
MeshLike = Union["DeviceMesh", tuple["ProcessGroup", Union["ProcessGroup", None]]]


def mesh_groups(mesh: MeshLike) -> MeshGroups:
    """Normalise ``mesh``: a 2-D DeviceMesh (dim 1 horizontal, dim 0 vertical) or ``(h, v)`` groups.

    Raises:
        PlanError: ``mesh`` is neither.

    Example:
        >>> mesh_groups("2x2")
        Traceback (most recent call last):
        ...
        shardsync.errors.PlanError: mesh must be a 2-D DeviceMesh or (horizontal group, ...); got str
    """
    from torch.distributed.device_mesh import DeviceMesh  # local: a plain process never needs it

    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 2:
            raise PlanError(
                f"mesh2d needs a 2-D DeviceMesh, got {mesh.ndim} dims; pass "
                "(horizontal group, vertical group) for other shapes"
            )
        return MeshGroups(mesh.get_group(1), mesh.get_group(0))
    if isinstance(mesh, (tuple, list)) and len(mesh) == 2 and mesh[0] is not None:
        return MeshGroups(mesh[0], mesh[1])
    raise PlanError(f"mesh must be a 2-D DeviceMesh or (horizontal group, vertical group); got {type(mesh).__name__}")


def local_mesh_info(groups: MeshGroups, ranks: GroupRanks) -> MeshPlace:
    """This rank's place in the mesh, in ranks of the stream's group.

    Raises:
        PlanError: a mesh group reaches ranks outside the stream's group.

    Example:
        >>> place = local_mesh_info(mesh_groups(device_mesh), GroupRanks.of(None))  # doctest: +SKIP
    """

    def members(g: ProcessGroup | None) -> tuple[int, ...]:
        if g is None:
            return (ranks.rank,)
        glob = dist.get_process_group_ranks(g)
        outside = [r for r in glob if r not in ranks.global_ranks]
        if outside:
            raise PlanError(
                f"mesh group with global ranks {glob} reaches global ranks {outside} outside "
                "the stream's group; build the mesh from the same ranks"
            )
        return tuple(ranks.global_ranks.index(r) for r in glob)

    return MeshPlace(members(groups.horizontal), members(groups.vertical))


class MeshTransport(Plain):
    """``mesh_hv`` and ``mesh_global`` steps over a 2-D mesh.

    ``mesh_hv``: each column's read is broadcast down the column from its sender (the vertical group),
    then every row all_gathers the columns' buffers (the horizontal group). ``mesh_global``: one read
    is broadcast down its column, then across every row from that column. The two stages run on
    different groups and the second reads what the first wrote, so a step runs to completion in
    :meth:`start` (its handle is already done).

    Example:
        >>> transport = MeshTransport(GroupRanks.of(None), mesh_groups(mesh), plan.topology)  # doctest: +SKIP
    """

    def __init__(self, ranks: GroupRanks, groups: MeshGroups, topology: Topology) -> None:
        self.ranks = ranks
        self.h, self.v = groups.horizontal, groups.vertical
        self.topology = topology
        self.row, self.col = next(
            (i, j) for i, row in enumerate(topology) for j, r in enumerate(row) if r == ranks.rank
        )

    def start(self, step: Step, io: PacketIO, stats: Stats) -> Pending:
        if step.kind == "mesh_hv":
            return Posted(got=self._hv(step, io, stats))
        if step.kind == "mesh_global":
            return Posted(got=self._global(step, io, stats))
        return Posted()

    def _down(self, buf: torch.Tensor, src: int, stats: Stats, group: ProcessGroup | None, io: PacketIO) -> None:
        with transport_errors():
            wait_for(dist.broadcast(buf, src=self.ranks.to_global(src), group=group, async_op=True), io.roll)
        stats.collectives += 1
        if src == self.ranks.rank:
            stats.bytes_sent += buf.numel()
        else:
            stats.bytes_received += buf.numel()

    def _hv(self, step: Step, io: PacketIO, stats: Stats) -> list[Received]:
        me, pk = self.ranks.rank, step.packets[self.col]
        n, ncols = pk.nbytes, len(self.topology[0])
        buf = io.fill(pk) if pk.src == me else landing(pk, io) if pk.src >= 0 else io.buffer(n)
        if pk.src >= 0 and len(self.topology) > 1:
            self._down(buf, pk.src, stats, self.v, io)
        outs = [
            landing(p, io) if p.src >= 0 and c != self.col and p.src != me else io.buffer(n)
            for c, p in enumerate(step.packets)
        ]
        with transport_errors():
            wait_for(dist.all_gather(outs, buf, group=self.h, async_op=True), io.roll)
        stats.collectives += 1
        stats.bytes_sent += n
        stats.bytes_received += n * (ncols - 1)
        got = [Received(p, outs[c]) for c, p in enumerate(step.packets) if p.src >= 0 and c != self.col]
        if pk.src >= 0 and pk.src != me:
            got.append(Received(pk, buf))
        return got

    def _global(self, step: Step, io: PacketIO, stats: Stats) -> list[Received]:
        me, pk = self.ranks.rank, step.packets[0]
        src_col = next(j for row in self.topology for j, r in enumerate(row) if r == pk.src)
        buf = io.fill(pk) if pk.src == me else landing(pk, io)
        if self.col == src_col and len(self.topology) > 1:
            self._down(buf, pk.src, stats, self.v, io)
        if len(self.topology[0]) > 1:
            self._down(buf, self.topology[self.row][src_col], stats, self.h, io)
        return [Received(pk, buf)] if pk.src != me else []
