"""The element hash of :mod:`shardsync.exec.box_hash` in torch, for boxes on an accelerator.

The same sums, bit for bit, computed where the tensor lies, so that a digest or ``verify=True`` of
weights on a GPU copies nothing to the host: int64 arithmetic wraps as uint64 does (two's
complement), a logical right shift is an arithmetic one masked, and bit patterns narrower than 8
bytes are zero-extended. Runs are large (:data:`DEVICE_CHUNK_ELEMENTS`): few kernels are launched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..layout.dtypes import to_torch_dtype

__all__ = ["DEVICE_CHUNK_ELEMENTS", "mix_", "pattern", "runs_sum"]

#: Elements hashed at once on an accelerator (a few int64 temporaries of this length).
DEVICE_CHUNK_ELEMENTS = 1 << 24
_C1, _C2 = 0xBF58476D1CE4E5B9 - (1 << 64), 0x94D049BB133111EB - (1 << 64)
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_LOW = {2: 0xFFFF, 4: 0xFFFFFFFF}


def _signed(x: int) -> int:
    """``x`` in [0, 2^64) as the int64 of the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


def mix_(z: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser, in place on an int64 tensor; returns ``z``.

    Example:
        >>> hex(int(mix_(torch.tensor([1]))[0]) % 2**64)
        '0x5692161d100b05e5'
    """
    for shift, mul in ((30, _C1), (27, _C2)):
        z.bitwise_xor_(z.bitwise_right_shift(shift).bitwise_and_((1 << (64 - shift)) - 1))
        z.mul_(mul)
    return z.bitwise_xor_(z.bitwise_right_shift(31).bitwise_and_((1 << 33) - 1))


def pattern(sizes: Sequence[int], strides: Sequence[int], words: int, step: int,
            device: torch.device) -> torch.Tensor:
    """The index part of the keys of a run of ``sizes`` (int64, on ``device``), as
    :func:`shardsync.exec.box_hash._pattern` gives it on the host.

    Example:
        >>> pattern((2, 3), (10, 1), 1, 1, torch.device("cpu")).tolist()
        [[0, 1, 2], [10, 11, 12]]
    """
    index = torch.zeros((), dtype=torch.int64, device=device)
    for size, s in zip(sizes, strides):
        index = index.unsqueeze(-1) + torch.arange(size, dtype=torch.int64, device=device) * _signed(s)
    if words > 1:
        index = index.unsqueeze(-1) + torch.arange(words, dtype=torch.int64, device=device) * _signed(step)
    return index


def _bits(values: torch.Tensor, words: int) -> torch.Tensor:
    """The bit patterns of ``values``, zero-extended to int64 (a last dim of ``words`` when an element
    is several words)."""
    if words > 1:
        values = torch.view_as_real(values.contiguous())
    elif values.dtype == torch.bool:
        values = values.view(torch.uint8)
    size = values.element_size()
    wide = values.view(_INT[size]).to(torch.int64)
    return wide.bitwise_and_(_LOW[size]) if size in _LOW else wide


def runs_sum(values: torch.Tensor, casts: Sequence[str], base: int, stride: Sequence[int], words: int,
             index: torch.Tensor, runs: Sequence[tuple[tuple[int, ...], int, int]]) -> int:
    """The sum (not reduced mod 2^64) of the element hashes of ``runs`` of a box, on its device.

    Args:
        values: the box's values, in source order.
        casts: dtype names applied in order.
        base: the key's index part of the box's first element.
        stride: per dim of ``values``, the key's index step.
        words: words per element.
        index: :func:`pattern` of a whole run.
        runs: ``(leading indices, start, stop)`` along the split dim.

    Example:
        >>> from shardsync.exec.box_hash import box_sum
        >>> v = torch.arange(6.)
        >>> runs_sum(v, (), 0, [1 << 32], 1, pattern((6,), [1 << 32], 1, 1 << 32, v.device),
        ...          [((), 0, 6)]) % 2**64 == box_sum(v, (6,), (0,))
        True
    """
    total = 0
    for lead, start, stop in runs:
        where: tuple[int | slice, ...] = (*lead, slice(start, stop))
        run = values[where]
        for c in casts:
            run = run.to(to_torch_dtype(c))
        at = _signed((base + sum(i * s for i, s in zip((*lead, start), stride))) % (1 << 64))
        z = index[:stop - start] + at
        total += int(mix_(z.add_(_bits(run, words))).sum())
    return total
