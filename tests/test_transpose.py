"""Transposes on fbgemm's SIMD kernel (exec/transpose.py): every bit lands where ``copy_`` puts it."""

from __future__ import annotations

import platform

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardsync.exec import copies, transpose
from shardsync.exec.copies import copy_into
from shardsync.exec.transpose import kernel, transposable, transpose_into
from shardsync.layout.dtypes import BITS

x86 = pytest.mark.skipif(platform.machine() != "x86_64", reason="torch carries fbgemm on x86 only")

#: Every element size the kernel has, with dtypes whose bits are not all values (NaN payloads,
#: fp8's NaN, bool) - the kernel moves bits.
DTYPES = [
    torch.float32,
    torch.int32,
    torch.bfloat16,
    torch.float16,
    torch.int16,
    torch.float8_e4m3fn,
    torch.uint8,
    torch.bool,
]


def _bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bits of every pattern (NaNs with payloads among them), as ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    size = dtype.itemsize
    raw = torch.randint(-(2 ** (8 * size - 1)), 2 ** (8 * size - 1), shape, generator=g, dtype=torch.int64)
    if dtype == torch.bool:
        return (raw % 2).bool()
    return raw.to(BITS[size]).view(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.view(BITS[a.element_size()]), b.view(BITS[b.element_size()]))


@x86
def test_this_torch_has_every_kernel() -> None:
    """The pinned torch (x86, fbgemm) has the 1-, 2- and 4-byte kernels: the fast path is the one tested."""
    assert all(kernel(size) is not None for size in (1, 2, 4))
    assert kernel(8) is None


@x86
@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(2, 70),
    cols=st.integers(2, 70),
    lead=st.sampled_from([(), (3,), (2, 2)]),
    dtype=st.sampled_from(DTYPES),
    pad_src=st.integers(0, 5),
    pad_dst=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_transpose_moves_every_bit(
    rows: int, cols: int, lead: tuple[int, ...], dtype: torch.dtype, pad_src: int, pad_dst: int, seed: int
) -> None:
    """Odd sizes, leading dims, rows padded on either side (a slice of a wider buffer): bit-exact."""
    base = _bits((*lead, cols, rows + pad_src), dtype, seed)
    src = base[..., :rows].transpose(-1, -2)  # (…, rows, cols), columns contiguous, leading dim rows + pad
    buffer = _bits((*lead, rows, cols + pad_dst), dtype, seed + 1)
    dst = buffer[..., :cols]
    untouched = buffer[..., cols:].clone()
    assert transposable(dst, src)
    transpose_into(dst, src)
    expected = torch.empty(dst.shape, dtype=dtype)
    expected.copy_(src)
    assert _same_bits(dst.contiguous(), expected)
    assert _same_bits(buffer[..., cols:].contiguous(), untouched)  # the padding is not written


def test_what_is_not_a_transpose_goes_to_torch() -> None:
    a = torch.zeros(8, 6)
    cast = torch.empty(6, 8, dtype=torch.bfloat16)
    assert not copies._bits(cast, a.t()) and copies._jobs(cast, a.t())[0][0] is copies._torch_small
    conj = torch.zeros(8, 6, dtype=torch.complex64).conj()
    assert not copies._bits(torch.empty(6, 8, dtype=torch.complex64), conj.t())  # lazily conjugated
    assert not transposable(torch.empty(8, 6), a)  # a plain copy
    assert not transposable(torch.empty(6, 8, dtype=torch.float64), a.double().t())  # no 8-byte kernel
    assert not transposable(torch.empty(8, 6).t(), a.t())  # dst's columns contiguous: a plain copy
    assert not transposable(torch.empty(1, 8), torch.zeros(8, 1).t())  # one row: a plain copy
    assert not transposable(torch.empty(3, 6), a[::3])  # every third row, not transposed
    assert transposable(torch.empty(6, 4), a[::2].t()) == (kernel(4) is not None)  # every other row
    assert not transposable(torch.empty(3, 8), a[:, ::2].t())  # src's columns are not contiguous
    assert not transposable(torch.empty(0, 8), torch.zeros(8, 0).t())  # nothing to copy


@x86
def test_copies_transpose_on_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A large transposed copy is cut into chunks that each run on the kernel; the result is torch's."""
    calls: list[tuple[int, ...]] = []
    real = transpose.transpose_into

    def counted(dst: torch.Tensor, src: torch.Tensor) -> None:
        calls.append(tuple(dst.shape))
        real(dst, src)

    monkeypatch.setattr(copies, "transpose_into", counted)
    src = torch.arange(701 * 1303, dtype=torch.float32).reshape(701, 1303)
    dst = torch.empty(1303, 701)
    copy_into(dst, src.t())
    assert torch.equal(dst, src.t())
    assert len(calls) > 1 and sum(shape[0] for shape in calls) == 1303


def test_without_a_kernel_torch_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch without fbgemm: the same copies, by torch's ``copy_`` in tiles."""
    monkeypatch.setattr(transpose, "kernel", lambda itemsize: None)
    src = torch.arange(301 * 517, dtype=torch.float32).reshape(301, 517)
    assert not transposable(torch.empty(517, 301), src.t())
    dst = torch.empty(517, 301)
    copy_into(dst, src.t())
    assert torch.equal(dst, src.t())


def test_a_library_that_will_not_load_means_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(path: str) -> None:
        raise OSError(f"{path}: cannot open shared object file")

    transpose._library.cache_clear()
    transpose.kernel.cache_clear()
    monkeypatch.setattr(transpose.ctypes, "CDLL", missing)
    try:
        assert kernel(4) is None
    finally:
        monkeypatch.undo()
        transpose._library.cache_clear()
        transpose.kernel.cache_clear()


def test_quantized_tensors_are_torch_s_to_copy() -> None:
    """``copy_`` of quantized tensors also gives the destination the source's scale: left to torch."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates its quantized tensors
        src = torch.quantize_per_tensor(torch.arange(60000.0).reshape(300, 200) / 1000, 0.25, 3, torch.quint8)
        dst = torch._empty_affine_quantized((200, 300), scale=0.5, zero_point=0, dtype=torch.quint8)
        ref = torch._empty_affine_quantized((200, 300), scale=0.5, zero_point=0, dtype=torch.quint8)
    assert not copies._plain(dst, src.t())
    copy_into(dst, src.t())
    ref.copy_(src.t())
    assert torch.equal(dst.int_repr(), ref.int_repr()) and (dst.q_scale(), dst.q_zero_point()) == (0.25, 3)
