"""Steps for the broadcast-family strategies, and when each target opens and completes.

* ``broadcast``: one step per moved read, one broadcast from its sender (Paddle's single-group path).
* ``bucketed``: reads packed into per-sender flat buffers of at most ``cap`` bytes; a step broadcasts
  one bucket per sender and closes when a bucket would overflow.
* ``p2p``: like ``bucketed`` with one buffer per (sender, receiver) pair, sent point to point; only the
  consumers receive.

Under ``auto`` the bucketed schedules let reads of at least 1 MiB travel alone: a lone read is sent
straight from the shard and received straight into its target, where packing would add a copy on
each side - which for 1 MiB costs about what a gloo broadcast's fixed overhead (~0.5 ms) saves.

Reads that nobody receives over the wire (every reader holds them) are read in place and never packed.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

from .model import Copy, Packet, Read, Step, StepKind

__all__ = [
    "ALIGN",
    "aligned",
    "RawStep",
    "pack",
    "schedule_broadcast",
    "schedule_bucketed",
    "schedule_p2p",
    "attach_targets",
]

#: Byte alignment of each read inside a flat buffer (any dtype can then be viewed in place).
ALIGN = 16
#: A step before targets are attached: its kind and packets.
RawStep = tuple[StepKind, tuple[Packet, ...]]
K = TypeVar("K", bound=Hashable)


def aligned(n: int) -> int:
    """``n`` bytes rounded up to :data:`ALIGN` (where the next read of a buffer starts).

    Example:
        >>> aligned(1), aligned(ALIGN)
        (16, 16)
    """
    return -(-n // ALIGN) * ALIGN


def pack(reads: Sequence[Read], ids: Sequence[int], src: int, dst: int = -1) -> Packet:
    """A packet of ``ids`` laid out back to back at aligned offsets.

    Example:
        >>> packet = pack(reads, [3, 4], src=1)    # doctest: +SKIP
    """
    offsets, end = [], 0
    for i in ids:
        offsets.append(end)
        end = aligned(end + reads[i].nbytes)
    last = offsets[-1] + reads[ids[-1]].nbytes if ids else 0
    return Packet(src, dst, tuple(ids), tuple(offsets), last)


def _moved(reads: Sequence[Read]) -> list[int]:
    return [i for i, r in enumerate(reads) if r.receivers]


def _sender(read: Read) -> int:
    if read.sender is None:  # build_reads gives every read with receivers a sender
        raise ValueError(f"read of {read.source!r} {read.box} has receivers but no sender (planner bug)")
    return read.sender


def schedule_broadcast(reads: Sequence[Read]) -> tuple[list[RawStep], dict[int, int]]:
    """One broadcast step per moved read. Returns the steps and each moved read's step index.

    Example:
        >>> steps, step_of = schedule_broadcast(reads)   # doctest: +SKIP
    """
    moved = _moved(reads)
    steps: list[RawStep] = [("broadcast", (pack(reads, [i], _sender(reads[i])),)) for i in moved]
    return steps, {i: k for k, i in enumerate(moved)}


def _rounds(
    reads: Sequence[Read], cap: int, keys: Callable[[Read], list[K]], solo: int | None = None
) -> tuple[list[dict[K, list[int]]], dict[int, int]]:
    # Fill one buffer per key; when any buffer of a read would overflow, close the round first, so a
    # read's deliveries all land in one round. A read larger than cap travels alone, and so does one
    # of at least ``solo`` bytes (in a round of its own: sent from the shard, received in place).
    rounds: list[dict[K, list[int]]] = [{}]
    size: dict[K, int] = {}
    step_of: dict[int, int] = {}
    for i in _moved(reads):
        ks, n = keys(reads[i]), reads[i].nbytes
        alone = solo is not None and n >= solo
        if rounds[-1] and (alone or any(rounds[-1].get(k) and aligned(size[k]) + n > cap for k in ks)):
            rounds.append({})
            size = {}
        for k in ks:
            rounds[-1].setdefault(k, []).append(i)
            size[k] = aligned(size.get(k, 0)) + n
        step_of[i] = len(rounds) - 1
        if alone:
            rounds.append({})
            size = {}
    return [r for r in rounds if r], _renumber(rounds, step_of)


def _renumber(rounds: Sequence[dict[K, list[int]]], step_of: dict[int, int]) -> dict[int, int]:
    index, k = {}, 0
    for j, r in enumerate(rounds):
        if r:
            index[j] = k
            k += 1
    return {i: index[j] for i, j in step_of.items()}


def schedule_bucketed(
    reads: Sequence[Read],
    cap: int,
    solo: int | None = None,
) -> tuple[list[RawStep], dict[int, int]]:
    """Per-sender buckets of at most ``cap`` bytes; one broadcast per bucket. Reads of at least
    ``solo`` bytes (if given) get a bucket and a step of their own.

    Example:
        >>> steps, step_of = schedule_bucketed(reads, 16 << 20, solo=1 << 20)   # doctest: +SKIP
    """
    rounds, step_of = _rounds(reads, cap, lambda r: [_sender(r)], solo)
    steps: list[RawStep] = [
        ("broadcast", tuple(pack(reads, ids, src) for src, ids in sorted(rnd.items()))) for rnd in rounds
    ]
    return steps, step_of


def schedule_p2p(
    reads: Sequence[Read],
    cap: int,
    solo: int | None = None,
) -> tuple[list[RawStep], dict[int, int]]:
    """Per-(sender, receiver) buffers of at most ``cap`` bytes, sent point to point (``solo`` as in
    :func:`schedule_bucketed`).

    Example:
        >>> steps, step_of = schedule_p2p(reads, 16 << 20)   # doctest: +SKIP
    """
    rounds, step_of = _rounds(reads, cap, lambda r: [(_sender(r), d) for d in r.receivers], solo)
    steps: list[RawStep] = [
        ("p2p", tuple(pack(reads, ids, s, d) for (s, d), ids in sorted(rnd.items()))) for rnd in rounds
    ]
    return steps, step_of


def attach_targets(raw: list[RawStep], step_of: dict[int, int], copies: Sequence[Sequence[Copy]]) -> list[Step]:
    """Add to each step the targets that open (first moved data arrives) and complete in it.

    A target with no moved data opens nowhere: it is built right before it is yielded, and completes
    with the target before it (or before any step, in a leading local step), so that targets read
    entirely in place keep their place in the order.

    Example:
        >>> steps = attach_targets([("broadcast", (packet,))], {0: 0}, [[Copy(0, piece)]])  # doctest: +SKIP
    """
    done: list[int] = []
    opens: list[int | None] = []  # None: nothing moves for it, built right before it is yielded
    prev = -1
    for per_target in copies:
        steps = [step_of[c.read] for c in per_target if c.read in step_of]
        prev = max(steps) if steps else prev
        done.append(prev)
        opens.append(min(steps) if steps else None)
    lead = -1 in done
    shift = 1 if lead else 0
    leading: list[RawStep] = [("local", ())] if lead else []
    all_raw = leading + list(raw)
    by_ready: list[list[int]] = [[] for _ in all_raw]
    by_open: list[list[int]] = [[] for _ in all_raw]
    for t, (d, o) in enumerate(zip(done, opens)):
        by_ready[d + shift].append(t)
        if o is not None:
            by_open[o + shift].append(t)
    return [Step(kind, packets, tuple(by_open[k]), tuple(by_ready[k])) for k, (kind, packets) in enumerate(all_raw)]
