"""The same-host transport: ranks on one machine exchange reads through shared memory, not sockets.

Every read a rank sends (each once, however many ranks receive it) is published in shared memory:
in place when it is a contiguous part of a tensor the caller already moved there (``share_memory_()``
- nothing is copied to publish it), otherwise copied into the rank's segment, one file in
``/dev/shm``. The receivers map what they need and copy each box straight into their targets - no
packing, no socket, no receive buffer. A read copied into the segment whose pieces cast or permute
(a transpose, a narrowing cast) is written there already in target form, piece by piece
(:func:`arranged_pieces`): its sender arranges it once, and every rank that builds those pieces - the
sender too - copies them plainly, instead of each transposing or casting on its own.

Setup is two agreed phases (:func:`shardsync.dist.agree`, so a failure on any rank is raised on all of
them):

1. ``shm publish``: each rank fills its segment - created with ``O_EXCL`` and its space reserved with
   ``posix_fallocate``, so a full ``/dev/shm`` is an error, never a ``SIGBUS`` - and says where each
   of its reads lies (segment or shared storage, and offset);
2. ``shm open``: each rank maps what it reads (a peer's shared storage through
   ``/proc/<pid>/fd/<fd>``, so peers run as the same user).

Right after the second phase - whether it succeeded or not - every rank unlinks every segment name of
the stream, so names live only for the few milliseconds of setup: a rank killed later leaves nothing
behind (the kernel frees a segment when its last mapping goes), and a rank killed during setup has its
name removed by the survivors, which know it (names are ``shardsync-<pid of rank 0>-<n>-<rank>-<pid>``,
all agreed when the layout is gathered). A segment whose creator died with every other rank (all of
them killed during setup) is removed by the next stream on the host.

Fresh shared memory fills at about a third of the speed of memory already touched, so a rank keeps its
segment, and its mappings of its peers' ones, for the next stream of the group (:func:`release` drops
them); the next stream writes into them when every rank still has them (agreed with the layout).

After setup no rank waits for another until :meth:`ShmTransport.close`, a barrier after the last
step: a rank that failed or stopped iterating still makes every other rank raise (the
``data_phase`` guarantee), and no rank writes the next stream's data while another reads this one's.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import warnings
import weakref
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from .. import phases
from ..dist import GroupRanks, agree, transport_errors
from ..errors import PlanError
from ..layout.dtypes import itemsize, to_torch_dtype
from ..mapping.pieces import Piece
from ..planning.model import Costs, Packet, Plan, Step
from ..planning.schedule import aligned
from .assemble import cast_into, piece_view
from .copies import Copies
from .hosts import SHM_DIR, HostInfo, describe_hosts, same_host
from .stats import Stats
from .transport import PacketIO, Posted, Received

__all__ = [
    "ShmTransport",
    "TransportChoice",
    "TRANSPORT_CHOICES",
    "HostChoice",
    "check_transport",
    "use_shm",
    "shm_costs",
    "cached_token",
    "release",
    "release_all",
    "group_name",
    "arranged_pieces",
    "SHM_DIR",
    "SHM_PREFIX",
]

log = logging.getLogger(__name__)

#: Every segment name starts with this.
SHM_PREFIX = "shardsync-"
#: How data moves between ranks: ``"shm"`` through shared memory (every rank on one host, CPU),
#: ``"backend"`` through the process group's collectives, ``"auto"``: shm where it applies.
TransportChoice = Literal["auto", "shm", "backend"]
TRANSPORT_CHOICES: tuple[str, ...] = ("auto", "shm", "backend")
#: What each rank reports when the layout is gathered: its host and its ``transport=`` choice.
HostChoice = tuple[HostInfo, TransportChoice]
#: Collectives of the setup (publish, open); :meth:`ShmTransport.close` adds one barrier.
SETUP_COLLECTIVES = 2


def shm_costs(plan: Plan) -> Costs:
    """The plan's costs when its reads move through shared memory: each read is written once by its
    sender and copied by each receiver; no collective moves data, three small ones synchronise (the
    two setup phases and the closing barrier); and every rank may also hold a segment of the bytes it
    sends for the whole stream (none for reads published in place; no receive or pack buffers either,
    so this stays an upper bound).

    Example:
        >>> import shardsync
        >>> plan = shardsync.plan({"w": torch.zeros(3)})   # one process: nothing is received
        >>> shm_costs(plan).collectives, shm_costs(plan).bytes_received
        ((3,), (0,))
    """
    world = plan.world_size
    sent, recv = [0] * world, [0] * world
    segment = [0] * world  # at most: every read a rank sends copied into its segment
    for r in plan.reads:
        if r.receivers and r.sender is not None:
            sent[r.sender] += r.nbytes
            segment[r.sender] += aligned(r.nbytes)
            for d in r.receivers:
                recv[d] += r.nbytes
    peak = tuple(p + s for p, s in zip(plan.costs.peak_bytes, segment))
    return Costs(tuple(sent), tuple(recv), (SETUP_COLLECTIVES + 1,) * world, peak)


def _piece_dtype(piece: Piece, dtype: str) -> str:
    return piece.casts[-1] if piece.casts else dtype


def _regions(pieces: Sequence[Piece], dtype: str) -> tuple[list[int], int]:
    """Byte offsets of ``pieces`` in target form (read dtype ``dtype``), one after another, aligned;
    and the bytes they take."""
    offsets, size = [], 0
    for p in pieces:
        offsets.append(size)
        size = aligned(size + p.target_box.numel * itemsize(_piece_dtype(p, dtype)))
    return offsets, size


def arranged_pieces(plan: Plan) -> dict[int, tuple[Piece, ...]]:
    """The reads whose sender publishes their pieces in target form rather than the read's own bytes.

    A receiver copies what it gets into its targets piece by piece, casting and permuting each as it
    goes (a transposed piece is the slow copy of them all). When a sender copies a read into its
    segment anyway, it can as well write the read's pieces already cast and permuted: each is then
    arranged once, by its sender, and every rank that builds it - the receivers, and the sender
    itself when it builds that target too - copies it plainly. So it is done for a read that some
    piece casts or permutes and whose distinct pieces, so written, take no more bytes than the read
    (not for pieces that overlap, nor for a cast that widens).

    Example:
        >>> import shardsync
        >>> plan = shardsync.plan({"w": torch.zeros(3, 2)}, "w^T -> wt")   # one process: no receivers
        >>> arranged_pieces(plan)
        {}
    """
    pieces: dict[int, dict[Piece, None]] = {}
    for tp in plan.targets:
        for c in tp.copies:
            r = plan.reads[c.read]
            if r.receivers and r.sender is not None:
                pieces.setdefault(c.read, {})[c.piece] = None
    out = {}
    for i, found in pieces.items():
        r, ps = plan.reads[i], tuple(found)
        if any(p.permutes or p.casts for p in ps) and _regions(ps, r.dtype)[1] <= aligned(r.nbytes):
            out[i] = ps
    return out


def group_name(group: Any) -> str:
    """The name every member process has for ``group`` (None: the default group).

    Example:
        >>> group_name(None)
        'world'
    """
    g = group if group is not None else dist.group.WORLD
    return str(getattr(g, "group_name", None) or "world")


def check_transport(value: object) -> None:
    """Raise :class:`PlanError` for a ``transport=`` value that is not one of :data:`TRANSPORT_CHOICES`.

    Example:
        >>> check_transport("tcp")
        Traceback (most recent call last):
        ...
        shardsync.errors.PlanError: transport='tcp': use one of ['auto', 'shm', 'backend']
    """
    if value not in TRANSPORT_CHOICES:
        raise PlanError(f"transport={value!r}: use one of {list(TRANSPORT_CHOICES)}")


def use_shm(plan: Plan, hosts: Sequence[tuple[HostInfo, str]], budget: int | None) -> bool:
    """Whether ``plan``'s reads move through shared memory, from every rank's host and ``transport=``
    choice (gathered with the layout): the same answer, or the same error, on every rank.

    Raises:
        PlanError: the ranks passed different choices, or ``"shm"`` where it cannot be used (mesh2d,
            CUDA targets, several hosts, too little room in /dev/shm, over ``memory_budget``).

    Example:
        >>> import shardsync
        >>> from shardsync.exec.hosts import host_info
        >>> plan = shardsync.plan({"w": torch.zeros(3)})
        >>> use_shm(plan, [(host_info(), "auto")], None)   # nothing to move
        False
        >>> use_shm(plan, [(host_info(), "shm"), (host_info(data_device="cuda"), "shm")], None)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        shardsync.errors.PlanError: transport='shm' cannot be used: targets of some ranks are on cuda, ...
    """
    choices = {choice for _, choice in hosts}
    if len(choices) > 1:
        raise PlanError(
            f"ranks passed different transport= values {sorted(choices)}; pass the same on every rank of the group"
        )
    infos, choice = [h for h, _ in hosts], choices.pop()
    need = sum(r.nbytes for r in plan.reads if r.receivers)
    peak = max(shm_costs(plan).peak_bytes, default=0)
    off_cpu = ", ".join(sorted({h.data_device for h in infos} - {"cpu"}))  # every rank's, gathered
    why = (
        "the strategy is mesh2d (its transport is the mesh's groups)"
        if plan.strategy == "mesh2d"
        else f"targets of some ranks are on {off_cpu}, not cpu"
        if off_cpu
        else f"the ranks are on several hosts ({describe_hosts(infos)})"
        if not same_host(infos)
        else f"{infos[0].shm_free} B free in /dev/shm, {need} B needed"
        if need > infos[0].shm_free
        else f"its segments raise the peak to {peak} B, over memory_budget={budget} B"
        if budget is not None and peak > budget
        else ""
    )
    if choice == "shm" and why:
        raise PlanError(f"transport='shm' cannot be used: {why}; pass transport='backend' or 'auto'")
    return choice != "backend" and not why and need > 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep() -> None:
    """Remove segments whose creator is dead (every rank of that stream was killed during setup)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(SHM_DIR):
            pid = name.rsplit("-", 1)[-1]
            if name.startswith(SHM_PREFIX) and pid.isdigit() and not _alive(int(pid)):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(SHM_DIR, name))
                    log.warning("removed %s/%s, left by a process that died", SHM_DIR, name)


def _map(path: str, size: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.posix_fallocate(fd, 0, size)  # ENOSPC here, not SIGBUS on first touch
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _bytes(mm: mmap.mmap) -> torch.Tensor:
    with warnings.catch_warnings():  # frombuffer warns about buffers it cannot check; ours is writable
        warnings.simplefilter("ignore")
        return torch.frombuffer(mm, dtype=torch.uint8)


class _Kept:
    """What a rank keeps for its group between streams: its own segment (by the reads it holds) and
    its mappings of peers' segments and shared storages (by handle)."""

    def __init__(self) -> None:
        self.token = ""  # the stream that set these up; "" when none (or after a failure)
        self.own: tuple[tuple, tuple, torch.Tensor] | None = None  # (reads and sizes, handle, bytes)
        self.maps: dict[tuple, torch.Tensor] = {}  # handle -> mapped bytes
        self.busy = False  # a stream is using them: another one works on its own


#: Per default group (weakly: a group made after ``destroy_process_group``, whose groups take the same
#: names again, starts afresh), group name -> what its ranks keep between streams.
_caches: weakref.WeakKeyDictionary[Any, dict[str, _Kept]] = weakref.WeakKeyDictionary()


def _kept_by_name() -> dict[str, _Kept]:
    world = dist.distributed_c10d._get_default_group() if dist.is_initialized() else _NO_GROUP
    return _caches.setdefault(world, {})


class _NoGroup:
    """The key of what a process without a process group keeps (never any segment)."""


_NO_GROUP = _NoGroup()


def cached_token(group: Any) -> str:
    """The stream that set up what is kept for ``group``; "" if nothing is or it is in use.

    Example:
        >>> cached_token(None)
        ''
    """
    kept = _kept_by_name().get(group_name(group))
    return kept.token if kept is not None and not kept.busy else ""


def release(group: Any = None) -> None:
    """Drop the shared memory kept for ``group`` (None: the default group) between streams.

    After a stream each rank keeps its segment (the bytes it sends) and its mappings of its peers',
    so that the next stream writes and reads memory already touched instead of faulting in fresh
    pages. Call this on every rank to give that memory back.

    Example:
        >>> release()
    """
    _kept_by_name().pop(group_name(group), None)


def release_all() -> None:
    """Drop the shared memory kept for every group (see :func:`release`).

    Example:
        >>> release_all()
    """
    _caches.clear()


def _storage_handle(view: torch.Tensor) -> tuple[tuple, int] | None:
    """For a contiguous CPU view inside a storage in shared memory (``share_memory_()``): a handle a
    peer can map it by, and the view's byte offset in it. None for any other tensor."""
    if view.device.type != "cpu" or not view.is_contiguous() or not view.is_shared():
        return None
    storage = view.untyped_storage()
    offset = view.data_ptr() - storage.data_ptr()
    if torch.multiprocessing.get_sharing_strategy() == "file_system":
        _, name, size = storage._share_filename_cpu_()
        return ("file", os.path.join(SHM_DIR, name.decode().lstrip("/")), size), offset
    fd, size = storage._share_fd_cpu_()
    return ("fd", os.getpid(), fd, os.fstat(fd).st_ino, size), offset


def _open_handle(handle: tuple) -> torch.Tensor:
    if handle[0] == "fd":  # the owner's descriptor, reached through /proc (same user)
        _, pid, fd, ino, size = handle
        path = f"/proc/{pid}/fd/{fd}"
        try:
            same = os.stat(path).st_ino == ino
        except OSError as exc:
            raise RuntimeError(
                f"cannot reach the shared tensor storage of process {pid} through {path} "
                f"({exc.strerror}): ranks must run as the same user and see each other's "
                "/proc; or pass transport='backend'"
            ) from exc
        if not same:
            raise RuntimeError(f"{path} is no longer the shared storage published by process {pid}")
    else:
        path, size = handle[-2:]
    return _bytes(_map(path, size, create=False))


class ShmTransport:
    """Moves a plan's reads between ranks of one host through shared memory (see the module doc).

    Works with the packet strategies (``broadcast``, ``bucketed``, ``p2p``): what a packet would
    carry, a receiver copies from where its sender published it; each read crosses once per receiver.
    A read that is a contiguous part of a tensor already in shared memory (``share_memory_()``) is
    published in place; any other is copied into the sender's segment.

    Args:
        ranks: the stream's group and this rank's place in it.
        plan: the agreed plan.
        hosts: every rank's :class:`HostInfo`, by group rank (gathered with the layout).

    Example:
        >>> transport = ShmTransport(GroupRanks.of(None), plan, hosts)   # doctest: +SKIP
    """

    def __init__(self, ranks: GroupRanks, plan: Plan, hosts: Sequence[HostInfo]) -> None:
        self.ranks, self.plan = ranks, plan
        token = f"{hosts[0].pid}-{hosts[0].stream}"
        self.paths = [os.path.join(SHM_DIR, f"{SHM_PREFIX}{token}-{r}-{h.pid}") for r, h in enumerate(hosts)]
        self.token, self.tokens = token, {h.segments for h in hosts}
        self.kept = _Kept()  # until setup takes what is kept for the group
        self.reuse_own = False
        self.views: dict[int, torch.Tensor] = {}  # read this rank receives -> its bytes
        # read -> its pieces, their offsets and bytes, when published in target form (if copied)
        self.arrange = {i: (ps, *_regions(ps, plan.reads[i].dtype)) for i, ps in arranged_pieces(plan).items()}
        self.held = 0

    def start(self, step: Step, io: PacketIO, stats: Stats) -> Posted:
        """Hand out, for every read of ``step`` this rank receives, a view of it where its sender
        published it (no data moves here)."""
        me, posted = self.ranks.rank, Posted()
        for pk in step.packets:
            for i in pk.reads:
                r = self.plan.reads[i]
                if me in r.receivers and pk.src != me and pk.dst in (-1, me):
                    posted.got.append(Received(Packet(pk.src, me, (i,), (0,), r.nbytes), self.views[i]))
                    stats.bytes_received += r.nbytes
        return posted

    def close(self, stats: Stats) -> None:
        """After the last step, on every rank: wait for the others (a failure anywhere fails all, and
        no rank writes the next stream's data while another still reads this one's)."""
        with transport_errors():
            dist.barrier(group=self.ranks.group)
        stats.collectives += 1
        stats.release(self.held)
        self.views.clear()
        self.kept.busy = False

    def setup(self, io: PacketIO, stats: Stats) -> None:
        """Before the first step, on every rank, in two agreed phases of their own (before the data
        phase): publish the reads this rank sends, map the ones it receives."""
        kept = _kept_by_name().setdefault(group_name(self.ranks.group), _Kept())
        if kept.busy:  # another stream of this group is live: work on fresh memory of its own
            kept = _Kept()
        # every rank still has what the last stream left (their tokens were gathered with the layout)
        self.reuse_own = len(self.tokens) == 1 and kept.token in self.tokens and kept.token != ""
        if not self.reuse_own:
            kept.own, kept.maps = None, {}
        self.kept = kept
        kept.busy = True
        weakref.finalize(self, _idle, kept)  # an abandoned stream frees them for the next
        stats.collectives += SETUP_COLLECTIVES
        self.kept.token = ""  # until every rank has set up
        try:
            tables = agree(phases.SHM_PUBLISH, lambda: self._publish(io, stats), self.ranks.group)
            agree(phases.SHM_OPEN, lambda: self._open(tables.all, io), self.ranks.group)
            self.kept.token = self.token
        finally:
            for path in self.paths:  # mapped by every reader, or failed on every rank: names go
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    @torch.no_grad()
    def _publish(self, io: PacketIO, stats: Stats) -> dict[int, tuple[tuple, int, bool]]:
        """Where each read this rank sends can be mapped from: (handle, byte offset, whether its
        pieces are there in target form, see :func:`arranged_pieces`)."""
        me, where, copied = self.ranks.rank, {}, []
        _sweep()
        for i, r in enumerate(self.plan.reads):
            if r.sender == me and r.receivers:
                stats.bytes_sent += r.nbytes
                view = io.send_once(i)
                found = _storage_handle(view)
                if found is None:
                    copied.append((i, view))
                else:
                    where[i] = (*found, False)
        if copied:
            where |= self._fill(copied, stats, io)
        return where

    def _published_bytes(self, i: int) -> int:
        return self.arrange[i][2] if i in self.arrange else self.plan.reads[i].nbytes

    def _pieces(self, region: torch.Tensor, i: int) -> dict[Piece, torch.Tensor]:
        """Read ``i``'s pieces in target form, as views of ``region`` (the bytes it is published in)."""
        (pieces, offsets, _), out = self.arrange[i], {}
        for p, off in zip(pieces, offsets):
            dtype = to_torch_dtype(_piece_dtype(p, self.plan.reads[i].dtype))
            n = p.target_box.numel * dtype.itemsize
            out[p] = region[off : off + n].view(dtype).view(p.target_box.sizes)
        return out

    def _fill(
        self, copied: list[tuple[int, torch.Tensor]], stats: Stats, io: PacketIO
    ) -> dict[int, tuple[tuple, int, bool]]:
        offsets, size = [], 0
        for i, _ in copied:
            offsets.append(size)
            size = aligned(size + self._published_bytes(i))
        # written again only for the same receivers: they mapped it last time (its name is gone)
        layout = tuple((i, self._published_bytes(i), self.plan.reads[i].receivers) for i, _ in copied)
        own = self.kept.own
        if own is None or own[0] != layout or not self.reuse_own:
            path = self.paths[self.ranks.rank]
            try:
                own = (layout, ("seg", self.ranks.rank, path, size), _bytes(_map(path, size, create=True)))
            except OSError as exc:
                raise RuntimeError(
                    f"cannot create a {size} B shared-memory segment {path} ({exc.strerror}); "
                    f"free space in {SHM_DIR} (docker: --shm-size) or pass "
                    "transport='backend'"
                ) from exc
            self.kept.own = own
        self.held = size
        stats.hold(size)
        batch = Copies()  # one hand-off to this rank's copy threads for every read
        for (i, view), off in zip(copied, offsets):
            r = self.plan.reads[i]
            if i in self.arrange:  # each piece cast and permuted here, once; then copied plainly
                pieces = self._pieces(own[2][off : off + self._published_bytes(i)], i)
                for p, region in pieces.items():
                    cast_into(region, piece_view(view, r.box, p), p.casts, batch)
                io.prearranged(i, pieces)  # this rank's own targets copy them from here too
            else:
                batch.add(own[2][off : off + r.nbytes].view(to_torch_dtype(r.dtype)).view(r.box.sizes), view)
        io.copy(batch)
        return {i: (own[1], off, i in self.arrange) for (i, _), off in zip(copied, offsets)}

    def _open(self, tables: list[dict[int, tuple[tuple, int, bool]]], io: PacketIO) -> None:
        me, maps = self.ranks.rank, self.kept.maps
        needed = {}
        for table in tables:
            for i, where in table.items():
                if me in self.plan.reads[i].receivers:
                    needed[i] = where
        used = {h for h, _, _ in needed.values()}
        for handle in used - set(maps):
            maps[handle] = _open_handle(handle)
        # Unmap storages not read any more, and a peer's segment once it published another; keep
        # the others: their owners write the next stream into them (their names are gone).
        owners = {h[1] for h in used if h[0] == "seg"}
        for handle in [h for h in maps if h not in used and (h[0] != "seg" or h[1] in owners)]:
            del maps[handle]
        for i, (handle, off, arranged) in needed.items():
            if arranged:
                self.views[i] = maps[handle][off : off + self._published_bytes(i)]
                io.prearranged(i, self._pieces(self.views[i], i))
            else:
                self.views[i] = maps[handle][off : off + self.plan.reads[i].nbytes]


def _idle(kept: _Kept) -> None:
    kept.busy = False
