"""Copies on shardsync's own threads (exec/copies.py): every element lands where ``copy_`` puts it."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import arange_tensor
from shardsync.exec import copies
from shardsync.exec.copies import copy_into

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def _small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copies, "CHUNK_BYTES", 256)
    monkeypatch.setattr(copies, "PARALLEL_BYTES", 512)
    monkeypatch.setattr(copies, "TORCH_GRAIN", 37)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of a few hundred bytes, so that small tensors take the threaded path."""
    _small(monkeypatch)


def _values(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    x = torch.arange(n, dtype=torch.int64).reshape(shape) % 97
    return (x % 2).bool() if dtype == torch.bool else x.to(dtype)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 41),
    cols=st.integers(1, 29),
    src_dtype=st.sampled_from(DTYPES),
    same=st.booleans(),
    transposed=st.booleans(),
    sliced=st.booleans(),
)
def test_any_copy_equals_copy_(
    rows: int, cols: int, src_dtype: torch.dtype, same: bool, transposed: bool, sliced: bool
) -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        _small(monkeypatch)
        _check_copy(rows, cols, src_dtype, same, transposed, sliced)


def _check_copy(rows: int, cols: int, src_dtype: torch.dtype, same: bool, transposed: bool, sliced: bool) -> None:
    dst_dtype = src_dtype if same else torch.float32
    if src_dtype == torch.complex64 and not same:
        dst_dtype = torch.complex128
    base = _values((cols, rows) if transposed else (rows, cols + 3 * sliced), src_dtype)
    src = base.t() if transposed else base[:, 1 : 1 + cols] if sliced else base
    want = torch.empty(src.shape, dtype=dst_dtype).copy_(src)
    got = (
        torch.full(src.shape, 7, dtype=dst_dtype)
        if dst_dtype != torch.bool
        else torch.zeros(src.shape, dtype=torch.bool)
    )
    copy_into(got, src)
    assert torch.equal(
        got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
        want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want,
    )


def test_into_a_strided_destination_leaves_the_rest(small_chunks: None) -> None:
    out = torch.full((23, 31), -1.0)
    src = torch.arange(23 * 17, dtype=torch.float32).reshape(23, 17)
    copy_into(out[:, 5:22], src)
    assert torch.equal(out[:, 5:22], src)
    assert (out[:, :5] == -1).all() and (out[:, 22:] == -1).all()


def test_large_copies_use_the_pool_and_are_exact() -> None:
    # over PARALLEL_BYTES with the real constants: a raw row copy, a cast, a contiguous 1-D run
    src = torch.arange(1_500_007, dtype=torch.float32)
    for dst, s in [
        (torch.empty(1_500_007), src),
        (torch.empty(1_500_007, dtype=torch.bfloat16), src),
        (torch.empty(1023, 1466), src[: 1023 * 1466].reshape(1466, 1023).t()),
    ]:
        copy_into(dst, s)
        assert torch.equal(dst, s.to(dst.dtype))


def test_a_parameter_is_written_in_place(small_chunks: None) -> None:
    p = torch.nn.Parameter(torch.zeros(19, 11))
    copy_into(p[2:], torch.arange(17 * 11, dtype=torch.bfloat16).reshape(17, 11))
    assert torch.equal(p.detach()[2:], torch.arange(17 * 11, dtype=torch.float32).reshape(17, 11))
    assert p.requires_grad and p.grad is None


def test_shapes_must_match() -> None:
    with pytest.raises(ValueError, match=r"shapes differ, \(2, 3\) and \(3, 2\)"):
        copy_into(torch.empty(2, 3), torch.empty(3, 2))


def test_torch_thread_setting_is_left_as_the_caller_chose(small_chunks: None) -> None:
    before = torch.get_num_threads()
    copy_into(torch.empty(40, 40), torch.ones(40, 40))
    assert torch.get_num_threads() == before


def _copy_in_child(queue: multiprocessing.Queue) -> None:
    torch.set_num_threads(1)  # torch's own OpenMP threads hang in a forked child (DataLoader does the same)
    src = torch.arange(2_000_000, dtype=torch.float32)
    dst = torch.empty(2_000_000)
    copy_into(dst, src)
    queue.put(bool(torch.equal(dst, src)))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_child_makes_its_own_pool() -> None:
    copy_into(torch.empty(2_000_000), torch.ones(2_000_000))  # the parent's pool exists
    assert copies._pool is not None
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_copy_in_child, args=(queue,))
    child.start()
    child.join(60)
    assert child.exitcode == 0 and queue.get(timeout=5) is True


@pytest.mark.parametrize("lazy", ["conj src", "conj dst", "neg src"])
def test_lazy_conj_and_neg_views_are_copied_by_value(small_chunks: None, lazy: str) -> None:
    # same dtype and row runs, but the bytes of a conj/neg view are not its values: torch.copy_ semantics
    re = torch.arange(23 * 17, dtype=torch.float32).reshape(23, 17)
    z = torch.complex(re, re + 0.5)
    if lazy == "neg src":
        src, want, out = torch._neg_view(re), -re, torch.zeros(23, 17)
        copy_into(out, src)
    elif lazy == "conj src":
        src, want, out = z.conj(), torch.complex(re, -re - 0.5), torch.zeros(23, 17, dtype=torch.complex64)
        copy_into(out, src)
    else:
        out = torch.zeros(23, 17, dtype=torch.complex64)
        copy_into(out.conj(), z)
        want = torch.complex(re, -re - 0.5)
    assert torch.equal(out, want)


def test_targets_made_under_inference_mode_are_written_by_the_pool(small_chunks: None) -> None:
    with torch.inference_mode():
        out = torch.zeros(41, 29, dtype=torch.bfloat16)  # an inference tensor: only written in inference mode
        src = torch.arange(29 * 41, dtype=torch.float32).reshape(29, 41).t()
        copy_into(out, src)  # a cast and a permutation: torch's copy_ on the pool's threads
    assert torch.equal(out, src.to(torch.bfloat16))


def test_a_failing_helper_is_waited_for_with_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    # every thread takes one job (a barrier); helper 0 fails at once, helper 1 is still writing then
    monkeypatch.setattr(copies, "copy_threads", lambda: 3)
    pool, local, done = copies._get_pool(), threading.local(), []
    barrier = threading.Barrier(3, timeout=10)

    class Tagged:
        def __init__(self) -> None:
            self.n = 0

        def submit(self, fn):  # type: ignore[no-untyped-def]
            k, self.n = self.n, self.n + 1
            return pool.submit(lambda: (setattr(local, "k", k), fn())[1])

    tagged = Tagged()
    monkeypatch.setattr(copies, "_get_pool", lambda: tagged)

    def job(a: object, b: object) -> None:
        barrier.wait()
        k = getattr(local, "k", None)
        if k == 0:
            raise RuntimeError("helper 0 failed")
        if k == 1:
            time.sleep(0.3)
            done.append("helper 1")

    with pytest.raises(RuntimeError, match="helper 0 failed"):
        lane = copies.Lane()
        lane.wait(lane.start(_batch([(job, None, None)] * 3)))
    assert done == ["helper 1"]  # no thread writes a target after copy_into has returned


@pytest.mark.parametrize("shape", [(41, 3, 5), (5, 7, 11), (3, 4, 2, 9), (2, 1, 40)])
def test_casts_of_permuted_boxes_of_three_or_more_dims(small_chunks: None, shape: tuple[int, ...]) -> None:
    # short rows are copied in blocks of rows, long ones row by row (TORCH_GRAIN is 37 here)
    src = _values((*shape[:-2], shape[-1], shape[-2]), torch.int64).transpose(-1, -2)
    out = torch.full(shape, -1.0, dtype=torch.bfloat16)
    copy_into(out, src)
    assert torch.equal(out, src.to(torch.bfloat16))


def test_overlapping_copies_are_torch_copies(small_chunks: None) -> None:
    buf = torch.arange(1000.0)
    copy_into(buf[1:], buf[:-1].clone())  # separate memory: cut in chunks
    assert torch.equal(buf[1:], torch.arange(999.0))
    shared = torch.arange(1000.0)
    with pytest.raises(RuntimeError, match="overlap|internal overlap|memory location"):
        copy_into(shared[1:], shared[:-1])  # one storage: copy_ decides (it refuses an overlap)
    sparse = torch.zeros(40, 40).to_sparse()
    copy_into(sparse, torch.eye(40).to_sparse())  # sparse: torch's copy_ as well
    assert torch.equal(sparse.to_dense(), torch.eye(40))


def test_a_copy_does_not_wait_for_a_helper_whose_core_is_busy() -> None:
    # every pool thread is held elsewhere (as when the machine's other cores are busy): the caller
    # copies every chunk itself and returns; the helpers it asked for are cancelled, never run late
    pool, release = copies._get_pool(), threading.Event()
    held = [pool.submit(release.wait, 30) for _ in range(copies.copy_threads())]
    src = torch.arange(1_500_007, dtype=torch.float32)
    dst = torch.empty_like(src)
    copier = threading.Thread(target=copy_into, args=(dst, src))
    try:
        copier.start()
        copier.join(10)
        finished = not copier.is_alive()
    finally:
        release.set()
        copier.join()
        for f in held:
            f.result()
    assert finished, "copy_into waited for a pool thread that had not started"
    assert torch.equal(dst, src)


def _batch(jobs: list) -> copies.Copies:  # type: ignore[type-arg]
    batch = copies.Copies()
    batch.jobs, batch.nbytes = list(jobs), copies.PARALLEL_BYTES  # large enough for the pool
    return batch


def test_a_lane_runs_batches_in_the_background_and_wait_returns_once_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(copies, "copy_threads", lambda: 3)
    written: list[tuple[int, int]] = []
    running, most = [0], [0]
    lock = threading.Lock()

    def job(batch: int, k: int) -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.01)
        with lock:
            running[0] -= 1
            written.append((batch, k))

    lane = copies.Lane()
    first = lane.start(_batch([(job, 1, k) for k in range(6)]))
    second = lane.start(_batch([(job, 2, k) for k in range(6)]))
    time.sleep(0.05)  # the helpers copy while this thread does something else
    assert written, "nothing was copied in the background"
    lane.wait(first)
    assert {(1, k) for k in range(6)} <= set(written)  # every chunk of the batch, before wait returned
    lane.wait(second)
    assert sorted(written) == [(b, k) for b in (1, 2) for k in range(6)]
    assert most[0] <= 3  # two helpers and this thread: never more threads than copy_threads()


def test_a_lane_of_one_thread_copies_each_batch_as_it_starts_without_a_lock() -> None:
    written: list[int] = []
    calls: list[str] = []
    lane = copies.Lane(threads=1)
    lane._done = None  # type: ignore[assignment]  # a lock taken would raise
    ticket = lane.start(
        _batch([(lambda k, _: written.append(k), k, None) for k in range(5)]), then=lambda: calls.append("then")
    )
    assert written == list(range(5)) and calls == ["then"]  # before any wait
    lane.wait(ticket)
    lane.settle()

    def fail(k: int, _: object) -> None:
        raise ValueError(f"chunk {k} failed")

    with pytest.raises(ValueError, match="chunk 0 failed"):  # raised by start: nothing runs later
        lane.start(_batch([(fail, 0, None)]), then=lambda: calls.append("never"))
    assert calls == ["then"]


def test_a_failed_chunk_is_raised_by_wait_of_its_batch_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copies, "copy_threads", lambda: 2)
    done: list[int] = []

    def job(k: int, _: object) -> None:
        if k == 1:
            raise ValueError("chunk 1 failed")
        time.sleep(0.01)
        done.append(k)

    lane = copies.Lane()
    bad = lane.start(_batch([(job, k, None) for k in range(4)]))
    good = lane.start(_batch([(job, k, None) for k in range(10, 14)]))
    with pytest.raises(ValueError, match="chunk 1 failed"):
        lane.wait(bad)
    assert {0, 2, 3} <= set(done)  # the batch's other chunks were written before it raised
    lane.wait(good)
    assert {10, 11, 12, 13} <= set(done)


def test_settle_waits_for_every_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copies, "copy_threads", lambda: 2)
    done: list[int] = []
    lane = copies.Lane()
    lane.start(_batch([(lambda k, _: (time.sleep(0.02), done.append(k)), k, None) for k in range(5)]))
    lane.settle()
    assert sorted(done) == list(range(5))


def test_a_batch_keeps_the_inference_mode_it_was_started_in(small_chunks: None) -> None:
    with torch.inference_mode():
        dst = torch.empty(40, 30)
        batch = copies.Copies()
        batch.add(dst, _values((30, 40), torch.float32).t())
        lane = copies.Lane()
        ticket = lane.start(batch)
    lane.wait(ticket)  # the chunks write an inference tensor, from threads outside the mode
    assert torch.equal(dst, _values((30, 40), torch.float32).t())


def test_a_wait_takes_its_own_batch_not_the_older_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    # a batch needed now (a packet, received data) is not copied behind targets built ahead
    monkeypatch.setattr(copies, "copy_threads", lambda: 2)
    done: list[tuple[str, int]] = []
    lane = copies.Lane()
    ahead = lane.start(
        _batch([(lambda k, _: (time.sleep(0.05), done.append(("ahead", k))), k, None) for k in range(8)])
    )
    now = lane.start(_batch([(lambda k, _: done.append(("now", k)), k, None) for k in range(4)]))
    lane.wait(now)
    assert sorted(k for w, k in done if w == "now") == [0, 1, 2, 3]
    assert sum(w == "ahead" for w, _ in done) < 8  # the older batch is still being copied by the helper
    lane.wait(ahead)
    assert sum(w == "ahead" for w, _ in done) == 8


@pytest.mark.parametrize("threads", [1, 3])
def test_then_runs_once_every_chunk_is_written_and_never_after_a_failure(
    monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    monkeypatch.setattr(copies, "copy_threads", lambda: threads)
    done: list[int] = []
    seen: list[list[int]] = []

    def job(k: int, _: object) -> None:
        if k == 99:
            raise ValueError("chunk 99 failed")
        time.sleep(0.005)
        done.append(k)

    lane = copies.Lane()
    ticket = lane.start(_batch([(job, k, None) for k in range(6)]), then=lambda: seen.append(sorted(done)))
    lane.wait(ticket)
    assert seen == [list(range(6))]  # once, after the last chunk, before wait returned
    with pytest.raises(ValueError, match="chunk 99 failed"):  # one thread: start() copies it, and raises
        lane.wait(lane.start(_batch([(job, k, None) for k in (7, 99, 8)]), then=lambda: seen.append([-1])))
    assert seen == [list(range(6))]


def test_an_error_in_then_is_raised_by_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copies, "copy_threads", lambda: 2)
    lane = copies.Lane()

    def then() -> None:
        raise RuntimeError("then failed")

    ticket = lane.start(_batch([(lambda k, _: None, k, None) for k in range(4)]), then=then)
    with pytest.raises(RuntimeError, match="then failed"):
        lane.wait(ticket)


def test_copy_bits_writes_scalars_and_every_layout_of_one_dtype() -> None:
    from shardsync.exec.assemble import copy_bits
    from shardsync.exec.copies import ints
    from shardsync.layout.box import Box
    from shardsync.mapping.pieces import Piece

    out, batch = torch.zeros(()), copies.Copies()
    assert copy_bits(ints(out), ints(torch.tensor(2.5)), Box((), ()), Piece("s", Box((), ()), Box((), ())), batch)
    batch.run()
    assert out.item() == 2.5  # a 0-d target is written, not a copy of it
    src = arange_tensor((5, 9, 7), dtype=torch.bfloat16)[:, 1:8:3, 2:]  # strided middle dim
    out = torch.zeros(5, 3, 5, dtype=torch.bfloat16)
    piece = Piece("s", Box((1, 0, 0), (3, 3, 5)), Box((2, 0, 0), (3, 3, 5)))
    assert copy_bits(ints(out), ints(src), Box((0, 0, 0), (5, 3, 5)), piece, batch)
    batch.run()
    assert torch.equal(out[2:], src[1:4]) and not out[:2].any()
    transposed = Piece("s", Box((0, 0), (3, 2)), Box((0, 0), (2, 3)), perm=(1, 0))
    assert not copy_bits(ints(torch.zeros(2, 3)), ints(torch.ones(3, 2)), Box((0, 0), (3, 2)), transposed, batch)


def test_a_scalar_state_streams() -> None:
    import shardsync

    for dtype in (torch.float32, torch.bfloat16, torch.bool):
        got = dict(
            shardsync.full_params({"w": torch.tensor(1, dtype=dtype), "v": arange_tensor((300, 220))}, ["w -> r"])
        )
        assert torch.equal(got["r"], torch.tensor(1, dtype=dtype)) and torch.equal(got["v"], arange_tensor((300, 220)))
