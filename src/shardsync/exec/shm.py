"""The same-host transport: ranks on one machine exchange data through shared memory, not sockets.

Targets of :data:`~shardsync.exec.push.PUSH_MIN_BYTES` or more that their consumers get in fresh
memory lie in shared memory, and the ranks that send their pieces write them straight in
(:mod:`shardsync.exec.push`). For the others, every read a rank sends (each once, however many ranks
receive it) is published in shared memory:
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
   of its reads lies (segment or shared storage, and offset), and where its board is (see
   :mod:`~shardsync.exec.push`: every rank has one, for the pushed targets and the end of the stream);
2. ``shm open``: each rank maps what it reads and every peer's board (a peer's shared storage through
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

After setup ranks wait for each other only through their boards: for pushed targets, and at
:meth:`ShmTransport.close`, after the last step, until every rank is done (no rank writes the next
stream's data while another reads this one's). A rank that failed, stopped iterating or died makes
every rank waiting for it raise (the ``data_phase`` guarantee), within a fraction of a second.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import warnings
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from .. import phases
from ..dist import GroupRanks, agree
from ..errors import PlanError
from ..layout.dtypes import itemsize, to_torch_dtype
from ..liveness import ProcessRecord, is_gone, this_process
from ..mapping.pieces import Piece
from ..planning.model import Costs, Packet, Plan, Step
from ..planning.schedule import aligned
from ..roll_call import group_timeout
from .assemble import cast_into, piece_view
from .copies import Copies
from .hosts import SHM_DIR, HostInfo, describe_hosts, same_host
from .memory import BlockHandle, handle, shm_block, shm_blocks_supported
from .push import (
    NO_PUSHING,
    PUSH_AHEAD_BYTES,
    Board,
    Pusher,
    Pushing,
    allocations,
    pushed_bytes,
    pushed_targets,
    writers,
)
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
    "pushes",
    "pulls",
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
#: Collectives of the setup (publish, open); nothing else of the stream is a collective.
SETUP_COLLECTIVES = 2


def pushes(plan: Plan, fresh: bool, budget: int | None = None) -> Pushing:
    """The targets senders write straight into (:func:`~shardsync.exec.push.pushed_targets`) when
    the destination gives targets fresh memory (``fresh``) and this system has shared-memory blocks,
    and how far ahead their consumers allocate them: :data:`~shardsync.exec.push.PUSH_AHEAD_BYTES`,
    or what is left of ``budget`` (``memory_budget``); the same on every rank.

    Example:
        >>> import shardsync
        >>> pushes(shardsync.plan({"w": torch.zeros(3)}), fresh=True)
        Pushing(targets=frozenset(), window=0)
    """
    if not (fresh and shm_blocks_supported()):
        return NO_PUSHING
    pushed = pushed_targets(plan)
    if not pushed:
        return NO_PUSHING
    window = PUSH_AHEAD_BYTES
    if budget is not None:
        held = max(shm_costs(plan, Pushing(pushed)).peak_bytes, default=0)
        window = max(0, min(window, budget - held))
    return Pushing(pushed, window)


def pulls(plan: Plan, pushed: frozenset[int]) -> dict[int, frozenset[int]]:
    """Read -> the ranks that copy it out of its sender's shared memory (for the targets that are not
    pushed), for every read some rank does: the reads their senders publish.

    Example:
        >>> import shardsync
        >>> pulls(shardsync.plan({"w": torch.zeros(3)}), frozenset())
        {}
    """
    out: dict[int, set[int]] = {}
    for t, tp in enumerate(plan.targets):
        if t in pushed:
            continue
        for cp in tp.copies:
            r = plan.reads[cp.read]
            for c in tp.consumers:
                if c in r.receivers:
                    out.setdefault(cp.read, set()).add(c)
    return {i: frozenset(ranks) for i, ranks in sorted(out.items())}


def shm_costs(plan: Plan, pushing: Pushing = NO_PUSHING) -> Costs:
    """The plan's costs when its data moves through shared memory, the targets of ``pushing`` written
    straight into by their senders (:func:`pushes`): a pushed piece is written once by its sender per
    consumer; any other read is written once by its sender and copied by each rank that pulls it; no
    collective moves data, two small ones set up; and every rank may also hold a segment of the
    bytes it publishes for the whole stream (none for reads published in place) and the pushed
    targets it allocates ahead of their step (no receive or pack buffers either, so this stays an
    upper bound).

    Example:
        >>> import shardsync
        >>> plan = shardsync.plan({"w": torch.zeros(3)})   # one process: nothing is received
        >>> shm_costs(plan).collectives, shm_costs(plan).bytes_received
        ((2,), (0,))
    """
    world = plan.world_size
    sent, recv = pushed_bytes(plan, pushing.targets)
    segment = [0] * world  # at most: every read a rank publishes copied into its segment
    for rank in range(world) if pushing.targets else ():  # and the pushed targets allocated ahead
        segment[rank] += allocations(plan, writers(plan, pushing.targets, rank), pushing.window)[1]
    for i, ranks in pulls(plan, pushing.targets).items():
        r = plan.reads[i]
        if r.sender is not None:
            sent[r.sender] += r.nbytes
            segment[r.sender] += aligned(r.nbytes)
            for d in ranks:
                recv[d] += r.nbytes
    peak = tuple(p + s for p, s in zip(plan.costs.peak_bytes, segment))
    return Costs(tuple(sent), tuple(recv), (SETUP_COLLECTIVES,) * world, peak)


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


def arranged_pieces(plan: Plan, pushed: frozenset[int] = frozenset()) -> dict[int, tuple[Piece, ...]]:
    """The reads whose sender publishes their pieces in target form rather than the read's own bytes
    (pieces of ``pushed`` targets are written by their senders, not published).

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
    for t, tp in enumerate(plan.targets):
        if t in pushed:
            continue
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


def use_shm(
    plan: Plan, hosts: Sequence[tuple[HostInfo, str]], budget: int | None, pushing: Pushing = NO_PUSHING
) -> bool:
    """Whether ``plan``'s data moves through shared memory, from every rank's host and ``transport=``
    choice (gathered with the layout): the same answer, or the same error, on every rank.
    ``pushing``: the targets senders would write straight into (:func:`pushes`); their bytes need no
    room in /dev/shm (their blocks have no name there).

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
    need = sum(plan.reads[i].nbytes for i in pulls(plan, pushing.targets))
    peak = max(shm_costs(plan, pushing).peak_bytes, default=0)
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
    return choice != "backend" and not why and any(r.receivers for r in plan.reads)


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


def _map(path: str, size: int, create: bool, populate: bool = False) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.posix_fallocate(fd, 0, size)  # ENOSPC here, not SIGBUS on first touch
        # populate: the pages mapped now, in one call, rather than faulted in one by one on first write
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0))
    finally:
        os.close(fd)


def _bytes(mm: mmap.mmap) -> torch.Tensor:
    with warnings.catch_warnings():  # frombuffer warns about buffers it cannot check; ours is writable
        warnings.simplefilter("ignore")
        return torch.frombuffer(mm, dtype=torch.uint8)


class _Kept:
    """What a rank keeps for its group between streams: its own segment (by the reads it holds) and
    board, its mappings of peers' segments, boards and shared storages (by handle), and of the
    peers' blocks it wrote pieces into."""

    def __init__(self) -> None:
        self.token = ""  # the stream that set these up; "" when none (or after a failure)
        self.own: tuple[tuple, tuple, torch.Tensor] | None = None  # (reads and sizes, handle, bytes)
        self.board: tuple[tuple, torch.Tensor] | None = None  # (handle, bytes)
        self.maps: dict[tuple, torch.Tensor] = {}  # handle -> mapped bytes
        self.blocks: dict[tuple[int, int, int], torch.Tensor] = {}  # (rank, fd, inode) -> mapped bytes
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


def _open_handle(handle: tuple, populate: bool = False) -> torch.Tensor:
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
    return _bytes(_map(path, size, create=False, populate=populate))


#: What a rank shows its peers at setup: where each read it publishes lies (handle, byte offset,
#: whether in target form), its board's handle, and where its process runs.
_Published = tuple[dict[int, tuple[tuple, int, bool]], tuple, ProcessRecord]


class ShmTransport:
    """Moves a plan's data between ranks of one host through shared memory (see the module doc).

    Works with the packet strategies (``broadcast``, ``bucketed``, ``p2p``, ``multicast``): what a
    packet would carry, a receiver copies from where its sender published it, or its sender writes
    straight into the receiver's target (``pushed`` targets); each read crosses once per receiver.
    A published read that is a contiguous part of a tensor already in shared memory
    (``share_memory_()``) is published in place; any other is copied into the sender's segment.

    Args:
        ranks: the stream's group and this rank's place in it.
        plan: the agreed plan.
        hosts: every rank's :class:`HostInfo`, by group rank (gathered with the layout).
        pushing: the targets senders write straight into, and how far ahead (:func:`pushes`).

    Example:
        >>> transport = ShmTransport(GroupRanks.of(None), plan, hosts, pushes(plan, True))  # doctest: +SKIP
    """

    def __init__(self, ranks: GroupRanks, plan: Plan, hosts: Sequence[HostInfo], pushing: Pushing = NO_PUSHING) -> None:
        self.ranks, self.plan = ranks, plan
        token = f"{hosts[0].pid}-{hosts[0].stream}"
        self.paths = [os.path.join(SHM_DIR, f"{SHM_PREFIX}{token}-{r}-{h.pid}") for r, h in enumerate(hosts)]
        self.token, self.tokens = token, {h.segments for h in hosts}
        self.gen = hosts[0].stream % (2**31 - 2) + 1  # numbers the stream on every board (rank 0's count)
        self.kept = _Kept()  # until setup takes what is kept for the group
        self.reuse_own = False
        me = ranks.rank
        self.pulls = pulls(plan, pushing.targets)
        self.mine = frozenset(i for i, ranks_ in self.pulls.items() if me in ranks_)  # reads this rank pulls
        self.views: dict[int, torch.Tensor] = {}  # read this rank pulls -> its bytes
        # read -> its pieces, their offsets and bytes, when published in target form (if copied)
        self.arrange = {
            i: (ps, *_regions(ps, plan.reads[i].dtype)) for i, ps in arranged_pieces(plan, pushing.targets).items()
        }
        self.push = Pusher(ranks, plan, pushing)
        # how many times this rank takes each read from its source: once per read it publishes, once
        # per piece it pushes
        self.sends: Counter[int] = Counter(i for i in self.pulls if plan.reads[i].sender == me) + self.push.takes
        self.held = 0

    def start(self, step: Step, io: PacketIO, stats: Stats) -> Posted:
        """Hand out, for every read of ``step`` this rank pulls, a view of it where its sender
        published it (no data moves here)."""
        me, posted = self.ranks.rank, Posted()
        for pk in step.packets:
            for i in pk.reads:
                if i in self.mine and pk.src != me and pk.dst in (-1, me) and i in self.views:
                    r = self.plan.reads[i]
                    posted.got.append(Received(Packet(pk.src, me, (i,), (0,), r.nbytes), self.views[i]))
                    stats.bytes_received += r.nbytes
        return posted

    def close(self, stats: Stats) -> None:
        """After the last step, on every rank: wait for the others (a failure anywhere fails all, and
        no rank writes the next stream's data while another still reads this one's)."""
        self.push.close()
        stats.release(self.held)
        self.views.clear()
        self.kept.busy = False

    def setup(self, io: PacketIO, stats: Stats) -> None:
        """Before the first step, on every rank, in two agreed phases of their own (before the data
        phase): publish the reads this rank sends and show its board, map the reads it pulls and
        every peer's board."""
        kept = _kept_by_name().setdefault(group_name(self.ranks.group), _Kept())
        if kept.busy:  # another stream of this group is live: work on fresh memory of its own
            kept = _Kept()
        # every rank still has what the last stream left (their tokens were gathered with the layout)
        self.reuse_own = len(self.tokens) == 1 and kept.token in self.tokens and kept.token != ""
        if not self.reuse_own:
            kept.own, kept.board, kept.maps, kept.blocks = None, None, {}, {}
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

    def _board(self) -> tuple:
        """This rank's board (the kept one when it fits this plan), as its handle."""
        size = Board.nbytes(len(self.plan.targets), self.ranks.world)
        kept = self.kept.board
        if kept is None or kept[1].numel() != size:
            memory = shm_block((size,), torch.uint8)
            block = handle(memory)
            assert block is not None
            kept = self.kept.board = (("fd", *block), memory)
        return kept[0]

    @torch.no_grad()
    def _publish(self, io: PacketIO, stats: Stats) -> _Published:
        """Where each read this rank publishes can be mapped from: (handle, byte offset, whether its
        pieces are there in target form, see :func:`arranged_pieces`); where its board is; and where
        its process runs (the waits on its board check it)."""
        me, where, copied = self.ranks.rank, {}, []
        _sweep()
        board = self._board()
        for i in self.pulls:
            if self.plan.reads[i].sender == me:
                stats.bytes_sent += self.plan.reads[i].nbytes
                view = io.send_once(i)
                found = _storage_handle(view)
                if found is None:
                    copied.append((i, view))
                else:
                    where[i] = (*found, False)
        if copied:
            where |= self._fill(copied, stats, io)
        return where, board, this_process()

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
        layout = tuple((i, self._published_bytes(i), self.pulls[i]) for i, _ in copied)
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

    def _open(self, tables: list[_Published], io: PacketIO) -> None:
        me, maps = self.ranks.rank, self.kept.maps
        needed = {i: where for table, _, _ in tables for i, where in table.items() if i in self.mine}
        boards = [board for _, board, _ in tables]
        used = {h for h, _, _ in needed.values()} | {b for r, b in enumerate(boards) if r != me}
        records = [record for _, _, record in tables]
        for handle_ in used - set(maps):
            try:
                maps[handle_] = _open_handle(handle_)
            except (OSError, RuntimeError):
                if _owner_gone(handle_, records):  # died since it published: this phase names it
                    return
                raise
        # Unmap storages not read any more, and a peer's segment once it published another; keep
        # the others: their owners write the next stream into them (their names are gone).
        owners = {h[1] for h in used if h[0] == "seg"}
        for handle_ in [h for h in maps if h not in used and (h[0] != "seg" or h[1] in owners)]:
            del maps[handle_]
        for i, (handle_, off, arranged) in needed.items():
            if arranged:
                self.views[i] = maps[handle_][off : off + self._published_bytes(i)]
                io.prearranged(i, self._pieces(self.views[i], i))
            else:
                self.views[i] = maps[handle_][off : off + self.plan.reads[i].nbytes]
        size = Board.nbytes(len(self.plan.targets), self.ranks.world)
        own = self.kept.board
        assert own is not None
        memories = [own[1] if r == me else maps[b] for r, b in enumerate(boards)]
        self.push.attach(
            self.gen,
            [Board(m[:size], *self.push.shape) for m in memories],
            records,
            self.kept.blocks,
            _open_block,
            group_timeout(self.ranks.group),
        )


def _owner_gone(handle_: tuple, records: Sequence[ProcessRecord]) -> bool:
    """Whether the process that published ``handle_`` has ended (its segment's rank, or its pid)."""
    owner = records[handle_[1]] if handle_[0] == "seg" else next((r for r in records if r.pid == handle_[1]), None)
    return owner is not None and bool(is_gone(owner))


def _open_block(block: BlockHandle) -> torch.Tensor:
    """A peer's block of shared memory (a target it receives pieces in), mapped with its pages."""
    return _open_handle(("fd", *block), populate=True)


def _idle(kept: _Kept) -> None:
    kept.busy = False
