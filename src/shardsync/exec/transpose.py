"""Transposed copies on a SIMD kernel: fbgemm's ``transpose_simd``, which torch's x86 builds carry.

Converting between Paddle's ``[in, out]`` Linear weights and HF's ``[out, in]`` transposes nearly
every tensor of a model, and torch's ``copy_`` of a transposed matrix moves one element at a time.
fbgemm (linked into ``libtorch_cpu`` on x86 for torch's quantized kernels) has AVX2/AVX-512
transposes of 1-, 2- and 4-byte elements. The kernel moves bits (no arithmetic), so one kernel per
element size serves every dtype of that size (fp32 and int32; bf16, fp16 and int16; fp8, int8, bool).
``bench/bench_export.py`` measures the export with the kernel and without it.

The kernel is not part of torch's Python API: it is looked up by its symbol in the library that
torch loaded, once, and where it is missing (a torch built without fbgemm, another architecture)
:func:`kernel` returns None and the callers copy with torch as before.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable

import torch

__all__ = ["kernel", "transposable", "transpose_into"]

log = logging.getLogger(__name__)

#: ``fbgemm::transpose_simd<T>(int64 M, int64 N, const T* src, int64 ld_src, T* dst, int64 ld_dst)``
#: (transposes the ``M x N`` row-major ``src`` into the ``N x M`` ``dst``), by element size: T is
#: float, uint16_t, uint8_t.
_SYMBOLS = {
    4: "_ZN6fbgemm14transpose_simdIfEEvllPKT_lPS1_l",
    2: "_ZN6fbgemm14transpose_simdItEEvllPKT_lPS1_l",
    1: "_ZN6fbgemm14transpose_simdIhEEvllPKT_lPS1_l",
}
_ARGS = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]


@functools.cache
def _library() -> ctypes.CDLL | None:
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        return ctypes.CDLL(path)  # already loaded by torch: this only finds its handle
    except OSError:
        log.debug("no %s: transposes copied by torch", path)
        return None


@functools.cache
def kernel(itemsize: int) -> Callable[..., None] | None:
    """The transpose kernel for elements of ``itemsize`` bytes, or None where this torch has none.

    Example:
        >>> kernel(8) is None   # 1-, 2- and 4-byte elements only
        True
    """
    lib = _library()
    name = _SYMBOLS.get(itemsize)
    fn = getattr(lib, name, None) if lib is not None and name is not None else None
    if fn is None:
        return None
    fn.argtypes, fn.restype = _ARGS, None
    return fn


def transposable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether the copy of a pair that moves bits (dense CPU tensors of one dtype, same shape: what
    ``exec/copies.py`` has checked) is a transpose the kernel does: the last two dims contiguous in
    rows on ``dst`` and in columns on ``src`` (``src`` is a transposed view of row-major memory), and
    a kernel for the element size.

    Example:
        >>> a = torch.zeros(64, 48)
        >>> transposable(torch.empty(48, 64), a.t()) == (kernel(4) is not None)
        True
        >>> transposable(torch.empty(64, 48), a)   # not transposed: a plain copy
        False
    """
    if dst.dim() < 2:
        return False
    rows, cols = dst.shape[-2:]
    return (
        dst.stride(-1) == 1
        and src.stride(-2) == 1
        and rows > 1
        and cols > 1
        and dst.stride(-2) >= cols
        and src.stride(-1) >= rows
        and kernel(dst.element_size()) is not None
    )


def transpose_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for a :func:`transposable` pair, on the kernel (the GIL released); the
    dims before the last two are looped over.

    Example:
        >>> a = torch.arange(12.).reshape(3, 4)
        >>> out = torch.empty(4, 3)
        >>> if kernel(4) is not None:
        ...     transpose_into(out, a.t())
        ... else:
        ...     out.copy_(a.t())
        >>> torch.equal(out, a.t())
        True
    """
    if dst.dim() > 2:
        for i in range(dst.shape[0]):
            transpose_into(dst[i], src[i])
        return
    fn = kernel(dst.element_size())
    assert fn is not None, "transpose_into: check transposable() first"
    rows, cols = dst.shape
    # src is the transpose of a (cols x rows) row-major matrix with leading dim src.stride(1).
    fn(cols, rows, src.data_ptr(), src.stride(1), dst.data_ptr(), dst.stride(0))
