"""The box sums of :mod:`shardsync.exec.box_hash` in torch, for boxes on an accelerator.

The same sums, bit for bit, computed where the tensor lies, so that a digest or ``verify=True`` of
weights on a GPU copies nothing to the host but the (small) weight vectors: int64 arithmetic wraps as
uint64 does (two's complement), a logical right shift is an arithmetic one masked, and bit patterns
narrower than 8 bytes are zero-extended, and 8-byte ones xor-shifted as on the host. Runs are
large (:data:`DEVICE_CHUNK_ELEMENTS`): few kernels are launched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import EllipsisType

import numpy as np
import torch

from ..layout.dtypes import BITS, to_torch_dtype

__all__ = ["DEVICE_CHUNK_ELEMENTS", "mix_", "run_values", "runs_sum"]

#: Elements hashed at once on an accelerator (a few int64 temporaries of this length).
DEVICE_CHUNK_ELEMENTS = 1 << 24
_C1, _C2 = 0xBF58476D1CE4E5B9 - (1 << 64), 0x94D049BB133111EB - (1 << 64)
_SEED_A = 0x243F6A8885A308D3  # box_hash.SEED_A (below 2^63: the same as an int64)
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


def _bits(values: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``values``, zero-extended to int64 (complex128: the last dim doubled);
    8-byte words ``b`` as ``b ^ (b >> 32)`` (a new tensor: ``values`` is never written)."""
    if values.dtype == torch.complex128:
        values = torch.view_as_real(values).flatten(-2)
    elif values.dtype == torch.bool:
        values = values.view(torch.uint8)
    size = values.element_size()
    wide = values.view(BITS[size])
    if size == 8:
        return wide.bitwise_right_shift(32).bitwise_and_(0xFFFFFFFF).bitwise_xor_(wide)
    wide = wide.to(torch.int64)
    return wide.bitwise_and_(_LOW[size]) if size in _LOW else wide


def run_values(
    view: torch.Tensor, run: tuple[tuple[int, ...], int, int, int, int], casts: Sequence[str]
) -> torch.Tensor:
    """The values of ``run`` (``(leading indices, start, stop, c0, c1)``) of a box in target order,
    cast by ``casts`` in order.

    Example:
        >>> run_values(torch.arange(24).reshape(2, 3, 4), ((1,), 0, 2, 1, 3), ("float32",)).tolist()
        [[13.0, 14.0], [17.0, 18.0]]
    """
    lead, start, stop, c0, c1 = run
    where: tuple[int | slice | EllipsisType, ...] = (*lead, slice(start, stop), Ellipsis, slice(c0, c1))
    out = view[where].resolve_conj().resolve_neg()  # lazy conj/neg bits: their bytes are not values
    for c in casts:
        out = out.to(to_torch_dtype(c))
    return out


def _on(words: np.ndarray, device: torch.device) -> torch.Tensor:
    """uint64 ``words`` as an int64 tensor of the same bits on ``device``."""
    return torch.tensor(words.view(np.int64), device=device)


def runs_sum(
    view: torch.Tensor,
    casts: Sequence[str],
    frame: tuple[int, Sequence[int], int],
    q: np.ndarray,
    runs: Sequence[tuple[tuple[int, ...], int, int, int, int]],
    columns: Callable[[int, int], np.ndarray],
) -> int:
    """The sum (not reduced mod 2^64) of the terms of ``runs`` of a box, on its device.

    Args:
        view: the box's values in target order (row dims, then ``m`` column dims).
        casts: dtype names applied in order.
        frame: ``(base, strides, m)``: the row index of the box's first row, per dim the row index's
            step (0 for the column dims), and how many trailing dims make the column index.
        q: the row indices of a whole run, relative to its first row (uint64).
        runs: ``(leading indices, start, stop, c0, c1)`` (:data:`shardsync.exec.box_hash.Run`).
        columns: the column weights ``B`` (uint64) of the run's columns ``c0:c1``.

    Example:
        >>> from shardsync.exec.box_hash import box_sum, column_weights
        >>> v = torch.arange(6.).reshape(1, 6)
        >>> B = lambda c0, c1: column_weights(6, c0, c1)
        >>> got = runs_sum(v, (), (0, [0, 0], 1), np.zeros(1, np.uint64), [((), 0, 1, 0, 6)], B)
        >>> got % 2**64 == box_sum(v, (1, 6), (0, 0))
        True
    """
    base, strides, m = frame
    rows = _on(q, view.device)
    total = 0
    for lead, start, stop, c0, c1 in runs:
        run = run_values(view, (lead, start, stop, c0, c1), casts)
        sums = (_bits(run) * _on(columns(c0, c1), view.device)).sum(tuple(range(-m, 0)))
        at = _signed((base + sum(i * s for i, s in zip((*lead, start), strides))) % (1 << 64))
        a = mix_(rows[: stop - start].add(at).bitwise_xor_(_SEED_A)).bitwise_or_(1)
        total += int(sums.mul_(a).sum())
    return total
