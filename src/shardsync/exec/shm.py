"""The same-host transport: ranks on one machine exchange data through shared memory, not sockets.

Targets of :data:`~shardsync.exec.push_schedule.PUSH_MIN_BYTES` or more that their consumers get in fresh
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
them), or none (below):

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
them); the next stream writes into them when every rank still has them (agreed with the layout). A
stream that publishes no read (every target pushed, as in a training loop's repeated sync) and
finds every rank still holding the boards of the last one (the same tokens, gathered with the
layout, and a plan of as many targets) has nothing to publish nor to open: it skips both phases and
starts writing at once, on every rank alike (each decides from what all of them gathered). Its peers
then wait for a rank that fails before its data phase on its board, not in a collective: it marks
the board failed (:meth:`ShmTransport.abandon`) and reports the failure in the data phase, so they
raise naming it at once.

After setup ranks wait for each other only through their boards: for pushed targets, and at
:meth:`ShmTransport.close`, after the last step, until every rank is done (no rank writes the next
stream's data while another reads this one's). A rank that failed, stopped iterating or died makes
every rank waiting for it raise (the ``data_phase`` guarantee), within a fraction of a second.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import weakref
from collections import Counter
from collections.abc import Sequence

import torch

from .. import phases
from ..dist import GroupRanks, agree
from ..layout.dtypes import to_torch_dtype
from ..liveness import ProcessRecord, this_process
from ..mapping.pieces import Piece
from ..planning.model import Packet, Plan, Read, Step
from ..planning.schedule import aligned
from ..roll_call import group_timeout
from .assemble import cast_into, piece_view
from .copies import Copies
from .hosts import SHM_DIR, HostInfo
from .push import Board, Pusher
from .push_schedule import NO_PUSHING, Pushing, per_plan
from .shm_blocks import open_block
from .shm_plan import SETUP_COLLECTIVES, arranged_pieces, piece_dtype, pulls, regions
from .shm_segments import (
    SHM_PREFIX,
    Boards,
    Kept,
    as_bytes,
    group_name,
    idle,
    kept_by_name,
    map_file,
    open_handle,
    owner_gone,
    storage_handle,
    sweep,
)
from .stats import Stats
from .transport import PacketIO, Posted, Received

__all__ = ["ShmTransport"]


#: What a rank shows its peers at setup: where each read it publishes lies (handle, byte offset,
#: whether in target form), its board's handle, and where its process runs.
_Published = tuple[dict[int, tuple[tuple, int, bool]], tuple, ProcessRecord]


def _create(path: str, size: int) -> mmap.mmap:
    try:
        return map_file(path, size, create=True)
    except OSError as exc:
        raise RuntimeError(
            f"cannot create a {size} B shared-memory segment {path} ({exc.strerror}); "
            f"free space in {SHM_DIR} (docker: --shm-size) or pass transport='backend'"
        ) from exc


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
        >>> transport = ShmTransport(GroupRanks.of(None), plan, hosts, pushes(plan, True, hosts))  # doctest: +SKIP
    """

    def __init__(self, ranks: GroupRanks, plan: Plan, hosts: Sequence[HostInfo], pushing: Pushing = NO_PUSHING) -> None:
        self.ranks, self.plan = ranks, plan
        token = f"{hosts[0].pid}-{hosts[0].stream}"
        self.paths = [os.path.join(SHM_DIR, f"{SHM_PREFIX}{token}-{r}-{h.pid}") for r, h in enumerate(hosts)]
        self.boards = [os.path.join(SHM_DIR, f"{SHM_PREFIX}{token}-{r}b-{h.pid}") for r, h in enumerate(hosts)]
        self.token, self.tokens = token, {h.segments for h in hosts}
        self.gen = hosts[0].stream % (2**31 - 2) + 1  # numbers the stream on every board (rank 0's count)
        self.kept = Kept()  # until setup takes what is kept for the group
        self.reuse_own = False
        me = ranks.rank
        self.pulls = pulls(plan, pushing.targets)
        self.mine = frozenset(i for i, ranks_ in self.pulls.items() if me in ranks_)  # reads this rank pulls
        # read this rank pulls -> its bytes, and the same in its dtype and shape (None: arranged)
        self.views: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.got: dict[tuple[int, int], Packet] = per_plan(plan, ("pulled", me), dict)  # (read, sender) -> packet
        # read -> its pieces, their offsets and bytes, when published in target form (if copied)
        self.arrange = per_plan(
            plan,
            ("arranged", pushing.targets),
            lambda: {
                i: (ps, *regions(ps, plan.reads[i].dtype)) for i, ps in arranged_pieces(plan, pushing.targets).items()
            },
        )
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
                    got = self.got.get((i, pk.src))
                    if got is None:  # one packet per read and sender, made on a plan's first stream
                        got = self.got[i, pk.src] = Packet(pk.src, me, (i,), (0,), self.plan.reads[i].nbytes)
                    posted.got.append(Received(got, *self.views[i]))
                    stats.bytes_received += got.nbytes
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
        every peer's board. None when nothing is published and every rank still has the last
        stream's boards (see the module doc)."""
        kept = kept_by_name().setdefault(group_name(self.ranks.group), Kept())
        if kept.busy:  # another stream of this group is live: work on fresh memory of its own
            kept = Kept()
        self.reuse_own = self._kept_by_all(kept)
        if not self.reuse_own:
            kept.own, kept.board, kept.maps, kept.blocks, kept.last = None, None, {}, {}, None
            kept.views = {}
        self.kept = kept
        kept.busy = True
        weakref.finalize(self, idle, kept)  # an abandoned stream frees them for the next
        last = self._reusable(kept)
        if last is not None:
            kept.token = self.token  # nothing to publish or open: the last stream's boards serve
            self._attach(last.boards, last.records)
            return
        stats.collectives += SETUP_COLLECTIVES
        self.kept.token = ""  # until every rank has set up
        try:
            tables = agree(phases.SHM_PUBLISH, lambda: self._publish(io, stats), self.ranks.group)
            agree(phases.SHM_OPEN, lambda: self._open(tables.all, io), self.ranks.group)
            self.kept.token = self.token
        finally:
            for path in self.paths + self.boards:  # mapped by every reader, or failed on every rank: names go
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def _kept_by_all(self, kept: Kept) -> bool:
        """Whether every rank still has what the stream of ``kept`` left (their tokens were gathered
        with the layout)."""
        return len(self.tokens) == 1 and kept.token in self.tokens and kept.token != ""

    def _reusable(self, kept: Kept) -> Boards | None:
        """The boards of the last stream, when this one sets up without an agreed phase: it publishes
        nothing and every rank kept them (the same decision on every rank, from what they all
        gathered and the agreed plan)."""
        last = kept.last
        if self.pulls or last is None or last.targets != len(self.plan.targets) or not self._kept_by_all(kept):
            return None
        return last

    def abandon(self) -> bool:
        """This rank's stream failed: peers waiting for its board stop within
        :data:`~shardsync.exec.push.LOOK_SECONDS` (its failed word). Before its data phase, where its
        peers start this stream without setting up (returns True), it marks the board they wait on."""
        if not self.push.boards:  # setup did not attach them: find the boards peers would use
            kept = kept_by_name().get(group_name(self.ranks.group))
            last = self._reusable(kept) if kept is not None and not kept.busy else None
            if last is None:  # peers set up with an agreed phase, which this rank's next call meets
                return False
            self._attach(last.boards, last.records)
        self.push.fail()
        return True

    def _board(self) -> tuple:
        """This rank's board (the kept one when it fits this plan), as its handle: a segment of its
        own, reached by name during setup like the others (no ``/proc`` needed)."""
        size = Board.nbytes(len(self.plan.targets), self.ranks.world)
        kept = self.kept.board
        if kept is None or kept[1].numel() != size or not self.reuse_own:
            path = self.boards[self.ranks.rank]
            memory = as_bytes(_create(path, size))
            kept = self.kept.board = (("board", self.ranks.rank, path, size), memory)
        return kept[0]

    @torch.no_grad()
    def _publish(self, io: PacketIO, stats: Stats) -> _Published:
        """Where each read this rank publishes can be mapped from: (handle, byte offset, whether its
        pieces are there in target form, see :func:`arranged_pieces`); where its board is; and where
        its process runs (the waits on its board check it)."""
        me, where, copied = self.ranks.rank, {}, []
        sweep()
        board = self._board()
        for i in self.pulls:
            if self.plan.reads[i].sender == me:
                stats.bytes_sent += self.plan.reads[i].nbytes
                view = io.send_once(i)
                found = storage_handle(view)
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
            dtype = to_torch_dtype(piece_dtype(p, self.plan.reads[i].dtype))
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
            if own is not None:
                self.kept.views.pop(own[1], None)
            own = (layout, ("seg", self.ranks.rank, path, size), as_bytes(_create(path, size)))
            self.kept.own = own
        self.held = size
        stats.hold(size)
        batch = Copies()  # one hand-off to this rank's copy threads for every read
        views = self.kept.views.setdefault(own[1], {})
        for (i, view), off in zip(copied, offsets):
            r = self.plan.reads[i]
            if i in self.arrange:  # each piece cast and permuted here, once; then copied plainly
                pieces = self._pieces(own[2][off : off + self._published_bytes(i)], i)
                for p, region in pieces.items():
                    cast_into(region, piece_view(view, r.box, p), p.casts, batch)
                io.prearranged(i, pieces)  # this rank's own targets copy them from here too
            else:
                batch.add(read_views(views, own[2], off, r)[1], view)
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
                maps[handle_] = open_handle(handle_)
            except (OSError, RuntimeError):
                if owner_gone(handle_, records):  # died since it published: this phase names it
                    return
                raise
        # Unmap storages not read any more, and a peer's segment (or board) once it made another;
        # keep the others: their owners write the next stream into them (their names are gone).
        made = {(h[0], h[1]) for h in used if h[0] != "fd"}
        for handle_ in [h for h in maps if h not in used and (h[0] == "fd" or (h[0], h[1]) in made)]:
            del maps[handle_]
            self.kept.views.pop(handle_, None)
        for i, (handle_, off, arranged) in needed.items():
            if arranged:
                raw = maps[handle_][off : off + self._published_bytes(i)]
                self.views[i] = (raw, None)
                io.prearranged(i, self._pieces(raw, i))
            else:
                self.views[i] = read_views(
                    self.kept.views.setdefault(handle_, {}), maps[handle_], off, self.plan.reads[i]
                )
        own = self.kept.board
        assert own is not None
        memories = [own[1] if r == me else maps[b] for r, b in enumerate(boards)]
        self.kept.last = Boards(len(self.plan.targets), memories, records)
        self._attach(memories, records)

    def _attach(self, memories: Sequence[torch.Tensor], records: Sequence[ProcessRecord | None]) -> None:
        """Hand every rank's board (its bytes, by group rank) and process record to the pusher."""
        size = Board.nbytes(len(self.plan.targets), self.ranks.world)
        self.push.attach(
            self.gen,
            [Board(m[:size], *self.push.shape) for m in memories],
            records,
            self.kept.blocks,
            open_block,
            group_timeout(self.ranks.group),
        )


def read_views(
    views: dict[int, tuple[tuple, torch.Tensor, torch.Tensor]], memory: torch.Tensor, off: int, read: Read
) -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes of ``read`` at ``off`` in ``memory`` (a segment or a mapping), and the same in its
    dtype and box shape: made once per place and kept in ``views`` (that memory's, which live as long
    as it does), made again where the read there changed size, dtype or shape. A stream of a layout
    already seen makes no view of its small reads."""
    key = (read.nbytes, read.dtype, read.box.sizes)
    found = views.get(off)
    if found is None or found[0] != key:
        raw = memory[off : off + read.nbytes]
        found = views[off] = (key, raw, raw.view(to_torch_dtype(read.dtype)).view(read.box.sizes))
    return found[1], found[2]
