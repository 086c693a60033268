"""Replica fingerprints: a cheap check that tensors claimed to be replicas hold the same values.

A plain tensor in a state dict is taken as a replica: every rank holding it is assumed to hold the same
values, and the planner reads it from whichever rank is cheapest. If it is really a per-rank shard of
the same shape (Megatron's ``linear_proj`` passed as ``model.state_dict()``), the export would come
back as one rank's shard with no error. So every rank reports, with each of its layout entries, a
fingerprint: a hash of the local shape, the dtype and the exact bytes of a fixed sample of elements at
deterministic positions. :meth:`shardsync.layout.GlobalLayout.merge` compares them across the ranks
that hold the same box of the same key.

The sample is gathered by indexing (no copy of the tensor, whatever its strides) and moved to the CPU
in one transfer per device, so the cost is a few kernels and one synchronisation per stream. A sample
cannot see replicas that differ elsewhere (one element in a million): ``replica_check="exact"``
hashes every byte of every tensor instead (blake2b, in chunks; a GPU tensor is copied to the host
chunk by chunk), and ``"off"`` reports no fingerprint at all. Only digests travel to other ranks.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from ..errors import LayoutError
from ..layout.meta import EXACT_PREFIX

__all__ = [
    "SAMPLE_SIZE",
    "ReplicaCheck",
    "REPLICA_CHECKS",
    "EXACT_PREFIX",
    "check_replica_mode",
    "sample_positions",
    "fingerprints",
    "exact_digest",
]

#: Elements sampled per tensor (all of them for smaller tensors).
SAMPLE_SIZE = 16
#: How replicas are compared: a fixed sample of elements, every byte, or not at all.
ReplicaCheck = Literal["sampled", "exact", "off"]
REPLICA_CHECKS: tuple[str, ...] = ("sampled", "exact", "off")
#: Bytes hashed per host copy in exact mode: bounds the extra memory a GPU tensor needs.
_CHUNK_BYTES = 64 << 20

_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: consecutive multiples spread evenly (Weyl)


def sample_positions(numel: int) -> list[int]:
    """The flat positions sampled from a tensor of ``numel`` elements: the first, the last, and
    positions spread over the whole range by Fibonacci hashing (so both halves, and rows and columns
    of any width, are hit). Deterministic: every rank picks the same positions.

    Args:
        numel: number of elements.

    Returns:
        sorted distinct positions, at most :data:`SAMPLE_SIZE` of them.

    Example:
        >>> sample_positions(5)
        [0, 1, 2, 3, 4]
        >>> positions = sample_positions(1000)
        >>> len(positions), positions[:4], positions[-1]
        (16, [0, 34, 90, 180], 999)
    """
    if numel <= SAMPLE_SIZE:
        return list(range(numel))
    spread = {((i * _GOLDEN) % 2**64) * numel >> 64 for i in range(1, SAMPLE_SIZE - 1)}
    return sorted(spread | {0, numel - 1})


@functools.lru_cache(maxsize=256)
def _index(shape: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """One index tensor per dim picking :func:`sample_positions` of a tensor of ``shape`` (cached:
    a model's shards come in a few shapes, and a stream samples them on every call)."""
    flat = sample_positions(math.prod(shape))
    index = []
    for size in reversed(shape):  # unravel the flat positions into one index per dim
        index.append([p % size for p in flat])
        flat = [p // size for p in flat]
    return tuple(torch.tensor(i, dtype=torch.long, device=device) for i in reversed(index))


def _sample(t: torch.Tensor) -> torch.Tensor:
    """The sampled elements of ``t`` as raw bytes (uint8), on ``t``'s device; only they are read."""
    picked = t.reshape(1) if t.dim() == 0 else t[_index(tuple(t.shape), t.device)]
    picked = picked.contiguous()
    if picked.dtype == torch.bool:
        picked = picked.to(torch.uint8)
    return picked.view(torch.uint8).reshape(-1)


def check_replica_mode(mode: object) -> None:
    """Raise a LayoutError unless ``mode`` is one of :data:`REPLICA_CHECKS`.

    Example:
        >>> check_replica_mode("exact")
    """
    if mode not in REPLICA_CHECKS:
        raise LayoutError(
            f"replica_check={mode!r}: use 'sampled' (16 elements per tensor, the default), "
            "'exact' (every byte hashed) or 'off' (replicas taken on trust)"
        )


def exact_digest(t: torch.Tensor) -> str:
    """A digest of ``t``'s shape, dtype and every byte of its values, in row-major order (so equal
    values give equal digests whatever the strides). Chunks of dim 0 are made contiguous and
    hashed one by one, so no second copy of a large tensor is held.

    Example:
        >>> a = torch.arange(12.).reshape(3, 4)
        >>> exact_digest(a) == exact_digest(a.T.contiguous().T), exact_digest(a) == exact_digest(a + 1)
        (True, False)
    """
    h = hashlib.blake2b(f"{tuple(t.shape)}|{t.dtype}|".encode(), digest_size=16)
    rows = t.detach().reshape(1, *t.shape) if t.dim() == 0 else t.detach()
    per_row = max(1, rows[0].numel() * rows.element_size()) if len(rows) else 1
    step = max(1, _CHUNK_BYTES // per_row)
    for start in range(0, len(rows), step):
        chunk = rows[start : start + step].contiguous()
        if chunk.dtype == torch.bool:
            chunk = chunk.to(torch.uint8)
        # through DLPack: numpy() would leave the caller's storage unresizable (FSDP resizes them)
        h.update(np.from_dlpack(chunk.reshape(-1).view(torch.uint8).cpu()).data)
    return EXACT_PREFIX + h.hexdigest()


def fingerprints(tensors: Sequence[torch.Tensor], mode: ReplicaCheck = "sampled") -> list[str | None]:
    """One fingerprint per tensor: equal for tensors with the same shape, dtype and sampled bytes
    (``mode="exact"``: all bytes; ``"off"``: None for every tensor).

    Args:
        tensors: local tensors, on any devices, of any dtype and strides (meta tensors get None).
        mode: one of :data:`REPLICA_CHECKS`.

    Returns:
        16 hex digits per tensor (exact: :data:`EXACT_PREFIX` and 32), or None for a tensor with no
        data (device ``meta``).

    Example:
        >>> a = torch.arange(40.).reshape(8, 5)
        >>> one, same, other = fingerprints([a, a.clone(), a.flip(0)])
        >>> one == same, one == other
        (True, False)
    """
    if mode == "off":
        return [None] * len(tensors)
    if mode == "exact":
        return [None if t.is_meta else exact_digest(t) for t in tensors]
    samples: list[torch.Tensor | None] = [None if t.is_meta else _sample(t) for t in tensors]
    on_cpu: dict[int, bytes] = {}
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(samples):
        if s is not None:
            by_device.setdefault(s.device, []).append(i)
    for members in by_device.values():  # one transfer (and one synchronisation) per device
        data = torch.cat([samples[i] for i in members]).cpu().numpy().tobytes()  # type: ignore[misc]
        start = 0
        for i in members:
            n = samples[i].numel()  # type: ignore[union-attr]
            on_cpu[i] = data[start : start + n]
            start += n
    out: list[str | None] = []
    for i, t in enumerate(tensors):
        if i not in on_cpu:
            out.append(None)
            continue
        head = f"{tuple(t.shape)}|{t.dtype}|".encode()
        out.append(hashlib.blake2b(head + on_cpu[i], digest_size=8).hexdigest())
    return out
