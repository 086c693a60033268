"""Counters of one rank's stream (its own module: the executor and every transport update them)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Stats"]


@dataclass
class Stats:
    """Counters of one rank's stream, filled while it runs (read them after iteration).

    Conventions match :class:`shardsync.planning.Costs`: a collective counts once per rank that calls it;
    ``bytes_sent`` is this rank's own data handed to collectives or messages, ``bytes_received`` other
    ranks' data it got; ``bytes_read`` what it read from its source (each planned box once, however
    many copies and packets use it; for a checkpoint, the bytes this rank loaded from files);
    ``peak_bytes`` is the most the streamer held at once (targets being built and
    communication buffers; yielded targets belong to the caller and are not counted).

    Example:
        >>> import torch, shardsync
        >>> stream = shardsync.full_params({"w": torch.zeros(4, 4)}, "w^T -> wt")
        >>> _ = [t for _, t in stream]
        >>> stream.stats.peak_bytes, stream.stats.targets
        (64, 1)
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_read: int = 0
    collectives: int = 0
    peak_bytes: int = 0
    held_bytes: int = 0
    targets: int = 0
    bytes_yielded: int = 0
    seconds: float = 0.0
    plan_seconds: float = 0.0
    reused_blocks: int = 0
    transport: str = ""
    #: the caller stopped iterating early; the rest of the stream ran and was discarded
    abandoned: bool = False
    _blocks: dict[int, int] = field(default_factory=dict, repr=False)

    def hold(self, nbytes: int, tag: int | None = None) -> None:
        """Count ``nbytes`` as held (an allocation); ``tag`` lets :meth:`release` find it again."""
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        if tag is not None:
            self._blocks[tag] = self._blocks.get(tag, 0) + nbytes

    def release(self, nbytes: int | None = None, tag: int | None = None) -> None:
        """Stop counting ``nbytes`` (or everything held under ``tag``)."""
        if tag is not None:
            nbytes = self._blocks.pop(tag, 0)
        self.held_bytes -= nbytes or 0

    def summary(self) -> str:
        """One line: targets, bytes, collectives, peak memory, seconds."""
        rate = self.bytes_yielded / self.seconds / 1e9 if self.seconds > 0 else 0.0
        return (
            f"{self.targets} targets, {self.bytes_yielded} B yielded in {self.seconds:.3f} s "
            f"({rate:.2f} GB/s); read {self.bytes_read} B; sent {self.bytes_sent} B, "
            f"received {self.bytes_received} B in "
            f"{self.collectives} collectives; peak {self.peak_bytes} B held"
        )
